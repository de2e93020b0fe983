//! The handler contract: one message in, `Ok` or a classified error out.
//!
//! A transient error is retried inside the message's lane; a terminal one dead-letters the
//! message at once. Panics are caught by the engine and treated as terminal.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

use crate::message::{EventId, Headers, Message, Offset, SourceId};

/// One attempt at handling one message. Cheap to clone (the message is shared).
#[derive(Clone, Debug)]
pub struct Delivery {
    message: Arc<Message>,
    attempt: u32,
    received: Instant,
}

impl Delivery {
    /// A delivery of `message` for attempt number `attempt` (1 for the first try), received now.
    pub fn new(message: Arc<Message>, attempt: u32) -> Self {
        Delivery::received_at(message, attempt, Instant::now())
    }

    /// A delivery of a message the engine received at `received`.
    pub fn received_at(message: Arc<Message>, attempt: u32, received: Instant) -> Self {
        Delivery {
            message,
            attempt,
            received,
        }
    }

    /// When the engine received the message from the transport (queueing time starts here).
    pub fn received(&self) -> Instant {
        self.received
    }

    /// The whole message.
    pub fn message(&self) -> &Message {
        &self.message
    }

    /// The correlation key, if any (as [`Message::key`]).
    pub fn key(&self) -> Option<&Bytes> {
        self.message.key()
    }

    /// The key as text: `None` when there is none or it is not UTF-8 (as [`Message::key_str`]).
    pub fn key_str(&self) -> Option<&str> {
        self.message.key_str()
    }

    /// The key as lossy UTF-8, `<none>` without one: for logs (as [`Message::key_display`]).
    pub fn key_display(&self) -> std::borrow::Cow<'_, str> {
        self.message.key_display()
    }

    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.message.payload
    }

    /// The payload as text; one that is not UTF-8 is a malformed message (dead-lettered with
    /// reason `malformed`, never retried): `let text = delivery.payload_str()?;`.
    pub fn payload_str(&self) -> Result<&str, HandlerError> {
        std::str::from_utf8(&self.message.payload)
            .map_err(|e| HandlerError::caused_by(ErrorClass::Malformed, e))
    }

    /// The headers.
    pub fn headers(&self) -> &Headers {
        &self.message.headers
    }

    /// The source the message came from.
    pub fn source(&self) -> &SourceId {
        &self.message.source
    }

    /// The offset within the source.
    pub fn offset(&self) -> Offset {
        self.message.offset
    }

    /// The stable event id (header, else source and offset).
    pub fn event_id(&self) -> EventId {
        self.message.event_id()
    }

    /// Attempt number, starting at 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// How the engine treats a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retry in the lane with backoff.
    Transient,
    /// Dead-letter now.
    Terminal,
    /// The payload could not be decoded; dead-letter now.
    Malformed,
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Terminal => "terminal",
            ErrorClass::Malformed => "malformed",
        })
    }
}

/// The cause of a handler's failure: any error, shared (a `HandlerError` is cloned into
/// logs and dead-letter reasons).
pub type Cause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// A handler's failure, classified, with what caused it.
///
/// `?` works on any error in a handler: it becomes a transient failure (retried in the lane)
/// carrying the error as its cause. Say otherwise with [`ResultExt`]: `.terminal()?`,
/// `.malformed()?`, `.transient()?`. The message and the whole chain of causes go into the logs
/// and into the dead-letter reason (`convoy-dl-error`).
///
/// `HandlerError` is not itself a `std::error::Error` (as with `anyhow::Error`), which is what
/// lets every error convert into it with `?`; [`HandlerError::cause`] gives the cause.
#[derive(Clone)]
pub struct HandlerError {
    class: ErrorClass,
    message: String,
    retry_after: Option<Duration>,
    cause: Option<Cause>,
}

impl HandlerError {
    fn new(class: ErrorClass, message: String, cause: Option<Cause>) -> Self {
        HandlerError {
            class,
            message,
            retry_after: None,
            cause,
        }
    }

    /// A failure worth retrying (a timeout, an unavailable dependency).
    pub fn transient(message: impl fmt::Display) -> Self {
        Self::new(ErrorClass::Transient, message.to_string(), None)
    }

    /// A transient failure that asks for the next attempt no sooner than `after`
    /// (overrides the policy's backoff for this retry; still counts as an attempt).
    pub fn retry_after(message: impl fmt::Display, after: Duration) -> Self {
        HandlerError {
            retry_after: Some(after),
            ..HandlerError::transient(message)
        }
    }

    /// A failure no retry can fix (a business rule, a bad reference): dead-letter now.
    pub fn terminal(message: impl fmt::Display) -> Self {
        Self::new(ErrorClass::Terminal, message.to_string(), None)
    }

    /// The payload could not be decoded: dead-letter now with reason `malformed`.
    pub fn malformed(message: impl fmt::Display) -> Self {
        Self::new(ErrorClass::Malformed, message.to_string(), None)
    }

    /// A failure of `class` caused by `error` (its text is the message).
    pub fn caused_by(class: ErrorClass, error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::new(class, error.to_string(), Some(Arc::new(error)))
    }

    /// The same failure, caused by `error` (kept, and printed after the message).
    pub fn with_cause(mut self, error: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(Arc::new(error));
        self
    }

    /// The error's class.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// The error text (without its causes).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// What caused it, if an error did.
    pub fn cause(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.cause.as_deref()
    }

    /// The message followed by every cause in the chain: `message: cause: its cause: …` (a
    /// cause whose text the message already is, as with `?`, is not repeated).
    pub fn chain(&self) -> String {
        let mut text = self.message.clone();
        let mut next: Option<&(dyn std::error::Error + 'static)> = match &self.cause {
            Some(cause) => Some(cause.as_ref()),
            None => None,
        };
        let mut first = true;
        while let Some(error) = next {
            let said = error.to_string();
            if !(first && said == self.message) {
                text.push_str(": ");
                text.push_str(&said);
            }
            first = false;
            next = error.source();
        }
        text
    }

    /// The requested delay before the next attempt, if the handler gave one.
    pub fn retry_after_hint(&self) -> Option<Duration> {
        self.retry_after
    }

    /// True when the engine retries this error.
    pub fn is_transient(&self) -> bool {
        self.class == ErrorClass::Transient
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} error: {}", self.class, self.chain())
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("class", &self.class)
            .field("message", &self.message)
            .field("retry_after", &self.retry_after)
            .field("cause", &self.cause)
            .finish()
    }
}

/// `?` on any error in a handler: a transient failure caused by it.
impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(error: E) -> Self {
        HandlerError::caused_by(ErrorClass::Transient, error)
    }
}

/// Classifies a result's error for a handler: `serde_json::from_slice(p).malformed()?`,
/// `repo.debit(a).await.terminal()?`.
pub trait ResultExt<T> {
    /// A failure retried in the lane.
    fn transient(self) -> Result<T, HandlerError>;
    /// A failure no retry can fix: dead-lettered now.
    fn terminal(self) -> Result<T, HandlerError>;
    /// Input that cannot be decoded: dead-lettered now with reason `malformed`.
    fn malformed(self) -> Result<T, HandlerError>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> ResultExt<T> for Result<T, E> {
    fn transient(self) -> Result<T, HandlerError> {
        self.map_err(|e| HandlerError::caused_by(ErrorClass::Transient, e))
    }

    fn terminal(self) -> Result<T, HandlerError> {
        self.map_err(|e| HandlerError::caused_by(ErrorClass::Terminal, e))
    }

    fn malformed(self) -> Result<T, HandlerError> {
        self.map_err(|e| HandlerError::caused_by(ErrorClass::Malformed, e))
    }
}

/// Handles one message at a time for a key. The same handler runs on every transport.
///
/// At most one delivery of a key is in flight at a time, so a handler may keep per-key state
/// without locks of its own for ordering. Delivery is at least once: make side effects
/// idempotent (see the engine's idempotency store for skipping known duplicates).
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Handles one attempt. Return a transient error to retry, a terminal one to dead-letter.
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError>;
}

#[async_trait]
impl<H: Handler + ?Sized> Handler for Arc<H> {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        (**self).handle(delivery).await
    }
}

/// A handler made from an async closure; see [`handler_fn`].
#[derive(Clone)]
pub struct HandlerFn<F>(F);

/// Makes a handler from `Fn(Delivery) -> impl Future<Output = Result<(), HandlerError>>`.
pub fn handler_fn<F, Fut>(f: F) -> HandlerFn<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    HandlerFn(f)
}

#[async_trait]
impl<F, Fut> Handler for HandlerFn<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        (self.0)(delivery).await
    }
}

/// What a caught panic said, for logs and dead-letter reasons.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "handler panicked".to_owned());
    format!("handler panicked: {text}")
}

#[cfg(test)]
mod error_tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("the ledger refused the entry")]
    struct Refused(#[source] std::io::Error);

    fn debit(ok: bool) -> Result<(), Refused> {
        match ok {
            true => Ok(()),
            false => Err(Refused(std::io::Error::other("account 7 is frozen"))),
        }
    }

    fn handler_with_question_mark(ok: bool) -> Result<(), HandlerError> {
        debit(ok)?;
        Ok(())
    }

    #[test]
    fn question_mark_makes_a_transient_failure_that_keeps_its_cause_chain() {
        let e = handler_with_question_mark(false).unwrap_err();
        assert_eq!(e.class(), ErrorClass::Transient);
        assert_eq!(e.message(), "the ledger refused the entry");
        assert_eq!(e.chain(), "the ledger refused the entry: account 7 is frozen");
        assert!(e.cause().is_some_and(|c| c.source().is_some()));
        assert_eq!(
            e.to_string(),
            "transient error: the ledger refused the entry: account 7 is frozen"
        );
        assert!(handler_with_question_mark(true).is_ok());
    }

    #[test]
    fn results_are_classified_and_messages_take_causes() {
        let terminal = debit(false).terminal().unwrap_err();
        assert_eq!(terminal.class(), ErrorClass::Terminal);
        let malformed = "x".parse::<u32>().malformed().unwrap_err();
        assert_eq!(malformed.class(), ErrorClass::Malformed);
        assert_eq!(malformed.chain(), "invalid digit found in string");
        let explained =
            HandlerError::terminal("overdraft").with_cause(Refused(std::io::Error::other("frozen")));
        assert_eq!(
            explained.chain(),
            "overdraft: the ledger refused the entry: frozen"
        );
        assert_eq!(
            HandlerError::transient("busy").chain(),
            "busy",
            "no cause, no chain"
        );
    }
}
