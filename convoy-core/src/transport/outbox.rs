//! Where a subscription's transform outputs go: the part of transforms the transport contract
//! carries ([`Subscription::outbox`](super::Subscription::outbox)). Transforms themselves, and
//! the outboxes convoy provides, are in [`crate::transform`].

use async_trait::async_trait;
use bytes::Bytes;

use super::TransportError;
use crate::message::{Message, OutgoingMessage};

/// One message a transform publishes: where to, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    /// The topic it goes to.
    pub topic: String,
    /// The message (its key picks the partition, as with any convoy publisher).
    pub message: OutgoingMessage,
}

impl Output {
    /// `message` to `topic`.
    pub fn new(topic: impl Into<String>, message: OutgoingMessage) -> Self {
        Output {
            topic: topic.into(),
            message,
        }
    }

    /// A keyed message to `topic`.
    pub fn keyed(topic: impl Into<String>, key: impl Into<Bytes>, payload: impl Into<Bytes>) -> Self {
        Output::new(topic, OutgoingMessage::new(key, payload))
    }
}

/// What an [`Outbox`] promises about the outputs it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputGuarantee {
    /// Published in one broker transaction with the commit that covers their input: visible
    /// to `read_committed` readers exactly once (Kafka with a transactional id).
    ExactlyOnce,
    /// Published before their input is finished, again if the input is redelivered, always
    /// with the same event ids: at least once, deduplicated by id downstream.
    Deduplicated,
}

/// Where a subscription's transform outputs go (see [`crate::transform`]).
#[async_trait]
pub trait Outbox: Send + Sync + 'static {
    /// Takes the outputs of `input`, whose handling just succeeded. `Ok` means they will be
    /// published no later than the commit that covers `input`; an error fails the attempt
    /// (a [`TransportError::Fatal`] one dead-letters the input, any other is retried).
    async fn put(&self, input: &Message, outputs: Vec<Output>) -> Result<(), TransportError>;

    /// What this outbox promises.
    fn guarantee(&self) -> OutputGuarantee;

    /// `input` ended without outputs (dead-lettered, set aside): an outbox that holds outputs
    /// until a commit forgets any an earlier handling of it left.
    fn discard(&self, _input: &Message) {}

    /// True if what `input` outputs is already taken care of, so that a delivery of it found to
    /// be a duplicate may be skipped. An outbox holding outputs until a commit says false when
    /// it holds none for this very delivery (they went with its ownership): the input runs again.
    fn covers(&self, _input: &Message) -> bool {
        true
    }

    /// Bytes of outputs held until a commit: they count against the engine's held-bytes bound.
    fn held_bytes(&self) -> usize {
        0
    }
}
