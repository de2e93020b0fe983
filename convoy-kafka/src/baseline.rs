//! The benchmark baseline: a bare rdkafka consumer (its own group, no engine, no ordering, no
//! commits) draining a topic, so convoy's throughput is reported as a ratio to the client's.

use std::time::{Duration, Instant};

use convoy_core::TransportError;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::Message as _;

use crate::config::KafkaConfig;

/// Drains `expected` messages of `topic` (or fewer once `limit` passed) and returns the rate in
/// messages per second, timed from the first message so the group join is not counted.
pub async fn bare_drain(
    config: &KafkaConfig,
    topic: &str,
    expected: u64,
    limit: Duration,
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
        let mut sum = 0u64;
        let mut started = None;
        let deadline = Instant::now() + limit;
        while seen < expected && Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                started.get_or_insert_with(Instant::now);
                sum = sum.wrapping_add(m.payload().map_or(0, |p| p.len() as u64));
                seen += 1;
            }
        }
        std::hint::black_box(sum);
        let elapsed = started.map_or(f64::INFINITY, |s: Instant| s.elapsed().as_secs_f64());
        seen as f64 / elapsed
    })
    .await
    .map_err(|_| TransportError::Closed)
}
