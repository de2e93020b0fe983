//! A consumer cut off its server with deliveries in flight (the testkit's proxy holds back what
//! the server sent, then closes the connection; the client reconnects through it at once) and
//! nothing published afterwards: every message is handled within seconds of the reconnect —
//! none waits for a later publish. Three rounds, the time from each cut to the last message
//! handled reported. Runs on whatever server
//! `CONVOY_NATS_URL` names (scripts/test: 2.12, and 2.9 in the compatibility run).
//!
//! Before the reader made its own pulls and recreated its consumer on every reconnect, the last
//! 1–3 messages of a partition sat unhandled after a reconnect until more were published (issue
//! 24: 3 runs of 3 on 2.12).

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use convoy_core::Engine;
use convoy_nats::{NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{publish_load, FaultPlan, Latency, ProbeHandler, RecordingSink};
use convoy_testkit::proxy::Proxy;
use convoy_testkit::OrderChecker;

/// Longest a round may take after its cut; a healthy one takes about a second.
const WITHIN: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_in_flight_at_a_cut_are_handled_promptly_after_the_reconnect() {
    common::init_tracing();
    let Some(server) = common::server() else {
        return;
    };
    let proxy = Proxy::start(&server).await.unwrap();
    let topic = common::unique("convoy-reconnect");
    let direct = common::test_config(&server, &common::unique("g"), &topic, 2);
    convoy_nats::admin::create_topics(&direct, &[(&topic, 2)])
        .await
        .unwrap();
    let mut through_proxy = direct.clone();
    through_proxy.servers = vec![proxy.address()];
    // The leases live through the cut: it is reading that must recover, not ownership.
    through_proxy.lease_ttl_ms = 30_000;
    let checker = Arc::new(OrderChecker::new());
    let plan = FaultPlan {
        latency: Latency::Fixed(Duration::from_millis(5)),
        ..FaultPlan::default()
    };
    let mut config = test_config(&direct.group);
    config.drain_timeout = Duration::from_secs(5);
    let engine = Engine::builder(ProbeHandler::with_faults(checker.clone(), plan))
        .config(config)
        .dead_letter_sink(RecordingSink::new(
            Arc::new(NatsDeadLetterSink::new(&direct)),
            checker.clone(),
        ))
        .build()
        .unwrap()
        .start(&NatsTransport::new(through_proxy).unwrap())
        .await
        .unwrap();
    let publisher = NatsPublisher::new(&direct, &topic);
    let mut took = Vec::new();
    // The member owns and reads both partitions before the first cut.
    publish_load(&publisher, &checker, "warm-up-k", 20, 1)
        .await
        .unwrap();
    for round in 0..3 {
        // Caught up; then whatever the server delivers next is held in the proxy and lost with
        // the cut — the server counts it delivered (no acks), so only re-reading brings it.
        assert!(
            checker.wait_complete(WITHIN).await,
            "round {round}: not caught up"
        );
        proxy.stall();
        publish_load(&publisher, &checker, &format!("r{round}-k"), 20, 15)
            .await
            .unwrap();
        let deadline = Instant::now() + WITHIN;
        while proxy.held_bytes() == 0 {
            assert!(
                Instant::now() < deadline,
                "round {round}: the server delivered nothing"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let connections = proxy.accepted();
        let cut = Instant::now();
        proxy.cut();
        proxy.resume();
        let complete = checker.wait_complete(WITHIN).await;
        let elapsed = cut.elapsed();
        assert!(
            complete,
            "round {round}: {:?} after the cut, not everything was handled: {:?}",
            elapsed,
            checker.report()
        );
        assert!(
            proxy.accepted() > connections,
            "round {round}: the client did not reconnect through the proxy ({} connections)",
            proxy.accepted()
        );
        took.push(elapsed);
    }
    eprintln!("from each cut to the last message handled: {took:?}");
    engine.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 920);
    convoy_nats::admin::delete_topic(&direct, &topic, &[&direct.dlq_topic()])
        .await
        .unwrap();
}
