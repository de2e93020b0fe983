//! Reading a stream without consuming it (streams keep what is read): the dead-letter stream,
//! the topic registry, and the read-back of parked keys after a checkpoint.

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
