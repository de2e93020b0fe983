//! The benchmark baseline: a bare member of a new group drains a topic, no engine, no order,
//! no commits — what convoy's throughput on the memory broker is compared with.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use convoy_core::transport::SourceEvent;
use convoy_core::{Message, Transport};

use crate::broker::MemoryBroker;
use crate::transport::MemoryTransport;

/// Drains `topic` with a bare member of a new group on `broker` and no engine, calling `each`
/// per message: returns how many were read once `expected` arrived, or fewer if `limit` passed.
pub async fn bare_drain(
    broker: &MemoryBroker,
    topic: &str,
    expected: u64,
    limit: Duration,
    mut each: impl FnMut(&Message),
) -> u64 {
    static BARE: AtomicU64 = AtomicU64::new(0);
    let group = format!("{topic}-bare-{}", BARE.fetch_add(1, Relaxed));
    let Ok(mut sub) = MemoryTransport::new(broker, group, &[topic]).subscribe().await else {
        return 0;
    };
    let deadline = tokio::time::Instant::now() + limit;
    let mut seen = 0u64;
    while seen < expected {
        match tokio::time::timeout_at(deadline, sub.events.recv()).await {
            Ok(Some(SourceEvent::Messages { messages, .. })) => {
                for m in &messages {
                    each(m);
                }
                seen += messages.len() as u64;
            }
            Ok(Some(SourceEvent::Revoked { ack, .. })) => ack.done(),
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    let _ = sub.control.close().await;
    seen
}

/// The rate of [`bare_drain`] in messages per second, calling `check` with each message's key
/// and payload (the benchmark's own per-message work, which the engine's side pays too).
pub async fn bare_drain_rate(
    broker: &MemoryBroker,
    topic: &str,
    expected: u64,
    limit: Duration,
    check: impl Fn(&[u8], &[u8]),
) -> f64 {
    let started = std::time::Instant::now();
    let seen = bare_drain(broker, topic, expected, limit, |m| {
        check(m.key.as_deref().unwrap_or_default(), &m.payload);
    })
    .await;
    seen as f64 / started.elapsed().as_secs_f64()
}
