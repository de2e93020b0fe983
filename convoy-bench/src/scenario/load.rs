//! Offering probe messages: all at once before the run, or live at a rate; or registering the
//! ones another process published.

use std::sync::Arc;
use std::time::{Duration, Instant};

use convoy_core::{Publisher, TransportError};

use crate::checker::OrderChecker;
use crate::probe::{probe_batch_spread, probe_key, unix_micros, SENT_AT_HEADER};
use crate::spread::KeySpread;

/// Messages built per shared buffer: few enough that parallel shards rarely contend on one
/// buffer's reference count (a real transport gives each message its own buffer).
const CHUNK: usize = 256;

/// Messages handed to the publisher at once when pre-filling: enough for a network producer to
/// form full batches (the broker stores them as sent, and consumers fetch them that way).
const PREFILL_BATCH: usize = 16_384;

/// Most messages sent in one live step when unthrottled.
const LIVE_BURST: usize = 4_096;

/// Publishes `messages` probes over the keys of `spread`, each payload padded to `payload_bytes`.
pub async fn prefill(
    publisher: &dyn Publisher,
    checker: &OrderChecker,
    messages: u64,
    spread: &KeySpread,
    payload_bytes: usize,
) -> Result<(), TransportError> {
    let total = messages as usize;
    let mut from = 0usize;
    while from < total {
        let end = (from + PREFILL_BATCH).min(total);
        let mut batch = Vec::with_capacity(end - from);
        while from < end {
            let count = CHUNK.min(end - from);
            batch.extend(probe_batch_spread(
                checker,
                "key-",
                spread,
                from,
                count,
                payload_bytes,
            ));
            from += count;
        }
        publisher.publish_all(batch).await?;
    }
    Ok(())
}

/// Registers with `checker` the `messages` probes that [`prefill`] publishes over `spread` (key
/// `key-{spread.key_of(i)}` for message `i`), without publishing them: for a topic another
/// process filled that way (`convoy produce --generate N --keys K --probes`).
pub(super) fn register_prefilled(checker: &OrderChecker, messages: u64, spread: &KeySpread) {
    for i in 0..messages {
        checker.expect(&probe_key("key-", spread.key_of(i)));
    }
}

/// Publishes `messages` probes at `rate` msg/s (open loop: message i is due at start + i / rate)
/// or as fast as the publisher confirms. Returns the rate achieved.
///
/// At a rate each message is stamped with its *intended* send instant, not the moment the
/// producer got to it: a producer held up (by the broker, by the machine) sends late, and the
/// wait counts in the message's latency. Without that, a stall would delay the stamps along with
/// the messages and hide itself (coordinated omission). Unthrottled, the stamp is the send time.
pub(super) async fn live(
    publisher: Arc<dyn Publisher>,
    checker: Arc<OrderChecker>,
    messages: u64,
    spread: KeySpread,
    rate: Option<f64>,
    payload_bytes: usize,
) -> Result<f64, TransportError> {
    let total = messages as usize;
    let start = Instant::now();
    let start_us = unix_micros();
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
        let stamps: Vec<u64> = match rate {
            Some(rate) => (sent..sent + count)
                .map(|i| start_us + (i as f64 * 1e6 / rate) as u64)
                .collect(),
            None => vec![unix_micros(); count],
        };
        let batch = probe_batch_spread(&checker, "key-", &spread, sent, count, payload_bytes)
            .into_iter()
            .zip(&stamps)
            .map(|(m, stamp)| m.header(SENT_AT_HEADER, stamp.to_string()))
            .collect();
        publisher.publish_all(batch).await?;
        // Every message of the batch is acknowledged once `publish_all` returns.
        checker.acked(unix_micros(), &stamps);
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
        register_prefilled(&registered, 7, &KeySpread::uniform(3));
        let published = crate::probe::probe_batch(&OrderChecker::new(), "key-", 3, 0, 7, 0);
        for m in &published {
            let key = m.key.as_deref().unwrap_or_default();
            let seq = decode_seq(&m.payload).unwrap_or(u64::MAX);
            registered.handled(key, seq, None);
        }
        let report = registered.report();
        assert!(report.is_clean() && registered.complete(), "{report:?}");
        assert_eq!((report.published, report.finished), (7, 7));
    }

    #[test]
    fn registered_zipf_messages_are_the_ones_prefill_publishes() {
        let spread = KeySpread::zipf(50, 1.0).unwrap();
        let registered = OrderChecker::new();
        register_prefilled(&registered, 500, &spread);
        let published = probe_batch_spread(&OrderChecker::new(), "key-", &spread, 0, 500, 0);
        for m in &published {
            let key = m.key.as_deref().unwrap_or_default();
            registered.handled(key, decode_seq(&m.payload).unwrap_or(u64::MAX), None);
        }
        let report = registered.report();
        assert!(report.is_clean() && registered.complete(), "{report:?}");
        // Skewed: key 0 has far more than its uniform share (10).
        let hot = published
            .iter()
            .filter(|m| m.key.as_deref() == Some(&b"key-0"[..]))
            .count();
        assert!(hot > 50, "{hot}");
    }
}
