//! A member owning many partitions polls them with a bounded number of threads, and still
//! delivers every message in per-key order while back-pressure pauses and resumes partitions.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_core::Engine;
use convoy_kafka::KafkaTransport;
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::probe::{publish_load, FaultPlan, Latency, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;

const PARTITIONS: u32 = 64;

/// This process's threads whose name starts with `prefix` (Linux: `/proc/self/task/*/comm`,
/// which holds at most 15 characters of a name).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end().starts_with(prefix))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_partitions_are_polled_by_a_bounded_pool_in_per_key_order() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    let bed = common::KafkaBed::new(&bootstrap, PARTITIONS, common::Protocol::Cooperative).await;
    let checker = Arc::new(OrderChecker::new());
    // 640 keys over 64 partitions, 10 messages each.
    publish_load(bed.publisher().as_ref(), &checker, "k", 640, 10)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    // Small bounds, so partitions are paused and resumed while the member drains them.
    config.back_pressure.source_high = 20;
    config.back_pressure.source_low = 10;
    config.back_pressure.total_high = 200;
    config.back_pressure.total_low = 100;
    let plan = FaultPlan {
        latency: Latency::Fixed(Duration::from_millis(1)),
        ..FaultPlan::default()
    };
    let handler = ProbeHandler::with_faults(checker.clone(), plan);
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
        .build()
        .unwrap();
    let transport = KafkaTransport::new(bed.config.clone()).unwrap();
    let running = engine.start(&transport).await.unwrap();
    assert!(
        checker.wait_complete(Duration::from_secs(120)).await,
        "{:?}",
        checker.report()
    );
    // Every partition is assigned to this member by now (it handled all of them): its threads
    // are the main poll thread and the pollers, one per CPU at most (a thread per partition
    // before: 65).
    let pollers = threads_named("convoy-kafka-po");
    let all = threads_named("convoy-kafka");
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    assert!(
        (1..=cpus.clamp(1, 8)).contains(&pollers) && all <= pollers + 1,
        "{all} consumer threads ({pollers} pollers) for {PARTITIONS} partitions on {cpus} CPUs"
    );
    let stats = running.stats();
    running.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, report.published);
    assert_eq!(report.published, 6_400);
    assert!(stats.sources > 0);
    // Close stops the pool.
    assert_eq!(
        threads_named("convoy-kafka"),
        0,
        "consumer threads left after close"
    );
}
