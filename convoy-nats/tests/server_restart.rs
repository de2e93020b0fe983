//! A nats-server killed (`kill -9`) and restarted twice while an engine consumes and a producer
//! publishes: the client reconnects by itself, leases that could not be renewed in time are
//! reported lost and taken again (taken back where the server still held them), and each partition is read again from its committed
//! watermark. Nothing is lost, no key's order is violated; JetStream's file storage keeps the
//! streams, the watermarks and the published messages across the crashes. The server is a
//! private one (its own port and store directory), started and killed by this test by its PID:
//! the machine's nats-server is never touched.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_core::Publisher;
use convoy_nats::{admin, NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::nodes::nats::NatsServer;
use convoy_testkit::{restarts, OrderChecker};

/// A private server of its own, started and healthy; none when the tests have no NATS (or the
/// server's program is missing: skipped, which `CONVOY_REQUIRE_ALL` turns into a failure).
async fn private_server() -> Option<NatsServer> {
    common::server()?;
    match tokio::task::spawn_blocking(NatsServer::start).await.unwrap() {
        Ok(server) => Some(server),
        Err(missing @ convoy_testkit::nodes::NodeError::Missing(_)) => {
            convoy_testkit::support::skip(missing);
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_restarted_twice_loses_nothing() {
    common::init_tracing();
    let Some(mut server) = private_server().await else {
        return;
    };
    let topic = common::unique("convoy-restart");
    let config = common::test_config(&server.address(), &common::unique("g"), &topic, 4);
    admin::create_topics(&config, &[(&topic, 4)]).await.unwrap();
    let checker = Arc::new(OrderChecker::new());
    let engine = restarts::start_engine(
        &NatsTransport::new(config.clone()).unwrap(),
        Arc::new(NatsDeadLetterSink::new(&config)),
        &config.group,
        &checker,
    )
    .await;
    // The stream stores a batch re-sent after a lost acknowledgement once (same event ids).
    let publisher = NatsPublisher::new(&config, &topic);
    // The first outage outlasts a lease's validity on the member (2/3 of its lifetime) but not
    // its lifetime on the server: the member loses its partitions while the server still holds
    // its leases, and takes them back. The second outlasts the lifetime: the server expired
    // them, and the member takes them anew.
    let outages = [
        config.lease_ttl() * 5 / 6,
        config.lease_ttl() + Duration::from_secs(1),
    ];
    restarts::publish_through_two_crashes(engine, &publisher, restarts::Ids::Stable, &checker, |crash| {
        server.kill().expect("the server was killed");
        std::thread::sleep(outages[crash]);
        server.restart().unwrap();
    })
    .await;
    // Commits went on through both restarts: the final ones reach every partition's last
    // message (a write stored but unanswered at a crash once left every later one refused).
    let expected = common::last_sequences(&server.address(), &topic, 4).await;
    common::wait_committed(&config, &topic, &expected).await;
}

/// A member started while its server is down (a replacement started during a server restart)
/// waits the outage out and joins once the server is back, instead of ending with "the
/// transport failed"; then it handles what was published before and after, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_started_while_its_server_is_down_joins_once_it_is_back() {
    common::init_tracing();
    let Some(mut server) = private_server().await else {
        return;
    };
    let topic = common::unique("convoy-late");
    let config = common::test_config(&server.address(), &common::unique("g"), &topic, 4);
    admin::create_topics(&config, &[(&topic, 4)]).await.unwrap();
    let checker = Arc::new(OrderChecker::new());
    let publisher = NatsPublisher::new(&config, &topic);
    let before = convoy_testkit::probe::probe_batch(&checker, "key-", 10, 0, 200, 0);
    publisher.publish_all(before).await.unwrap();
    tokio::task::block_in_place(|| server.kill()).unwrap();
    let joining = {
        let (config, checker) = (config.clone(), checker.clone());
        tokio::spawn(async move {
            restarts::start_engine(
                &NatsTransport::new(config.clone()).unwrap(),
                Arc::new(NatsDeadLetterSink::new(&config)),
                &config.group,
                &checker,
            )
            .await
        })
    };
    // The outage's length: the member's first attempts to connect fall in it on any machine
    // that starts a task within two seconds (on a slower one the test still must pass).
    tokio::task::block_in_place(|| {
        std::thread::sleep(Duration::from_secs(2));
        server.restart()
    })
    .unwrap();
    let engine = joining.await.expect("the member joined after the outage");
    let after = convoy_testkit::probe::probe_batch(&checker, "key-", 10, 200, 200, 0);
    publisher.publish_all(after).await.unwrap();
    assert!(
        checker.wait_complete(Duration::from_secs(120)).await,
        "not everything was handled: {:?}",
        checker.report()
    );
    engine.stop().await.expect("the engine stopped cleanly");
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 400, "{report:#?}");
}
