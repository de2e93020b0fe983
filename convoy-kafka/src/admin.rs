//! Broker administration the tools need: reachability, topic creation, reading a topic from
//! its beginning (for dead-letter inspection) — without joining a consumer group.

use std::time::{Duration, Instant};

use convoy_core::{Message, TransportError};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
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

/// Checks that a broker answers a metadata request within [`REACH_TIMEOUT`].
pub async fn check_reachable(config: &KafkaConfig) -> Result<(), TransportError> {
    let probe = consumer(config, "convoy-reachability")?;
    let servers = config.bootstrap_servers.clone();
    tokio::task::spawn_blocking(move || probe.fetch_metadata(None, REACH_TIMEOUT).map(|_| ()))
        .await
        .map_err(|_| TransportError::Closed)?
        .map_err(|e| {
            TransportError::Unavailable(format!(
                "no Kafka broker answered at {servers} within {} s ({e}); is it running and is the address right?",
                REACH_TIMEOUT.as_secs()
            ))
        })
}

/// Creates topics that do not exist yet (`(name, partitions)`) with the broker's default
/// replication factor; existing ones are left alone.
pub async fn create_topics(config: &KafkaConfig, topics: &[(&str, i32)]) -> Result<(), TransportError> {
    let admin: AdminClient<DefaultClientContext> = config
        .base()
        .create()
        .map_err(|e| TransportError::broker("creating a Kafka admin client", e))?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        // -1: the broker's `default.replication.factor` (KIP-464), not a single copy.
        .map(|(name, partitions)| NewTopic::new(name, *partitions, TopicReplication::Fixed(-1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = admin
        .create_topics(&new, &options)
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

/// Every message of `topic` from the beginning of each partition to its end at the time of
/// the call, without joining a group or committing: until every partition is read to the end
/// its high watermark gave, or nothing arrived for `idle`.
pub async fn read_topic(
    config: &KafkaConfig,
    topic: &str,
    idle: Duration,
) -> Result<Vec<Message>, TransportError> {
    let reader = consumer(config, "convoy-reader")?;
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || read_blocking(&reader, &topic, idle))
        .await
        .map_err(|_| TransportError::Closed)?
}

fn read_blocking(reader: &BaseConsumer, topic: &str, idle: Duration) -> Result<Vec<Message>, TransportError> {
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
    let mut remaining = std::collections::BTreeMap::new();
    let mut assignment = TopicPartitionList::new();
    for p in partitions {
        let (low, high) = reader
            .fetch_watermarks(topic, p, REACH_TIMEOUT)
            .map_err(|e| TransportError::broker(format!("reading the end offsets of {topic}"), e))?;
        if high > low {
            remaining.insert(p, high);
        }
        assignment
            .add_partition_offset(topic, p, KafkaOffset::Beginning)
            .map_err(|e| TransportError::broker("assigning partitions", e))?;
    }
    if remaining.is_empty() {
        return Ok(Vec::new());
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
    messages.sort_by(|a, b| (a.source.as_str(), a.offset).cmp(&(b.source.as_str(), b.offset)));
    Ok(messages)
}
