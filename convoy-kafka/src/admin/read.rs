//! Reading a topic without joining a group: whole (dead-letter inspection), after a mark
//! (parked keys' read-back), or a key's latest record from the end (their checkpoint).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use convoy_core::{Message, TransportError};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};

use super::{consumer, REACH_TIMEOUT};
use crate::config::KafkaConfig;
use crate::convert::{source_id, to_message};

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

/// The latest record of `key` in `topic`, searched from each partition's end backwards in
/// windows growing fourfold: a store of one record per key (a compacted topic) costs what the
/// records written since the key's last one cost, not its whole history — which a compacted
/// topic keeps uncompacted in its active segment. The search ends at the first partition
/// holding the key (a key's records share one partition). A stall of `stall` is an error.
pub async fn latest_of_key(
    config: &KafkaConfig,
    topic: &str,
    key: &[u8],
    stall: Duration,
) -> Result<Option<Message>, TransportError> {
    let reader = consumer(config, "convoy-reader")?;
    let topic = topic.to_owned();
    let key = key.to_vec();
    tokio::task::spawn_blocking(move || {
        for (partition, low, high) in partition_ends(&reader, &topic)? {
            let mut end = high;
            let mut window = FIRST_WINDOW;
            while end > low {
                let start = end.saturating_sub(window).max(low);
                let mut part = TopicPartitionList::new();
                part.add_partition_offset(&topic, partition, KafkaOffset::Offset(start))
                    .map_err(|e| TransportError::broker("assigning partitions", e))?;
                let records = drain(
                    &reader,
                    &topic,
                    part,
                    BTreeMap::from([(partition, end)]),
                    stall,
                    true,
                )?;
                if let Some(latest) = records
                    .into_iter()
                    .rev()
                    .find(|r| r.key.as_deref() == Some(&key[..]))
                {
                    return Ok(Some(latest));
                }
                end = start;
                window = window.saturating_mul(4);
            }
        }
        Ok(None)
    })
    .await
    .map_err(|_| TransportError::Closed)?
}

/// The first window [`latest_of_key`] reads back from a partition's end.
const FIRST_WINDOW: i64 = 16;

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

/// `(partition, low, high)` watermarks of each partition of `topic`, now.
fn partition_ends(reader: &BaseConsumer, topic: &str) -> Result<Vec<(i32, i64, i64)>, TransportError> {
    let metadata = reader
        .fetch_metadata(Some(topic), REACH_TIMEOUT)
        .map_err(|e| TransportError::broker(format!("reading the metadata of {topic}"), e))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    partitions
        .into_iter()
        .map(|p| {
            let (low, high) = reader
                .fetch_watermarks(topic, p, REACH_TIMEOUT)
                .map_err(|e| TransportError::broker(format!("reading the end offsets of {topic}"), e))?;
            Ok((p, low, high))
        })
        .collect()
}

fn read_blocking(
    reader: &BaseConsumer,
    topic: &str,
    from: &BTreeMap<u32, u64>,
    idle: Duration,
    to_end: bool,
) -> Result<Option<ReadAfter>, TransportError> {
    // The end of each partition now: reading stops once every partition is read up to it.
    let mut ends = BTreeMap::new();
    let mut next = BTreeMap::new();
    let mut assignment = TopicPartitionList::new();
    for (p, low, high) in partition_ends(reader, topic)? {
        let part = u32::try_from(p).unwrap_or(0);
        let given = from.get(&part).map(|&o| i64::try_from(o).unwrap_or(i64::MAX));
        if given.is_some_and(|o| o > high) {
            return Ok(None);
        }
        let start = given.map_or(low, |o| o.max(low));
        next.insert(part, u64::try_from(high.max(start)).unwrap_or(0));
        if high > start {
            ends.insert(p, high);
            let offset = match given {
                Some(_) => KafkaOffset::Offset(start),
                None => KafkaOffset::Beginning,
            };
            assignment
                .add_partition_offset(topic, p, offset)
                .map_err(|e| TransportError::broker("assigning partitions", e))?;
        }
    }
    let messages = drain(reader, topic, assignment, ends, idle, to_end)?;
    Ok(Some((messages, next)))
}

/// Reads `assignment` until each partition's position reached its end in `ends` (a position
/// also moves past transaction markers and compacted gaps), or nothing arrived for `idle`
/// before then (an error if `to_end`). Records at or past their partition's end are left out:
/// they are the next read's. Sorted by partition and offset.
fn drain(
    reader: &BaseConsumer,
    topic: &str,
    assignment: TopicPartitionList,
    mut ends: BTreeMap<i32, i64>,
    idle: Duration,
    to_end: bool,
) -> Result<Vec<Message>, TransportError> {
    if ends.is_empty() {
        return Ok(Vec::new());
    }
    let bounds = ends.clone();
    reader
        .assign(&assignment)
        .map_err(|e| TransportError::broker(format!("assigning the partitions of {topic}"), e))?;
    let mut messages = Vec::new();
    let mut last_progress = Instant::now();
    while !ends.is_empty() && last_progress.elapsed() < idle {
        match reader.poll(Duration::from_millis(100)) {
            Some(Ok(record)) => {
                use rdkafka::Message as _;
                let within = bounds
                    .get(&record.partition())
                    .is_some_and(|end| record.offset() < *end);
                if within {
                    messages.push(to_message(&record, &source_id(topic, record.partition())));
                }
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
                if ends.get(&e.partition()).is_some_and(|end| at >= *end) {
                    ends.remove(&e.partition());
                }
            }
        }
    }
    if to_end && !ends.is_empty() {
        return Err(TransportError::Unavailable(format!(
            "reading {topic}: nothing arrived for {idle:?} before the end of partitions {:?}",
            ends.keys().collect::<Vec<_>>()
        )));
    }
    messages.sort_by(|a, b| (a.source.as_str(), a.offset).cmp(&(b.source.as_str(), b.offset)));
    Ok(messages)
}
