//! `amqps://` (issue 21, item 1): a private RabbitMQ node with a TLS listener whose certificate a
//! CA made by this test signed. With the CA trusted (`tls_ca_file`) the library declares,
//! publishes and consumes through the engine in per-key order; without it the connection is
//! refused at once as a fatal error naming the setting; a wrong password is fatal too.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_amqp::{admin, AmqpConfig, AmqpDeadLetterSink, AmqpPublisher, AmqpTransport};
use convoy_core::Engine;
use convoy_testkit::conformance::test_config;
use convoy_testkit::nodes::rabbitmq::RabbitNode;
use convoy_testkit::nodes::tls::TestCa;
use convoy_testkit::nodes::NodeError;
use convoy_testkit::probe::{publish_load, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_a_private_ca_consumes_in_order_and_an_untrusted_broker_is_refused() {
    if common::uri().is_none() {
        return;
    }
    let started = tokio::task::spawn_blocking(|| {
        let ca = TestCa::new()?;
        let node = RabbitNode::start_tls(&ca)?;
        Ok::<_, NodeError>((ca, node))
    })
    .await
    .unwrap();
    let (ca, node) = match started {
        Ok(started) => started,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let topic = common::unique("convoy-tls");
    let mut config = AmqpConfig::new(node.amqps_uri().unwrap(), common::unique("g"), &[&topic]);
    config.partitions = 4;
    config.tls_ca_file = Some(ca.ca_pem());

    admin::create_topics(&config, &[(&topic, 4)]).await.unwrap();
    let checker = Arc::new(OrderChecker::new());
    let publisher = AmqpPublisher::new(&config, &topic);
    publish_load(&publisher, &checker, "k", 20, 25).await.unwrap();
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(&config.group))
        .dead_letter_sink(RecordingSink::new(
            Arc::new(AmqpDeadLetterSink::new(&config)),
            checker.clone(),
        ))
        .build()
        .unwrap()
        .start(&AmqpTransport::new(config.clone()).unwrap())
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

    // The public roots do not know the test's CA.
    let mut untrusting = config.clone();
    untrusting.tls_ca_file = None;
    let refused = admin::check_reachable(&untrusting).await.unwrap_err();
    println!("untrusted broker: {refused}");
    assert!(refused.is_fatal(), "{refused}");
    assert!(refused.to_string().contains("tls_ca_file"), "{refused}");

    let mut wrong = config.clone();
    wrong.uri = wrong.uri.replacen("guest:guest", "guest:wrong", 1);
    let refused = admin::check_reachable(&wrong).await.unwrap_err();
    println!("wrong password: {refused}");
    assert!(refused.is_fatal(), "{refused}");
    drop(node);
}
