//! Messages produced by another language's client (PyPI pika) with the documented key → partition
//! function are consumed in per-key order, from the partition convoy's own murmur2 picks.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use convoy_testkit::conformance::TestBed;
use convoy_testkit::interop;

const KEYS: usize = 20;
const PER_KEY: usize = 30;
const PARTITIONS: u32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pika_messages_are_consumed_in_per_key_order() {
    let (Some(uri), Some(python)) = (common::uri(), common::python()) else {
        return;
    };
    let bed = common::AmqpBed::new(&uri, PARTITIONS).await;
    let script = &convoy_testkit::support::repo_file("scripts/interop/pika_produce.py");
    let (partitions, keys, per_key) = (PARTITIONS.to_string(), KEYS.to_string(), PER_KEY.to_string());
    let printed =
        interop::run_producer(&python, script, &[&uri, &bed.topic, &partitions, &keys, &per_key]).await;
    // pika's placement is convoy's placement.
    interop::assert_printed_placements(&printed, PARTITIONS);
    interop::consume_in_order(&bed, KEYS, PER_KEY, PARTITIONS).await;
    assert_eq!(bed.remaining().await.unwrap(), 0);
}
