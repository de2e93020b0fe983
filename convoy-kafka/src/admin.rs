//! Broker administration the tools need: reachability, topic creation, reading a topic from
//! its beginning (for dead-letter inspection) — without joining a consumer group.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use convoy_core::{Message, TransportError};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset as KafkaOffset, TopicPartitionList};

use crate::config::KafkaConfig;
use crate::convert::{source_id, to_message};

/// How long a metadata request may take before the broker counts as unreachable.
pub const REACH_TIMEOUT: Duration = Duration::from_secs(5);

fn consumer(config: &KafkaConfig, group: &str) -> Result<BaseConsumer, TransportError> {
    let mut c: ClientConfig = config.consumer_config();
    c.set("group.id", group);
    c.create()
        .map_err(|e| TransportError::broker("creating a Kafka consumer", e))
}

/// What the reachability probe heard from librdkafka besides its answers: a refused SASL login
/// or a failed TLS handshake never reaches a metadata call, which only times out. The error's
/// code comes from polling the probe; librdkafka's words for it, from its log.
#[derive(Default)]
struct ProbeContext {
    last_complaint: Mutex<Option<String>>,
}

impl ClientContext for ProbeContext {
    /// Polled instead (see `check_reachable`): not logged as well.
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "librdkafka error while checking the broker");
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        if (level as i32) <= (RDKafkaLogLevel::Warning as i32) {
            *self.last_complaint.lock().unwrap_or_else(|p| p.into_inner()) = Some(message.to_owned());
        }
        tracing::debug!(facility = fac, "librdkafka: {message}");
    }
}

impl ConsumerContext for ProbeContext {}

impl ProbeContext {
    fn last_complaint(&self) -> Option<String> {
        self.last_complaint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A refused login or a failed TLS handshake: no retry can fix either, so the probe says what to
/// check at once instead of waiting out [`REACH_TIMEOUT`].
fn refusal(code: RDKafkaErrorCode, reason: &str, servers: &str) -> Option<TransportError> {
    match code {
        RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed => {
            Some(TransportError::Fatal(format!(
                "Kafka at {servers} refused the login: {reason} — check sasl.mechanisms, \
                 sasl.username and sasl.password"
            )))
        }
        RDKafkaErrorCode::SSL => Some(TransportError::Fatal(format!(
            "the TLS handshake with Kafka at {servers} failed: {reason} — check \
             security.protocol, and ssl.ca.location for a broker whose certificate a private CA signed"
        ))),
        _ => None,
    }
}

/// Checks that a broker answers a metadata request within [`REACH_TIMEOUT`]. A login the broker
/// refuses or a TLS handshake that fails ends the check at once, as a fatal error saying which
/// settings to check.
pub async fn check_reachable(config: &KafkaConfig) -> Result<(), TransportError> {
    let mut c: ClientConfig = config.consumer_config();
    c.set("group.id", "convoy-reachability");
    let probe: BaseConsumer<ProbeContext> = c
        .create_with_context(ProbeContext::default())
        .map_err(|e| TransportError::broker("creating a Kafka consumer", e))?;
    let servers = config.bootstrap_servers.clone();
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        loop {
            let answer = probe.fetch_metadata(None, REACH_STEP);
            // Errors the client raised meanwhile (a refused login, a failed handshake).
            while let Some(event) = probe.poll(Duration::ZERO) {
                let Err(e) = event else { continue };
                let Some(code) = e.rdkafka_error_code() else { continue };
                let reason = probe.context().last_complaint().unwrap_or_else(|| e.to_string());
                if let Some(refused) = refusal(code, &reason, &servers) {
                    return Err(refused);
                }
            }
            match answer {
                Ok(_) => return Ok(()),
                Err(_) if started.elapsed() < REACH_TIMEOUT => {}
                Err(e) => {
                    let heard = probe
                        .context()
                        .last_complaint()
                        .map(|said| format!("; the client last said: {said}"))
                        .unwrap_or_default();
                    return Err(TransportError::Unavailable(format!(
                        "no Kafka broker answered at {servers} within {} s ({e}{heard}); is it running and is the address right?",
                        REACH_TIMEOUT.as_secs()
                    )));
                }
            }
        }
    })
    .await
    .map_err(|_| TransportError::Closed)?
}

/// How long each metadata request of the reachability check waits.
const REACH_STEP: Duration = Duration::from_millis(500);

/// Creates topics that do not exist yet (`(name, partitions)`) with the broker's default
/// replication factor; existing ones are left alone.
pub async fn create_topics(config: &KafkaConfig, topics: &[(&str, i32)]) -> Result<(), TransportError> {
    create_topics_replicated(config, topics, None).await
}

/// Creates topics that do not exist yet (`(name, partitions)`), each partition on
/// `replication` brokers (`None`: the broker's `default.replication.factor`); existing ones
/// are left alone.
pub async fn create_topics_replicated(
    config: &KafkaConfig,
    topics: &[(&str, i32)],
    replication: Option<i32>,
) -> Result<(), TransportError> {
    let admin = admin_client(config)?;
    // -1: the broker's `default.replication.factor` (KIP-464), not a single copy.
    let replication = replication.unwrap_or(-1);
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|(name, partitions)| NewTopic::new(name, *partitions, TopicReplication::Fixed(replication)))
        .collect();
    create(&admin, &new).await
}

/// Creates the compacted one-partition topic `name` if it does not exist: a store of the latest
/// record per key (a group's parked keys' checkpoint).
pub async fn create_compacted_topic(config: &KafkaConfig, name: &str) -> Result<(), TransportError> {
    let admin = admin_client(config)?;
    let topic = NewTopic::new(name, 1, TopicReplication::Fixed(-1)).set("cleanup.policy", "compact");
    create(&admin, &[topic]).await
}

/// Creates `topics`, leaving those that exist already alone.
async fn create(
    admin: &AdminClient<DefaultClientContext>,
    topics: &[NewTopic<'_>],
) -> Result<(), TransportError> {
    let results = admin
        .create_topics(topics, &admin_options())
        .await
        .map_err(|e| TransportError::broker("creating topics", e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(TransportError::broker(
                    format!("creating topic {topic}"),
                    rdkafka::error::KafkaError::AdminOp(code),
                ))
            }
        }
    }
    Ok(())
}

/// Every topic on the cluster but Kafka's internal ones (`__…`): `(name, partitions)`, by name.
pub async fn list_topics(config: &KafkaConfig) -> Result<Vec<(String, usize)>, TransportError> {
    // An unreachable broker or a refused login is said as such, not as a failed listing.
    check_reachable(config).await?;
    let probe = consumer(config, "convoy-admin")?;
    tokio::task::spawn_blocking(move || {
        let metadata = probe
            .fetch_metadata(None, Duration::from_secs(10))
            .map_err(|e| TransportError::broker("listing the topics", e))?;
        let mut topics: Vec<(String, usize)> = metadata
            .topics()
            .iter()
            .filter(|t| !t.name().starts_with("__"))
            .map(|t| (t.name().to_owned(), t.partitions().len()))
            .collect();
        topics.sort();
        Ok(topics)
    })
    .await
    .map_err(|_| TransportError::Closed)?
}

/// Deletes `topics` (and every message in them); one that does not exist is skipped.
pub async fn delete_topics(config: &KafkaConfig, topics: &[&str]) -> Result<(), TransportError> {
    let admin = admin_client(config)?;
    let results = admin
        .delete_topics(topics, &admin_options())
        .await
        .map_err(|e| TransportError::broker("deleting topics", e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((topic, code)) => {
                return Err(TransportError::broker(
                    format!("deleting topic {topic}"),
                    rdkafka::error::KafkaError::AdminOp(code),
                ))
            }
        }
    }
    Ok(())
}

fn admin_client(config: &KafkaConfig) -> Result<AdminClient<DefaultClientContext>, TransportError> {
    config
        .base()
        .create()
        .map_err(|e| TransportError::broker("creating a Kafka admin client", e))
}

fn admin_options() -> AdminOptions {
    AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)))
}

/// Every message of `topic` from the beginning of each partition to its end at the time of
/// the call, without joining a group or committing: until every partition is read to the end
/// its high watermark gave, or nothing arrived for `idle`.
pub async fn read_topic(
    config: &KafkaConfig,
    topic: &str,
    idle: Duration,
) -> Result<Vec<Message>, TransportError> {
    read(config, topic, idle, false).await
}

/// The same, but reading must reach every partition's end: a stall of `stall` before it is an
/// error (what parked keys are read back with: a partial read would miss a parked key).
pub async fn read_topic_to_end(
    config: &KafkaConfig,
    topic: &str,
    stall: Duration,
) -> Result<Vec<Message>, TransportError> {
    read(config, topic, stall, true).await
}

/// Records read, and the next offset of each partition (where the next read starts).
pub type ReadAfter = (Vec<Message>, BTreeMap<u32, u64>);

/// The records of `topic` from the offsets of `from` on (a partition not named: from its
/// beginning) to the end each partition had when reading began, and that end per partition:
/// where the next read starts. A stall of `stall` before the end is an error. `None` when an
/// offset of `from` is past its partition's end: the topic was deleted and created again
/// since `from` was taken.
pub async fn read_topic_after(
    config: &KafkaConfig,
    topic: &str,
    from: BTreeMap<u32, u64>,
    stall: Duration,
) -> Result<Option<ReadAfter>, TransportError> {
    let reader = consumer(config, "convoy-reader")?;
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || read_blocking(&reader, &topic, &from, stall, true))
        .await
        .map_err(|_| TransportError::Closed)?
}

async fn read(
    config: &KafkaConfig,
    topic: &str,
    idle: Duration,
    to_end: bool,
) -> Result<Vec<Message>, TransportError> {
    let reader = consumer(config, "convoy-reader")?;
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        // From the beginning: never past an end.
        read_blocking(&reader, &topic, &BTreeMap::new(), idle, to_end).map(|read| read.unwrap_or_default().0)
    })
    .await
    .map_err(|_| TransportError::Closed)?
}

fn read_blocking(
    reader: &BaseConsumer,
    topic: &str,
    from: &BTreeMap<u32, u64>,
    idle: Duration,
    to_end: bool,
) -> Result<Option<ReadAfter>, TransportError> {
    let metadata = reader
        .fetch_metadata(Some(topic), REACH_TIMEOUT)
        .map_err(|e| TransportError::broker(format!("reading the metadata of {topic}"), e))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    // The end of each partition now: reading stops once every partition is read up to it (its
    // position, which also moves past transaction markers, reached it), or when nothing arrived
    // for `idle` before then.
    let mut remaining = BTreeMap::new();
    let mut next = BTreeMap::new();
    let mut assignment = TopicPartitionList::new();
    for p in partitions {
        let (low, high) = reader
            .fetch_watermarks(topic, p, REACH_TIMEOUT)
            .map_err(|e| TransportError::broker(format!("reading the end offsets of {topic}"), e))?;
        let part = u32::try_from(p).unwrap_or(0);
        let given = from.get(&part).map(|&o| i64::try_from(o).unwrap_or(i64::MAX));
        if given.is_some_and(|o| o > high) {
            return Ok(None);
        }
        let start = given.map_or(low, |o| o.max(low));
        next.insert(part, u64::try_from(high.max(start)).unwrap_or(0));
        if high > start {
            remaining.insert(p, high);
            let offset = match given {
                Some(_) => KafkaOffset::Offset(start),
                None => KafkaOffset::Beginning,
            };
            assignment
                .add_partition_offset(topic, p, offset)
                .map_err(|e| TransportError::broker("assigning partitions", e))?;
        }
    }
    if remaining.is_empty() {
        return Ok(Some((Vec::new(), next)));
    }
    reader
        .assign(&assignment)
        .map_err(|e| TransportError::broker(format!("assigning the partitions of {topic}"), e))?;
    let mut messages = Vec::new();
    let mut last_progress = Instant::now();
    while !remaining.is_empty() && last_progress.elapsed() < idle {
        match reader.poll(Duration::from_millis(100)) {
            Some(Ok(record)) => {
                use rdkafka::Message as _;
                messages.push(to_message(&record, &source_id(topic, record.partition())));
                last_progress = Instant::now();
            }
            Some(Err(e)) => return Err(TransportError::broker(format!("reading {topic}"), e)),
            None => {}
        }
        let positions = reader
            .position()
            .map_err(|e| TransportError::broker(format!("reading the positions in {topic}"), e))?;
        for e in positions.elements() {
            if let KafkaOffset::Offset(at) = e.offset() {
                if remaining.get(&e.partition()).is_some_and(|end| at >= *end) {
                    remaining.remove(&e.partition());
                }
            }
        }
    }
    if to_end && !remaining.is_empty() {
        return Err(TransportError::Unavailable(format!(
            "reading {topic}: nothing arrived for {idle:?} before the end of partitions {:?}",
            remaining.keys().collect::<Vec<_>>()
        )));
    }
    messages.sort_by(|a, b| (a.source.as_str(), a.offset).cmp(&(b.source.as_str(), b.offset)));
    Ok(Some((messages, next)))
}
