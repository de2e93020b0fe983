//! A topic that gains partitions under the group.
//!
//! Kafka's partitioner maps a key to `hash(key) % partitions`, so adding partitions to a live
//! topic sends most keys' later messages to another partition than their earlier ones. A key's
//! messages from before and after the change are then in two partitions, which nothing orders:
//! the broker cannot keep their order, and neither can convoy. Reading goes on (the new
//! partitions are assigned like any other, nothing is lost), and the change is said once per
//! member with what to do — stop the producers, let the group drain, then grow — and counted
//! (`convoy_partitions_added_total`). Checked at every assignment, since librdkafka rebalances
//! when it sees the new partitions.

use convoy_core::metrics::partitions_added;
use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaResult;

use super::{KafkaConsumer, Shared, BROKER_TIMEOUT};

/// The partitions `topic` has now, from the broker's metadata.
pub(super) fn partitions_of<C: Consumer<X>, X: rdkafka::consumer::ConsumerContext>(
    client: &C,
    topic: &str,
) -> KafkaResult<usize> {
    let metadata = client.fetch_metadata(Some(topic), BROKER_TIMEOUT)?;
    Ok(metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic)
        .map(|t| t.partitions().len())
        .sum())
}

/// Compares each subscribed topic's partitions with what the member saw last, and says and
/// counts a growth. A failed metadata query is left for the next assignment.
pub(super) fn check(consumer: &KafkaConsumer, shared: &Shared) {
    let topics: Vec<(String, usize)> = lock(shared).iter().map(|(t, n)| (t.clone(), *n)).collect();
    for (topic, known) in topics {
        let now = match partitions_of(consumer, &topic) {
            Ok(now) => now,
            Err(e) => {
                tracing::debug!(error = %e, topic, "reading the topic's partitions at an assignment");
                continue;
            }
        };
        if now > known {
            tracing::warn!(
                topic, before = known, now,
                "topic {topic} grew from {known} to {now} partitions while this group consumed it: keys now map to other partitions, so a key's messages published before and after the change are in two partitions and their order is not kept; to grow a topic safely, stop its producers, let the group drain (lag 0), then add partitions"
            );
            partitions_added(&shared.group, &topic, (now - known) as u64);
        }
        if now != known && now > 0 {
            lock(shared).insert(topic, now);
        }
    }
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, usize>> {
    shared.partitions.lock().unwrap_or_else(|p| p.into_inner())
}
