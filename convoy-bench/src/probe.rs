//! Test messages and the handlers that check them.
//!
//! A probe message carries its per-key sequence number as its payload (ASCII decimal, which is
//! also valid JSON), so a handler can tell the checker exactly which message it handled. It may
//! be padded with spaces to a given size (still valid JSON), to weigh like real payloads.
//! [`ProbeHandler`] records into an [`OrderChecker`] and injects faults from a [`FaultPlan`]:
//! transient or terminal errors at a rate or on chosen messages, panics, latency, and keys
//! held until released (hangs).

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use convoy_core::{
    BatchHandler, BatchResults, DeadLetter, DeadLetterSink, Delivery, Handler, HandlerError, Offset,
    OutgoingMessage, Publisher, Receipt, SourceId, TransportError,
};
use tokio::sync::Notify;

use crate::checker::OrderChecker;
use crate::spread::KeySpread;

/// The sequence number a probe payload carries, if it is one.
pub fn decode_seq(payload: &[u8]) -> Option<u64> {
    let end = payload.iter().rposition(|b| *b != b' ').map_or(0, |i| i + 1);
    let digits = &payload[..end];
    if digits.is_empty() || digits.len() > 20 {
        return None;
    }
    digits.iter().try_fold(0u64, |acc, b| {
        let digit = b.checked_sub(b'0').filter(|d| *d < 10)?;
        acc.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// The probe key for key number `i` of a run (`k{i}`, or `{prefix}{i}`).
pub fn probe_key(prefix: &str, i: usize) -> Bytes {
    Bytes::from(format!("{prefix}{i}"))
}

/// Publishes `per_key` messages for each of `keys` keys, interleaved round-robin (k0 k1 … k0 k1 …),
/// registering each with the checker. Returns the receipts in publish order.
pub async fn publish_load(
    publisher: &dyn Publisher,
    checker: &OrderChecker,
    prefix: &str,
    keys: usize,
    per_key: usize,
) -> Result<Vec<Receipt>, TransportError> {
    let mut receipts = Vec::with_capacity(keys * per_key);
    for _ in 0..per_key {
        for k in 0..keys {
            let key = probe_key(prefix, k);
            receipts.push(publish_probe(publisher, checker, key).await?);
        }
    }
    Ok(receipts)
}

/// Publishes the next probe message of `key`.
pub async fn publish_probe(
    publisher: &dyn Publisher,
    checker: &OrderChecker,
    key: Bytes,
) -> Result<Receipt, TransportError> {
    let seq = checker.expect(&key);
    publisher
        .publish(OutgoingMessage::new(key, seq.to_string()))
        .await
}

/// Builds many probe messages with few allocations: keys and payloads are slices of shared
/// chunks, so a million messages cost a few hundred allocations, not millions. Payloads are
/// padded with spaces to `payload_bytes` when it is longer than the number.
pub fn probe_batch(
    checker: &OrderChecker,
    prefix: &str,
    keys: usize,
    from: usize,
    count: usize,
    payload_bytes: usize,
) -> Vec<OutgoingMessage> {
    probe_batch_spread(
        checker,
        prefix,
        &KeySpread::uniform(keys),
        from,
        count,
        payload_bytes,
    )
}

/// [`probe_batch`] with message `i`'s key chosen by `spread` (`{prefix}{spread.key_of(i)}`).
pub fn probe_batch_spread(
    checker: &OrderChecker,
    prefix: &str,
    spread: &KeySpread,
    from: usize,
    count: usize,
    payload_bytes: usize,
) -> Vec<OutgoingMessage> {
    let mut buf = BytesMut::with_capacity(count * (prefix.len() + 16));
    let mut spans = Vec::with_capacity(count);
    for i in from..from + count {
        let start = buf.len();
        buf.put_slice(prefix.as_bytes());
        buf.put_slice(spread.key_of(i as u64).to_string().as_bytes());
        spans.push((start, buf.len()));
    }
    // Copy into exact-size buffers: the slices keep their buffer alive as long as the broker
    // stores the message, so spare capacity would be held for the whole run.
    let keys_buf = Bytes::copy_from_slice(&buf);
    let mut out = Vec::with_capacity(count);
    let mut payloads = BytesMut::with_capacity(count * 8);
    let mut payload_spans = Vec::with_capacity(count);
    for &(s, e) in &spans {
        let key = keys_buf.slice(s..e);
        let seq = checker.expect(&key);
        let start = payloads.len();
        let digits = seq.to_string();
        payloads.put_slice(digits.as_bytes());
        payloads.put_bytes(b' ', payload_bytes.saturating_sub(digits.len()));
        payload_spans.push((key, start, payloads.len()));
    }
    let payloads = Bytes::copy_from_slice(&payloads);
    for (key, s, e) in payload_spans {
        out.push(OutgoingMessage {
            key: Some(key),
            payload: payloads.slice(s..e),
            headers: convoy_core::Headers::new(),
        });
    }
    out
}

/// A gate a handler waits at until released; see [`FaultPlan::hold_key`].
#[derive(Default, Debug)]
pub struct Latch {
    open: AtomicBool,
    notify: Notify,
    arrived: AtomicBool,
    arrival: Notify,
}

impl Latch {
    /// Resolves once a handler has come to the latch (at once if one has already): from then
    /// on, that message is certainly fetched and in its handler.
    pub async fn reached(&self) {
        loop {
            let arrival = self.arrival.notified();
            tokio::pin!(arrival);
            arrival.as_mut().enable();
            if self.arrived.load(Relaxed) {
                return;
            }
            arrival.await;
        }
    }

    /// Opens the latch: waiting handlers go on, later ones pass straight through.
    pub fn release(&self) {
        self.open.store(true, Relaxed);
        self.notify.notify_waiters();
    }

    async fn wait(&self) {
        self.arrived.store(true, Relaxed);
        self.arrival.notify_waiters();
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.open.load(Relaxed) {
                return;
            }
            notified.await;
        }
    }
}

/// Handler latency.
#[derive(Clone, Copy, Debug, Default)]
pub enum Latency {
    /// Return at once.
    #[default]
    None,
    /// Always this long (tokio's timer, not CPU: follows a paused clock, and rounds each wait up
    /// to its next 1 ms tick).
    Fixed(Duration),
    /// Always this long, on the exact timer ([`crate::timer`]): what benchmarks
    /// use to model async work. Ignores a paused clock.
    Exact(Duration),
    /// Uniform in `[min, max]`, chosen per message deterministically.
    Uniform(Duration, Duration),
}

impl Latency {
    /// `ms` milliseconds of async work per message, as the benchmarks model it: the exact timer,
    /// or tokio's with `tokio_timer` (each 1 ms wait then lasts 2.1–2.4 ms); none at 0.
    pub fn work(ms: f64, tokio_timer: bool) -> Latency {
        let duration = Duration::from_secs_f64(ms.max(0.0) / 1000.0);
        match (duration.is_zero(), tokio_timer) {
            (true, _) => Latency::None,
            (false, true) => Latency::Fixed(duration),
            (false, false) => Latency::Exact(duration),
        }
    }
}

/// Which faults a [`ProbeHandler`] injects. Choices are a deterministic function of the seed,
/// key and sequence number, so a run can be repeated exactly.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    /// Seed for the per-message choices.
    pub seed: u64,
    /// Fraction of messages that fail transiently on their first `transient_attempts` attempts.
    pub transient_rate: f64,
    /// How many attempts a transiently failing message fails.
    pub transient_attempts: u32,
    /// Fraction of messages that fail terminally.
    pub terminal_rate: f64,
    /// Fraction of messages whose handler panics.
    pub panic_rate: f64,
    /// These (key, seq) fail terminally.
    pub terminal_on: HashSet<(Bytes, u64)>,
    /// These (key, seq) fail transiently on every attempt.
    pub transient_forever: HashSet<(Bytes, u64)>,
    /// Latency per call.
    pub latency: Latency,
    /// Handlers of this key wait at the latch until it is released.
    pub hold: Option<(Bytes, Arc<Latch>)>,
}

impl FaultPlan {
    /// Holds every message of `key` until the returned latch is released.
    pub fn hold_key(&mut self, key: Bytes) -> Arc<Latch> {
        let latch = Arc::new(Latch::default());
        self.hold = Some((key, latch.clone()));
        latch
    }

    /// True when the plan makes this message fail transiently (on its first attempts).
    pub fn fails_transiently(&self, key: &[u8], seq: u64) -> bool {
        self.transient_rate > 0.0 && self.roll(4, key, seq) < self.transient_rate
    }

    /// True when the plan makes this message fail terminally at its rate (it is
    /// dead-lettered): what a verifier recomputes to know which messages to find dead-lettered.
    pub fn fails_terminally(&self, key: &[u8], seq: u64) -> bool {
        self.terminal_rate > 0.0 && self.roll(2, key, seq) < self.terminal_rate
    }

    /// The failure the plan's rates give attempt `attempt` of (key, seq), if any: terminal, or
    /// transient on its first `transient_attempts` attempts (what `convoy consume
    /// --terminal-rate --transient-rate` injects; [`ProbeHandler`] also panics and holds).
    pub fn failure_at_rate(&self, key: &[u8], seq: u64, attempt: u32) -> Option<HandlerError> {
        if self.fails_terminally(key, seq) {
            return Some(HandlerError::terminal(format!(
                "injected terminal failure of seq {seq}"
            )));
        }
        self.transient_failure(key, seq, attempt)
    }

    /// The transient failure the plan's rate gives attempt `attempt` of (key, seq), if any: what
    /// a message spared terminal failures (a replay, once its cause was fixed) still meets.
    pub fn transient_failure(&self, key: &[u8], seq: u64, attempt: u32) -> Option<HandlerError> {
        (attempt <= self.transient_attempts && self.fails_transiently(key, seq)).then(|| {
            HandlerError::transient(format!(
                "injected transient failure of seq {seq}, attempt {attempt}"
            ))
        })
    }

    fn roll(&self, salt: u64, key: &[u8], seq: u64) -> f64 {
        let h = foldhash::fast::FixedState::with_seed(self.seed ^ salt).hash_one((key, seq));
        (h >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Records handled probes in an [`OrderChecker`], injecting the faults of a [`FaultPlan`].
pub struct ProbeHandler {
    checker: Arc<OrderChecker>,
    plan: FaultPlan,
    calls: CallCount,
    /// Calls running now and the most at once; `None` when not tracked (benchmarks: two
    /// read-modify-writes of one cache line shared by every worker, per message).
    in_flight: Option<(AtomicUsize, AtomicUsize)>,
    /// Only when asked for: a lock per message is the benchmark's cost, not the engine's.
    calls_by_message: Option<Mutex<std::collections::HashMap<(Bytes, u64), u32>>>,
    offsets: Option<Mutex<Vec<(SourceId, Offset)>>>,
}

/// A call counter in cache-line-sized stripes, one per worker thread (by a slot each thread
/// takes once): counting costs no cache line shared between workers.
#[derive(Default)]
struct CallCount([Stripe; CALL_STRIPES]);

#[derive(Default)]
#[repr(align(64))]
struct Stripe(AtomicU64);

const CALL_STRIPES: usize = 16;

impl CallCount {
    fn add_one(&self) {
        static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);
        thread_local! {
            static SLOT: usize = NEXT_SLOT.fetch_add(1, Relaxed) % CALL_STRIPES;
        }
        let slot = SLOT.with(|s| *s);
        self.0[slot].0.fetch_add(1, Relaxed);
    }

    fn total(&self) -> u64 {
        self.0.iter().map(|s| s.0.load(Relaxed)).sum()
    }
}

struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl ProbeHandler {
    /// A handler that records into `checker` and injects nothing.
    pub fn new(checker: Arc<OrderChecker>) -> Self {
        ProbeHandler::with_faults(checker, FaultPlan::default())
    }

    /// A handler injecting `plan`'s faults.
    pub fn with_faults(checker: Arc<OrderChecker>, plan: FaultPlan) -> Self {
        ProbeHandler {
            checker,
            plan,
            calls: CallCount::default(),
            in_flight: Some((AtomicUsize::new(0), AtomicUsize::new(0))),
            calls_by_message: None,
            offsets: None,
        }
    }

    /// Does not track how many calls run at once ([`max_in_flight`](Self::max_in_flight) stays
    /// 0): what benchmarks use, so the baseline and the engine pay for the same bookkeeping.
    pub fn without_in_flight_tracking(mut self) -> Self {
        self.in_flight = None;
        self
    }

    /// Also counts calls per (key, seq), for [`calls_for`](Self::calls_for).
    pub fn counting_calls(mut self) -> Self {
        self.calls_by_message = Some(Mutex::default());
        self
    }

    /// Also records the (source, offset) of every message it handled successfully.
    pub fn recording_offsets(mut self) -> Self {
        self.offsets = Some(Mutex::default());
        self
    }

    /// The (source, offset) of each message handled successfully, in completion order
    /// (needs [`recording_offsets`](Self::recording_offsets)).
    pub fn handled_offsets(&self) -> Vec<(SourceId, Offset)> {
        self.offsets
            .as_ref()
            .map(|o| o.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .unwrap_or_default()
    }

    /// Handler calls so far (every attempt).
    pub fn calls(&self) -> u64 {
        self.calls.total()
    }

    /// The most calls that ran at once (parallelism actually reached; 0 without tracking).
    pub fn max_in_flight(&self) -> usize {
        self.in_flight.as_ref().map_or(0, |(_, most)| most.load(Relaxed))
    }

    /// Calls made for one message (needs [`counting_calls`](Self::counting_calls)).
    pub fn calls_for(&self, key: &[u8], seq: u64) -> u32 {
        self.calls_by_message
            .as_ref()
            .and_then(|m| {
                let m = m.lock().unwrap_or_else(|p| p.into_inner());
                m.get(&(Bytes::copy_from_slice(key), seq)).copied()
            })
            .unwrap_or(0)
    }
}

#[async_trait]
impl Handler for ProbeHandler {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        self.calls.add_one();
        // Borrowed, not cloned: a clone's reference count is shared by every record of a
        // fetched batch, a cache line both workers would write for every message.
        let key: &[u8] = delivery.key().map_or(&[], |k| k.as_ref());
        let seq = decode_seq(delivery.payload())
            .ok_or_else(|| HandlerError::malformed("payload is not a probe sequence number"))?;
        if let Some(counts) = &self.calls_by_message {
            let mut counts = counts.lock().unwrap_or_else(|p| p.into_inner());
            *counts.entry((Bytes::copy_from_slice(key), seq)).or_default() += 1;
        }
        if delivery.attempt() == 1 {
            if let Some(sent) = sent_at(&delivery) {
                let in_engine = delivery.received().elapsed();
                let since_sent = Duration::from_micros(unix_micros().saturating_sub(sent));
                self.checker
                    .stages(since_sent.saturating_sub(in_engine), in_engine);
            }
        }
        let inside = self.checker.enter(key);
        let _in_flight = self.in_flight.as_ref().map(|(now, most)| {
            most.fetch_max(now.fetch_add(1, Relaxed) + 1, Relaxed);
            InFlight(now)
        });
        let plan = &self.plan;
        match plan.latency {
            Latency::None => {}
            Latency::Fixed(d) => tokio::time::sleep(d).await,
            Latency::Exact(d) => crate::timer::exact_sleep(d).await,
            Latency::Uniform(min, max) => {
                let span = max.saturating_sub(min);
                tokio::time::sleep(min + span.mul_f64(plan.roll(1, key, seq))).await;
            }
        }
        if let Some((held, latch)) = &plan.hold {
            if held.as_ref() == key {
                latch.wait().await;
            }
        }
        let listed = |set: &HashSet<(Bytes, u64)>| {
            !set.is_empty() && set.contains(&(Bytes::copy_from_slice(key), seq))
        };
        if listed(&plan.terminal_on) || plan.fails_terminally(key, seq) {
            return Err(HandlerError::terminal(format!(
                "injected terminal failure of seq {seq}"
            )));
        }
        if plan.panic_rate > 0.0 && plan.roll(3, key, seq) < plan.panic_rate {
            panic!("injected panic on seq {seq}");
        }
        if listed(&plan.transient_forever)
            || (delivery.attempt() <= plan.transient_attempts && plan.fails_transiently(key, seq))
        {
            return Err(HandlerError::transient(format!(
                "injected transient failure of seq {seq}, attempt {}",
                delivery.attempt()
            )));
        }
        if let Some(offsets) = &self.offsets {
            let mut offsets = offsets.lock().unwrap_or_else(|p| p.into_inner());
            offsets.push((delivery.source().clone(), delivery.offset()));
        }
        inside.handled(seq, Some(latency(&delivery)));
        Ok(())
    }
}

/// What a batch handler saw: its calls' sizes, the longest run of one key, and any batch
/// whose messages of a key were not together, consecutive and in order.
#[derive(Default)]
pub struct BatchLog {
    sizes: Mutex<Vec<usize>>,
    longest_run: std::sync::atomic::AtomicUsize,
    broken_runs: AtomicU64,
}

impl BatchLog {
    /// Each call's number of messages, in call order.
    pub fn sizes(&self) -> Vec<usize> {
        self.sizes.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The most consecutive messages of one key seen in a call.
    pub fn longest_run(&self) -> usize {
        self.longest_run.load(Relaxed)
    }

    /// Calls whose messages of a key were not together, consecutive and in order.
    pub fn broken_runs(&self) -> u64 {
        self.broken_runs.load(Relaxed)
    }

    fn record(&self, batch: &[Delivery]) {
        self.sizes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(batch.len());
        let mut keys_seen = HashSet::new();
        let mut previous: Option<(Option<&Bytes>, Option<u64>)> = None;
        let mut run = 0;
        for d in batch {
            let (key, seq) = (d.key(), decode_seq(d.payload()));
            let continues = previous.is_some_and(|(k, _)| k == key);
            if continues {
                run += 1;
                if previous.and_then(|(_, s)| s).map(|s| s + 1) != seq {
                    self.broken_runs.fetch_add(1, Relaxed);
                }
            } else {
                run = 1;
                if !keys_seen.insert(key) {
                    self.broken_runs.fetch_add(1, Relaxed);
                }
            }
            self.longest_run.fetch_max(run, Relaxed);
            previous = Some((key, seq));
        }
    }
}

/// A batch handler running the probe handler on each message of a batch: each key's run in
/// order, stopping at its first failure (a batch handler's contract), the keys at once.
pub struct BatchProbe {
    probe: Arc<ProbeHandler>,
    log: Option<Arc<BatchLog>>,
}

impl BatchProbe {
    /// Runs `probe` on each message of a call.
    pub fn new(probe: Arc<ProbeHandler>) -> Self {
        BatchProbe { probe, log: None }
    }

    /// Records every call in `log`.
    pub fn logging(mut self, log: Arc<BatchLog>) -> Self {
        self.log = Some(log);
        self
    }
}

#[async_trait]
impl BatchHandler for BatchProbe {
    async fn handle_batch(&self, batch: Vec<Delivery>) -> Result<BatchResults, HandlerError> {
        if let Some(log) = &self.log {
            log.record(&batch);
        }
        // A key's messages are together and in order: its run.
        let handled = batch.chunk_by(|a, b| a.key() == b.key()).map(|run| async move {
            let mut results = Vec::with_capacity(run.len());
            for d in run {
                let failed_before = results
                    .last()
                    .is_some_and(|r: &Result<(), HandlerError>| r.is_err());
                results.push(match failed_before {
                    true => Err(HandlerError::transient(
                        "not attempted: an earlier message of its key failed",
                    )),
                    false => self.probe.handle(d.clone()).await,
                });
            }
            results
        });
        Ok(futures_util::future::join_all(handled)
            .await
            .into_iter()
            .flatten()
            .collect())
    }
}

/// Header a load generator may set: when the message was produced, microseconds since the
/// Unix epoch. With it, latency is produce → handled; without it, receipt → handled.
pub const SENT_AT_HEADER: &str = "probe-sent-us";

/// Microseconds since the Unix epoch now (for [`SENT_AT_HEADER`]).
pub fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// When the message was produced ([`SENT_AT_HEADER`]), if the load generator said.
fn sent_at(delivery: &Delivery) -> Option<u64> {
    delivery
        .headers()
        .get_str(SENT_AT_HEADER)
        .and_then(|s| s.parse::<u64>().ok())
}

fn latency(delivery: &Delivery) -> Duration {
    match sent_at(delivery) {
        Some(sent) => Duration::from_micros(unix_micros().saturating_sub(sent)),
        None => delivery.received().elapsed(),
    }
}

/// Wraps a dead-letter sink: once the inner sink confirmed, records the dead letter in the
/// checker and keeps a copy for assertions.
pub struct RecordingSink {
    inner: Arc<dyn DeadLetterSink>,
    checker: Arc<OrderChecker>,
    recorded: Mutex<Vec<DeadLetter>>,
}

impl RecordingSink {
    /// Records what `inner` confirmed.
    pub fn new(inner: Arc<dyn DeadLetterSink>, checker: Arc<OrderChecker>) -> Self {
        RecordingSink {
            inner,
            checker,
            recorded: Mutex::new(Vec::new()),
        }
    }

    /// Dead letters confirmed so far.
    pub fn recorded(&self) -> Vec<DeadLetter> {
        self.recorded.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[async_trait]
impl DeadLetterSink for RecordingSink {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        self.inner.publish(dead_letter).await?;
        let m = &dead_letter.message;
        let key = m.key.clone().unwrap_or_default();
        match decode_seq(&m.payload) {
            Some(seq) => self.checker.dead_lettered(&key, seq),
            None => {
                // A non-probe payload (e.g. a malformed-input test): registered by its own test.
            }
        }
        self.recorded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(dead_letter.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_round_trip_and_rejects() {
        assert_eq!(decode_seq(b"0"), Some(0));
        assert_eq!(decode_seq(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(decode_seq(b"18446744073709551616"), None);
        assert_eq!(decode_seq(b""), None);
        assert_eq!(decode_seq(b"{\"x\":1}"), None);
        assert_eq!(decode_seq(b"42      "), Some(42), "padded payloads");
        assert_eq!(decode_seq(b"   "), None);
    }

    #[test]
    fn probe_batch_registers_in_key_order() {
        let c = OrderChecker::new();
        let batch = probe_batch(&c, "k", 3, 0, 7, 16);
        assert!(batch.iter().all(|m| m.payload.len() == 16));
        let got: Vec<(String, u64)> = batch
            .iter()
            .map(|m| {
                (
                    String::from_utf8_lossy(m.key.as_ref().unwrap()).into_owned(),
                    decode_seq(&m.payload).unwrap(),
                )
            })
            .collect();
        assert_eq!(got[0], ("k0".into(), 0));
        assert_eq!(got[3], ("k0".into(), 1));
        assert_eq!(got[6], ("k0".into(), 2));
        assert_eq!(got[5], ("k2".into(), 1));
        assert_eq!(c.published(), 7);
    }
}
