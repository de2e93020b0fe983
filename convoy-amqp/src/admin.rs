//! What tools need besides consuming: declaring topics, reading a dead-letter stream without
//! consuming it, deleting what tests declared.

use std::time::Duration;

use bytes::Bytes;
use convoy_core::{Message, SourceId, TransportError};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::config::AmqpConfig;
use crate::connect::connect;
use crate::convert::to_message;
use crate::error::broker;
use crate::{registry, topology};

/// Checks that RabbitMQ answers (connects and closes at once).
pub async fn check_reachable(config: &AmqpConfig) -> Result<(), TransportError> {
    let connection = connect(config, "check").await?;
    crate::connect::close(&connection, "checked").await;
    Ok(())
}

/// Declares each `(topic, partitions)` for `config.group` (idempotent; a queue with other
/// arguments is an error naming it), recorded in the topic registry.
pub async fn create_topics(config: &AmqpConfig, topics: &[(&str, u32)]) -> Result<(), TransportError> {
    let connection = connect(config, "admin").await?;
    let result = async {
        for (topic, partitions) in topics {
            registry::declare_recorded(&connection, topic, config, *partitions).await?;
        }
        Ok::<(), TransportError>(())
    }
    .await;
    crate::connect::close(&connection, "done").await;
    result
}

/// Declares `topic` with no group: its exchange and partition count, what publishing needs. A
/// message published while no group's queues are bound is returned, and the publisher reports
/// it as an error (nothing would keep it).
pub async fn create_topic_alone(
    config: &AmqpConfig,
    topic: &str,
    partitions: u32,
) -> Result<(), TransportError> {
    let connection = connect(config, "admin").await?;
    let result = async {
        if topology::declare_topic_only(&connection, topic, partitions).await? {
            registry::note(&connection, &registry::Record::topic(topic, partitions)).await?;
        }
        Ok::<(), TransportError>(())
    }
    .await;
    crate::connect::close(&connection, "done").await;
    result
}

/// The topics convoy declared on this broker and the groups receiving each (the registry).
pub async fn list_topics(config: &AmqpConfig) -> Result<Vec<registry::Topic>, TransportError> {
    registry::list(config).await
}

/// Declares the dead-letter stream `name`.
pub async fn create_stream(config: &AmqpConfig, name: &str) -> Result<(), TransportError> {
    let connection = connect(config, "admin").await?;
    let result = topology::declare_stream(&connection, name)
        .await
        .map_err(TransportError::from);
    crate::connect::close(&connection, "done").await;
    result
}

/// Every message of the stream `name`, in order, without consuming it (streams keep what is
/// read): read from its first offset until nothing arrived for `idle` (a stream has no end
/// marker). Each message's offset is its stream offset. A stream that does not exist (nothing
/// was dead-lettered yet) reads as empty.
pub async fn read_stream(
    config: &AmqpConfig,
    name: &str,
    idle: Duration,
) -> Result<Vec<Message>, TransportError> {
    Ok(read_stream_to(config, name, Start::First, End::Idle(idle))
        .await?
        .0)
}

/// Where reading a stream starts.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Start {
    /// Its first message.
    First,
    /// Its last chunk (the latest messages).
    Last,
    /// This offset (one past the end waits for it to be written).
    Offset(u64),
}

/// Where reading a stream stops.
pub(crate) enum End<'f> {
    /// Once nothing arrived for this long.
    Idle(Duration),
    /// At the first message `fence` picks (not returned), which must arrive within `limit`.
    Fence(&'f (dyn Fn(&Message) -> bool + Sync), Duration),
}

/// The messages of stream `name` from `start` on, and — for an [`End::Fence`] — the offset of
/// the fence.
pub(crate) async fn read_stream_to(
    config: &AmqpConfig,
    name: &str,
    start: Start,
    end: End<'_>,
) -> Result<(Vec<Message>, Option<u64>), TransportError> {
    let connection = connect(config, "read").await?;
    let result = async {
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| broker("opening a channel", e))?;
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..lapin::options::QueueDeclareOptions::default()
        };
        if let Err(e) = channel
            .queue_declare(name.into(), passive, FieldTable::default())
            .await
        {
            return match crate::error::amqp_error(&e) {
                Some((404, _)) => Ok((Vec::new(), None)),
                _ => Err(broker(&format!("reading {name}"), e)),
            };
        }
        // A stream consumer needs a prefetch and manual acks (acks only grant credit here).
        channel
            .basic_qos(500, BasicQosOptions::default())
            .await
            .map_err(|e| broker("setting the prefetch", e))?;
        let mut args = FieldTable::default();
        let from = match start {
            Start::Offset(offset) if offset > 0 => {
                AMQPValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX))
            }
            Start::First | Start::Offset(_) => AMQPValue::LongString("first".into()),
            Start::Last => AMQPValue::LongString("last".into()),
        };
        args.insert("x-stream-offset".into(), from);
        let mut consumer = channel
            .basic_consume(name.into(), "".into(), BasicConsumeOptions::default(), args)
            .await
            .map_err(|e| broker(&format!("reading {name}"), e))?;
        let source = SourceId::partition(name, 0);
        let mut messages = Vec::new();
        let started = tokio::time::Instant::now();
        loop {
            let wait = match end {
                End::Idle(idle) => idle,
                End::Fence(_, limit) => limit.saturating_sub(started.elapsed()),
            };
            let delivery = match tokio::time::timeout(wait, consumer.next()).await {
                Ok(Some(delivery)) => delivery,
                _ if matches!(end, End::Idle(_)) => break,
                _ => {
                    return Err(TransportError::Unavailable(format!(
                        "reading {name}: the end marker written before did not arrive within {wait:?}"
                    )))
                }
            };
            let delivery = delivery.map_err(|e| broker(&format!("reading {name}"), e))?;
            let tag = delivery.delivery_tag;
            let offset = match delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("x-stream-offset"))
            {
                Some(AMQPValue::LongLongInt(o)) => u64::try_from(*o).unwrap_or(0),
                _ => messages.len() as u64,
            };
            let mut message = to_message(delivery, &source);
            message.offset = offset;
            message.headers = message
                .headers
                .iter()
                .filter(|(n, _)| *n != "x-stream-offset")
                .map(|(n, v): (&str, &Bytes)| (n, v.clone()))
                .collect();
            channel
                .basic_ack(tag, BasicAckOptions { multiple: true })
                .await
                .map_err(|e| broker(&format!("reading {name}"), e))?;
            if let End::Fence(fence, _) = end {
                if fence(&message) {
                    return Ok((messages, Some(offset)));
                }
            }
            messages.push(message);
        }
        Ok::<_, TransportError>((messages, None))
    }
    .await;
    crate::connect::close(&connection, "done").await;
    result
}

/// True if the dead-letter stream `name` exists (the registry lists topics, not these).
pub async fn dead_letter_stream_exists(config: &AmqpConfig, name: &str) -> Result<bool, TransportError> {
    let connection = connect(config, "admin").await?;
    let result = topology::exists(&connection, false, name)
        .await
        .map_err(TransportError::from);
    crate::connect::close(&connection, "done").await;
    result
}

/// Deletes the dead-letter stream `name` and every dead letter in it.
pub async fn delete_dead_letter_stream(config: &AmqpConfig, name: &str) -> Result<(), TransportError> {
    let connection = connect(config, "admin").await?;
    let result = delete_queue_on(&connection, name).await;
    crate::connect::close(&connection, "done").await;
    result
}

/// Deletes `group`'s parked keys' checkpoint of the dead-letter stream `stream`, if any.
pub async fn delete_checkpoint(config: &AmqpConfig, stream: &str, group: &str) -> Result<(), TransportError> {
    let queue = crate::checkpoint::queue(stream, group);
    let connection = connect(config, "admin").await?;
    let result = async {
        match topology::exists(&connection, false, &queue).await? {
            true => delete_queue_on(&connection, &queue).await,
            false => Ok(()),
        }
    }
    .await;
    crate::connect::close(&connection, "done").await;
    result
}

/// Deletes the queue `name` on a channel of its own.
async fn delete_queue_on(connection: &lapin::Connection, name: &str) -> Result<(), TransportError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| broker("opening a channel", e))?;
    Ok(topology::delete_queue(&channel, name).await?)
}

/// Deletes `topic`'s exchange and `config.group`'s queues of it, and the queue `also` (a
/// dead-letter stream), if given: for tests that clean up after themselves.
pub async fn delete_topic(
    config: &AmqpConfig,
    topic: &str,
    also: Option<&str>,
) -> Result<(), TransportError> {
    let connection = connect(config, "admin").await?;
    let result = async {
        topology::delete_topic(&connection, topic, &config.group, config.partitions).await?;
        registry::note(
            &connection,
            &registry::Record::topic(topic, config.partitions).deleted(),
        )
        .await?;
        if let Some(queue) = also {
            delete_queue_on(&connection, queue).await?;
        }
        Ok::<(), TransportError>(())
    }
    .await;
    crate::connect::close(&connection, "done").await;
    result
}
