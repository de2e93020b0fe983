//! The benchmark scenario runner shared by the benchmark programs and `convoy bench`: load
//! generator, order checker, latency histogram and a bare-client baseline, over any
//! [`ScenarioBed`] (a fresh topic, group and dead-letter topic on some broker).
//!
//! Three loads:
//! - [`Load::Prefill`]: the topic is filled first, then the engine drains it; the clock runs
//!   from the first finished message to the last, latency is receipt → handled;
//! - [`Load::Prefilled`]: as `Prefill`, on a topic another process already filled with the
//!   same messages (`convoy produce --probes`), so that other consumers can drain it too;
//! - [`Load::Live`]: the engine runs first and a producer offers messages while it consumes,
//!   as fast as it can or at a fixed rate; latency is produce → handled.
//!
//! After the engine's run the baseline drains the same topic with a bare client in the same
//! process, so the ratio survives a noisy machine.
//!
//! For memory bounds a scenario may pad payloads and block one key (its handler waits until
//! every message of the other sources finished): the report then shows the peak resident
//! memory of the consuming phase against the bound the back-pressure configuration implies.

mod load;
mod report;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use convoy_core::transport::{PrefetchLimit, Subscription};
use convoy_core::{
    BackPressure, DeadLetterSink, Engine, EngineConfig, Publisher, RetryPolicy, TransportError,
};

pub use load::prefill;
pub use report::{
    bench_main, cpu_seconds, peak_rss_mb, reset_peak_rss, rss_mb, Measured, Reference, ScenarioReport,
};

use crate::checker::OrderChecker;
use crate::probe::{FaultPlan, Latency, ProbeHandler, RecordingSink};
use crate::spread::KeySpread;

/// How messages are offered.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    /// Fill the topic, then drain it.
    Prefill,
    /// Drain a topic that already holds the messages [`prefill`] publishes (filled by another
    /// process): they are registered with the checker, nothing is published.
    Prefilled,
    /// Produce while the engine consumes; `rate` in messages per second, `None` for as fast as
    /// the producer goes.
    Live {
        /// Offered rate.
        rate: Option<f64>,
    },
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Its name in reports.
    pub name: String,
    /// Messages to publish and consume.
    pub messages: u64,
    /// Distinct keys (messages are spread round-robin over them, or by [`Scenario::zipf`]).
    pub keys: usize,
    /// Spread messages over the keys Zipf-skewed with this exponent (key 0 the hottest) instead
    /// of round-robin.
    pub zipf: Option<f64>,
    /// Sources (partitions) of the topic.
    pub partitions: u32,
    /// Engine shards (0: the engine default, four per CPU).
    pub shards: usize,
    /// Handler latency.
    pub latency: Latency,
    /// Fraction of messages failing transiently once.
    pub transient_rate: f64,
    /// Seed for the fault choices.
    pub seed: u64,
    /// Retry policy for the transient failures.
    pub retry: RetryPolicy,
    /// Back-pressure bounds.
    pub back_pressure: BackPressure,
    /// How messages are offered.
    pub load: Load,
    /// Run the bare baseline too.
    pub baseline: bool,
    /// Pad each payload to this many bytes (0: the bare sequence number).
    pub payload_bytes: usize,
    /// Block one key (`key-0`): its handler waits until every message outside its source
    /// finished, so that source's watermark window fills behind a stuck head.
    pub hold_one_key: bool,
    /// Give up waiting after this long.
    pub limit: Duration,
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            name: "custom".to_owned(),
            messages: 1_000_000,
            keys: 10_000,
            zipf: None,
            partitions: 8,
            shards: 0,
            latency: Latency::None,
            transient_rate: 0.0,
            seed: 1,
            retry: RetryPolicy::default(),
            back_pressure: BackPressure::default(),
            load: Load::Prefill,
            baseline: true,
            payload_bytes: 0,
            hold_one_key: false,
            limit: Duration::from_secs(600),
        }
    }
}

/// A fresh topic (with [`Scenario::partitions`] partitions), consumer group and dead-letter
/// topic on some broker, with a bare client for the baseline.
#[async_trait]
pub trait ScenarioBed: Send + Sync {
    /// The transport's name for reports (`memory`, `kafka`).
    fn transport(&self) -> &str;
    /// The consumer group the engine joins.
    fn group(&self) -> &str;
    /// Partitions of the topic.
    fn partitions(&self) -> u32;
    /// Publishes to the topic.
    fn publisher(&self) -> Arc<dyn Publisher>;
    /// Dead letters go here.
    fn dead_letter_sink(&self) -> Arc<dyn DeadLetterSink>;
    /// Joins the group, the broker client prefetching at most `limit`.
    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError>;
    /// Drains the topic with a bare client of the broker (its own group, no engine, no
    /// ordering), calling `check` with each message's key and payload, and returns its rate in
    /// messages per second.
    async fn bare_drain(
        &self,
        expected: u64,
        limit: Duration,
        check: RecordCheck,
    ) -> Result<f64, TransportError>;
}

/// What a baseline does with each message it reads: the benchmark's own bookkeeping
/// ([`baseline_check`]), so both sides of a ratio pay for it.
pub type RecordCheck = Arc<dyn Fn(&[u8], &[u8]) + Send + Sync>;

/// The baseline's share of the benchmark's work per message, what the engine's probe handler
/// does for each message it handles: decode the probe's sequence number and record it, with a
/// latency, in an order checker of its own (the same expectations: the baseline drains the same
/// topic). Without it the checker's locks and histogram were charged to convoy alone.
pub fn baseline_check(messages: u64, spread: &KeySpread) -> (RecordCheck, Arc<OrderChecker>) {
    let checker = Arc::new(OrderChecker::with_capacity(spread.keys()));
    load::register_prefilled(&checker, messages, spread);
    let check = {
        let checker = checker.clone();
        Arc::new(move |key: &[u8], payload: &[u8]| {
            let received = Instant::now();
            if let Some(seq) = crate::probe::decode_seq(payload) {
                checker.handled(key, seq, Some(received.elapsed()));
            }
        })
    };
    (check, checker)
}

/// The process's CPU seconds from a baseline's first message to its `expected`-th, the span its
/// rate is timed on (the client's start and group join left out, as the engine's are).
struct CpuSpan {
    seen: AtomicU64,
    /// f64 bits of the CPU clock at the first and at the last message.
    first: AtomicU64,
    last: AtomicU64,
}

impl CpuSpan {
    /// The CPU seconds between the first and the last message (0 if the drain did not end).
    fn seconds(&self) -> f64 {
        let (first, last) = (self.first.load(Relaxed), self.last.load(Relaxed));
        if last == 0 {
            0.0
        } else {
            f64::from_bits(last) - f64::from_bits(first)
        }
    }
}

/// Wraps `check` to measure [`CpuSpan`] over `expected` messages.
fn cpu_span(check: RecordCheck, expected: u64) -> (RecordCheck, Arc<CpuSpan>) {
    let span = Arc::new(CpuSpan {
        seen: AtomicU64::new(0),
        first: AtomicU64::new(0),
        last: AtomicU64::new(0),
    });
    let wrapped = {
        let span = span.clone();
        Arc::new(move |key: &[u8], payload: &[u8]| {
            let n = span.seen.fetch_add(1, Relaxed) + 1;
            if n == 1 {
                span.first.store(cpu_seconds().to_bits(), Relaxed);
            }
            check(key, payload);
            if n == expected {
                span.last.store(cpu_seconds().to_bits(), Relaxed);
            }
        })
    };
    (wrapped, span)
}

/// What the seed measured on its own scenario (50,000 messages, 10 keys, 10 % failing
/// transiently once, a live producer): convoy's `seed` figures are shown beside these.
pub fn seed_reference() -> Reference {
    Reference {
        what: "the first implementation of this scenario, produce → handled, its producer at its own pace"
            .to_owned(),
        throughput_msg_s: 14_027.0,
        p50_ms: 11.7,
    }
}

/// The rate the `seed` scenario's latency is measured at: the seed's own pace (14,027 msg/s),
/// rounded down — at an unthrottled producer the median is queueing, not latency.
pub const SEED_HELD_RATE: f64 = 14_000.0;

/// The seed's retry policy: backoff 1 ms, factor 2, cap 100 ms, full jitter.
pub fn seed_retry() -> RetryPolicy {
    RetryPolicy::with_backoff(convoy_core::Backoff::new(
        Duration::from_millis(1),
        2.0,
        Duration::from_millis(100),
        convoy_core::Jitter::Full,
    ))
}

/// The `seed-load` scenario's shape, the same for every bench that offers it: a live producer
/// offering `rate` msg/s for `duration_s` seconds over 1,000 keys, nothing failing. Returns the
/// message count, the keys and the load; both figures must be positive.
pub fn seed_load(rate: f64, duration_s: f64) -> Result<(u64, usize, Load), String> {
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if !positive(rate) || !positive(duration_s) {
        return Err("seed-load needs a positive --rate and --duration".into());
    }
    let messages = (rate * duration_s).round().max(1.0) as u64;
    Ok((messages, 1_000, Load::Live { rate: Some(rate) }))
}

/// Finished and total message counts while a run goes on.
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Send + Sync);

/// Runs `scenario` on `bed`, calling `progress(finished, total)` every 100 ms.
pub async fn run(
    bed: &dyn ScenarioBed,
    scenario: &Scenario,
    progress: Progress<'_>,
) -> Result<ScenarioReport, String> {
    let spread = KeySpread::new(scenario.keys, scenario.zipf).map_err(|e| e.to_string())?;
    let checker = Arc::new(OrderChecker::with_capacity(scenario.keys));
    match scenario.load {
        Load::Prefill => prefill(
            bed.publisher().as_ref(),
            &checker,
            scenario.messages,
            &spread,
            scenario.payload_bytes,
        )
        .await
        .map_err(|e| format!("filling the topic failed: {e}"))?,
        Load::Prefilled => load::register_prefilled(&checker, scenario.messages, &spread),
        Load::Live { .. } => {}
    }
    let rss_before = rss_mb();
    // From here on the peak measures consumption, not what filling the topic took.
    reset_peak_rss();
    let mut plan = FaultPlan {
        seed: scenario.seed,
        transient_rate: scenario.transient_rate,
        transient_attempts: 1,
        latency: scenario.latency,
        ..FaultPlan::default()
    };
    let held = scenario
        .hold_one_key
        .then(|| hold_one_key(&mut plan, checker.clone(), scenario, &spread, bed.partitions()));
    let handler = ProbeHandler::with_faults(checker.clone(), plan).without_in_flight_tracking();
    let mut config = EngineConfig::for_group(bed.group());
    config.shards = scenario.shards;
    config.retry = scenario.retry;
    config.back_pressure = scenario.back_pressure;
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
        .build()
        .map_err(|e| e.to_string())?;
    let subscription = bed
        .subscribe_with(scenario.back_pressure.prefetch_limit())
        .await
        .map_err(|e| format!("subscribing failed: {e}"))?;
    let running = engine.spawn(subscription);
    let joined = Instant::now() + Duration::from_secs(60);
    // The clock measures consumption, not the group join (the baseline's clock likewise starts
    // at its first message).
    let all_assigned = || running.stats().sources >= bed.partitions() as usize;
    let producer = match scenario.load {
        Load::Prefill | Load::Prefilled => {
            while checker.finished() == 0 && Instant::now() < joined {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            None
        }
        Load::Live { rate } => {
            while !all_assigned() && Instant::now() < joined {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Some(tokio::spawn(load::live(
                bed.publisher(),
                checker.clone(),
                scenario.messages,
                spread.clone(),
                rate,
                scenario.payload_bytes,
            )))
        }
    };
    let started = Instant::now();
    // The process's CPU over the span the throughput is timed on (a drain: from its first
    // finished message, to within the wait loop's 200 µs; a live load: from the producer's
    // start, its CPU included), to the last.
    let cpu_started = cpu_seconds();
    let completed = wait_with_progress(&checker, scenario, progress).await;
    let cpu_s = cpu_seconds() - cpu_started;
    let rss_after_drain = rss_mb();
    let elapsed = match (&producer, checker.finishing_span()) {
        // A drain is timed by the messages themselves, from the first finished to the last:
        // waiting for the first one above can miss the start of a short drain.
        (None, Some(span)) if completed => span.as_secs_f64(),
        _ => started.elapsed().as_secs_f64(),
    };
    let threads = report::thread_count();
    let engine_report = running.stop().await.map_err(|e| e.to_string())?;
    // The engine's peak: the baseline below keeps per-key bookkeeping of its own (a million
    // distinct keys' worth in the largest scenario), which is not the engine's memory.
    let peak_rss = peak_rss_mb();
    if let Some(releaser) = held {
        releaser.abort();
    }
    let produced_rate = match producer {
        Some(task) => Some(
            task.await
                .map_err(|e| format!("the producer failed: {e}"))?
                .map_err(|e| format!("producing failed: {e}"))?,
        ),
        None => None,
    };
    let (baseline, baseline_cpu_s) = if scenario.baseline {
        let (check, _) = baseline_check(scenario.messages, &spread);
        let (check, cpu) = cpu_span(check, scenario.messages);
        let rate = bed
            .bare_drain(scenario.messages, scenario.limit, check)
            .await
            .map_err(|e| format!("the baseline failed: {e}"))?;
        (rate, cpu.seconds())
    } else {
        (0.0, 0.0)
    };
    let mut report = ScenarioReport::new(Measured {
        scenario: &scenario.name,
        transport: bed.transport(),
        messages: scenario.messages,
        spread: &spread,
        elapsed_s: elapsed,
        completed,
        checker: &checker,
        stats: engine_report.stats,
        baseline_msg_s: baseline,
        cpu_s,
        baseline_cpu_s,
        rss_before_mb: rss_before,
        peak_rss_mb: peak_rss,
        rss_after_drain_mb: rss_after_drain,
        threads,
        back_pressure: scenario.back_pressure,
    });
    if let Load::Live { rate } = scenario.load {
        report.set_offered(rate, produced_rate.unwrap_or(0.0));
    }
    Ok(report)
}

/// Holds `key-0` in `plan` and releases it once every message outside its source finished;
/// returns the task that watches for that.
fn hold_one_key(
    plan: &mut FaultPlan,
    checker: Arc<OrderChecker>,
    scenario: &Scenario,
    spread: &KeySpread,
    partitions: u32,
) -> tokio::task::JoinHandle<()> {
    let key = crate::probe::probe_key("key-", 0);
    let partition = convoy_core::partitioner::partition_for_key(&key, partitions);
    let same_source = spread
        .counts(scenario.messages)
        .into_iter()
        .enumerate()
        .filter(|&(k, _)| {
            convoy_core::partitioner::partition_for_key(&crate::probe::probe_key("key-", k), partitions)
                == partition
        })
        .map(|(_, n)| n)
        .sum::<u64>();
    let latch = plan.hold_key(key);
    let elsewhere = scenario.messages - same_source;
    tokio::spawn(async move {
        checker
            .wait_for(Duration::from_secs(3600), |c| c.finished() >= elsewhere)
            .await;
        latch.release();
    })
}

async fn wait_with_progress(checker: &OrderChecker, scenario: &Scenario, progress: Progress<'_>) -> bool {
    // A live producer registers messages as it goes: complete means all of them, finished.
    let done = checker.wait_for(scenario.limit, |c| {
        c.published() >= scenario.messages && c.complete()
    });
    tokio::pin!(done);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            completed = &mut done => {
                progress(checker.finished(), scenario.messages);
                return completed;
            }
            _ = tick.tick() => progress(checker.finished(), scenario.messages),
        }
    }
}
