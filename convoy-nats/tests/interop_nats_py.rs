//! Messages produced by another language's client (PyPI nats-py) with the documented key →
//! partition function are consumed in per-key order, from the partition convoy's own murmur2
//! picks.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use convoy_testkit::conformance::TestBed;
use convoy_testkit::interop;

const KEYS: usize = 20;
const PER_KEY: usize = 30;
const PARTITIONS: u32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_py_messages_are_consumed_in_per_key_order() {
    let (Some(server), Some(python)) = (common::server(), common::python()) else {
        return;
    };
    let bed = common::NatsBed::new(&server, PARTITIONS).await;
    let script = &convoy_testkit::support::repo_file("scripts/interop/nats_produce.py");
    let uri = format!("nats://{server}");
    let (partitions, keys, per_key) = (PARTITIONS.to_string(), KEYS.to_string(), PER_KEY.to_string());
    let printed =
        interop::run_producer(&python, script, &[&uri, &bed.topic, &partitions, &keys, &per_key]).await;
    // nats-py's placement is convoy's placement.
    interop::assert_printed_placements(&printed, PARTITIONS);
    interop::consume_in_order(&bed, KEYS, PER_KEY, PARTITIONS).await;
    // Everything is committed: each partition's watermark reached its last message.
    let committed = bed.committed().await.unwrap();
    assert_eq!(
        committed.len() as u32,
        PARTITIONS.min(KEYS as u32),
        "{committed:?}"
    );
}
