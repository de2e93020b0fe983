//! Messages produced by another language's client (PyPI kafka-python: its own protocol code
//! and Java-compatible murmur2 partitioner) are consumed in per-key order, and land on the
//! partition convoy's own murmur2 picks for their key.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use convoy_testkit::interop;

const KEYS: usize = 20;
const PER_KEY: usize = 30;
const PARTITIONS: u32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_python_messages_are_consumed_in_per_key_order() {
    common::init_tracing();
    let (Some(bootstrap), Some(python)) = (common::bootstrap(), common::python()) else {
        return;
    };
    let bed = common::KafkaBed::new(&bootstrap, PARTITIONS, common::Protocol::Cooperative).await;
    let script = &convoy_testkit::support::repo_file("scripts/interop/kafka_python_produce.py");
    let (keys, per_key) = (KEYS.to_string(), PER_KEY.to_string());
    // kafka-python picks the partition itself (Java's murmur2): where each key landed is checked
    // on the consuming side.
    interop::run_producer(&python, script, &[&bootstrap, &bed.topic, &keys, &per_key]).await;
    interop::consume_in_order(&bed, KEYS, PER_KEY, PARTITIONS).await;
}
