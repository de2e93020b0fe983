//! NATS over TLS with a login (issue 21, item 1): a private nats-server that requires TLS — its
//! certificate signed by a CA this test made — and a user and password. With the CA trusted
//! (`tls_ca_file`) the library declares, publishes and consumes through the engine in per-key
//! order; without it, or with a wrong password, connecting fails at once as a fatal error that
//! says what to check.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_core::Engine;
use convoy_nats::{admin, NatsConfig, NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::conformance::test_config;
use convoy_testkit::nodes::nats::NatsServer;
use convoy_testkit::nodes::tls::TestCa;
use convoy_testkit::nodes::NodeError;
use convoy_testkit::probe::{publish_load, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca_and_a_login_consumes_in_order_and_refusals_are_fatal() {
    if common::server().is_none() {
        return;
    }
    let started = tokio::task::spawn_blocking(|| {
        let ca = TestCa::new()?;
        let server = NatsServer::start_tls(&ca, "alice", "alice-secret")?;
        Ok::<_, NodeError>((ca, server))
    })
    .await
    .unwrap();
    let (ca, server) = match started {
        Ok(started) => started,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let topic = common::unique("convoy-tls");
    let mut config: NatsConfig = common::test_config(
        &format!("tls://{}", server.address()),
        &common::unique("g"),
        &topic,
        4,
    );
    config.user = Some("alice".into());
    config.password = Some("alice-secret".into());
    config.tls_ca_file = Some(ca.ca_pem());
    config.tls_required = true;

    admin::create_topics(&config, &[(&topic, 4)]).await.unwrap();
    admin::create_dead_letters(&config, &config.dlq_topic())
        .await
        .unwrap();
    let checker = Arc::new(OrderChecker::new());
    let publisher = NatsPublisher::new(&config, &topic);
    publish_load(&publisher, &checker, "k", 20, 25).await.unwrap();
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(&config.group))
        .dead_letter_sink(RecordingSink::new(
            Arc::new(NatsDeadLetterSink::new(&config)),
            checker.clone(),
        ))
        .build()
        .unwrap()
        .start(&NatsTransport::new(config.clone()).unwrap())
        .await
        .unwrap();
    assert!(
        checker.wait_complete(Duration::from_secs(120)).await,
        "{:?}",
        checker.report()
    );
    engine.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 500);

    let mut untrusting = config.clone();
    untrusting.tls_ca_file = None;
    let refused = admin::check_reachable(&untrusting).await.unwrap_err();
    println!("untrusted server: {refused}");
    assert!(refused.is_fatal(), "{refused}");
    assert!(refused.to_string().contains("tls_ca_file"), "{refused}");

    let mut wrong = config.clone();
    wrong.password = Some("wrong".into());
    let refused = admin::check_reachable(&wrong).await.unwrap_err();
    println!("wrong password: {refused}");
    assert!(refused.is_fatal(), "{refused}");
    assert!(
        !refused.to_string().contains("wrong"),
        "the password is never printed: {refused}"
    );
    drop(server);
}
