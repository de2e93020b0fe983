//! The benchmark baseline: bare async-nats pull consumers (no engine, no ordering, no leases,
//! no watermarks) draining every partition of a topic's stream from its start, with the same
//! batch and acknowledgement policy as convoy's readers, so convoy's throughput is reported as a
//! ratio to the client's.

use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use convoy_core::TransportError;
use futures_util::stream::{SelectAll, StreamExt};

use crate::config::NatsConfig;
use crate::connect::connect;
use crate::convert::KEY_HEADER;
use crate::error::nats_error;
use crate::topology;

/// Drains `expected` messages of `topic` (or fewer once `limit` passed), `batch` per pull,
/// calling `check` with each message's key and payload (the benchmark's own per-message work,
/// which the engine's side pays too), and returns the rate in messages per second, timed from
/// the first message.
pub async fn bare_drain(
    config: &NatsConfig,
    topic: &str,
    batch: usize,
    expected: u64,
    limit: Duration,
    check: impl Fn(&[u8], &[u8]),
) -> Result<f64, TransportError> {
    let connected = connect(config, "baseline").await?;
    let stream = connected
        .js
        .get_stream(topology::stream_name(topic))
        .await
        .map_err(|e| nats_error(&format!("opening the stream of {topic}"), e))?;
    let mut all = SelectAll::new();
    for p in 0..config.partitions {
        let consumer = stream
            .create_consumer(pull::Config {
                filter_subject: topology::partition_subject(topic, p),
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::None,
                inactive_threshold: Duration::from_secs(30),
                ..pull::Config::default()
            })
            .await
            .map_err(|e| nats_error("creating a baseline consumer", e))?;
        let messages = consumer
            .stream()
            .max_messages_per_batch(batch)
            .heartbeat(Duration::from_secs(5))
            .messages()
            .await
            .map_err(|e| nats_error("starting a baseline consumer", e))?;
        all.push(messages);
    }
    let deadline = tokio::time::Instant::now() + limit;
    let mut started = None;
    let mut seen = 0u64;
    while seen < expected {
        let Ok(Some(message)) = tokio::time::timeout_at(deadline, all.next()).await else {
            break;
        };
        let message = message.map_err(|e| nats_error("baseline consume", e))?;
        started.get_or_insert_with(Instant::now);
        // The key travels in a header, as convoy's publishers send it.
        let key = message
            .headers
            .as_ref()
            .and_then(|h| h.get(KEY_HEADER))
            .map_or(&b""[..], |v| v.as_str().as_bytes());
        check(key, &message.payload);
        seen += 1;
    }
    let elapsed = started.map_or(f64::INFINITY, |s| s.elapsed().as_secs_f64());
    Ok(seen as f64 / elapsed)
}
