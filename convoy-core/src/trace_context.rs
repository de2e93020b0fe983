//! W3C Trace Context (`traceparent`) carried in message headers, so a trace continues across
//! the broker: the producer injects, the consumer's per-message span records the parent.

use std::fmt;

use crate::message::Headers;

pub use crate::header_names::TRACEPARENT;

/// A parsed `traceparent`: version 00, trace id, parent span id, flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// 16-byte trace id (never all zero).
    pub trace_id: [u8; 16],
    /// 8-byte span id of the parent (never all zero).
    pub span_id: [u8; 8],
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != N * 2
        || !s
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[i * 2..i * 2 + 2], 16).ok()?;
    }
    Some(out)
}

impl TraceContext {
    /// A new root context with random ids, sampled.
    pub fn new_root() -> Self {
        let mut rng = fastrand::Rng::new();
        let mut trace_id = [0u8; 16];
        trace_id.iter_mut().for_each(|b| *b = rng.u8(..));
        trace_id[0] |= 1; // never all zero
        TraceContext {
            trace_id,
            span_id: random_span_id(&mut rng),
            flags: 1,
        }
    }

    /// The same trace with a new span id (the span this hop creates).
    pub fn child(&self) -> Self {
        TraceContext {
            span_id: random_span_id(&mut fastrand::Rng::new()),
            ..*self
        }
    }

    /// Parses a `traceparent` value; `None` if malformed (the trace then simply restarts).
    pub fn parse(value: &str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let version = parts.next()?;
        let trace_id: [u8; 16] = hex(parts.next()?)?;
        let span_id: [u8; 8] = hex(parts.next()?)?;
        let flags: [u8; 1] = hex(parts.next()?)?;
        // Version 00 has exactly four fields; future versions may append more.
        if version == "ff" || hex::<1>(version).is_none() || (version == "00" && parts.next().is_some()) {
            return None;
        }
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            flags: flags[0],
        })
    }

    /// This context as OpenTelemetry's remote parent (the producer's span).
    #[cfg(feature = "opentelemetry")]
    pub fn to_otel(&self) -> opentelemetry::Context {
        use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
        let span = SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            TraceFlags::new(self.flags),
            true,
            TraceState::default(),
        );
        opentelemetry::Context::new().with_remote_span_context(span)
    }

    /// The OpenTelemetry span of the current `tracing` span, if it has a valid one: what a
    /// publish inside that span carries as `traceparent`.
    #[cfg(feature = "opentelemetry")]
    pub fn of_current_span() -> Option<Self> {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let context = tracing::Span::current().context();
        let span = context.span();
        let span = span.span_context();
        span.is_valid().then(|| TraceContext {
            trace_id: span.trace_id().to_bytes(),
            span_id: span.span_id().to_bytes(),
            flags: span.trace_flags().to_u8(),
        })
    }

    /// Reads the context from message headers.
    pub fn extract(headers: &Headers) -> Option<Self> {
        headers.get_str(TRACEPARENT).and_then(TraceContext::parse)
    }

    /// Writes the context into message headers (replacing any earlier one).
    pub fn inject(&self, headers: &mut Headers) {
        headers.insert(TRACEPARENT, self.to_string());
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        let mut hex = String::with_capacity(32);
        push_hex(&mut hex, &self.trace_id);
        hex
    }

    /// The span id as 16 lowercase hex digits.
    pub fn span_id_hex(&self) -> String {
        let mut hex = String::with_capacity(16);
        push_hex(&mut hex, &self.span_id);
        hex
    }
}

/// Appends `bytes` as lowercase hex (one header per published message: no `format!` per byte).
fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
}

fn random_span_id(rng: &mut fastrand::Rng) -> [u8; 8] {
    let mut id = rng.u64(1..).to_be_bytes();
    if id == [0; 8] {
        id[7] = 1;
    }
    id
}

impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut header = String::with_capacity(55);
        header.push_str("00-");
        push_hex(&mut header, &self.trace_id);
        header.push('-');
        push_hex(&mut header, &self.span_id);
        header.push('-');
        push_hex(&mut header, &[self.flags]);
        f.write_str(&header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_headers() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let ctx = TraceContext::parse(v).unwrap();
        assert_eq!(ctx.to_string(), v);
        let mut h = Headers::new();
        ctx.child().inject(&mut h);
        let back = TraceContext::extract(&h).unwrap();
        assert_eq!(back.trace_id, ctx.trace_id, "the trace continues");
        assert_ne!(back.span_id, ctx.span_id, "with a new span");
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
        let root = TraceContext::new_root();
        assert_eq!(TraceContext::parse(&root.to_string()), Some(root));
    }
}
