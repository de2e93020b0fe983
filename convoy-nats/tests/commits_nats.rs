//! Commits whose answers are lost: the testkit's proxy lets the member's requests through to the
//! server but holds back everything the server sends, for longer than a request may wait — the
//! watermark writes are stored, and the member never hears so. Afterwards it must commit on:
//! every partition's watermark reaches its last message. Before, the revision the member held
//! was stale after such a write, every later compare-and-set was refused as "not owned", and
//! the partition was handled on without a commit ever again (issue 25, item 2: a fresh member
//! then handled tens of thousands of messages again).

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use convoy_core::Engine;
use convoy_nats::{admin, NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{probe_key, publish_load, FaultPlan, Latency, ProbeHandler, RecordingSink};
use convoy_testkit::proxy::Proxy;
use convoy_testkit::OrderChecker;

const LIMIT: Duration = Duration::from_secs(60);
/// Longer than async-nats waits for an answer (5 s): the writes sent meanwhile time out.
const ANSWERS_LOST_FOR: Duration = Duration::from_secs(7);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_go_on_after_writes_whose_answers_were_lost() {
    common::init_tracing();
    let Some(server) = common::server() else {
        return;
    };
    let proxy = Proxy::start(&server).await.unwrap();
    let topic = common::unique("convoy-commits");
    let direct = common::test_config(&server, &common::unique("g"), &topic, 2);
    admin::create_topics(&direct, &[(&topic, 2)]).await.unwrap();
    let mut through_proxy = direct.clone();
    through_proxy.servers = vec![proxy.address()];
    // Leases outlive the fault: what is tested is the commit, not ownership.
    through_proxy.lease_ttl_ms = 60_000;
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan {
        latency: Latency::Fixed(Duration::from_millis(20)),
        ..FaultPlan::default()
    };
    // One key is held until the answers are stalled, so that handling (and so committing) is
    // certainly still going on then, however fast or slow the machine is.
    let held = plan.hold_key(probe_key("k", 0));
    let engine = Engine::builder(ProbeHandler::with_faults(checker.clone(), plan))
        .config(test_config(&direct.group))
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
    // 10 keys × 60, 20 ms each, committed every 20 ms.
    publish_load(&publisher, &checker, "k", 10, 60).await.unwrap();
    assert!(
        tokio::time::timeout(LIMIT, held.reached()).await.is_ok(),
        "the held key's first message never reached its handler: {:?}",
        checker.report()
    );
    assert!(
        checker.wait_for(LIMIT, |c| c.finished() >= 100).await,
        "{:?}",
        checker.report()
    );
    proxy.stall_replies();
    // The held key goes on now: its watermark moves, and the commits go out unanswered.
    held.release();
    let stalled = Instant::now();
    let deadline = stalled + LIMIT;
    while proxy.held_bytes() == 0 {
        assert!(Instant::now() < deadline, "no answer was held back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(ANSWERS_LOST_FOR.saturating_sub(stalled.elapsed())).await;
    proxy.resume();
    assert!(checker.wait_complete(LIMIT).await, "{:?}", checker.report());

    // Every partition's committed watermark reaches the last sequence stored on it.
    let expected = common::last_sequences(&server, &topic, 2).await;
    common::wait_committed(&direct, &topic, &expected).await;
    engine.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    admin::delete_topic(&direct, &topic, &[&direct.dlq_topic()])
        .await
        .unwrap();
}
