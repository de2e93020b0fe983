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

    /// The correlation key, if any.
    pub fn key(&self) -> Option<&Bytes> {
        self.message.key.as_ref()
    }

    /// The payload bytes.
    pub fn payload(&self) -> &Bytes {
        &self.message.payload
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

/// A handler's failure, classified.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{class} error: {message}")]
pub struct HandlerError {
    class: ErrorClass,
    message: String,
    retry_after: Option<Duration>,
}

impl HandlerError {
    /// A failure worth retrying (a timeout, an unavailable dependency).
    pub fn transient(message: impl fmt::Display) -> Self {
        HandlerError {
            class: ErrorClass::Transient,
            message: message.to_string(),
            retry_after: None,
        }
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
        HandlerError {
            class: ErrorClass::Terminal,
            message: message.to_string(),
            retry_after: None,
        }
    }

    /// The payload could not be decoded: dead-letter now with reason `malformed`.
    pub fn malformed(message: impl fmt::Display) -> Self {
        HandlerError {
            class: ErrorClass::Malformed,
            message: message.to_string(),
            retry_after: None,
        }
    }

    /// The error's class.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// The error text.
    pub fn message(&self) -> &str {
        &self.message
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
