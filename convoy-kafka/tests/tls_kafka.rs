//! Kafka over TLS with SASL SCRAM and zstd (issue 21, item 1): a private Apache Kafka node whose
//! `SASL_SSL` listener carries a certificate signed by a CA this test made, with SCRAM-SHA-512
//! users formatted into it. The library checks the broker, creates its topic, publishes
//! zstd-compressed batches and consumes them through the engine, in per-key order; a wrong
//! password is refused at once as a fatal error naming the settings to check, and a client that
//! does not trust the CA is told its TLS handshake failed.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Instant;

use convoy_core::Engine;
use convoy_kafka::{admin, KafkaConfig, KafkaDeadLetterSink, KafkaPublisher, KafkaTransport};
use convoy_testkit::conformance::test_config;
use convoy_testkit::nodes::kafka::{SecuredKafka, SCRAM};
use convoy_testkit::nodes::tls::TestCa;
use convoy_testkit::nodes::NodeError;
use convoy_testkit::probe::{publish_load, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;

const USER: (&str, &str) = ("alice", "alice-secret");

fn secured_config(node: &SecuredKafka, ca: &TestCa, password: &str) -> KafkaConfig {
    let topic = common::unique("convoy-tls");
    let mut config = KafkaConfig::new(node.sasl_ssl_address(), common::unique("g"), &[&topic]);
    for (name, value) in [
        ("security.protocol", "SASL_SSL"),
        ("sasl.mechanisms", SCRAM),
        ("sasl.username", USER.0),
        ("sasl.password", password),
        ("ssl.ca.location", &ca.ca_pem().display().to_string()),
        ("compression.type", "zstd"),
    ] {
        config.properties.insert(name.to_owned(), value.to_owned());
    }
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_ssl_with_scram_and_zstd_consumes_in_order_and_bad_credentials_are_refused_at_once() {
    if common::bootstrap().is_none() {
        return;
    }
    let started = tokio::task::spawn_blocking(|| {
        let ca = TestCa::new()?;
        let node = SecuredKafka::start(&ca, &[USER])?;
        Ok::<_, NodeError>((ca, node))
    })
    .await
    .unwrap();
    let (ca, node) = match started {
        Ok(started) => started,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };

    let config = secured_config(&node, &ca, USER.1);
    let topic = config.topics[0].clone();
    admin::check_reachable(&config).await.unwrap();
    admin::create_topics(&config, &[(&topic, 4), (&config.dlq_topic(), 1)])
        .await
        .unwrap();
    let checker = Arc::new(OrderChecker::new());
    let publisher = KafkaPublisher::new(&config, &topic).unwrap();
    publish_load(&publisher, &checker, "k", 20, 25).await.unwrap();
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(&config.group_id))
        .dead_letter_sink(RecordingSink::new(
            Arc::new(KafkaDeadLetterSink::new(&config).unwrap()),
            checker.clone(),
        ))
        .build()
        .unwrap()
        .start(&KafkaTransport::new(config.clone()).unwrap())
        .await
        .unwrap();
    assert!(
        checker.wait_complete(std::time::Duration::from_secs(120)).await,
        "{:?}",
        checker.report()
    );
    engine.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 500);

    // A wrong password: refused as the broker answered, not as an unreachable broker.
    let wrong = secured_config(&node, &ca, "not-the-password");
    let asked = Instant::now();
    let refused = admin::check_reachable(&wrong).await.unwrap_err();
    println!("wrong password refused after {:?}: {refused}", asked.elapsed());
    assert!(refused.is_fatal(), "{refused}");
    assert!(refused.to_string().contains("sasl.password"), "{refused}");
    // An engine subscribed with it (no reachability check first) ends with the refusal instead
    // of retrying forever.
    let subscribed = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(&wrong.group_id))
        .dead_letter_sink(Arc::new(KafkaDeadLetterSink::new(&wrong).unwrap()))
        .build()
        .unwrap()
        .start(&KafkaTransport::new(wrong.clone()).unwrap())
        .await;
    let ended = match subscribed {
        Ok(engine) => tokio::time::timeout(std::time::Duration::from_secs(120), engine.join())
            .await
            .expect("an engine with a refused login never ended")
            .unwrap_err()
            .to_string(),
        Err(e) => e.to_string(),
    };
    println!("an engine with a wrong password ended: {ended}");
    assert!(ended.to_lowercase().contains("authentication"), "{ended}");

    // A client that does not trust the test CA.
    let mut untrusting = secured_config(&node, &ca, USER.1);
    untrusting.properties.remove("ssl.ca.location");
    let asked = Instant::now();
    let refused = admin::check_reachable(&untrusting).await.unwrap_err();
    println!(
        "untrusted certificate refused after {:?}: {refused}",
        asked.elapsed()
    );
    assert!(refused.is_fatal(), "{refused}");
    assert!(refused.to_string().contains("ssl.ca.location"), "{refused}");
    drop(node);
}
