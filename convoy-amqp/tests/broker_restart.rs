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
use convoy_core::partitioner::partition_for_key;
use convoy_core::{OutgoingMessage, Publisher, Receipt, SourceId, TransportError};
use convoy_testkit::nodes::rabbitmq::RabbitNode;
use convoy_testkit::{restarts, OrderChecker};

/// A producer as a foreign client publishes — the key header, no event id, no `message_id` —
/// one confirmed message at a time, on a connection it opens again after an outage.
struct ForeignPublisher {
    uri: String,
    topic: String,
    partitions: u32,
    channel: tokio::sync::Mutex<Option<(lapin::Connection, lapin::Channel)>>,
}

#[async_trait::async_trait]
impl Publisher for ForeignPublisher {
    async fn publish(&self, message: OutgoingMessage) -> Result<Receipt, TransportError> {
        use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
        use lapin::types::{AMQPValue, FieldTable};
        let fail = |e: lapin::Error| TransportError::Unavailable(e.to_string());
        let mut open = self.channel.lock().await;
        if open.is_none() {
            let connection = lapin::Connection::connect(&self.uri, lapin::ConnectionProperties::default())
                .await
                .map_err(fail)?;
            let channel = connection.create_channel().await.map_err(fail)?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(fail)?;
            *open = Some((connection, channel));
        }
        let key = message.key.clone().unwrap_or_default();
        let partition = partition_for_key(&key, self.partitions);
        let mut headers = FieldTable::default();
        headers.insert(
            "convoy-key".into(),
            AMQPValue::LongString(String::from_utf8_lossy(&key).as_ref().into()),
        );
        let properties = lapin::BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(headers);
        let channel = open
            .as_ref()
            .map(|(_, c)| c.clone())
            .ok_or(TransportError::Closed)?;
        let published = async {
            channel
                .basic_publish(
                    self.topic.as_str().into(),
                    partition.to_string().as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &message.payload,
                    properties,
                )
                .await?
                .await
        };
        match published.await {
            Ok(_) => Ok(Receipt {
                source: SourceId::partition(&self.topic, partition),
                offset: 0,
            }),
            Err(e) => {
                *open = None; // connect again next time
                Err(fail(e))
            }
        }
    }
}

/// A private node, booted (or why the test is skipped).
async fn node() -> Option<RabbitNode> {
    common::init_tracing();
    common::uri()?;
    match tokio::task::spawn_blocking(RabbitNode::start).await.unwrap() {
        Ok(node) => Some(node),
        Err(missing @ convoy_testkit::nodes::NodeError::Missing(_)) => {
            convoy_testkit::support::skip(missing);
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The node killed and restarted twice under `publisher`'s load, checked by the scenario.
async fn two_crashes(node: RabbitNode, ids: restarts::Ids, foreign: bool) {
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
    let publisher: Box<dyn Publisher> = if foreign {
        Box::new(ForeignPublisher {
            uri: node.uri(),
            topic: topic.clone(),
            partitions: 4,
            channel: tokio::sync::Mutex::default(),
        })
    } else {
        Box::new(AmqpPublisher::new(&config, &topic))
    };
    restarts::publish_through_two_crashes(engine, publisher.as_ref(), ids, &checker, |_| {
        node.kill().expect("the node was killed");
        node.boot().unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_and_restarted_twice_loses_nothing() {
    let Some(node) = node().await else { return };
    two_crashes(node, restarts::Ids::Stable, false).await;
}

/// Fails without `Assignment::offsets_are_positions`: the messages redelivered on the channels
/// opened after each restart, having no event id, were taken for duplicates of the finished
/// messages at the same delivery tags, acknowledged unhandled, and lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restarted_twice_under_a_foreign_producer_loses_nothing() {
    let Some(node) = node().await else { return };
    two_crashes(node, restarts::Ids::None, true).await;
}
