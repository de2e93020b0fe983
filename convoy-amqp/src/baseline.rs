//! The benchmark baseline: a bare lapin consumer (no engine, no ordering) draining a group's
//! partition queues with the same prefetch and multiple-acks as convoy, so convoy's throughput is
//! reported as a ratio to the client's.

use std::time::{Duration, Instant};

use convoy_core::TransportError;
use futures_util::stream::{SelectAll, StreamExt};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};

use crate::config::AmqpConfig;
use crate::connect::connect;
use crate::convert::KEY_HEADER;
use crate::error::broker;
use crate::topology;

/// Acknowledge every this many deliveries of a channel (and at the end).
const ACK_EVERY: u64 = 250;

/// Drains `expected` messages of `topic` from `group`'s queues (or fewer once `limit` passed),
/// calling `check` with each message's key and payload (the benchmark's own per-message work,
/// which the engine's side pays too), and returns the rate in messages per second, timed from
/// the first message.
pub async fn bare_drain(
    config: &AmqpConfig,
    topic: &str,
    group: &str,
    prefetch: u16,
    expected: u64,
    limit: Duration,
    check: impl Fn(&[u8], &[u8]),
) -> Result<f64, TransportError> {
    let connection = connect(config, "baseline").await?;
    let mut streams = SelectAll::new();
    let mut channels = Vec::new();
    for p in 0..config.partitions {
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| broker("opening a channel", e))?;
        channel
            .basic_qos(prefetch, BasicQosOptions { global: false })
            .await
            .map_err(|e| broker("setting the prefetch", e))?;
        let queue = topology::partition_queue(topic, group, p);
        let consumer = channel
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| broker(&format!("consuming {queue}"), e))?;
        let index = channels.len();
        channels.push((channel, 0u64));
        streams.push(consumer.map(move |d| (index, d)));
    }
    let deadline = tokio::time::Instant::now() + limit;
    let mut started = None;
    let mut seen = 0u64;
    while seen < expected {
        let Ok(Some((index, delivery))) = tokio::time::timeout_at(deadline, streams.next()).await else {
            break;
        };
        let delivery = delivery.map_err(|e| broker("baseline consume", e))?;
        started.get_or_insert_with(Instant::now);
        // The key travels in a header, as convoy's publishers send it.
        let key = delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|h| h.inner().get(KEY_HEADER))
            .and_then(|v| match v {
                AMQPValue::LongString(s) => Some(s.as_bytes()),
                AMQPValue::ByteArray(b) => Some(b.as_slice()),
                _ => None,
            })
            .unwrap_or_default();
        check(key, &delivery.data);
        seen += 1;
        let (channel, unacked) = &mut channels[index];
        *unacked += 1;
        if *unacked >= ACK_EVERY {
            channel
                .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true })
                .await
                .map_err(|e| broker("baseline ack", e))?;
            *unacked = 0;
        }
    }
    let elapsed = started.map_or(f64::INFINITY, |s| s.elapsed().as_secs_f64());
    crate::connect::close(&connection, "done").await;
    Ok(seen as f64 / elapsed)
}
