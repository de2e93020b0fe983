//! Offering probe messages: all at once before the run, or live at a rate; or registering the
//! ones another process published.

use std::sync::Arc;
use std::time::{Duration, Instant};

use convoy_core::{Publisher, TransportError};

use crate::checker::OrderChecker;
use crate::probe::{probe_batch, probe_key, unix_micros, SENT_AT_HEADER};

/// Messages built per shared buffer: few enough that parallel shards rarely contend on one
/// buffer's reference count (a real transport gives each message its own buffer).
const CHUNK: usize = 256;

/// Messages handed to the publisher at once when pre-filling: enough for a network producer to
/// form full batches (the broker stores them as sent, and consumers fetch them that way).
const PREFILL_BATCH: usize = 16_384;

/// Most messages sent in one live step when unthrottled.
const LIVE_BURST: usize = 4_096;

/// Publishes `messages` probes over `keys` keys, each payload padded to `payload_bytes`.
pub async fn prefill(
    publisher: &dyn Publisher,
    checker: &OrderChecker,
    messages: u64,
    keys: usize,
    payload_bytes: usize,
) -> Result<(), TransportError> {
    let total = messages as usize;
    let mut from = 0usize;
    while from < total {
        let end = (from + PREFILL_BATCH).min(total);
        let mut batch = Vec::with_capacity(end - from);
        while from < end {
            let count = CHUNK.min(end - from);
            batch.extend(probe_batch(checker, "key-", keys, from, count, payload_bytes));
            from += count;
        }
        publisher.publish_all(batch).await?;
    }
    Ok(())
}

/// Registers with `checker` the `messages` probes over `keys` keys that [`prefill`] publishes
/// (key `key-{i % keys}` for message `i`), without publishing them: for a topic another process
/// filled that way (`convoy produce --generate N --keys K --probes`).
pub(super) fn register_prefilled(checker: &OrderChecker, messages: u64, keys: usize) {
    let keys = keys.max(1) as u64;
    for i in 0..messages {
        checker.expect(&probe_key("key-", (i % keys) as usize));
    }
}

/// Publishes `messages` probes stamped with their send time, at `rate` msg/s (open loop:
/// message i is due at start + i / rate) or as fast as the publisher confirms. Returns the
/// rate achieved.
pub(super) async fn live(
    publisher: Arc<dyn Publisher>,
    checker: Arc<OrderChecker>,
    messages: u64,
    keys: usize,
    rate: Option<f64>,
    payload_bytes: usize,
) -> Result<f64, TransportError> {
    let total = messages as usize;
    let start = Instant::now();
    let mut sent = 0usize;
    while sent < total {
        let due = match rate {
            Some(rate) => ((start.elapsed().as_secs_f64() * rate) as usize + 1).min(total),
            None => total,
        };
        if due <= sent {
            let next = start + Duration::from_secs_f64((sent as f64) / rate.unwrap_or(f64::INFINITY));
            tokio::time::sleep_until(next.max(Instant::now() + Duration::from_millis(1)).into()).await;
            continue;
        }
        let count = (due - sent).min(LIVE_BURST);
        let stamped = unix_micros();
        let stamp = stamped.to_string();
        let batch = probe_batch(&checker, "key-", keys, sent, count, payload_bytes)
            .into_iter()
            .map(|m| m.header(SENT_AT_HEADER, stamp.clone()))
            .collect();
        publisher.publish_all(batch).await?;
        // Every message of the batch is acknowledged once `publish_all` returns.
        checker.acked(
            Duration::from_micros(unix_micros().saturating_sub(stamped)),
            count as u64,
        );
        sent += count;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::decode_seq;

    #[test]
    fn registered_messages_are_the_ones_prefill_publishes() {
        let registered = OrderChecker::new();
        register_prefilled(&registered, 7, 3);
        let published = probe_batch(&OrderChecker::new(), "key-", 3, 0, 7, 0);
        for m in &published {
            let key = m.key.as_deref().unwrap_or_default();
            let seq = decode_seq(&m.payload).unwrap_or(u64::MAX);
            registered.handled(key, seq, None);
        }
        let report = registered.report();
        assert!(report.is_clean() && registered.complete(), "{report:?}");
        assert_eq!((report.published, report.finished), (7, 7));
    }
}
