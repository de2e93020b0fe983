//! The memory transport as a conformance and benchmark target.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::transport::{PrefetchLimit, Subscription};
use convoy_core::{DeadLetterSink, Message, Offset, Publisher, SourceId, TransportError};
use convoy_memory::baseline::bare_drain_rate;
use convoy_memory::{MemoryBroker, MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};

use crate::conformance::{BedParts, Capabilities, ConformanceTarget, TestBed};
use crate::scenario::{Progress, RecordCheck, Scenario, ScenarioBed, ScenarioReport};
use crate::support::read_until;

/// Largest batch the memory broker hands out per partition in conformance runs.
const CONFORMANCE_BATCH: usize = 32;

/// Fresh topics and groups on one in-memory broker.
pub struct MemoryTarget {
    broker: MemoryBroker,
    beds: AtomicU64,
}

impl Default for MemoryTarget {
    fn default() -> Self {
        MemoryTarget::new()
    }
}

impl MemoryTarget {
    /// A target over a new broker with small fetch batches (so back-pressure bounds are tight).
    pub fn new() -> Self {
        let broker = MemoryBroker::new();
        broker.set_faults(|f| f.max_batch = CONFORMANCE_BATCH);
        MemoryTarget {
            broker,
            beds: AtomicU64::new(0),
        }
    }

    /// A target over an existing broker (its faults are left as they are).
    pub fn on(broker: MemoryBroker) -> Self {
        MemoryTarget {
            broker,
            beds: AtomicU64::new(0),
        }
    }

    /// The broker, for fault injection.
    pub fn broker(&self) -> &MemoryBroker {
        &self.broker
    }

    /// A fresh topic with `partitions` partitions, its group and dead-letter topic.
    pub fn memory_bed(&self, partitions: u32) -> MemoryBed {
        let n = self.beds.fetch_add(1, Relaxed);
        let topic = format!("convoy-test-{n}");
        self.broker.create_topic(&topic, partitions);
        let dlq = format!("{topic}.dlq");
        let group = format!("group-{n}");
        MemoryBed {
            parts: BedParts {
                publisher: Arc::new(MemoryPublisher::new(&self.broker, &topic)),
                dead_letter_sink: Arc::new(MemoryDeadLetterSink::new(&self.broker, &dlq)),
                transport: Arc::new(MemoryTransport::new(
                    &self.broker,
                    group.clone(),
                    &[topic.as_str()],
                )),
                group,
            },
            broker: self.broker.clone(),
            topic,
            dlq,
        }
    }
}

/// One isolated topic + group + dead-letter topic on the memory broker.
pub struct MemoryBed {
    broker: MemoryBroker,
    topic: String,
    dlq: String,
    parts: BedParts,
}

impl MemoryBed {
    /// The topic name.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The broker the bed lives on.
    pub fn broker(&self) -> &MemoryBroker {
        &self.broker
    }
}

/// Runs a benchmark scenario on a fresh memory broker.
pub async fn run_memory(scenario: &Scenario, progress: Progress<'_>) -> Result<ScenarioReport, String> {
    let target = MemoryTarget::on(MemoryBroker::new());
    let bed = target.memory_bed(scenario.partitions);
    crate::scenario::run(&bed, scenario, progress).await
}

#[async_trait]
impl ScenarioBed for MemoryBed {
    fn transport(&self) -> &str {
        "memory"
    }

    fn group(&self) -> &str {
        &self.parts.group
    }

    fn partitions(&self) -> u32 {
        self.broker.partitions(&self.topic).unwrap_or(0)
    }

    fn publisher(&self) -> Arc<dyn Publisher> {
        self.parts.publisher.clone()
    }

    fn dead_letter_sink(&self) -> Arc<dyn DeadLetterSink> {
        self.parts.dead_letter_sink.clone()
    }

    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        self.parts.transport.subscribe_with(limit).await
    }

    async fn bare_drain(
        &self,
        expected: u64,
        limit: Duration,
        check: RecordCheck,
    ) -> Result<f64, TransportError> {
        Ok(bare_drain_rate(&self.broker, &self.topic, expected, limit, |k, p| check(k, p)).await)
    }
}

#[async_trait]
impl TestBed for MemoryBed {
    fn parts(&self) -> &BedParts {
        &self.parts
    }

    async fn dead_letters(&self, expected: usize) -> Result<Vec<Message>, TransportError> {
        read_until(expected, Duration::from_secs(10), || async {
            Ok(self.broker.read_all(&self.dlq))
        })
        .await
    }

    async fn committed(&self) -> Result<BTreeMap<SourceId, Offset>, TransportError> {
        Ok(self.broker.committed(&self.parts.group))
    }
}

#[async_trait]
impl ConformanceTarget for MemoryTarget {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            // The batch that crossed the mark, the batches queued in the event channel, and the
            // one the fetch loop holds while waiting to send it.
            max_prefetch: (convoy_memory::broker::EVENT_CAPACITY + 2) * CONFORMANCE_BATCH,
            positions: crate::conformance::Positions::Log,
            deduplicates_publishes: false,
        }
    }

    async fn bed(&self, partitions: u32) -> Result<Box<dyn TestBed>, TransportError> {
        Ok(Box::new(self.memory_bed(partitions)))
    }
}
