//! The memory transport: convoy's transport contract over [`MemoryBroker`], so handlers run
//! with no broker process. It prefetches a few batches per member by design; the prefetch limit
//! bounds what each batch weighs.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::dead_letter::{ReadBack, ReadMark};
use convoy_core::transform::{Outbox, StagingOutbox, DEFAULT_MAX_TRANSACTION_BYTES};
use convoy_core::transport::{Commit, PrefetchLimit, SourceControl, Subscription};
use convoy_core::{
    DeadLetter, DeadLetterSink, Message, Offset, OutgoingMessage, Publisher, Receipt, SourceId, Transport,
    TransportError,
};

use crate::broker::{Joining, MemoryBroker};

/// Subscribes group members to topics of a [`MemoryBroker`].
#[derive(Clone)]
pub struct MemoryTransport {
    broker: MemoryBroker,
    group: String,
    topics: Vec<String>,
    /// Commit in transactions, with an exactly-once outbox for transforms whose transactions
    /// carry at most this many bytes of outputs each.
    transactions: Option<usize>,
    /// Assignments say their offsets count deliveries, not positions (as RabbitMQ's do).
    delivery_offsets: bool,
}

impl MemoryTransport {
    /// A transport for `group` consuming `topics`.
    pub fn new(broker: &MemoryBroker, group: impl Into<String>, topics: &[&str]) -> Self {
        MemoryTransport {
            broker: broker.clone(),
            group: group.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            transactions: None,
            delivery_offsets: false,
        }
    }

    /// Assignments say their offsets count deliveries and name no position (as an AMQP
    /// channel's delivery tags): no event id is derived from them. Tests and simulations of
    /// such brokers.
    pub fn delivery_offsets(mut self) -> Self {
        self.delivery_offsets = true;
        self
    }

    /// Members commit in transactions: a transform's outputs are staged until the commit that
    /// covers their input and published with it, both or neither (exactly once, as on Kafka
    /// with a transactional id).
    pub fn transactional(self) -> Self {
        self.max_transaction_bytes(DEFAULT_MAX_TRANSACTION_BYTES)
    }

    /// As [`transactional`](Self::transactional), each transaction carrying at most
    /// `max_bytes` of outputs (a backlog goes in several).
    pub fn max_transaction_bytes(mut self, max_bytes: usize) -> Self {
        self.transactions = Some(max_bytes);
        self
    }
}

#[async_trait]
impl Transport for MemoryTransport {
    async fn subscribe(&self) -> Result<Subscription, TransportError> {
        self.subscribe_with(PrefetchLimit::default()).await
    }

    fn group(&self) -> Option<String> {
        Some(self.group.clone())
    }

    /// Joins with batches of at most `limit.bytes / 64` (the member keeps a few batches ahead of
    /// the engine: their weight is what this bounds).
    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        let batch_bytes = (limit.bytes / 64).max(64 << 10);
        let outbox = self
            .transactions
            .map(|max_bytes| Arc::new(StagingOutbox::new(max_bytes)));
        let joining = Joining {
            batch_bytes,
            outbox: outbox.clone(),
            delivery_offsets: self.delivery_offsets,
        };
        let (member, events) = self.broker.join(&self.group, &self.topics, joining)?;
        let mut subscription = Subscription::new(
            events,
            Box::new(MemoryControl {
                broker: self.broker.clone(),
                member,
                outbox: outbox.clone(),
            }),
        );
        subscription.outbox = outbox.map(|o| o as Arc<dyn Outbox>);
        Ok(subscription)
    }
}

/// Flow control and commits of one member. Dropping it leaves the group (a crash, if the
/// engine did not commit first).
struct MemoryControl {
    broker: MemoryBroker,
    member: u64,
    outbox: Option<Arc<StagingOutbox>>,
}

#[async_trait]
impl SourceControl for MemoryControl {
    fn pause(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.broker.set_paused(self.member, sources, true)
    }

    fn resume(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.broker.set_paused(self.member, sources, false)
    }

    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError> {
        let Some(outbox) = &self.outbox else {
            return self.broker.commit_when_answered(self.member, commits).await;
        };
        for transaction in outbox.transactions(commits) {
            self.broker.commit_transaction(self.member, &transaction).await?;
            outbox.committed(&transaction);
        }
        Ok(())
    }

    async fn last_offsets(&self, sources: &[SourceId]) -> Vec<Option<Offset>> {
        self.broker.last_offsets(sources)
    }

    /// The newest offset minus the committed one; 0 on an empty partition.
    async fn backlogs(&self, sources: &[(SourceId, Option<Offset>)]) -> Vec<Option<u64>> {
        let ids: Vec<SourceId> = sources.iter().map(|(id, _)| id.clone()).collect();
        let newest = self.broker.last_offsets(&ids);
        sources
            .iter()
            .zip(newest)
            .map(|((_, committed), newest)| {
                Some(newest.map_or(0, |newest| {
                    convoy_core::transport::backlog_between(*committed, newest)
                }))
            })
            .collect()
    }

    /// An offset map, except for a member committing in transactions: an input finished above
    /// the watermark has outputs that go only with a commit covering it.
    fn wants_finished_above(&self) -> bool {
        self.outbox.is_none()
    }

    fn revoke_timeout(&self) -> Option<std::time::Duration> {
        Some(self.broker.faults().rebalance_timeout)
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.broker.leave(self.member);
        Ok(())
    }
}

impl Drop for MemoryControl {
    fn drop(&mut self) {
        self.broker.leave(self.member);
    }
}

/// Publishes to one topic; keys pick partitions with Kafka's murmur2.
#[derive(Clone)]
pub struct MemoryPublisher {
    broker: MemoryBroker,
    topic: String,
}

impl MemoryPublisher {
    /// A publisher to `topic`.
    pub fn new(broker: &MemoryBroker, topic: impl Into<String>) -> Self {
        MemoryPublisher {
            broker: broker.clone(),
            topic: topic.into(),
        }
    }
}

#[async_trait]
impl Publisher for MemoryPublisher {
    /// Stamps the message as every broker's publisher does (event id, `traceparent`);
    /// [`MemoryBroker::publish`] stores it as it is, like a foreign producer.
    async fn publish(&self, mut message: OutgoingMessage) -> Result<Receipt, TransportError> {
        message.stamp();
        self.broker.publish(&self.topic, message)
    }
}

/// Dead letters to a topic of the memory broker (created with one partition if missing).
#[derive(Clone)]
pub struct MemoryDeadLetterSink {
    broker: MemoryBroker,
    topic: String,
}

impl MemoryDeadLetterSink {
    /// A sink writing to `topic`.
    pub fn new(broker: &MemoryBroker, topic: impl Into<String>) -> Self {
        let topic = topic.into();
        broker.create_topic(&topic, 1);
        MemoryDeadLetterSink {
            broker: broker.clone(),
            topic,
        }
    }
}

#[async_trait]
impl DeadLetterSink for MemoryDeadLetterSink {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        if self.broker.take_dead_letter_failure() {
            return Err(TransportError::Unavailable("injected dead-letter failure".into()));
        }
        self.broker
            .publish(&self.topic, dead_letter.to_outgoing())
            .map(|_| ())
    }

    fn can_read_back(&self) -> bool {
        true
    }

    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        Ok(self.broker.read_all(&self.topic))
    }

    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        let from = mark.and_then(ReadMark::next_offsets).unwrap_or_default();
        let (records, next) = self.broker.read_from(&self.topic, &from);
        Ok(ReadBack {
            records,
            mark: Some(ReadMark::of_next_offsets(&next)),
            restarted: false,
        })
    }

    async fn load_checkpoint(&self, group: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
        Ok(self.broker.load_checkpoint(&self.topic, group, part))
    }

    async fn save_checkpoint(&self, group: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
        self.broker.save_checkpoint(&self.topic, group, part, checkpoint);
        Ok(())
    }
}
