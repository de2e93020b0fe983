//! A paused partition asks for nothing more: while the engine holds a partition paused (one key
//! blocked at its head, the source's bound reached) under a producer that keeps publishing, what
//! the server delivers to the client stays within the one pull that was outstanding. Before,
//! async-nats's pull stream pulled again on a 35 s timer and on every reconnect even while
//! nobody read it: 4,500 → 5,000 → 5,500 delivered over 70 s, up to 65,536 per partition
//! outside every bound (issue 25, item 4). The pause lasts 90 s, more than twice that timer,
//! under a producer publishing 800 messages a second.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_core::Engine;
use convoy_nats::{admin, topology, NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{probe_key, publish_load, FaultPlan, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;
use futures_util::StreamExt;

const LIMIT: Duration = Duration::from_secs(60);
/// More than twice as long as async-nats's pull stream waits before it pulls again by itself
/// (35 s).
const PAUSED_FOR: Duration = Duration::from_secs(90);

/// How many messages the server delivered to the member's consumers of `topic`'s stream.
async fn delivered(js: &async_nats::jetstream::Context, topic: &str) -> u64 {
    let stream = js.get_stream(topology::stream_name(topic)).await.unwrap();
    let names: Vec<String> = stream
        .consumer_names()
        .filter_map(|n| async move { n.ok() })
        .collect()
        .await;
    let mut total = 0;
    for name in names {
        if let Ok(mut consumer) = stream
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(&name)
            .await
        {
            if let Ok(info) = consumer.info().await {
                total += info.delivered.consumer_sequence;
            }
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_partition_receives_no_more_than_one_pull() {
    common::init_tracing();
    let Some(server) = common::server() else {
        return;
    };
    let topic = common::unique("convoy-paused");
    let mut config = common::test_config(&server, &common::unique("g"), &topic, 1);
    config.fetch_batch = Some(100);
    config.lease_ttl_ms = 30_000;
    admin::create_topics(&config, &[(&topic, 1)]).await.unwrap();
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let latch = plan.hold_key(probe_key("k", 0));
    let mut engine_config = test_config(&config.group);
    engine_config.back_pressure.source_high = 50;
    engine_config.back_pressure.source_low = 10;
    let engine = Engine::builder(ProbeHandler::with_faults(checker.clone(), plan))
        .config(engine_config)
        .dead_letter_sink(RecordingSink::new(
            Arc::new(NatsDeadLetterSink::new(&config)),
            checker.clone(),
        ))
        .build()
        .unwrap()
        .start(&NatsTransport::new(config.clone()).unwrap())
        .await
        .unwrap();
    let publisher = NatsPublisher::new(&config, &topic);
    // One key: its first message blocks the lane, and the partition pauses at 50 held.
    publish_load(&publisher, &checker, "k", 1, 1_000).await.unwrap();
    let deadline = tokio::time::Instant::now() + LIMIT;
    while engine.stats().paused_sources == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the partition never paused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let js = async_nats::jetstream::new(async_nats::connect(server.as_str()).await.unwrap());
    let at_pause = delivered(&js, &topic).await;
    // The producer keeps publishing while the partition stays paused. The most the consumers
    // ever delivered is sampled all along: the server deletes a consumer nobody pulled from for
    // a minute (the reader creates it again when it resumes), and its count goes with it.
    let start = tokio::time::Instant::now();
    let mut after = at_pause;
    while start.elapsed() < PAUSED_FOR {
        publish_load(&publisher, &checker, "k", 1, 200).await.unwrap();
        after = after.max(delivered(&js, &topic).await);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let held = engine.stats().held;
    eprintln!(
        "delivered {at_pause} at the pause, at most {after} during {PAUSED_FOR:?} paused; the engine holds {held}"
    );
    assert_eq!(engine.stats().paused_sources, 1, "still paused");
    assert!(
        after - at_pause <= 100,
        "{} more delivered while paused: more than the one pull of 100 that was outstanding",
        after - at_pause
    );
    latch.release();
    assert!(checker.wait_complete(LIMIT).await, "{:?}", checker.report());
    engine.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    admin::delete_topic(&config, &topic, &[&config.dlq_topic()])
        .await
        .unwrap();
}
