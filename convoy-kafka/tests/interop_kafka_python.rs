//! Messages produced by another language's client (PyPI kafka-python: its own protocol code
//! and Java-compatible murmur2 partitioner) are consumed in per-key order, and land on the
//! partition convoy's own murmur2 picks for their key.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy_core::partitioner::partition_for_key;
use convoy_core::{handler_fn, Delivery, Engine, Transport};
use convoy_kafka::convert::topic_partition;
use convoy_kafka::{KafkaDeadLetterSink, KafkaTransport};
use convoy_testkit::probe::decode_seq;
use convoy_testkit::OrderChecker;

const KEYS: usize = 20;
const PER_KEY: usize = 30;
const PARTITIONS: i32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_python_messages_are_consumed_in_per_key_order() {
    common::init_tracing();
    let (Some(bootstrap), Ok(python)) = (common::bootstrap(), std::env::var("CONVOY_PYTHON")) else {
        eprintln!(
            "skipped: needs {} and CONVOY_PYTHON (scripts/test sets both)",
            common::BOOTSTRAP_VAR
        );
        return;
    };
    let topic = common::unique("convoy-py");
    common::create_topic(&bootstrap, &topic, PARTITIONS).await;
    let config = common::test_config(&bootstrap, &common::unique("convoy-py-group"), &topic);
    common::create_topic(&bootstrap, &config.dlq_topic(), 1).await;

    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/interop/kafka_python_produce.py"
    );
    let status = tokio::process::Command::new(&python)
        .args([
            script,
            &bootstrap,
            &topic,
            &KEYS.to_string(),
            &PER_KEY.to_string(),
        ])
        .status()
        .await
        .unwrap();
    assert!(status.success(), "the kafka-python producer failed: {status}");

    let checker = Arc::new(OrderChecker::new());
    for _ in 0..PER_KEY {
        for k in 0..KEYS {
            checker.expect(&bytes::Bytes::from(format!("py-{k}")));
        }
    }
    let misplaced = Arc::new(Mutex::new(Vec::new()));
    let (c, m) = (checker.clone(), misplaced.clone());
    let handler = handler_fn(move |d: Delivery| {
        let (c, m) = (c.clone(), m.clone());
        async move {
            let key = d.key().cloned().unwrap();
            let seq = decode_seq(d.payload()).unwrap();
            let (_, partition) = topic_partition(d.source()).unwrap();
            if partition_for_key(&key, PARTITIONS as u32) != partition as u32 {
                m.lock().unwrap().push((key.clone(), partition));
            }
            let _guard = c.enter(&key);
            tokio::time::sleep(Duration::from_micros(200)).await;
            c.handled(&key, seq, None);
            Ok(())
        }
    });
    let engine = Engine::builder(handler)
        .config(convoy_testkit::conformance::test_config(&config.group_id))
        .dead_letter_sink(KafkaDeadLetterSink::new(&config).unwrap())
        .build()
        .unwrap();
    let consumer = engine.spawn(KafkaTransport::new(config).unwrap().subscribe().await.unwrap());
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "{:?}",
        checker.report()
    );
    consumer.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, (KEYS * PER_KEY) as u64);
    assert!(
        misplaced.lock().unwrap().is_empty(),
        "partitions differ from Java murmur2: {misplaced:?}"
    );
}
