//! The order checker: records what was published and what was handled or dead-lettered, per
//! key, and reports order violations, losses and duplicates separately.
//!
//! Semantics under at-least-once delivery: per key, a message may be handled only after every
//! earlier message of that key was handled (or dead-lettered) at least once. Handling one again
//! later (a replay after a crash or rebalance, restarting at or before the watermark) is a
//! duplicate, not a violation. A message published but never handled nor dead-lettered is lost.
//! Two handler calls of one key running at the same time are an overlap.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use serde::Serialize;

const STRIPES: usize = 64;
const SAMPLES: usize = 10;
/// Latency recorders: each thread records into one of its own, whose counts stay in its core's
/// cache. (Per key stripe, every record touched a cold line of one of 64 histograms.)
const RECORDERS: usize = 8;

static NEXT_RECORDER: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static RECORDER: usize = NEXT_RECORDER.fetch_add(1, Relaxed) % RECORDERS;
}

#[derive(Default)]
struct KeyState {
    published: u32,
    /// Every seq below it was finished at least once.
    frontier: u32,
}

/// Keys are tracked by a 64-bit hash, so a million keys cost ~16 bytes each in the checker
/// (a collision between two test keys is ~1e-8 likely at a million keys).
struct Stripe {
    keys: HashMap<u64, KeyState, foldhash::fast::RandomState>,
    /// Finished seqs above a key's frontier (only after violations).
    ahead: HashMap<u64, BTreeSet<u64>, foldhash::fast::RandomState>,
    /// Keys (by hash) in a handler now.
    active: HashSet<u64, foldhash::fast::RandomState>,
}

/// Latency histograms, one set per recorder.
struct Recorder {
    latency_us: Histogram<u64>,
    /// Produce → received by the engine (the broker path), first attempts only.
    to_engine_us: Histogram<u64>,
    /// Received by the engine → handler started (queued behind the key, back-pressure).
    in_engine_us: Histogram<u64>,
}

fn histogram() -> Histogram<u64> {
    // Constant, valid bounds: 1 µs to 1 h at 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("constant histogram bounds are valid")
}

fn micros(d: Duration) -> u64 {
    d.as_micros().clamp(1, u128::from(u64::MAX)) as u64
}

/// Latency percentiles in microseconds: p50, p95, p99, p99.9, and the mean (means of stages
/// add up to the mean of the whole; percentiles do not).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Percentiles {
    /// Median.
    pub p50: u64,
    /// 95th percentile.
    pub p95: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// Mean.
    pub mean: u64,
}

impl Percentiles {
    fn of(h: &Histogram<u64>) -> Self {
        Percentiles {
            p50: h.value_at_quantile(0.50),
            p95: h.value_at_quantile(0.95),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            mean: h.mean().round() as u64,
        }
    }
}

/// Counts reported by [`OrderChecker::report`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CheckReport {
    /// Messages published (expected).
    pub published: u64,
    /// Distinct messages finished at least once.
    pub finished: u64,
    /// Handler successes recorded (duplicates included).
    pub handled: u64,
    /// Dead letters recorded.
    pub dead_lettered: u64,
    /// Messages handled before an earlier message of their key was finished.
    pub order_violations: u64,
    /// Published messages never handled nor dead-lettered.
    pub lost: u64,
    /// Messages finished more than once.
    pub duplicates: u64,
    /// Times two handler calls of one key ran at once.
    pub overlaps: u64,
    /// The first few violations, described.
    pub samples: Vec<String>,
}

impl CheckReport {
    /// True when nothing was lost, nothing overtaken, no key ran twice at once.
    pub fn is_clean(&self) -> bool {
        self.order_violations == 0 && self.lost == 0 && self.overlaps == 0
    }
}

/// Shared by publishers and handlers of a test or benchmark.
pub struct OrderChecker {
    stripes: Box<[Mutex<Stripe>]>,
    recorders: Box<[Mutex<Recorder>]>,
    hasher: foldhash::fast::FixedState,
    published: AtomicU64,
    finished: AtomicU64,
    handled: AtomicU64,
    dead_lettered: AtomicU64,
    violations: AtomicU64,
    duplicates: AtomicU64,
    overlaps: AtomicU64,
    samples: Mutex<Vec<String>>,
    /// Produce → the broker's acknowledgement, per message (live loads; see `acked`).
    acked_us: Mutex<Histogram<u64>>,
    /// What [`finishing_span`](OrderChecker::finishing_span) is measured against.
    created: Instant,
    /// Microseconds after `created` when the first message finished (`u64::MAX`: none yet).
    first_finish_us: AtomicU64,
    /// Microseconds after `created` when the finished messages last caught up with the
    /// published ones (0: never).
    caught_up_us: AtomicU64,
}

impl Default for OrderChecker {
    fn default() -> Self {
        OrderChecker::new()
    }
}

/// Marks a key as being handled until dropped; see [`OrderChecker::enter`].
pub struct KeyGuard<'a> {
    checker: &'a OrderChecker,
    key: &'a [u8],
    hash: u64,
    /// False once [`handled`](Self::handled) left the key.
    inside: bool,
}

impl KeyGuard<'_> {
    /// Records the key's message `seq` as handled and leaves the key, in one step (what
    /// [`OrderChecker::handled`] and dropping the guard do in two).
    pub fn handled(mut self, seq: u64, latency: Option<Duration>) {
        self.inside = false;
        self.checker
            .record_handled(self.hash, self.key, seq, latency, true);
    }
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        if self.inside {
            self.checker.stripe_of(self.hash).active.remove(&self.hash);
        }
    }
}

impl OrderChecker {
    /// An empty checker.
    pub fn new() -> Self {
        OrderChecker::with_capacity(0)
    }

    /// An empty checker sized for about `keys` keys (saves rehashing a million-key run).
    pub fn with_capacity(keys: usize) -> Self {
        let per_stripe = keys.div_ceil(STRIPES);
        OrderChecker {
            stripes: (0..STRIPES)
                .map(|_| {
                    Mutex::new(Stripe {
                        keys: HashMap::with_capacity_and_hasher(per_stripe, Default::default()),
                        ahead: HashMap::default(),
                        active: HashSet::default(),
                    })
                })
                .collect(),
            recorders: (0..RECORDERS)
                .map(|_| {
                    Mutex::new(Recorder {
                        latency_us: histogram(),
                        to_engine_us: histogram(),
                        in_engine_us: histogram(),
                    })
                })
                .collect(),
            hasher: foldhash::fast::FixedState::with_seed(0xc4ec),
            published: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            handled: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            violations: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            overlaps: AtomicU64::new(0),
            samples: Mutex::new(Vec::new()),
            acked_us: Mutex::new(histogram()),
            created: Instant::now(),
            first_finish_us: AtomicU64::new(u64::MAX),
            caught_up_us: AtomicU64::new(0),
        }
    }

    fn stripe_of(&self, hash: u64) -> MutexGuard<'_, Stripe> {
        self.stripes[(hash as usize) % STRIPES]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// This thread's recorder.
    fn recorder(&self) -> MutexGuard<'_, Recorder> {
        self.recorders[RECORDER.with(|r| *r)]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn sample(&self, text: impl FnOnce() -> String) {
        let mut s = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() < SAMPLES {
            s.push(text());
        }
    }

    /// Registers the next message of `key`; returns its per-key sequence number.
    pub fn expect(&self, key: &Bytes) -> u64 {
        let hash = self.hasher.hash_one(&key[..]);
        let mut stripe = self.stripe_of(hash);
        let state = stripe.keys.entry(hash).or_default();
        let seq = u64::from(state.published);
        state.published += 1;
        self.published.fetch_add(1, Relaxed);
        seq
    }

    /// Marks `key` as in a handler; a second concurrent entry is an overlap.
    pub fn enter<'a>(&'a self, key: &'a [u8]) -> KeyGuard<'a> {
        let hash = self.hasher.hash_one(key);
        if !self.stripe_of(hash).active.insert(hash) {
            self.overlaps.fetch_add(1, Relaxed);
            self.sample(|| format!("key {:?} handled twice at once", String::from_utf8_lossy(key)));
        }
        KeyGuard {
            checker: self,
            key,
            hash,
            inside: true,
        }
    }

    /// Records a successful handling, with its latency if measured.
    pub fn handled(&self, key: &[u8], seq: u64, latency: Option<Duration>) {
        self.record_handled(self.hasher.hash_one(key), key, seq, latency, false);
    }

    fn record_handled(&self, hash: u64, key: &[u8], seq: u64, latency: Option<Duration>, leaving: bool) {
        self.handled.fetch_add(1, Relaxed);
        self.finish(hash, key, seq, latency, leaving);
    }

    /// Records a confirmed dead letter.
    pub fn dead_lettered(&self, key: &[u8], seq: u64) {
        self.dead_lettered.fetch_add(1, Relaxed);
        self.finish(self.hasher.hash_one(key), key, seq, None, false);
    }

    /// Records `seq` of `key` (whose hash is `hash`) as finished; `leaving` also marks the key
    /// as out of its handler.
    fn finish(&self, hash: u64, key: &[u8], seq: u64, latency: Option<Duration>, leaving: bool) {
        if let Some(l) = latency {
            self.recorder().latency_us.saturating_record(micros(l));
        }
        let mut guard = self.stripe_of(hash);
        let stripe = &mut *guard;
        if leaving {
            stripe.active.remove(&hash);
        }
        let Some(state) = stripe.keys.get_mut(&hash) else {
            drop(guard);
            self.violations.fetch_add(1, Relaxed);
            self.sample(|| {
                format!(
                    "key {:?} seq {seq} finished but never published",
                    String::from_utf8_lossy(key)
                )
            });
            return;
        };
        let ahead = stripe.ahead.get_mut(&hash);
        let frontier = u64::from(state.frontier);
        if seq < frontier || ahead.as_ref().is_some_and(|a| a.contains(&seq)) {
            self.duplicates.fetch_add(1, Relaxed);
        } else if seq == frontier {
            let mut advanced = 1;
            state.frontier += 1;
            if let Some(ahead) = ahead {
                while ahead.remove(&u64::from(state.frontier)) {
                    state.frontier += 1;
                    advanced += 1;
                }
            }
            let before = self.finished.fetch_add(advanced, Relaxed);
            // The clock is read only at the first finish and when the finishes catch up with
            // what was published (a prefilled run: once), not per message.
            if before == 0 {
                self.first_finish_us
                    .fetch_min(micros(self.created.elapsed()), Relaxed);
            }
            if before + advanced >= self.published() {
                self.caught_up_us
                    .fetch_max(micros(self.created.elapsed()), Relaxed);
            }
        } else {
            stripe.ahead.entry(hash).or_default().insert(seq);
            drop(guard);
            self.violations.fetch_add(1, Relaxed);
            self.sample(|| {
                format!(
                    "key {:?}: seq {seq} finished before seq {frontier}",
                    String::from_utf8_lossy(key)
                )
            });
        }
    }

    /// Distinct messages finished so far (ahead-of-order ones excluded until the gap fills).
    pub fn finished(&self) -> u64 {
        self.finished.load(Relaxed)
    }

    /// From the first message finished to the moment the finished ones last caught up with the
    /// published ones: the span a drain of a prefilled topic took, whatever the polling of
    /// whoever waits for it. `None` before both happened.
    pub fn finishing_span(&self) -> Option<Duration> {
        let first = self.first_finish_us.load(Relaxed);
        let last = self.caught_up_us.load(Relaxed);
        (first != u64::MAX && last >= first).then(|| Duration::from_micros(last - first))
    }

    /// Messages published so far.
    pub fn published(&self) -> u64 {
        self.published.load(Relaxed)
    }

    /// True when every published message was finished at least once.
    pub fn complete(&self) -> bool {
        self.finished() >= self.published()
    }

    /// Waits until [`complete`](Self::complete) or `limit` passes; returns whether complete.
    pub async fn wait_complete(&self, limit: Duration) -> bool {
        self.wait_for(limit, |c| c.complete()).await
    }

    /// Waits until `condition` holds or `limit` passes; returns whether it held.
    pub async fn wait_for(&self, limit: Duration, condition: impl Fn(&Self) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if condition(self) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Records where a message's time went before its handler started: produce → received by
    /// the engine, and received → handler started.
    pub fn stages(&self, to_engine: Duration, in_engine: Duration) {
        let mut recorder = self.recorder();
        recorder.to_engine_us.saturating_record(micros(to_engine));
        recorder.in_engine_us.saturating_record(micros(in_engine));
    }

    /// Records that the broker acknowledged, at `at_us` (microseconds since the Unix epoch), the
    /// messages stamped `stamps_us` (the load generator's stamp → its publisher's confirmation:
    /// the producer and the broker's append, the first part of produce → engine).
    pub fn acked(&self, at_us: u64, stamps_us: &[u64]) {
        let mut h = self.acked_us.lock().unwrap_or_else(|p| p.into_inner());
        for &stamp in stamps_us {
            let value = at_us.saturating_sub(stamp).min(h.high());
            let _ = h.record(value);
        }
    }

    /// Percentiles of [`acked`](Self::acked); `None` if nothing was recorded.
    pub fn ack_percentiles_us(&self) -> Option<Percentiles> {
        let h = self.acked_us.lock().unwrap_or_else(|p| p.into_inner());
        (!h.is_empty()).then(|| Percentiles::of(&h))
    }

    /// Latency percentiles (microseconds) over everything recorded.
    pub fn latency_percentiles_us(&self) -> Percentiles {
        self.percentiles(|s| &s.latency_us)
    }

    /// Percentiles of the two stages recorded by [`stages`](Self::stages): (produce → engine,
    /// engine → handler); `None` if none was recorded.
    pub fn stage_percentiles_us(&self) -> Option<(Percentiles, Percentiles)> {
        let to = self.percentiles(|s| &s.to_engine_us);
        let inside = self.percentiles(|s| &s.in_engine_us);
        (to != Percentiles::default()).then_some((to, inside))
    }

    fn percentiles(&self, which: impl Fn(&Recorder) -> &Histogram<u64>) -> Percentiles {
        let mut all: Option<Histogram<u64>> = None;
        for recorder in self.recorders.iter() {
            let s = recorder.lock().unwrap_or_else(|p| p.into_inner());
            match &mut all {
                None => all = Some(which(&s).clone()),
                Some(h) => {
                    let _ = h.add(which(&s));
                }
            }
        }
        match all {
            Some(h) if !h.is_empty() => Percentiles::of(&h),
            _ => Percentiles::default(),
        }
    }

    /// The counts now. `lost` counts messages not finished yet: call it once the run ended.
    pub fn report(&self) -> CheckReport {
        let mut unfinished = 0u64;
        for stripe in self.stripes.iter() {
            let s = stripe.lock().unwrap_or_else(|p| p.into_inner());
            for (hash, state) in &s.keys {
                let ahead = s.ahead.get(hash).map_or(0, |a| a.len() as u64);
                unfinished += u64::from(state.published) - u64::from(state.frontier) - ahead;
            }
        }
        CheckReport {
            published: self.published(),
            finished: self.finished(),
            handled: self.handled.load(Relaxed),
            dead_lettered: self.dead_lettered.load(Relaxed),
            order_violations: self.violations.load(Relaxed),
            lost: unfinished,
            duplicates: self.duplicates.load(Relaxed),
            overlaps: self.overlaps.load(Relaxed),
            samples: self.samples.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    #[test]
    fn in_order_is_clean_and_replays_are_duplicates() {
        let c = OrderChecker::new();
        for _ in 0..3 {
            c.expect(&k("a"));
        }
        c.handled(b"a", 0, None);
        c.handled(b"a", 1, None);
        c.handled(b"a", 0, None); // replay after a crash: allowed
        c.dead_lettered(b"a", 2);
        let r = c.report();
        assert!(r.is_clean(), "{r:?}");
        assert_eq!((r.finished, r.duplicates, r.lost), (3, 1, 0));
        assert!(c.complete());
    }

    #[test]
    fn overtaking_and_loss_are_reported() {
        let c = OrderChecker::new();
        for _ in 0..4 {
            c.expect(&k("a"));
        }
        c.handled(b"a", 1, None); // 0 not finished yet
        c.handled(b"a", 0, None);
        let r = c.report();
        assert_eq!(r.order_violations, 1);
        assert_eq!(r.lost, 2, "seqs 2 and 3 never finished");
        assert_eq!(r.finished, 2);
        assert!(!r.is_clean());
        assert!(r.samples[0].contains("seq 1 finished before seq 0"));
    }

    #[test]
    fn concurrent_handling_of_one_key_is_an_overlap() {
        let c = OrderChecker::new();
        let (a, b) = (k("a"), k("b"));
        let inside_a = c.enter(&a);
        let inside_b = c.enter(&b);
        {
            let _again = c.enter(&a);
        }
        assert_eq!(c.report().overlaps, 1);
        c.expect(&b);
        inside_b.handled(0, None);
        let _b_again = c.enter(&b);
        drop(inside_a);
        let _a_again = c.enter(&a);
        let r = c.report();
        assert_eq!(
            (r.overlaps, r.finished),
            (1, 1),
            "leaving by handled or by drop: {r:?}"
        );
    }

    #[test]
    fn stages_are_reported_only_when_recorded() {
        let checker = OrderChecker::new();
        assert_eq!(checker.stage_percentiles_us(), None);
        for ms in 1..=100u64 {
            checker.stages(Duration::from_millis(ms), Duration::from_micros(ms));
        }
        let (to, inside) = checker.stage_percentiles_us().unwrap();
        assert!((49_000..=51_000).contains(&to.p50), "{to:?}");
        assert!((98_000..=100_000).contains(&to.p99), "{to:?}");
        assert!((49..=51).contains(&inside.p50), "{inside:?}");
        assert!(
            (50_000..=51_000).contains(&to.mean),
            "the mean of 1..=100 ms: {to:?}"
        );
    }
}
