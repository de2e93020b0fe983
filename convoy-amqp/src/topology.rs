//! What a topic is on RabbitMQ, and declaring it.
//!
//! A topic `T` is a durable direct exchange `T`, and its partition count is part of its
//! identity: it is recorded as the `x-max-length` of an empty quorum queue
//! `convoy.topic.T.partitions` (never bound, so nothing is ever in it; replicated, so a cluster
//! losing a node keeps it) — RabbitMQ compares that
//! argument when a queue is declared again (it ignores unknown exchange arguments), so a member or
//! publisher configured with another count is refused by the broker, naming both counts,
//! instead of placing keys on partitions nobody reads or declaring queues of its own. Each
//! consumer group `G` has `N` partition
//! queues `T.G.p0 … T.G.p{N-1}` bound to it with routing keys `0 … N-1`: quorum queues with
//! `x-single-active-consumer` (the broker never delivers one queue to two consumers at once).
//! Groups consume independently, as on Kafka; a group receives what was published once its
//! queues exist (convoy declares them on `create_topics` and on every subscribe). Dead letters go
//! to a stream queue (listed without being consumed). Ownership among a group's members uses
//! exclusive queues as locks (`T.G.p{i}.owner`, `convoy.G.extra.{j}`): the broker grants each to
//! one connection and deletes it when that connection dies. `convoy.G.members` counts the live
//! members (each consumes it). Every declare is idempotent; one with other arguments than an
//! existing queue's is a clear error naming the queue and what differs, never a fallback.
//! Every call is bounded in time ([`crate::error::CALL_TIMEOUT`]).

use crate::config::AmqpConfig;
use convoy_core::TransportError;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};

use crate::error::{amqp_error, answered, broker, home_node_down, TopologyError};

pub use crate::names::{
    extra_token, members_queue, owner_lock, partition_queue, partitions_marker, routing_key,
};

/// Declares topic `topic`'s exchange and its partition count (on `channel`, which a refusal
/// closes).
pub async fn declare_exchange(channel: &Channel, topic: &str, partitions: u32) -> Result<(), TopologyError> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let declare =
        channel.exchange_declare(topic.into(), ExchangeKind::Direct, durable, FieldTable::default());
    answered(format!("declaring exchange {topic}"), declare)
        .await?
        .map_err(|e| match amqp_error(&e) {
            Some((406, text)) => TopologyError::Mismatch {
                queue: format!("exchange {topic}"),
                server: text.to_owned(),
            },
            _ => TopologyError::Broker(e),
        })?;
    // A quorum queue, like the partition queues, so the marker outlives the node it was
    // declared on (a classic queue whose node is down refuses every declare on a cluster).
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    args.insert(
        "x-max-length".into(),
        AMQPValue::LongLongInt(i64::from(partitions)),
    );
    let marker = partitions_marker(topic);
    let declare = channel.queue_declare(marker.as_str().into(), QueueDeclareOptions::durable(), args);
    answered(format!("declaring {marker}"), declare)
        .await?
        .map_err(|e| match amqp_error(&e) {
            Some((406, text)) => TopologyError::Partitions {
                topic: topic.to_owned(),
                partitions,
                server: text.to_owned(),
            },
            _ => TopologyError::Broker(e),
        })?;
    Ok(())
}

/// Arguments of a partition queue: a quorum queue with single active consumer that delivers a
/// message once and again at most `delivery_limit` times, then dead-letters it — at least once — to the stream
/// `dead_letters` (through the default exchange, which routes by queue name).
pub fn partition_args(delivery_limit: u32, dead_letters: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongLongInt(i64::from(delivery_limit)),
    );
    args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dead_letters.into()),
    );
    // At-least-once dead-lettering needs the reject-publish overflow (no length limit is set).
    args.insert(
        "x-dead-letter-strategy".into(),
        AMQPValue::LongString("at-least-once".into()),
    );
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    args
}

/// Arguments of a dead-letter stream: kept a week, at most 1 GB.
pub fn stream_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("stream".into()));
    args.insert("x-max-age".into(), AMQPValue::LongString("7D".into()));
    args.insert("x-max-length-bytes".into(), AMQPValue::LongLongInt(1_000_000_000));
    args
}

/// Runs `declare` on a channel of its own: a refused declare (406, 404) closes its channel.
async fn on_own_channel<T, F, Fut>(conn: &Connection, declare: F) -> Result<T, TopologyError>
where
    F: FnOnce(Channel) -> Fut,
    Fut: std::future::Future<Output = Result<T, TopologyError>>,
{
    let channel = answered("opening a channel", conn.create_channel())
        .await?
        .map_err(TopologyError::Broker)?;
    let result = declare(channel.clone()).await;
    if channel.status().connected() {
        let _ = answered("closing a channel", channel.close(200, "declared".into())).await;
    }
    result
}

async fn declare_queue(
    channel: &Channel,
    name: &str,
    options: QueueDeclareOptions,
    args: FieldTable,
) -> Result<(u32, u32), TopologyError> {
    let queue = answered(
        format!("declaring queue {name}"),
        channel.queue_declare(name.into(), options, args),
    )
    .await?
    .map_err(|e| match amqp_error(&e) {
        Some((406, text)) => TopologyError::Mismatch {
            queue: name.to_owned(),
            server: text.to_owned(),
        },
        _ => TopologyError::Broker(e),
    })?;
    Ok((queue.message_count(), queue.consumer_count()))
}

/// What a declare found new.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Declared {
    /// The topic's exchange did not exist.
    pub topic_new: bool,
    /// The group's partition queues did not exist: the group receives only what is published
    /// from now on.
    pub group_new: bool,
}

/// True if an exchange (`exchange`) or a queue named `name` exists (a passive declare, on a
/// channel of its own: a miss closes it).
pub(crate) async fn exists(conn: &Connection, exchange: bool, name: &str) -> Result<bool, TopologyError> {
    on_own_channel(conn, |channel| async move {
        let answer = if exchange {
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            let declare =
                channel.exchange_declare(name.into(), ExchangeKind::Direct, passive, FieldTable::default());
            answered(format!("looking up exchange {name}"), declare)
                .await?
                .map(|_| ())
        } else {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            let declare = channel.queue_declare(name.into(), passive, FieldTable::default());
            answered(format!("looking up queue {name}"), declare)
                .await?
                .map(|_| ())
        };
        match answer {
            Ok(()) => Ok(true),
            // A queue whose home node is down exists; it cannot be served now.
            Err(e) if home_node_down(&e) => Ok(true),
            Err(e) if amqp_error(&e).is_some_and(|(code, _)| code == 404) => Ok(false),
            Err(e) => Err(TopologyError::Broker(e)),
        }
    })
    .await
}

/// Declares topic `topic` alone: its exchange and its partition count — what a publisher
/// needs, no group. A message published while no group's queues are bound is returned
/// unroutable, and the publisher reports it.
pub async fn declare_topic_only(
    conn: &Connection,
    topic: &str,
    partitions: u32,
) -> Result<bool, TopologyError> {
    let topic_new = !exists(conn, true, topic).await?;
    on_own_channel(conn, |channel| async move {
        declare_exchange(&channel, topic, partitions).await
    })
    .await?;
    Ok(topic_new)
}

/// Declares topic `topic` for `config.group`: the exchange, the dead-letter stream, and the
/// group's `partitions` queues, bound. Says what was new.
pub async fn declare_topic(
    conn: &Connection,
    topic: &str,
    config: &AmqpConfig,
    partitions: u32,
) -> Result<Declared, TopologyError> {
    let declared = Declared {
        topic_new: !exists(conn, true, topic).await?,
        group_new: !exists(conn, false, &partition_queue(topic, &config.group, 0)).await?,
    };
    let dead_letters = config.dlq_topic();
    let args = partition_args(config.delivery_limit, &dead_letters);
    // Before the queues that dead-letter to it: a message routed to a missing queue is dropped.
    declare_dead_letter_stream(conn, &dead_letters).await?;
    on_own_channel(conn, |channel| async move {
        declare_exchange(&channel, topic, partitions).await?;
        for p in 0..partitions {
            let queue = partition_queue(topic, &config.group, p);
            declare_queue(&channel, &queue, QueueDeclareOptions::durable(), args.clone()).await?;
            let bind = channel.queue_bind(
                queue.as_str().into(),
                topic.into(),
                routing_key(p).as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            );
            answered(format!("binding queue {queue}"), bind)
                .await?
                .map_err(TopologyError::Broker)?;
        }
        Ok(())
    })
    .await?;
    Ok(declared)
}

/// Declares the dead-letter stream `name` for a consumer. A stream the broker cannot serve now
/// (RabbitMQ 3.10 leaves a stream declared moments before a node crash "down or inaccessible"
/// after the restart) does not stop consuming: dead letters wait in their lanes — the sink
/// declares it again on every failed one — until it serves again or an operator deletes it.
/// Only another queue of its name stops.
pub async fn declare_dead_letter_stream(conn: &Connection, name: &str) -> Result<(), TopologyError> {
    match declare_stream(conn, name).await {
        Err(e @ TopologyError::Mismatch { .. }) => Err(e),
        Err(e) => {
            tracing::warn!(
                stream = %name,
                error = %e,
                "the dead-letter stream cannot be declared now; consuming goes on, dead letters \
                 wait until it can (if it stays so, look at the stream on the broker: it may hold \
                 dead letters, so convoy never removes it)"
            );
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

/// Declares the dead-letter stream `name`.
pub async fn declare_stream(conn: &Connection, name: &str) -> Result<(), TopologyError> {
    on_own_channel(conn, |channel| async move {
        declare_queue(&channel, name, QueueDeclareOptions::durable(), stream_args()).await?;
        Ok(())
    })
    .await
}

/// Publishes `body` to the queue `queue` (by the default exchange), persistent, and waits for
/// the broker's confirm: the write of a small store kept in a queue (the registry, a parked keys'
/// checkpoint). `what` names it in errors.
pub async fn publish_confirmed(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    what: &str,
) -> Result<(), TransportError> {
    answered(
        "enabling confirms",
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?
    .map_err(|e| broker("enabling confirms", e))?;
    let publish = channel.basic_publish(
        "".into(),
        queue.into(),
        BasicPublishOptions::default(),
        body,
        BasicProperties::default().with_delivery_mode(2),
    );
    let confirm = answered(what, publish).await?.map_err(|e| broker(what, e))?;
    answered(what, confirm).await?.map_err(|e| broker(what, e))?;
    Ok(())
}

/// Ready messages (not delivered, or returned) and consumers of a partition queue.
pub async fn partition_depth(channel: &Channel, queue: &str) -> Result<(u32, u32), TopologyError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::durable()
    };
    declare_queue(channel, queue, passive, FieldTable::default()).await
}

/// Tries to take the exclusive lock queue `name`: false when another connection holds it.
pub async fn try_lock(conn: &Connection, name: &str) -> Result<bool, TopologyError> {
    on_own_channel(conn, |channel| async move {
        let options = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..QueueDeclareOptions::default()
        };
        let declare = channel.queue_declare(name.into(), options, FieldTable::default());
        match answered(format!("taking the lock {name}"), declare).await? {
            Ok(_) => Ok(true),
            // RESOURCE_LOCKED: exclusive to another connection.
            Err(e) if amqp_error(&e).is_some_and(|(code, _)| code == 405) => Ok(false),
            Err(e) => Err(TopologyError::Broker(e)),
        }
    })
    .await
}

/// Deletes a queue (a lock this connection holds, or a test's queues).
pub async fn delete_queue(channel: &Channel, name: &str) -> Result<(), TopologyError> {
    answered(
        format!("deleting queue {name}"),
        channel.queue_delete(name.into(), QueueDeleteOptions::default()),
    )
    .await?
    .map(|_| ())
    .map_err(TopologyError::Broker)
}

/// Deletes topic `topic`'s exchange and `group`'s partition queues (tests clean up with it).
pub async fn delete_topic(
    conn: &Connection,
    topic: &str,
    group: &str,
    partitions: u32,
) -> Result<(), TopologyError> {
    on_own_channel(conn, |channel| async move {
        for p in 0..partitions {
            delete_queue(&channel, &partition_queue(topic, group, p)).await?;
        }
        delete_queue(&channel, &partitions_marker(topic)).await?;
        let delete = channel.exchange_delete(topic.into(), lapin::options::ExchangeDeleteOptions::default());
        answered(format!("deleting exchange {topic}"), delete)
            .await?
            .map_err(TopologyError::Broker)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_topic_group_and_partition() {
        assert_eq!(partition_queue("orders", "billing", 3), "orders.billing.p3");
        assert_eq!(owner_lock("orders", "billing", 3), "orders.billing.p3.owner");
        assert_eq!(members_queue("billing"), "convoy.billing.members");
        assert_eq!(extra_token("billing", 0), "convoy.billing.extra.0");
        assert_eq!(routing_key(7), "7");
        assert_eq!(partitions_marker("orders"), "convoy.topic.orders.partitions");
    }
}
