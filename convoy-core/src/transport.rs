//! The transport contract: what every broker adapter implements, in its own terms.
//!
//! A [`Transport`] opens a [`Subscription`]: a channel of [`SourceEvent`]s (messages, sources
//! assigned, sources being revoked or lost) plus a [`SourceControl`] to pause and resume
//! fetching per source and to commit watermarks. A [`Publisher`] sends keyed messages so that
//! every message of one key lands in one source. The engine never sees a broker type.
//!
//! Rules an adapter must keep (the conformance suite checks them):
//! - `Assigned(s)` comes before any message of `s`; within one assignment, offsets of `s`
//!   increase.
//! - After `Revoked`/`Lost` for `s`, no message of that assignment follows; messages of a
//!   later assignment of `s` come only after a new `Assigned(s)`.
//! - `Revoked` is acknowledged by the engine after it drained and committed; the transport
//!   must accept commits of the revoked sources until the acknowledgement, and must not hand
//!   the sources to another member before it.
//! - `commit(s, W)` means every offset ≤ W of `s` is finished.

use std::fmt;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use crate::message::{Message, Offset, OutgoingMessage, SourceId};

/// Boxed error from a broker client, kept as the source of a [`TransportError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A broker operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The broker could not be reached; retry with backoff.
    #[error("broker unavailable: {0}")]
    Unavailable(String),
    /// This consumer no longer owns the source (it was rebalanced away); the commit is refused.
    #[error("source {0} is not owned by this consumer any more")]
    NotOwner(SourceId),
    /// The subscription or publisher was closed.
    #[error("transport closed")]
    Closed,
    /// The broker rejected the request.
    #[error("{context}: {source}")]
    Broker {
        /// What was being done.
        context: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

impl TransportError {
    /// Wraps a client error with what was being done.
    pub fn broker(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        TransportError::Broker {
            context: context.into(),
            source: source.into(),
        }
    }
}

/// A source handed to this consumer, with where its committed position stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The source.
    pub source: SourceId,
    /// The committed watermark (every offset ≤ it is finished), if any.
    pub committed: Option<Offset>,
    /// Offsets above the committed watermark known to be finished already (e.g. decoded from
    /// Kafka commit metadata); the engine skips them instead of handling them again.
    pub finished_above: Vec<Offset>,
}

impl Assignment {
    /// A source with a committed watermark and nothing known above it.
    pub fn new(source: SourceId, committed: Option<Offset>) -> Self {
        Assignment {
            source,
            committed,
            finished_above: Vec::new(),
        }
    }
}

/// The engine's acknowledgement that revoked sources were drained and committed.
#[derive(Debug)]
pub struct RevokeAck(oneshot::Sender<()>);

impl RevokeAck {
    /// A pair: the ack the engine completes, and the receiver the transport waits on.
    pub fn new() -> (RevokeAck, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (RevokeAck(tx), rx)
    }

    /// Tells the transport it may release the sources.
    pub fn done(self) {
        // The transport may have given up waiting; nothing more to do then.
        let _ = self.0.send(());
    }
}

/// What a subscription reports to the engine.
#[derive(Debug)]
pub enum SourceEvent {
    /// Messages of one source, in offset order.
    Messages {
        /// The source.
        source: SourceId,
        /// The batch.
        messages: Vec<Message>,
    },
    /// Sources now owned by this consumer.
    Assigned(Vec<Assignment>),
    /// Sources being taken away: drain, commit, then acknowledge.
    Revoked {
        /// The sources.
        sources: Vec<SourceId>,
        /// Complete after the final commit.
        ack: RevokeAck,
    },
    /// Sources already gone (session expired, connection lost): do not commit them.
    Lost(Vec<SourceId>),
}

/// A watermark to commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Commit {
    /// The source.
    pub source: SourceId,
    /// Every offset ≤ this is finished.
    pub watermark: Offset,
    /// Finished offsets above the watermark (only filled for transports that ask for them).
    pub finished_above: Vec<Offset>,
}

/// Per-source flow control and commits for a subscription.
#[async_trait]
pub trait SourceControl: Send + Sync + 'static {
    /// Stops fetching these sources (already fetched messages may still arrive).
    fn pause(&self, sources: &[SourceId]) -> Result<(), TransportError>;
    /// Fetches these sources again.
    fn resume(&self, sources: &[SourceId]) -> Result<(), TransportError>;
    /// Commits watermarks; returns once the broker confirmed.
    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError>;
    /// The newest offset in each source (for lag while paused); `None` where unknown.
    async fn last_offsets(&self, sources: &[SourceId]) -> Vec<Option<Offset>> {
        vec![None; sources.len()]
    }
    /// True when commits should carry the finished offsets above the watermark.
    fn wants_finished_above(&self) -> bool {
        false
    }
    /// Leaves gracefully (after the final commit).
    async fn close(&self) -> Result<(), TransportError>;
}

/// An open subscription: events in, control out. Dropping it without `close` is a crash:
/// the broker reassigns the sources from their last committed watermarks.
pub struct Subscription {
    /// The event stream.
    pub events: mpsc::Receiver<SourceEvent>,
    /// Flow control and commits.
    pub control: Box<dyn SourceControl>,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

/// Opens subscriptions (one consumer-group member each).
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Joins the group and starts fetching.
    async fn subscribe(&self) -> Result<Subscription, TransportError>;
}

/// Where a published message landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receipt {
    /// The source chosen for the key.
    pub source: SourceId,
    /// The offset assigned.
    pub offset: Offset,
}

/// Sends keyed messages; every message of one key lands in one source. Returns once the
/// broker confirmed.
#[async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// Publishes one message, confirmed.
    async fn publish(&self, message: OutgoingMessage) -> Result<Receipt, TransportError>;

    /// Publishes messages in order, pipelined where the broker allows, and returns once every
    /// one is confirmed. Messages of one key keep their order. The default sends one at a time.
    async fn publish_all(&self, messages: Vec<OutgoingMessage>) -> Result<Vec<Receipt>, TransportError> {
        let mut receipts = Vec::with_capacity(messages.len());
        for message in messages {
            receipts.push(self.publish(message).await?);
        }
        Ok(receipts)
    }
}

#[async_trait]
impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    async fn publish(&self, message: OutgoingMessage) -> Result<Receipt, TransportError> {
        (**self).publish(message).await
    }

    async fn publish_all(&self, messages: Vec<OutgoingMessage>) -> Result<Vec<Receipt>, TransportError> {
        (**self).publish_all(messages).await
    }
}
