//! A partition queue's delivery limit is convoy's, not the broker's default (issue 25, item 10):
//! RabbitMQ 4 gives quorum queues a limit of 20 and drops what exceeds it when no dead-letter
//! exchange is set. convoy sets `x-delivery-limit` (`delivery_limit`) and dead-letters what
//! exceeds it to the topic's dead-letter stream, with the broker's reason. Here a limit of 2: a
//! message taken and returned unacknowledged three times (members that died holding it: the
//! first delivery and two redeliveries) is not delivered again but found in the dead-letter
//! stream, reason `delivery_limit`.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::time::Duration;

use convoy_amqp::{admin, topology, AmqpPublisher};
use convoy_core::{OutgoingMessage, Publisher};
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_past_the_delivery_limit_is_dead_lettered_with_the_reason() {
    let Some(uri) = common::uri() else {
        return;
    };
    let topic = common::unique("convoy-test-limit");
    let mut config = common::test_config(&uri, &common::unique("g"), &topic, 1);
    config.delivery_limit = 2;
    admin::create_topics(&config, &[(&topic, 1)]).await.unwrap();
    AmqpPublisher::new(&config, &topic)
        .publish(OutgoingMessage::new("k", "the one"))
        .await
        .unwrap();

    let queue = topology::partition_queue(&topic, &config.group, 0);
    let dlq = config.dlq_topic();
    let connection = convoy_amqp::connect::connect(&config, "test").await.unwrap();
    let deadline = tokio::time::Instant::now() + LIMIT;
    let mut deliveries = 0;
    let dead = loop {
        let dead = admin::read_stream(&config, &dlq, Duration::from_millis(300))
            .await
            .unwrap();
        if !dead.is_empty() {
            break dead;
        }
        assert!(tokio::time::Instant::now() < deadline, "never dead-lettered");
        // A member that takes the message and dies holding it: its channel closes, unacknowledged.
        let channel = connection.create_channel().await.unwrap();
        channel.basic_qos(1, BasicQosOptions::default()).await.unwrap();
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        if let Ok(Some(Ok(delivery))) = tokio::time::timeout(Duration::from_secs(2), consumer.next()).await {
            assert_eq!(&delivery.data[..], b"the one");
            deliveries += 1;
        }
        let _ = channel.close(200, "a member died".into()).await;
    };
    assert_eq!(
        deliveries, 3,
        "delivered once, and again as often as the limit allows"
    );
    assert_eq!(dead.len(), 1);
    assert_eq!(&dead[0].payload[..], b"the one");
    assert_eq!(
        dead[0].headers.get("x-first-death-reason").map(|v| &v[..]),
        Some(&b"delivery_limit"[..]),
        "the broker's reason travels with it: {:?}",
        dead[0].headers
    );
    convoy_amqp::connect::close(&connection, "done").await;
    admin::delete_topic(&config, &topic, Some(&dlq)).await.unwrap();
}
