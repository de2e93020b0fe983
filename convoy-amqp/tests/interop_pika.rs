//! Messages produced by another language's client (PyPI pika) with the documented key → partition
//! function are consumed in per-key order, from the partition convoy's own murmur2 picks.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy_amqp::AmqpTransport;
use convoy_core::partitioner::partition_for_key;
use convoy_core::{handler_fn, Delivery, Engine};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::probe::decode_seq;
use convoy_testkit::OrderChecker;

const KEYS: usize = 20;
const PER_KEY: usize = 30;
const PARTITIONS: u32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pika_messages_are_consumed_in_per_key_order() {
    let (Some(uri), Ok(python)) = (common::uri(), std::env::var("CONVOY_PYTHON")) else {
        eprintln!(
            "skipped: needs {} and CONVOY_PYTHON (scripts/test sets both)",
            common::URI_VAR
        );
        return;
    };
    let bed = common::AmqpBed::new(&uri, PARTITIONS).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/interop/pika_produce.py");
    let output = tokio::process::Command::new(&python)
        .args([
            script,
            &uri,
            &bed.topic,
            &PARTITIONS.to_string(),
            &KEYS.to_string(),
            &PER_KEY.to_string(),
        ])
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "the pika producer failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // pika's placement is convoy's placement.
    for pair in String::from_utf8_lossy(&output.stdout).split_whitespace() {
        let (key, p) = pair.split_once('=').unwrap();
        assert_eq!(
            partition_for_key(key.as_bytes(), PARTITIONS),
            p.parse::<u32>().unwrap(),
            "{key}"
        );
    }

    let checker = Arc::new(OrderChecker::new());
    for _ in 0..PER_KEY {
        for k in 0..KEYS {
            checker.expect(&bytes::Bytes::from(format!("py-{k}")));
        }
    }
    let placements = Arc::new(Mutex::new(Vec::new()));
    let (c, seen) = (checker.clone(), placements.clone());
    let handler = handler_fn(move |d: Delivery| {
        let (c, seen) = (c.clone(), seen.clone());
        async move {
            let key = d.key().cloned().unwrap_or_default();
            let seq = decode_seq(d.payload()).unwrap_or(u64::MAX);
            let _inside = c.enter(&key);
            seen.lock().unwrap().push((key.clone(), d.source().clone()));
            c.handled(&key, seq, None);
            Ok::<(), convoy_core::HandlerError>(())
        }
    });
    let engine = Engine::builder(handler)
        .config(test_config(bed.group()))
        .dead_letter_sink(bed.dead_letter_sink())
        .build()
        .unwrap();
    let running = engine
        .start(&AmqpTransport::new(bed.config.clone()).unwrap())
        .await
        .unwrap();
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "{:?}",
        checker.report()
    );
    running.stop().await.unwrap();
    let report = checker.report();
    assert!(
        report.is_clean() && report.finished == (KEYS * PER_KEY) as u64,
        "{report:#?}"
    );
    for (key, source) in placements.lock().unwrap().iter() {
        let (_, p) = source.topic_partition().unwrap();
        assert_eq!(
            p,
            partition_for_key(key, PARTITIONS),
            "{key:?} read from {source}"
        );
    }
    assert_eq!(bed.remaining().await.unwrap(), 0);
}
