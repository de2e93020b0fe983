//! The benchmark scenario runner: load generator, order checker, latency histogram and a bare
//! baseline, shared by the memory benchmark (`examples/bench.rs`) and, later, `convoy bench`.
//!
//! A run pre-fills a fresh topic with `messages` probe messages over `keys` keys, starts the
//! engine with a probe handler, and measures the time until every message was finished
//! (handled or dead-lettered). The baseline then drains the same topic with a bare group
//! member and no ordering, in the same process, so the ratio survives a noisy machine.
//! Latency is measured from the engine's receipt of a message to its successful handling
//! (queueing behind its key included).

use std::sync::Arc;
use std::time::{Duration, Instant};

use convoy_core::{BackPressure, Engine, EngineConfig, Publisher, RetryPolicy};
use serde::Serialize;

use crate::checker::OrderChecker;
use crate::conformance::TestBed;
use crate::memory::{MemoryBed, MemoryTarget};
use crate::probe::{decode_seq, probe_batch, FaultPlan, Latency, ProbeHandler, RecordingSink};

/// What to run.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Messages to publish and consume.
    pub messages: u64,
    /// Distinct keys (messages are spread round-robin over them).
    pub keys: usize,
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
    /// Run the bare baseline too.
    pub baseline: bool,
    /// Give up waiting after this long.
    pub limit: Duration,
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            messages: 1_000_000,
            keys: 10_000,
            partitions: 8,
            shards: 0,
            latency: Latency::None,
            transient_rate: 0.0,
            seed: 1,
            retry: RetryPolicy::default(),
            back_pressure: BackPressure::default(),
            baseline: true,
            limit: Duration::from_secs(600),
        }
    }
}

/// The result, with the field names the JSON output promises.
#[derive(Clone, Debug, Serialize)]
pub struct ScenarioReport {
    /// Transport name.
    pub transport: String,
    /// Messages published.
    pub messages: u64,
    /// Distinct keys.
    pub keys: usize,
    /// Seconds from engine start until every message finished.
    pub elapsed_s: f64,
    /// messages / elapsed.
    pub throughput_msg_s: f64,
    /// Receipt → handled latency percentiles, milliseconds.
    pub p50_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Retries after transient failures.
    pub retries: u64,
    /// Dead letters.
    pub dead_letters: u64,
    /// Per-key order violations seen by the checker.
    pub order_violations: u64,
    /// Published but never finished.
    pub lost: u64,
    /// Finished more than once.
    pub duplicates: u64,
    /// The bare client's drain rate over the same topic.
    pub baseline_throughput_msg_s: f64,
    /// throughput / baseline.
    pub ratio_to_baseline: f64,
    /// Peak resident memory of the process, MiB (broker storage included).
    pub peak_rss_mb: f64,
    /// Resident memory once the topic was filled, before the engine started, MiB: the
    /// in-process broker's storage and the checker's bookkeeping, not the engine's.
    pub rss_after_prefill_mb: f64,
    /// Most messages the engine held at once.
    pub peak_held: usize,
    /// Whether every message finished before the limit.
    pub completed: bool,
}

/// What a run measured, turned into a [`ScenarioReport`] by [`ScenarioReport::new`].
pub struct Measured<'a> {
    /// Transport name.
    pub transport: &'a str,
    /// Messages published.
    pub messages: u64,
    /// Distinct keys.
    pub keys: usize,
    /// Seconds measured.
    pub elapsed_s: f64,
    /// Whether every message finished before the limit.
    pub completed: bool,
    /// The checker (order, losses, duplicates, latency).
    pub checker: &'a OrderChecker,
    /// The engine's final counters.
    pub stats: convoy_core::StatsSnapshot,
    /// The bare baseline's rate (0 when not run).
    pub baseline_msg_s: f64,
    /// Resident memory before the engine started, MiB.
    pub rss_before_mb: f64,
}

impl ScenarioReport {
    /// The report of a run.
    pub fn new(m: Measured<'_>) -> Self {
        let check = m.checker.report();
        let (p50, p95, p99, p999) = m.checker.latency_percentiles_us();
        let throughput = m.messages as f64 / m.elapsed_s;
        ScenarioReport {
            transport: m.transport.to_owned(),
            messages: m.messages,
            keys: m.keys,
            elapsed_s: m.elapsed_s,
            throughput_msg_s: throughput,
            p50_ms: p50 as f64 / 1000.0,
            p95_ms: p95 as f64 / 1000.0,
            p99_ms: p99 as f64 / 1000.0,
            p999_ms: p999 as f64 / 1000.0,
            retries: m.stats.retries,
            dead_letters: check.dead_lettered,
            order_violations: check.order_violations + check.overlaps,
            lost: check.lost,
            duplicates: check.duplicates,
            baseline_throughput_msg_s: m.baseline_msg_s,
            ratio_to_baseline: if m.baseline_msg_s > 0.0 {
                throughput / m.baseline_msg_s
            } else {
                0.0
            },
            peak_rss_mb: peak_rss_mb(),
            rss_after_prefill_mb: m.rss_before_mb,
            peak_held: m.stats.peak_held,
            completed: m.completed,
        }
    }

    /// True when every message finished, in per-key order, none lost.
    pub fn passed(&self) -> bool {
        self.completed && self.order_violations == 0 && self.lost == 0
    }

    /// Prints exactly one JSON object (`json`), or a short human summary.
    pub fn print(&self, json: bool) -> Result<(), String> {
        if json {
            println!(
                "{}",
                serde_json::to_string(self).map_err(|e| format!("cannot encode the report: {e}"))?
            );
        } else {
            println!(
                "{}: {} messages, {} keys in {:.3} s = {:.0} msg/s (baseline {:.0} msg/s, ratio {:.3})\n\
                 latency p50 {:.3} ms p95 {:.3} ms p99 {:.3} ms p99.9 {:.3} ms\n\
                 retries {} dead letters {} order violations {} lost {} duplicates {} peak held {} \
                 peak RSS {:.1} MiB (before the engine {:.1} MiB)",
                self.transport,
                self.messages,
                self.keys,
                self.elapsed_s,
                self.throughput_msg_s,
                self.baseline_throughput_msg_s,
                self.ratio_to_baseline,
                self.p50_ms,
                self.p95_ms,
                self.p99_ms,
                self.p999_ms,
                self.retries,
                self.dead_letters,
                self.order_violations,
                self.lost,
                self.duplicates,
                self.peak_held,
                self.peak_rss_mb,
                self.rss_after_prefill_mb,
            );
        }
        Ok(())
    }
}

/// The body of a benchmark program: runs `run` on a multi-threaded Tokio runtime, prints its
/// report (`json`: exactly one JSON object), and fails unless every message finished in order.
pub fn bench_main<F>(json: bool, run: F) -> std::process::ExitCode
where
    F: std::future::Future<Output = Result<ScenarioReport, String>>,
{
    use std::process::ExitCode;
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the Tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let report = match runtime.block_on(run) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("benchmark failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = report.print(json) {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Peak resident set size of this process in MiB (Linux `VmHWM`), 0 if unknown.
pub fn peak_rss_mb() -> f64 {
    proc_status_mb("VmHWM:")
}

/// Current resident set size of this process in MiB (Linux `VmRSS`), 0 if unknown.
pub fn rss_mb() -> f64 {
    proc_status_mb("VmRSS:")
}

fn proc_status_mb(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()))
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Publishes `messages` probes over `keys` keys, in chunks that share their buffers.
pub async fn prefill(
    publisher: &dyn Publisher,
    checker: &OrderChecker,
    messages: u64,
    keys: usize,
) -> Result<(), convoy_core::TransportError> {
    // Small chunks: messages sharing a buffer share its reference count, which parallel
    // shards would otherwise contend on (a real transport gives each message its own buffer).
    const CHUNK: usize = 256;
    let mut from = 0usize;
    while (from as u64) < messages {
        let count = CHUNK.min(messages as usize - from);
        for m in probe_batch(checker, "key-", keys, from, count) {
            publisher.publish(m).await?;
        }
        from += count;
    }
    Ok(())
}

/// Runs the scenario on a fresh memory broker.
pub async fn run_memory(scenario: &Scenario) -> Result<ScenarioReport, String> {
    let target = MemoryTarget::on(crate::broker::MemoryBroker::new());
    let bed = target.memory_bed(scenario.partitions);
    run_on_memory_bed(&bed, scenario).await
}

async fn run_on_memory_bed(bed: &MemoryBed, scenario: &Scenario) -> Result<ScenarioReport, String> {
    let checker = Arc::new(OrderChecker::with_capacity(scenario.keys));
    prefill(
        bed.publisher().as_ref(),
        &checker,
        scenario.messages,
        scenario.keys,
    )
    .await
    .map_err(|e| format!("prefill failed: {e}"))?;
    let rss_after_prefill = rss_mb();
    let plan = FaultPlan {
        seed: scenario.seed,
        transient_rate: scenario.transient_rate,
        transient_attempts: 1,
        latency: scenario.latency,
        ..FaultPlan::default()
    };
    let handler = ProbeHandler::with_faults(checker.clone(), plan);
    let sink = RecordingSink::new(bed.dead_letter_sink(), checker.clone());
    let config = EngineConfig {
        group: bed.group().to_owned(),
        shards: scenario.shards,
        retry: scenario.retry,
        back_pressure: scenario.back_pressure,
        ..EngineConfig::default()
    };
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(sink)
        .build()
        .map_err(|e| e.to_string())?;
    let subscription = bed
        .subscribe()
        .await
        .map_err(|e| format!("subscribe failed: {e}"))?;
    let started = Instant::now();
    let handle = engine.spawn(subscription);
    let completed = checker.wait_complete(scenario.limit).await;
    let elapsed = started.elapsed().as_secs_f64();
    let report = handle.stop().await.map_err(|e| e.to_string())?;
    let baseline = if scenario.baseline {
        let started = Instant::now();
        let mut sum = 0u64;
        let seen = bed
            .bare_drain(scenario.messages, scenario.limit, |m| {
                sum = sum.wrapping_add(decode_seq(&m.payload).unwrap_or(0));
            })
            .await;
        std::hint::black_box(sum);
        seen as f64 / started.elapsed().as_secs_f64()
    } else {
        0.0
    };
    Ok(ScenarioReport::new(Measured {
        transport: "memory",
        messages: scenario.messages,
        keys: scenario.keys,
        elapsed_s: elapsed,
        completed,
        checker: &checker,
        stats: report.stats,
        baseline_msg_s: baseline,
        rss_before_mb: rss_after_prefill,
    }))
}
