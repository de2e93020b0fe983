//! A RabbitMQ node killed (`kill -9`) and restarted twice while an engine consumes and a
//! producer publishes: the member reconnects with backoff, declares again and takes its
//! partitions again; the unacknowledged messages come back in order. Nothing is lost, no key's
//! order is violated. The node is a private one (its own port, data directory and node name),
//! started and stopped by this test by its PID: the machine's RabbitMQ is never touched.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_amqp::{admin, AmqpDeadLetterSink, AmqpPublisher, AmqpTransport};
use convoy_testkit::nodes::rabbitmq::RabbitNode;
use convoy_testkit::{restarts, OrderChecker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_and_restarted_twice_loses_nothing() {
    common::init_tracing();
    if common::uri().is_none() {
        eprintln!("skipped: {} is not set (scripts/test sets it)", common::URI_VAR);
        return;
    }
    let node = match tokio::task::spawn_blocking(RabbitNode::start).await.unwrap() {
        Ok(node) => node,
        Err(convoy_testkit::nodes::NodeError::Missing(what)) => {
            eprintln!("skipped: {what} is not installed here");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let topic = common::unique("convoy-restart");
    let config = common::test_config(&node.uri(), &common::unique("g"), &topic, 4);
    admin::create_topics(&config, &[(&topic, 4)]).await.unwrap();
    let checker = Arc::new(OrderChecker::new());
    let engine = restarts::start_engine(
        &AmqpTransport::new(config.clone()).unwrap(),
        Arc::new(AmqpDeadLetterSink::new(&config)),
        &config.group,
        &checker,
    )
    .await;
    // A quorum queue killed within moments of its creation can come back without a Raft leader
    // (RabbitMQ 3.10, seen here: consuming it then hangs); let the queues settle first.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let publisher = AmqpPublisher::new(&config, &topic);
    restarts::publish_through_two_crashes(engine, &publisher, &checker, |_| {
        node.kill();
        node.boot().unwrap();
    })
    .await;
}
