//! The Kafka subscription: a consumer-group member whose partitions are convoy sources.
//!
//! Threads, because librdkafka's calls block and its rebalance callback must block too:
//! - the *main* thread polls the consumer's main queue, which serves rebalance callbacks and
//!   errors (no messages arrive there: every partition is split off before it is assigned);
//! - each assigned partition keeps its own queue, so partitions are independent and a paused or
//!   slow one never blocks another; a bounded pool of *poller* threads (one per CPU, at most
//!   eight) serves the queues that librdkafka reports non-empty, so a member owning hundreds of
//!   partitions does not run hundreds of threads.
//!
//! By job: `context` runs rebalances (assign, revoke with its deadline, lost), `positions`
//! checks an assignment's committed positions against what the partitions still hold (a hole
//! left by retention, a topic created again), `growth` says when a topic gained partitions
//! under the group (keys move), `pollers` the partitions' queues and the threads
//! that poll them, `control` pause/resume/commit/close,
//! `transaction` the commits of a member with a transactional id (exactly once to Kafka).
//!
//! Memory: with split queues librdkafka's prefetch limits apply per partition, so they are
//! derived from the engine's [`PrefetchLimit`] divided over every partition of the subscribed
//! topics ([`Prefetch`]).

mod context;
mod control;
mod growth;
mod outage;
mod pollers;
mod positions;
mod transaction;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::transport::{event_channel, EventSender};
use convoy_core::transport::{wait_out_outage, JOIN_WITHIN};
use convoy_core::transport::{PrefetchLimit, SourceEvent, Subscription};
use convoy_core::{Transport, TransportError};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::Message as _;

pub use self::context::ConvoyContext;
use self::control::KafkaControl;
use self::pollers::Pollers;
use self::transaction::Transactions;
use crate::config::{KafkaConfig, Prefetch};
use crate::fatal;

/// Message batches buffered between the consumer threads and the engine (control events
/// never wait for room).
pub const EVENT_CAPACITY: usize = 16;
/// Poll timeout of the consumer threads (also how fast they notice a stop).
const POLL: Duration = Duration::from_millis(50);
/// Broker round-trips inside callbacks (committed offsets) give up after this long.
const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

type KafkaConsumer = BaseConsumer<ConvoyContext>;
type PartitionQueue = rdkafka::consumer::base_consumer::PartitionQueue<ConvoyContext>;
/// A topic and partition.
type Tp = (String, i32);

/// State shared by the callbacks, the threads and the control.
struct Shared {
    events: EventSender,
    consumer: OnceLock<Weak<KafkaConsumer>>,
    pollers: Pollers,
    /// Partitions the engine paused. Pausing stops draining the partition's queue; librdkafka
    /// keeps what it prefetched and stops fetching at its (bounded) queue limits. (librdkafka's
    /// own pause discards the prefetched messages and refetches them on resume: measured 7×
    /// slower under back-pressure.)
    paused: Mutex<HashSet<Tp>>,
    /// Set when the member is leaving: callbacks stop talking to the engine.
    closing: AtomicBool,
    /// Set once the member left: the main poll thread ends.
    stopped: AtomicBool,
    /// Set once a fatal error was reported (reported once).
    failed: AtomicBool,
    revoke_timeout: Duration,
    /// How long a query of a partition's newest offset may take.
    newest_offset_timeout: Duration,
    prefetch: Prefetch,
    /// The offset-map limit in force (lowered to 0 if the broker refuses the metadata size).
    offset_map_max: AtomicUsize,
    /// The transactional producer commits go through, with a transactional id.
    transactions: Option<Arc<Transactions>>,
    /// The consumer group (a label of the metrics the callbacks count).
    group: String,
    /// Each subscribed topic's partitions as last seen (at joining, then at each assignment):
    /// a topic that grows under the group is said once ([`growth`]).
    partitions: Mutex<HashMap<String, usize>>,
}

impl Shared {
    /// Sends a control event unless the member is leaving.
    fn control(&self, event: SourceEvent) -> bool {
        !self.closing.load(SeqCst) && self.events.control(event).is_ok()
    }

    /// Reports an error nothing retried can fix (once); the engine stops on it.
    fn fail(&self, error: TransportError) {
        if !self.failed.swap(true, SeqCst) {
            tracing::error!(%error, "Kafka consumer failed");
            let _ = self.events.control(SourceEvent::Failed(error));
        }
    }

    /// Reports `error` if it is fatal; true when it was.
    fn fail_if_fatal(&self, error: &rdkafka::error::KafkaError, context: &str) -> bool {
        match fatal::classify(error, context) {
            Some(fatal) => {
                self.fail(fatal);
                true
            }
            None => false,
        }
    }

    fn set_paused(&self, which: &[Tp], paused: bool) {
        {
            let mut set = self.paused.lock().unwrap_or_else(|p| p.into_inner());
            for tp in which {
                if paused {
                    set.insert(tp.clone());
                } else {
                    set.remove(tp);
                }
            }
        }
        if !paused {
            self.pollers.resume(which);
        }
    }

    fn is_paused(&self, tp: &Tp) -> bool {
        self.paused.lock().unwrap_or_else(|p| p.into_inner()).contains(tp)
    }

    /// Stops serving `which`: when this returns, no message of them reaches the engine.
    fn stop_partitions(&self, which: &[Tp]) {
        self.pollers.remove(which);
    }
}

/// Opens Kafka subscriptions: each `subscribe` joins the group as a new member.
#[derive(Clone, Debug)]
pub struct KafkaTransport {
    config: KafkaConfig,
}

impl KafkaTransport {
    /// A transport for `config` (validated here: the error names the bad field).
    pub fn new(config: KafkaConfig) -> Result<Self, convoy_core::ConfigError> {
        config.validate()?;
        Ok(KafkaTransport { config })
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// How many partitions the subscribed topics have now (at least one): the most this
    /// member can own, over which the prefetch budget is divided.
    /// Each subscribed topic's partitions now.
    async fn partition_counts(&self) -> Result<HashMap<String, usize>, TransportError> {
        // First the reachability check: a refused login or a failed TLS handshake is reported
        // as such (fatal, naming the settings) instead of as a metadata request timing out.
        crate::admin::check_reachable(&self.config).await?;
        let probe: BaseConsumer = self
            .config
            .consumer_config()
            .create()
            .map_err(|e| TransportError::broker("creating a metadata client", e))?;
        let topics = self.config.topics.clone();
        tokio::task::spawn_blocking(move || {
            topics
                .iter()
                .map(|topic| {
                    let count = growth::partitions_of(&probe, topic)
                        .map_err(|e| TransportError::broker(format!("reading the metadata of {topic}"), e))?;
                    Ok((topic.clone(), count))
                })
                .collect()
        })
        .await
        .map_err(|e| TransportError::broker("reading topic metadata", e))?
    }
}

#[async_trait]
impl Transport for KafkaTransport {
    fn group(&self) -> Option<String> {
        Some(self.config.group_id.clone())
    }

    async fn subscribe(&self) -> Result<Subscription, TransportError> {
        self.subscribe_with(PrefetchLimit::default()).await
    }

    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        // A member started while its broker restarts waits it out before joining.
        let counts = wait_out_outage(JOIN_WITHIN, "reading the subscribed topics", || {
            self.partition_counts()
        })
        .await?;
        let partitions = counts.values().sum::<usize>().max(1);
        let prefetch = Prefetch::divide(limit, partitions);
        tracing::debug!(partitions, ?prefetch, "prefetch per partition");
        // Before joining: registering the id fences a predecessor with the same id and aborts
        // its open transaction, so its offsets are settled before this member reads them.
        let transactions = match &self.config.transactional_id {
            Some(id) => {
                let (config, id) = (self.config.clone(), id.clone());
                Some(Arc::new(
                    tokio::task::spawn_blocking(move || Transactions::init(&config, &id))
                        .await
                        .map_err(|e| TransportError::broker("registering the transactional id", e))??,
                ))
            }
            None => None,
        };
        let (events, rx) = event_channel(EVENT_CAPACITY);
        let shared = Arc::new(Shared {
            events,
            consumer: OnceLock::new(),
            pollers: Pollers::new(),
            paused: Mutex::new(HashSet::new()),
            closing: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            revoke_timeout: self.config.revoke_timeout(),
            newest_offset_timeout: self.config.newest_offset_timeout(),
            prefetch,
            offset_map_max: AtomicUsize::new(self.config.offset_map_limit()),
            transactions: transactions.clone(),
            group: self.config.group_id.clone(),
            partitions: Mutex::new(counts),
        });
        let context = ConvoyContext {
            shared: shared.clone(),
        };
        let consumer: Arc<KafkaConsumer> = Arc::new(
            self.config
                .bounded_consumer_config(&prefetch)
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
                let mut outage = outage::Outage::default();
                while !poll_shared.stopped.load(SeqCst) {
                    match poller.poll(POLL) {
                        None => {}
                        Some(Ok(record)) => tracing::error!(
                            topic = record.topic(),
                            partition = record.partition(),
                            "a message reached the main queue; it is left to the next owner"
                        ),
                        Some(Err(e)) if poll_shared.fail_if_fatal(&e, "Kafka consumer") => {} // the engine stops
                        Some(Err(e)) if outage.on_error(&e) => {}
                        Some(Err(e)) => tracing::warn!(error = %e, "Kafka consumer error"),
                    }
                    outage.check(&poller);
                }
            })
            .map_err(|e| TransportError::broker("starting the Kafka poll thread", e))?;
        let mut subscription = Subscription::new(rx, Box::new(KafkaControl::new(consumer, shared, main)));
        if let Some(transactions) = transactions {
            subscription.outbox = Some(transactions.outbox.clone());
        }
        Ok(subscription)
    }
}
