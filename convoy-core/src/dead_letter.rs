//! Dead letters: a message taken out of its lane and published, with its reason, to a
//! dead-letter destination. The original key, payload and headers travel untouched; the
//! reason is added as `convoy-dl-*` headers so an operator can find, fix and replay.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use crate::message::{Headers, Message, OutgoingMessage};
use crate::transport::TransportError;

/// Header: why the message was dead-lettered (see [`DeadLetterCause`]).
pub const DL_CAUSE: &str = "convoy-dl-cause";
/// Header: the handler's error class (`transient`, `terminal`, `malformed`, `panic`, `stuck`).
pub const DL_ERROR_CLASS: &str = "convoy-dl-error-class";
/// Header: the last error's text.
pub const DL_ERROR: &str = "convoy-dl-error";
/// Header: how many attempts were made.
pub const DL_ATTEMPTS: &str = "convoy-dl-attempts";
/// Header: first failure, milliseconds since the Unix epoch.
pub const DL_FIRST_FAILURE_MS: &str = "convoy-dl-first-failure-ms";
/// Header: last failure, milliseconds since the Unix epoch.
pub const DL_LAST_FAILURE_MS: &str = "convoy-dl-last-failure-ms";
/// Header: the source the message was read from.
pub const DL_SOURCE: &str = "convoy-dl-source";
/// Header: its offset there.
pub const DL_OFFSET: &str = "convoy-dl-offset";
/// Header: the consumer group that gave up on it.
pub const DL_GROUP: &str = "convoy-dl-group";

/// Why a message left its lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadLetterCause {
    /// The handler returned a terminal error.
    Terminal,
    /// The payload could not be decoded.
    Malformed,
    /// The handler panicked.
    Panic,
    /// Transient failures exhausted the retry policy.
    RetriesExhausted,
    /// The message held the watermark back longer than the stuck-gap timeout.
    Stuck,
}

impl DeadLetterCause {
    /// The header value.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterCause::Terminal => "terminal",
            DeadLetterCause::Malformed => "malformed",
            DeadLetterCause::Panic => "panic",
            DeadLetterCause::RetriesExhausted => "retries-exhausted",
            DeadLetterCause::Stuck => "stuck",
        }
    }
}

impl fmt::Display for DeadLetterCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The reason attached to a dead letter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterReason {
    /// Why it left the lane.
    pub cause: DeadLetterCause,
    /// The class of the last error (`transient`, `terminal`, `malformed`, `panic`, `stuck`).
    pub error_class: String,
    /// The last error's text.
    pub error: String,
    /// Attempts made.
    pub attempts: u32,
    /// When the first attempt failed.
    pub first_failure: SystemTime,
    /// When the last attempt failed.
    pub last_failure: SystemTime,
    /// The consumer group.
    pub group: String,
}

/// A message on its way to the dead-letter destination.
#[derive(Clone, Debug)]
pub struct DeadLetter {
    /// The original message, untouched.
    pub message: Message,
    /// Why.
    pub reason: DeadLetterReason,
}

fn unix_ms(t: SystemTime) -> String {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
        .to_string()
}

impl DeadLetter {
    /// The original headers plus the reason headers.
    pub fn headers(&self) -> Headers {
        let mut h = self.message.headers.clone();
        let r = &self.reason;
        h.insert(DL_CAUSE, r.cause.as_str());
        h.insert(DL_ERROR_CLASS, r.error_class.clone());
        h.insert(DL_ERROR, r.error.clone());
        h.insert(DL_ATTEMPTS, r.attempts.to_string());
        h.insert(DL_FIRST_FAILURE_MS, unix_ms(r.first_failure));
        h.insert(DL_LAST_FAILURE_MS, unix_ms(r.last_failure));
        h.insert(DL_SOURCE, self.message.source.to_string());
        h.insert(DL_OFFSET, self.message.offset.to_string());
        h.insert(DL_GROUP, r.group.clone());
        h
    }

    /// The message to publish: original key and payload, headers with the reason.
    pub fn to_outgoing(&self) -> OutgoingMessage {
        OutgoingMessage {
            key: self.message.key.clone(),
            payload: self.message.payload.clone(),
            headers: self.headers(),
        }
    }
}

/// Publishes dead letters. Return `Ok` only once the destination confirmed the write: the
/// engine finishes the message's offset after that, and retries (blocking the lane) on error.
#[async_trait]
pub trait DeadLetterSink: Send + Sync + 'static {
    /// Publishes one dead letter, confirmed.
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError>;
}

#[async_trait]
impl<S: DeadLetterSink + ?Sized> DeadLetterSink for std::sync::Arc<S> {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        (**self).publish(dead_letter).await
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::message::SourceId;

    #[test]
    fn reason_headers_keep_the_original_ones() {
        let mut headers = Headers::new();
        headers.insert("traceparent", "00-abc");
        let dl = DeadLetter {
            message: Message {
                key: Some(Bytes::from_static(b"acct-1")),
                payload: Bytes::from_static(b"{}"),
                headers,
                source: SourceId::new("orders/2"),
                offset: 17,
            },
            reason: DeadLetterReason {
                cause: DeadLetterCause::RetriesExhausted,
                error_class: "transient".into(),
                error: "db down".into(),
                attempts: 5,
                first_failure: UNIX_EPOCH + std::time::Duration::from_millis(1_000),
                last_failure: UNIX_EPOCH + std::time::Duration::from_millis(9_000),
                group: "billing".into(),
            },
        };
        let out = dl.to_outgoing();
        assert_eq!(out.key.as_deref(), Some(&b"acct-1"[..]));
        let h = &out.headers;
        assert_eq!(h.get_str("traceparent"), Some("00-abc"));
        assert_eq!(h.get_str(DL_CAUSE), Some("retries-exhausted"));
        assert_eq!(h.get_str(DL_ERROR_CLASS), Some("transient"));
        assert_eq!(h.get_str(DL_ERROR), Some("db down"));
        assert_eq!(h.get_str(DL_ATTEMPTS), Some("5"));
        assert_eq!(h.get_str(DL_FIRST_FAILURE_MS), Some("1000"));
        assert_eq!(h.get_str(DL_LAST_FAILURE_MS), Some("9000"));
        assert_eq!(h.get_str(DL_SOURCE), Some("orders/2"));
        assert_eq!(h.get_str(DL_OFFSET), Some("17"));
        assert_eq!(h.get_str(DL_GROUP), Some("billing"));
    }
}
