//! What a scenario run reports, as a table for people and one JSON object for machines.

use serde::Serialize;

use crate::checker::OrderChecker;

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
    /// Where the time went before the handler, when messages carry their produce time (live
    /// loads): produce → the broker's acknowledgement, produce → received by the engine (the
    /// broker path, acknowledgement included) and received → handler started (the engine),
    /// p50 / p99 in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stages: Option<Stages>,
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
    /// Peak resident memory of the process while the engine ran (before the baseline), MiB
    /// (broker storage included).
    pub peak_rss_mb: f64,
    /// Resident memory once the topic was filled, before the engine started, MiB: the
    /// in-process broker's storage and the checker's bookkeeping, not the engine's.
    pub rss_after_prefill_mb: f64,
    /// Most messages the engine held at once.
    pub peak_held: usize,
    /// Most bytes (keys, payloads, headers) the engine held at once, MiB.
    pub peak_held_mb: f64,
    /// The longest watermark window of any source, in offsets.
    pub peak_window: usize,
    /// The memory the back-pressure configuration allows beyond the process's own: what the
    /// engine may hold (`total_bytes_high`) plus what the broker client may prefetch
    /// (the prefetch limit derived from it), MiB.
    pub configured_bound_mb: f64,
    /// How far resident memory grew over `rss_after_prefill_mb` while consuming, MiB: to
    /// compare with `configured_bound_mb`.
    pub rss_growth_mb: f64,
    /// Whether every message finished before the limit.
    pub completed: bool,
    /// Live load: the rate asked for, msg/s (absent when unthrottled or prefilled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offered_rate_msg_s: Option<f64>,
    /// Live load: the rate the producer achieved, msg/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub produced_rate_msg_s: Option<f64>,
    /// Live load at a rate: whether both producer and consumer kept within 5 % of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_held: Option<bool>,
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
    /// Peak resident memory while the engine ran, MiB: read before the baseline drains the
    /// topic again (with bookkeeping of its own, which is not the engine's memory).
    pub peak_rss_mb: f64,
    /// The bounds the engine ran with.
    pub back_pressure: convoy_core::BackPressure,
}

/// Latency before the handler, split at the engine's receipt (milliseconds).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Stages {
    /// Produce → the broker's acknowledgement to the producer, median (the producer's batching
    /// and the broker's append; messages of a batch share its acknowledgement time).
    pub to_ack_p50_ms: f64,
    /// Produce → the broker's acknowledgement, 99th percentile.
    pub to_ack_p99_ms: f64,
    /// Produce → received by the engine, median.
    pub to_engine_p50_ms: f64,
    /// Produce → received by the engine, 99th percentile.
    pub to_engine_p99_ms: f64,
    /// Received by the engine → handler started, median.
    pub in_engine_p50_ms: f64,
    /// Received by the engine → handler started, 99th percentile.
    pub in_engine_p99_ms: f64,
}

impl ScenarioReport {
    /// The report of a run.
    pub fn new(m: Measured<'_>) -> Self {
        let check = m.checker.report();
        let ack = m.checker.ack_percentiles_us().unwrap_or_default();
        let (p50, p95, p99, p999) = m.checker.latency_percentiles_us();
        let throughput = m.messages as f64 / m.elapsed_s;
        let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
        let bound = m.back_pressure.total_bytes_high + m.back_pressure.prefetch_limit().bytes;
        let peak_rss = m.peak_rss_mb;
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
            stages: m.checker.stage_percentiles_us().map(|(to, inside)| Stages {
                to_ack_p50_ms: ack.p50 as f64 / 1000.0,
                to_ack_p99_ms: ack.p99 as f64 / 1000.0,
                to_engine_p50_ms: to.p50 as f64 / 1000.0,
                to_engine_p99_ms: to.p99 as f64 / 1000.0,
                in_engine_p50_ms: inside.p50 as f64 / 1000.0,
                in_engine_p99_ms: inside.p99 as f64 / 1000.0,
            }),
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
            peak_rss_mb: peak_rss,
            rss_after_prefill_mb: m.rss_before_mb,
            peak_held: m.stats.peak_held,
            peak_held_mb: mib(m.stats.peak_held_bytes),
            peak_window: m.stats.peak_window,
            configured_bound_mb: mib(bound),
            rss_growth_mb: (peak_rss - m.rss_before_mb).max(0.0),
            completed: m.completed,
            offered_rate_msg_s: None,
            produced_rate_msg_s: None,
            rate_held: None,
        }
    }

    /// Records a live load's target and achieved producer rate.
    pub fn set_offered(&mut self, target: Option<f64>, produced: f64) {
        self.offered_rate_msg_s = target;
        self.produced_rate_msg_s = Some(produced);
        self.rate_held = target.map(|t| produced >= 0.95 * t && self.throughput_msg_s >= 0.95 * t);
    }

    /// The report as a two-column table.
    pub fn table(&self) -> String {
        let mut rows: Vec<(&str, String)> = vec![
            ("transport", self.transport.clone()),
            ("messages / keys", format!("{} / {}", self.messages, self.keys)),
            ("elapsed", format!("{:.3} s", self.elapsed_s)),
            ("throughput", format!("{:.0} msg/s", self.throughput_msg_s)),
        ];
        if let Some(rate) = self.offered_rate_msg_s {
            rows.push(("offered rate", format!("{rate:.0} msg/s")));
        }
        if let Some(rate) = self.produced_rate_msg_s {
            rows.push(("produced rate", format!("{rate:.0} msg/s")));
        }
        if let Some(held) = self.rate_held {
            rows.push(("rate held", if held { "yes" } else { "no" }.to_owned()));
        }
        rows.extend([
            (
                "latency p50 / p95",
                format!("{:.3} ms / {:.3} ms", self.p50_ms, self.p95_ms),
            ),
            (
                "latency p99 / p99.9",
                format!("{:.3} ms / {:.3} ms", self.p99_ms, self.p999_ms),
            ),
        ]);
        if let Some(s) = self.stages {
            rows.extend([
                (
                    "produce → broker ack p50 / p99",
                    format!("{:.3} ms / {:.3} ms", s.to_ack_p50_ms, s.to_ack_p99_ms),
                ),
                (
                    "produce → engine p50 / p99",
                    format!("{:.3} ms / {:.3} ms", s.to_engine_p50_ms, s.to_engine_p99_ms),
                ),
                (
                    "engine → handler p50 / p99",
                    format!("{:.3} ms / {:.3} ms", s.in_engine_p50_ms, s.in_engine_p99_ms),
                ),
            ]);
        }
        rows.extend([
            ("retries", self.retries.to_string()),
            ("dead letters", self.dead_letters.to_string()),
            ("order violations", self.order_violations.to_string()),
            ("lost", self.lost.to_string()),
            ("duplicates", self.duplicates.to_string()),
            (
                "baseline (bare client)",
                format!("{:.0} msg/s", self.baseline_throughput_msg_s),
            ),
            ("ratio to baseline", format!("{:.3}", self.ratio_to_baseline)),
            ("peak RSS", format!("{:.1} MiB", self.peak_rss_mb)),
            (
                "RSS growth / configured bound",
                format!(
                    "{:.1} MiB / {:.1} MiB",
                    self.rss_growth_mb, self.configured_bound_mb
                ),
            ),
            (
                "peak held / window",
                format!(
                    "{} messages, {:.1} MiB / {} offsets",
                    self.peak_held, self.peak_held_mb, self.peak_window
                ),
            ),
            (
                "result",
                if self.passed() {
                    "PASS: every message finished, per-key order held".to_owned()
                } else if !self.completed {
                    "FAIL: not every message finished in time".to_owned()
                } else {
                    "FAIL: order violated or messages lost".to_owned()
                },
            ),
        ]);
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        let value_width = rows.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
        let rule = format!("+-{}-+-{}-+\n", "-".repeat(width), "-".repeat(value_width));
        let mut out = rule.clone();
        for (k, v) in rows {
            out.push_str(&format!("| {k:<width$} | {v:<value_width$} |\n"));
        }
        out.push_str(&rule);
        out
    }

    /// True when every message finished, in per-key order, none lost.
    pub fn passed(&self) -> bool {
        self.completed && self.order_violations == 0 && self.lost == 0
    }

    /// Prints exactly one JSON object (`json`), or the table.
    pub fn print(&self, json: bool) -> Result<(), String> {
        if json {
            let line = serde_json::to_string(self).map_err(|e| format!("cannot encode the report: {e}"))?;
            println!("{line}");
        } else {
            print!("{}", self.table());
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

/// Starts measuring the peak resident set size afresh from now (Linux: `clear_refs` 5); no
/// effect where unsupported.
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
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
