//! The benchmark baseline: a bare rdkafka consumer (its own group, no engine, no ordering, no
//! commits) draining a topic, so convoy's throughput is reported as a ratio to the client's.
//! Per record it reads what convoy reads (event id, key, payload) and calls the benchmark's own
//! `check`, which the engine's side pays for in its handler too.

use std::time::{Duration, Instant};

use convoy_core::{TransportError, EVENT_ID_HEADER};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers as _;
use rdkafka::Message as _;

use crate::config::KafkaConfig;

/// Drains `expected` messages of `topic` (or fewer once `limit` passed), calling `check` with
/// each record's key and payload, and returns the rate in messages per second, timed from the
/// first message so the group join is not counted.
pub async fn bare_drain(
    config: &KafkaConfig,
    topic: &str,
    expected: u64,
    limit: Duration,
    check: impl Fn(&[u8], &[u8]) + Send + 'static,
) -> Result<f64, TransportError> {
    let mut c = config.consumer_config();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    c.set("group.id", format!("{}-bare-{nanos:x}", config.group_id));
    let consumer: BaseConsumer = c
        .create()
        .map_err(|e| TransportError::broker("creating the baseline consumer", e))?;
    consumer
        .subscribe(&[topic])
        .map_err(|e| TransportError::broker(format!("subscribing the baseline to {topic}"), e))?;
    tokio::task::spawn_blocking(move || {
        let mut seen = 0u64;
        let mut ids = 0u64;
        let mut started = None;
        let deadline = Instant::now() + limit;
        while seen < expected && Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                started.get_or_insert_with(Instant::now);
                // What any consumer of these records reads: the event id (librdkafka parses
                // the headers on this first look), the key and the payload.
                let id = m
                    .headers()
                    .and_then(|hs| hs.iter().find(|h| h.key == EVENT_ID_HEADER));
                ids += u64::from(id.is_some());
                check(m.key().unwrap_or_default(), m.payload().unwrap_or_default());
                seen += 1;
            }
        }
        std::hint::black_box(ids);
        let elapsed = started.map_or(f64::INFINITY, |s: Instant| s.elapsed().as_secs_f64());
        seen as f64 / elapsed
    })
    .await
    .map_err(|_| TransportError::Closed)
}
