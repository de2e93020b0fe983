//! The lag gauge is exact on Apache Kafka: per partition, `convoy_source_lag` equals the
//! partition's end offset (high watermark) minus the group's committed offset, as Kafka's own
//! tools count it — while a partition is paused behind a held key, while more is published to
//! it, and once everything is handled (0).

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use convoy_core::partitioner::partition_for_key;
use convoy_core::Engine;
use convoy_kafka::convert::source_id;
use convoy_kafka::KafkaTransport;
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::probe::{probe_key, publish_load, publish_probe, FaultPlan, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use rdkafka::consumer::{BaseConsumer, Consumer};

const PARTITIONS: u32 = 2;

/// `convoy_source_lag` per source label, as the recorder last saw it.
fn lag_gauges(snapshotter: &Snapshotter) -> BTreeMap<String, f64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| key.key().name() == "convoy_source_lag")
        .filter_map(|(key, _, _, value)| {
            let source = key
                .key()
                .labels()
                .find(|l| l.key() == "source")?
                .value()
                .to_owned();
            match value {
                DebugValue::Gauge(g) => Some((source, g.into_inner())),
                _ => None,
            }
        })
        .collect()
}

/// Kafka's lag per partition: the high watermark minus the committed offset (0 if none).
fn broker_lag(bed: &common::KafkaBed) -> BTreeMap<String, f64> {
    let reader: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &bed.config.bootstrap_servers)
        .create()
        .unwrap();
    let committed = common::committed(&bed.config, &bed.topic, bed.partitions);
    (0..bed.partitions)
        .map(|p| {
            let (_, high) = reader
                .fetch_watermarks(&bed.topic, p, Duration::from_secs(10))
                .unwrap();
            let source = source_id(&bed.topic, p);
            let next = committed.get(&source).map_or(0, |w| w + 1) as i64;
            (source.as_str().to_owned(), (high - next) as f64)
        })
        .collect()
}

/// Waits until the gauges equal the broker's lag for every partition (each lag query of the
/// engine comes after a commit confirmed by then), and returns it.
async fn lag_matches(bed: &common::KafkaBed, snapshotter: &Snapshotter, when: &str) -> BTreeMap<String, f64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let broker = tokio::task::block_in_place(|| broker_lag(bed));
        let gauges = lag_gauges(snapshotter);
        if gauges == broker {
            return broker;
        }
        assert!(
            Instant::now() < deadline,
            "{when}: the lag gauges {gauges:?} never matched the broker's lag {broker:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lag_gauge_is_end_offset_minus_committed_paused_or_not() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).unwrap();
    let bed = common::KafkaBed::new(&bootstrap, PARTITIONS, common::Protocol::Cooperative).await;
    let held = probe_key("k", 0);
    let held_partition = partition_for_key(&held, PARTITIONS) as i32;
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let latch = plan.hold_key(held.clone());
    let mut config = test_config(bed.group());
    // The held key's partition pauses after a few messages; the other one flows.
    config.back_pressure.source_high = 8;
    config.back_pressure.source_low = 2;
    let engine = Engine::builder(ProbeHandler::with_faults(checker.clone(), plan))
        .config(config)
        .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
        .build()
        .unwrap()
        .start(&KafkaTransport::new(bed.config.clone()).unwrap())
        .await
        .unwrap();
    publish_load(bed.publisher().as_ref(), &checker, "k", 10, 30)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.stats().paused_sources == 0 {
        assert!(Instant::now() < deadline, "the held key's partition never paused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let held_source = source_id(&bed.topic, held_partition).as_str().to_owned();
    let paused = lag_matches(&bed, &snapshotter, "paused").await;
    eprintln!("paused: lag {paused:?}");
    assert!(
        paused[&held_source] > 0.0,
        "the paused partition has lag: {paused:?}"
    );
    // More for the paused partition: its lag grows although nothing more is fetched.
    for _ in 0..25 {
        publish_probe(bed.publisher().as_ref(), &checker, held.clone())
            .await
            .unwrap();
    }
    let grown = lag_matches(&bed, &snapshotter, "paused, 25 more published").await;
    eprintln!("25 more while paused: lag {grown:?}");
    assert_eq!(grown[&held_source], paused[&held_source] + 25.0);
    assert_eq!(engine.stats().paused_sources, 1, "still paused");
    latch.release();
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "everything handled"
    );
    let done = lag_matches(&bed, &snapshotter, "everything handled").await;
    assert!(done.values().all(|lag| *lag == 0.0), "{done:?}");
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    engine.stop().await.unwrap();
}
