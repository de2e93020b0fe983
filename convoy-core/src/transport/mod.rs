//! The transport contract: what every broker adapter implements, in its own terms.
//!
//! A [`Transport`] opens a [`Subscription`]: a channel of [`SourceEvent`]s (messages, sources
//! assigned, sources being revoked or lost) plus a [`SourceControl`] to pause and resume
//! fetching per source and to commit watermarks. A [`Publisher`] sends keyed messages so that
//! every message of one key lands in one source. The engine never sees a broker type.
//!
//! Rules an adapter must keep (the conformance suite checks them):
//! - events travel through one [`event_channel`], so they keep their order;
//! - `Assigned(s)` comes before any message of `s`; within one assignment, offsets of `s`
//!   increase (an offset at or below one already sent means the source's log was truncated and
//!   rewritten: the engine treats it as a position reset);
//! - after `Revoked`/`Lost` for `s`, no message of that assignment follows; messages of a
//!   later assignment of `s` come only after a new `Assigned(s)`;
//! - `Revoked` carries the deadline at which the transport releases the sources; until then
//!   it accepts commits of them, and it never hands them to another member before the engine
//!   acknowledged or the deadline passed (the engine cancels their work before it);
//! - a commit with `next = N` means every offset below `N` of the source is finished;
//! - a failure the subscription cannot recover from is reported as `Failed`, never only logged.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use crate::message::{Offset, OutgoingMessage, SourceId};

mod batches;
pub mod clock;
mod departure;
mod events;
mod group;
mod lease;
mod member;
mod outage;
mod outbox;

pub use batches::BatchSender;
pub use departure::Departure;
pub use group::{Ended, GroupLocks, GroupMember, LockLoss, MemberTiming, PartitionReader};
pub use lease::{Lease, LeaseTerms, Renewal};
pub use member::{MemberControl, MemberSources};
pub use outage::{wait_out_outage, JOIN_WITHIN};
pub use outbox::{Outbox, Output, OutputGuarantee};

pub use events::{
    event_channel, EventReceiver, EventSender, EventsClosed, RevokeAck, SourceEvent, TrySendBatch,
};

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
    /// The client cannot go on (fenced, not authorized, a fatal client error): nothing retried
    /// will succeed; fix the cause and restart.
    #[error("{0} (fatal: this client cannot continue; fix the cause and restart)")]
    Fatal(String),
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

    /// True for errors no retry can fix ([`TransportError::Fatal`]).
    pub fn is_fatal(&self) -> bool {
        matches!(self, TransportError::Fatal(_))
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
    /// For a source held by lease: no handler attempt of it starts once the lease ran out.
    pub lease: Option<Lease>,
    /// True when an offset of this source is a stable position in a log (a Kafka offset, a
    /// JetStream stream sequence, the memory broker's): the same offset names the same message
    /// whoever reads it and however often, so a message without an event id of its own is
    /// identified by (source, offset). False for offsets that only count deliveries (an AMQP
    /// delivery tag restarts at 1 on every channel): the engine then derives no event id from
    /// them, and such a message is never skipped as a duplicate.
    pub offsets_are_positions: bool,
    /// The transport's own mark of this assignment (a channel, an ownership epoch), given back
    /// in every [`Commit`] computed for it, so a commit of an earlier assignment is never applied
    /// to a later one of the same source. 0 where the transport needs none.
    pub token: u64,
}

impl Assignment {
    /// A source with a committed watermark and nothing known above it, whose offsets are
    /// positions in a log.
    pub fn new(source: SourceId, committed: Option<Offset>) -> Self {
        Assignment {
            source,
            committed,
            finished_above: Vec::new(),
            lease: None,
            offsets_are_positions: true,
            token: 0,
        }
    }

    /// The same assignment, held by `lease`.
    pub fn with_lease(mut self, lease: Lease) -> Self {
        self.lease = Some(lease);
        self
    }

    /// The same assignment, its offsets counting deliveries rather than naming log positions.
    pub fn with_delivery_offsets(mut self) -> Self {
        self.offsets_are_positions = false;
        self
    }

    /// The same assignment, marked `token` for its commits.
    pub fn with_token(mut self, token: u64) -> Self {
        self.token = token;
        self
    }
}

/// The messages above `committed` up to `newest`, offsets being dense (`None`: nothing
/// committed, so everything from offset 0).
pub fn backlog_between(committed: Option<Offset>, newest: Offset) -> u64 {
    match committed {
        Some(committed) => newest.saturating_sub(committed),
        None => newest + 1,
    }
}

/// A position to commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Commit {
    /// The source.
    pub source: SourceId,
    /// Every offset below this is finished: the watermark plus one (Kafka's committed offset),
    /// or, while nothing is finished yet, the lowest offset received. A transport that
    /// acknowledges by the last finished position acknowledges `next - 1`, and nothing when no
    /// offset it delivered lies below `next`.
    pub next: Offset,
    /// The [`Assignment::token`] of the assignment this commit was computed for.
    pub token: u64,
    /// Finished offsets at or above `next` (only filled for transports that ask for them).
    pub finished_above: Vec<Offset>,
}

impl Commit {
    /// The watermark: the highest offset known finished with everything before it.
    pub fn watermark(&self) -> Option<Offset> {
        self.next.checked_sub(1)
    }
}

/// How much a subscription may fetch ahead of the engine, in total over its sources: the
/// engine's own back-pressure bounds what it holds, this bounds what the broker client buffers
/// beyond it. A transport divides it over the sources it may own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefetchLimit {
    /// Messages buffered in the client, in total.
    pub messages: usize,
    /// Bytes (keys, payloads, headers) buffered in the client, in total.
    pub bytes: usize,
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
    /// Per source, how many of its messages lie above `committed` (its committed watermark):
    /// its lag, asked of the broker so that it shows while fetching is paused. `None` where
    /// unknown. By default derived from [`last_offsets`](Self::last_offsets), exact where
    /// offsets are dense (Kafka's); a transport whose offsets have gaps (NATS stream sequences,
    /// which the partitions of a topic share) counts the messages instead.
    async fn backlogs(&self, sources: &[(SourceId, Option<Offset>)]) -> Vec<Option<u64>> {
        let ids: Vec<SourceId> = sources.iter().map(|(id, _)| id.clone()).collect();
        let newest = self.last_offsets(&ids).await;
        sources
            .iter()
            .zip(newest)
            .map(|((_, committed), newest)| newest.map(|newest| backlog_between(*committed, newest)))
            .collect()
    }
    /// True when commits should carry the finished offsets above the watermark.
    fn wants_finished_above(&self) -> bool {
        false
    }
    /// How long the transport waits for a revoke's acknowledgement before it releases the
    /// sources anyway; the engine refuses to start with a drain timeout that is not shorter.
    fn revoke_timeout(&self) -> Option<Duration> {
        None
    }
    /// How many delivered messages of one source may stand uncommitted before the transport
    /// stops delivering that source (RabbitMQ's prefetch: acknowledgements grant credit).
    /// The engine then commits a source as soon as half of it is finished, instead of waiting
    /// for `commit_every` or `commit_interval`. `None`: delivery never waits for commits.
    fn credit(&self) -> Option<u64> {
        None
    }
    /// Leaves gracefully (after the final commit).
    async fn close(&self) -> Result<(), TransportError>;
}

/// An open subscription: events in, control out. Dropping it without `close` is a crash:
/// the broker reassigns the sources from their last committed watermarks.
pub struct Subscription {
    /// The event stream.
    pub events: EventReceiver,
    /// Flow control and commits.
    pub control: Box<dyn SourceControl>,
    /// Where a transform's outputs go when this subscription's commits carry them (Kafka with a
    /// transactional id); `None` where outputs are simply published (the facade's connection
    /// gives those a [`PublishingOutbox`](crate::transform::PublishingOutbox)).
    pub outbox: Option<std::sync::Arc<dyn Outbox>>,
}

impl Subscription {
    /// A subscription with no outbox of its own.
    pub fn new(events: EventReceiver, control: Box<dyn SourceControl>) -> Self {
        Subscription {
            events,
            control,
            outbox: None,
        }
    }
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

/// Opens subscriptions (one consumer-group member each).
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Joins the group and starts fetching, prefetching at most the default limit.
    async fn subscribe(&self) -> Result<Subscription, TransportError>;

    /// Joins the group and starts fetching, prefetching at most `limit` (the engine passes
    /// one derived from its back-pressure bounds). Transports whose client buffers little
    /// by design may ignore it.
    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        let _ = limit;
        self.subscribe().await
    }

    /// The consumer group this transport's members join, if it has one: an engine whose
    /// configuration names no group takes it (for its dead-letter reasons and metrics).
    fn group(&self) -> Option<String> {
        None
    }
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
    /// one is confirmed. Messages of one key keep their order, also when one fails: no message
    /// is stored after an earlier message of its key that was not (brokers confirming each
    /// message on its own get the batch in rounds, see [`BatchSender`]). On an error, publish
    /// the batch again: what was stored comes again as a duplicate (skipped by its event id),
    /// in order. The default sends one at a time.
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
