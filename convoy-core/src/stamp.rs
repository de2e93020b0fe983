//! Stamps: what every convoy publisher adds to a message unless it is there already, so that a
//! consumer can tell duplicates apart and continue the trace. A message from a foreign producer
//! has none; convoy then derives its event id from source and offset.

use crate::header_names::EVENT_ID_HEADER;
use crate::message::OutgoingMessage;
use crate::trace_context::TraceContext;

impl OutgoingMessage {
    /// Gives the message what every convoy publisher adds unless it is there already: a fresh
    /// event id (128 random bits as hex) and a root trace context (`traceparent`).
    pub fn stamp(&mut self) {
        if self.headers.get(EVENT_ID_HEADER).is_none() {
            let mut rng = fastrand::Rng::new();
            self.headers.insert(
                EVENT_ID_HEADER,
                format!("{:016x}{:016x}", rng.u64(..), rng.u64(..)),
            );
        }
        if TraceContext::extract(&self.headers).is_none() {
            // Inside a span an OpenTelemetry layer records, that span is the message's parent.
            #[cfg(feature = "opentelemetry")]
            let context = TraceContext::of_current_span().unwrap_or_else(TraceContext::new_root);
            #[cfg(not(feature = "opentelemetry"))]
            let context = TraceContext::new_root();
            context.inject(&mut self.headers);
        }
    }
}
