//! The Kafka subscription: a consumer-group member whose partitions are convoy sources.
//!
//! Threads, because librdkafka's calls block and its rebalance callback must block too:
//! - the *main* thread polls the consumer's main queue, which serves rebalance and error
//!   callbacks (no messages arrive there: every partition is split off before it is assigned);
//! - one *partition* thread per assigned partition polls its own queue and sends batches to the
//!   engine, so partitions are independent and a paused or slow one never blocks another.
//!
//! On revoke, the callback stops the partition threads, hands the engine a `Revoked` event and
//! waits (bounded) for the engine's acknowledgement — drained and committed — before librdkafka
//! releases the partitions. A lost assignment is reported as `Lost` and never committed.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use convoy_core::{
    Assignment, Commit, Offset, RevokeAck, SourceControl, SourceEvent, SourceId, Subscription, Transport,
    TransportError,
};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Message as _, Offset as KafkaOffset, TopicPartitionList};
use tokio::sync::mpsc;

use crate::config::KafkaConfig;
use crate::convert::{source_id, to_message, topic_partition};
use crate::offset_map;

/// Events buffered between the consumer threads and the engine.
pub const EVENT_CAPACITY: usize = 16;
/// Most messages per batch from one partition.
pub const MAX_BATCH: usize = 500;
/// Poll timeout of the consumer threads (also how fast they notice a stop).
const POLL: Duration = Duration::from_millis(50);
/// Broker round-trips inside callbacks (committed offsets) give up after this long.
const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

type KafkaConsumer = BaseConsumer<ConvoyContext>;
type PartitionQueue = rdkafka::consumer::base_consumer::PartitionQueue<ConvoyContext>;
/// A split partition queue waiting for its thread.
type SplitQueue = (String, i32, PartitionQueue);

struct PartitionThread {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// State shared by the callbacks, the threads and the control.
struct Shared {
    events: mpsc::Sender<SourceEvent>,
    consumer: OnceLock<Weak<KafkaConsumer>>,
    partitions: Mutex<HashMap<(String, i32), PartitionThread>>,
    /// Partitions the engine paused. Pausing stops draining the partition's queue; librdkafka
    /// keeps what it prefetched and stops fetching once its own queue limits are reached.
    /// (librdkafka's own pause discards the prefetched messages and refetches them on resume:
    /// measured 7× slower under back-pressure.)
    paused: Mutex<HashSet<(String, i32)>>,
    /// Set when the member is leaving: callbacks stop talking to the engine.
    closing: AtomicBool,
    /// Set once the member left: the main poll thread ends.
    stopped: AtomicBool,
    revoke_timeout: Duration,
}

impl Shared {
    /// Sends an event unless closing; gives up at `deadline` (the engine stopped reading).
    fn send(&self, mut event: SourceEvent, deadline: Instant) -> bool {
        loop {
            match self.events.try_send(event) {
                Ok(()) => return true,
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
                Err(mpsc::error::TrySendError::Full(back)) => {
                    if self.closing.load(SeqCst) || Instant::now() >= deadline {
                        return false;
                    }
                    event = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    fn set_paused(&self, which: &[(String, i32)], paused: bool) {
        let mut set = self.paused.lock().unwrap_or_else(|p| p.into_inner());
        for tp in which {
            if paused {
                set.insert(tp.clone());
            } else {
                set.remove(tp);
            }
        }
    }

    fn is_paused(&self, tp: &(String, i32)) -> bool {
        self.paused.lock().unwrap_or_else(|p| p.into_inner()).contains(tp)
    }

    fn stop_partitions(&self, which: &[(String, i32)]) {
        let stopped: Vec<PartitionThread> = {
            let mut map = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
            which.iter().filter_map(|tp| map.remove(tp)).collect()
        };
        for p in &stopped {
            p.stop.store(true, SeqCst);
        }
        for p in stopped {
            // A partition thread only ends by noticing its stop flag; a panic there is a bug.
            if p.thread.join().is_err() {
                tracing::error!("a Kafka partition thread panicked");
            }
        }
    }
}

/// The librdkafka context: runs convoy's side of every rebalance.
pub struct ConvoyContext {
    shared: Arc<Shared>,
}

impl ClientContext for ConvoyContext {}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<(String, i32)> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

impl ConvoyContext {
    fn on_assign(&self, consumer: &KafkaConsumer, tpl: &TopicPartitionList) -> Vec<SplitQueue> {
        let shared = &self.shared;
        let parts = partitions_of(tpl);
        // A new assignment starts unpaused; the engine re-applies its back-pressure state.
        shared.set_paused(&parts, false);
        let Some(owner) = shared.consumer.get().and_then(Weak::upgrade) else {
            return Vec::new();
        };
        // Split before librdkafka starts fetching, so no message of these partitions reaches
        // the main queue.
        let queues: Vec<_> = parts
            .iter()
            .filter_map(|(t, p)| owner.split_partition_queue(t, *p).map(|q| (t.clone(), *p, q)))
            .collect();
        if queues.len() != parts.len() {
            tracing::error!(
                ?parts,
                "could not split every assigned partition into its own queue"
            );
        }
        let committed = match consumer.committed_offsets(tpl.clone(), BROKER_TIMEOUT) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "reading committed offsets failed; starting the tracker without them");
                tpl.clone()
            }
        };
        let assignments = committed
            .elements()
            .iter()
            .map(|e| {
                let source = source_id(e.topic(), e.partition());
                match e.offset() {
                    KafkaOffset::Offset(next) if next > 0 => {
                        let next = next as Offset;
                        Assignment {
                            source,
                            committed: Some(next - 1),
                            finished_above: offset_map::decode(next, e.metadata()),
                        }
                    }
                    _ => Assignment::new(source, None),
                }
            })
            .collect();
        let deadline = Instant::now() + shared.revoke_timeout;
        shared.send(SourceEvent::Assigned(assignments), deadline);
        queues
    }

    fn start_partitions(&self, queues: Vec<SplitQueue>) {
        let mut map = self.shared.partitions.lock().unwrap_or_else(|p| p.into_inner());
        for (topic, partition, queue) in queues {
            let stop = Arc::new(AtomicBool::new(false));
            let shared = self.shared.clone();
            let source = source_id(&topic, partition);
            let flag = stop.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("convoy-kafka-{partition}"))
                .spawn(move || partition_loop(&queue, &source, &shared, &flag));
            match spawned {
                Ok(thread) => {
                    map.insert((topic, partition), PartitionThread { stop, thread });
                }
                Err(e) => tracing::error!(error = %e, %topic, partition, "cannot start a partition thread"),
            }
        }
    }

    fn on_revoke(&self, consumer: &KafkaConsumer, tpl: &TopicPartitionList) {
        let shared = &self.shared;
        let parts = partitions_of(tpl);
        // No message of this assignment may reach the engine after the revoke event.
        shared.stop_partitions(&parts);
        if shared.closing.load(SeqCst) {
            return; // the engine committed before closing
        }
        let sources: Vec<SourceId> = parts.iter().map(|(t, p)| source_id(t, *p)).collect();
        let deadline = Instant::now() + shared.revoke_timeout;
        if consumer.assignment_lost() {
            tracing::warn!(?sources, "assignment lost (session expired); not committing");
            shared.send(SourceEvent::Lost(sources), deadline);
            return;
        }
        let (ack, mut done) = RevokeAck::new();
        if !shared.send(SourceEvent::Revoked { sources, ack }, deadline) {
            return;
        }
        // Block librdkafka's rebalance until the engine drained and committed (bounded).
        let waited = loop {
            match done.try_recv() {
                Ok(()) => break true,
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => break false,
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {
                    // Closing means the engine already made its final commit and is waiting for
                    // this thread to finish: the revoke needs nothing more from it.
                    if shared.closing.load(SeqCst) {
                        break true;
                    }
                    if Instant::now() >= deadline {
                        break false;
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        };
        if !waited {
            tracing::warn!(
                "the engine did not acknowledge the revoke in time; releasing the partitions anyway"
            );
        }
    }
}

impl ConsumerContext for ConvoyContext {
    fn rebalance(&self, consumer: &KafkaConsumer, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        let cooperative = matches!(consumer.rebalance_protocol(), RebalanceProtocol::Cooperative);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let queues = self.on_assign(consumer, tpl);
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = assigned {
                    tracing::error!(error = %e, "assigning partitions failed");
                }
                // librdkafka keeps a paused flag across reassignment: start unpaused, the engine
                // re-applies its own back-pressure state after every assignment.
                if let Err(e) = consumer.resume(tpl) {
                    tracing::debug!(error = %e, "resuming newly assigned partitions");
                }
                self.start_partitions(queues);
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.on_revoke(consumer, tpl);
                let released = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = released {
                    tracing::error!(error = %e, "releasing partitions failed");
                }
            }
            other => {
                tracing::error!(error = ?other, "rebalance error; dropping the assignment");
                let all = partitions_of(tpl);
                self.shared.stop_partitions(&all);
                let sources = all.iter().map(|(t, p)| source_id(t, *p)).collect();
                self.shared.send(
                    SourceEvent::Lost(sources),
                    Instant::now() + self.shared.revoke_timeout,
                );
                if let Err(e) = consumer.unassign() {
                    tracing::error!(error = %e, "unassigning after a rebalance error failed");
                }
            }
        }
    }
}

fn partition_loop(queue: &PartitionQueue, source: &SourceId, shared: &Shared, stop: &AtomicBool) {
    let (mut batches, mut messages, mut full_waits) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    let tp = topic_partition(source).map(|(t, p)| (t.to_owned(), p));
    while !stop.load(SeqCst) {
        if tp.as_ref().is_some_and(|tp| shared.is_paused(tp)) {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let mut batch = Vec::new();
        match queue.poll(POLL) {
            None => continue,
            Some(Err(e)) => {
                tracing::warn!(%source, error = %e, "fetch error");
                continue;
            }
            Some(Ok(record)) => batch.push(to_message(&record, source)),
        }
        while batch.len() < MAX_BATCH {
            match queue.poll(Duration::ZERO) {
                Some(Ok(record)) => batch.push(to_message(&record, source)),
                Some(Err(e)) => {
                    tracing::warn!(%source, error = %e, "fetch error");
                    break;
                }
                None => break,
            }
        }
        batches += 1;
        messages += batch.len() as u64;
        let mut event = SourceEvent::Messages {
            source: source.clone(),
            messages: batch,
        };
        // Wait for room, but notice a stop: an unsent batch is simply fetched again by the next
        // owner (nothing of it was committed).
        loop {
            match shared.events.try_send(event) {
                Ok(()) => break,
                Err(mpsc::error::TrySendError::Closed(_)) => return,
                Err(mpsc::error::TrySendError::Full(back)) => {
                    if stop.load(SeqCst) {
                        return;
                    }
                    full_waits += 1;
                    event = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
    tracing::debug!(%source, batches, messages, full_waits, elapsed = ?started.elapsed(), "partition thread stopped");
}

/// Opens Kafka subscriptions: each `subscribe` joins the group as a new member.
#[derive(Clone, Debug)]
pub struct KafkaTransport {
    config: KafkaConfig,
    revoke_timeout: Duration,
}

impl KafkaTransport {
    /// A transport for `config` (validated here: the error names the bad field).
    pub fn new(config: KafkaConfig) -> Result<Self, convoy_core::ConfigError> {
        config.validate()?;
        Ok(KafkaTransport {
            config,
            revoke_timeout: Duration::from_secs(60),
        })
    }

    /// How long a revoke waits for the engine's drain and commit (default 60 s; keep it above
    /// the engine's drain timeout).
    pub fn with_revoke_timeout(mut self, timeout: Duration) -> Self {
        self.revoke_timeout = timeout;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }
}

#[async_trait]
impl Transport for KafkaTransport {
    async fn subscribe(&self) -> Result<Subscription, TransportError> {
        let (events, rx) = mpsc::channel(EVENT_CAPACITY);
        let shared = Arc::new(Shared {
            events,
            consumer: OnceLock::new(),
            partitions: Mutex::new(HashMap::new()),
            paused: Mutex::new(HashSet::new()),
            closing: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            revoke_timeout: self.revoke_timeout,
        });
        let context = ConvoyContext {
            shared: shared.clone(),
        };
        let consumer: Arc<KafkaConsumer> = Arc::new(
            self.config
                .consumer_config()
                .create_with_context(context)
                .map_err(|e| TransportError::broker("creating the Kafka consumer", e))?,
        );
        let _ = shared.consumer.set(Arc::downgrade(&consumer));
        let topics: Vec<&str> = self.config.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| TransportError::broker(format!("subscribing to {topics:?}"), e))?;
        let poller = consumer.clone();
        let poll_shared = shared.clone();
        let main = std::thread::Builder::new()
            .name("convoy-kafka-main".into())
            .spawn(move || {
                while !poll_shared.stopped.load(SeqCst) {
                    match poller.poll(POLL) {
                        None => {}
                        Some(Ok(record)) => tracing::error!(
                            topic = record.topic(),
                            partition = record.partition(),
                            "a message reached the main queue; it is left to the next owner"
                        ),
                        Some(Err(e)) => tracing::warn!(error = %e, "Kafka consumer error"),
                    }
                }
            })
            .map_err(|e| TransportError::broker("starting the Kafka poll thread", e))?;
        Ok(Subscription {
            events: rx,
            control: Box::new(KafkaControl {
                consumer: Mutex::new(Some(consumer)),
                shared,
                main: Mutex::new(Some(main)),
            }),
        })
    }
}

/// Pause/resume/commit for one member.
struct KafkaControl {
    consumer: Mutex<Option<Arc<KafkaConsumer>>>,
    shared: Arc<Shared>,
    main: Mutex<Option<JoinHandle<()>>>,
}

impl KafkaControl {
    fn consumer(&self) -> Result<Arc<KafkaConsumer>, TransportError> {
        self.consumer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(TransportError::Closed)
    }

    fn partitions(sources: &[SourceId]) -> Vec<(String, i32)> {
        sources
            .iter()
            .filter_map(|s| topic_partition(s).map(|(t, p)| (t.to_owned(), p)))
            .collect()
    }

    /// Leaves the group, stops every thread and drops the consumer, off the runtime.
    fn shut(&self) -> Option<std::thread::JoinHandle<()>> {
        self.shared.closing.store(true, SeqCst);
        let consumer = self.consumer.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        let main = self.main.lock().unwrap_or_else(|p| p.into_inner()).take();
        let shared = self.shared.clone();
        std::thread::Builder::new()
            .name("convoy-kafka-close".into())
            .spawn(move || {
                tracing::debug!("leaving the Kafka group");
                // Unsubscribe while the main thread still polls: it serves the revoke callback
                // and librdkafka sends LeaveGroup, so the others rebalance at once instead of
                // waiting for this member to rejoin or its session to expire.
                consumer.unsubscribe();
                let deadline = Instant::now() + Duration::from_secs(10);
                while consumer.assignment().is_ok_and(|a| a.count() > 0) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let all: Vec<(String, i32)> = shared
                    .partitions
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .keys()
                    .cloned()
                    .collect();
                shared.stop_partitions(&all);
                shared.stopped.store(true, SeqCst);
                if let Some(main) = main {
                    let _ = main.join();
                }
                // Short-lived blocking calls (commit, watermarks) may still hold the consumer: let
                // them finish, so librdkafka's close runs here, now.
                while Arc::strong_count(&consumer) > 1 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                drop(consumer);
                tracing::debug!("Kafka consumer closed");
            })
            .ok()
    }
}

#[async_trait]
impl SourceControl for KafkaControl {
    fn pause(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.shared.set_paused(&Self::partitions(sources), true);
        Ok(())
    }

    fn resume(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.shared.set_paused(&Self::partitions(sources), false);
        Ok(())
    }

    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError> {
        let consumer = self.consumer()?;
        let mut tpl = TopicPartitionList::new();
        for c in commits {
            let Some((topic, partition)) = topic_partition(&c.source) else {
                return Err(TransportError::NotOwner(c.source.clone()));
            };
            let next = c.watermark + 1; // Kafka commits the next offset to read
            let mut e = tpl.add_partition(topic, partition);
            e.set_offset(KafkaOffset::Offset(next as i64))
                .map_err(|err| TransportError::broker("building the commit", err))?;
            if let Some(metadata) =
                offset_map::encode(next, &c.finished_above, offset_map::DEFAULT_MAX_METADATA)
            {
                e.set_metadata(metadata);
            }
        }
        let result = tokio::task::spawn_blocking(move || consumer.commit(&tpl, CommitMode::Sync))
            .await
            .map_err(|e| TransportError::broker("commit task", e))?;
        match result {
            Ok(()) => Ok(()),
            Err(KafkaError::ConsumerCommit(code)) => Err(TransportError::broker(
                "committing offsets",
                format!("{code} (the partitions may have been rebalanced away)"),
            )),
            Err(e) => Err(TransportError::broker("committing offsets", e)),
        }
    }

    async fn last_offsets(&self, sources: &[SourceId]) -> Vec<Option<Offset>> {
        let Ok(consumer) = self.consumer() else {
            return vec![None; sources.len()];
        };
        let sources = sources.to_vec();
        tokio::task::spawn_blocking(move || {
            sources
                .iter()
                .map(|s| {
                    let (t, p) = topic_partition(s)?;
                    let (_, high) = consumer.fetch_watermarks(t, p, Duration::from_millis(500)).ok()?;
                    (high > 0).then(|| (high - 1) as Offset)
                })
                .collect()
        })
        .await
        .unwrap_or_default()
    }

    fn wants_finished_above(&self) -> bool {
        true
    }

    async fn close(&self) -> Result<(), TransportError> {
        if let Some(closer) = self.shut() {
            tokio::task::spawn_blocking(move || closer.join())
                .await
                .map_err(|e| TransportError::broker("closing the consumer", e))?
                .map_err(|_| TransportError::broker("closing the consumer", "close thread panicked"))?;
        }
        Ok(())
    }
}

impl Drop for KafkaControl {
    fn drop(&mut self) {
        // Dropped without close (a crash of the engine): leave without committing, in the
        // background so a runtime thread never blocks on the network.
        let _ = self.shut();
    }
}
