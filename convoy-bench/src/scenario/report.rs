//! What a scenario run reports, as a table for people and one JSON object for machines.

use serde::Serialize;

use crate::checker::OrderChecker;

/// The result, with the field names the JSON output promises.
#[derive(Clone, Debug, Serialize)]
pub struct ScenarioReport {
    /// The scenario's name (`seed`, `seed-load`, `custom`, `memory-bound`, a benchmark's own).
    pub scenario: String,
    /// Transport name.
    pub transport: String,
    /// Messages published.
    pub messages: u64,
    /// Distinct keys.
    pub keys: usize,
    /// How messages were spread over the keys: `uniform` (round-robin) or `zipf s=…`.
    pub key_spread: String,
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
    /// Mean latency, milliseconds: the stages' means add up to it.
    pub mean_ms: f64,
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
    /// CPU time (user + system, every thread of the process) per message over the span the
    /// throughput is timed on, microseconds: a drain's first finished message to its last (a
    /// live load's producer and an in-process broker included).
    pub cpu_us_per_msg: f64,
    /// The same for the bare client's drain of the same topic, from its first message to its
    /// last (0 when not run).
    pub baseline_cpu_us_per_msg: f64,
    /// cpu_us_per_msg / baseline_cpu_us_per_msg: what convoy costs per message against reading
    /// it (NaN, null in JSON, without a baseline).
    pub cpu_ratio_to_baseline: f64,
    /// Peak resident memory of the process while the engine ran (before the baseline), MiB
    /// (broker storage included).
    pub peak_rss_mb: f64,
    /// Resident memory once the topic was filled, before the engine started, MiB: the
    /// in-process broker's storage and the checker's bookkeeping, not the engine's.
    pub rss_after_prefill_mb: f64,
    /// Resident memory once every message finished, the engine still running and idle, MiB:
    /// what it keeps after a drain (against `rss_after_prefill_mb`, its start).
    pub rss_after_drain_mb: f64,
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
    /// What the engine itself may hold (`total_bytes_high`), MiB: `peak_held_mb` stays under
    /// it whatever the process's resident memory does.
    pub engine_bound_mb: f64,
    /// How far resident memory grew over `rss_after_prefill_mb` while consuming, MiB: to
    /// compare with `configured_bound_mb`.
    pub rss_growth_mb: f64,
    /// Whether every message finished before the limit.
    pub completed: bool,
    /// Threads of the process once every message finished, before the engine stopped (the
    /// broker client's, the runtime's and the in-process broker's; 0 where unknown).
    pub threads: u64,
    /// Live load: the rate asked for, msg/s (absent when unthrottled or prefilled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offered_rate_msg_s: Option<f64>,
    /// Live load: the rate the producer achieved, msg/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub produced_rate_msg_s: Option<f64>,
    /// Live load at a rate: whether both producer and consumer kept within 5 % of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_held: Option<bool>,
    /// The figures this scenario is compared with (the seed's, for `seed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<Reference>,
    /// The same scenario again at a held rate (the reference's pace), for a latency that is not
    /// queueing behind an unthrottled producer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_held_rate: Option<Box<ScenarioReport>>,
}

/// Figures measured elsewhere that a scenario reproduces, shown beside convoy's.
#[derive(Clone, Debug, Serialize)]
pub struct Reference {
    /// Whose figures, measured how.
    pub what: String,
    /// Its throughput, msg/s.
    pub throughput_msg_s: f64,
    /// Its median latency, milliseconds.
    pub p50_ms: f64,
}

/// What a run measured, turned into a [`ScenarioReport`] by [`ScenarioReport::new`].
pub struct Measured<'a> {
    /// The scenario's name.
    pub scenario: &'a str,
    /// Transport name.
    pub transport: &'a str,
    /// Messages published.
    pub messages: u64,
    /// The keys and how the messages were spread over them.
    pub spread: &'a crate::spread::KeySpread,
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
    /// The process's CPU seconds while the engine ran.
    pub cpu_s: f64,
    /// The process's CPU seconds while the baseline drained (0 when not run).
    pub baseline_cpu_s: f64,
    /// Resident memory before the engine started, MiB.
    pub rss_before_mb: f64,
    /// Peak resident memory while the engine ran, MiB: read before the baseline drains the
    /// topic again (with bookkeeping of its own, which is not the engine's memory).
    pub peak_rss_mb: f64,
    /// Resident memory once every message finished, before the engine stopped, MiB.
    pub rss_after_drain_mb: f64,
    /// Threads of the process once every message finished, before the engine stopped.
    pub threads: u64,
    /// The bounds the engine ran with.
    pub back_pressure: convoy_core::BackPressure,
}

/// The shortest span a throughput is computed from: a drain over in less than this was not
/// timed, only counted (the clock's and the scheduler's granularity would make the figure up).
pub const MIN_TIMED_S: f64 = 0.01;

/// The shortest drain a baseline's rate is computed from. A bare client's drain has no
/// start-up inside its span (the engine's throughput counts from its first finished message,
/// after joining and fetching began), so a millisecond is enough to time it; below that the
/// scheduler's granularity would make the figure up (20 messages "at 214,000 msg/s").
pub const MIN_BASELINE_S: f64 = 0.001;

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
    /// Produce → received by the engine, mean.
    pub to_engine_mean_ms: f64,
    /// Produce → received by the engine, 99th percentile.
    pub to_engine_p99_ms: f64,
    /// Received by the engine → handler started, median.
    pub in_engine_p50_ms: f64,
    /// Received by the engine → handler started, 99th percentile.
    pub in_engine_p99_ms: f64,
    /// Received by the engine → handler started, mean.
    pub in_engine_mean_ms: f64,
    /// The rest of the mean latency: the handler, and the backoff and attempts of retried
    /// messages (`mean_ms` − `to_engine_mean_ms` − `in_engine_mean_ms`).
    pub handler_and_retries_mean_ms: f64,
}

impl ScenarioReport {
    /// The report of a run.
    pub fn new(m: Measured<'_>) -> Self {
        let check = m.checker.report();
        let ack = m.checker.ack_percentiles_us().unwrap_or_default();
        let latency = m.checker.latency_percentiles_us();
        let ms = |us: u64| us as f64 / 1000.0;
        // A span too short for the clock to cover the work gives no throughput (null in JSON).
        let throughput = match m.elapsed_s >= MIN_TIMED_S {
            true => m.messages as f64 / m.elapsed_s,
            false => f64::NAN,
        };
        // The baseline's drain too (its span is messages ÷ its rate); 0 is a baseline not run.
        let baseline = match m.baseline_msg_s {
            b if b > 0.0 && m.messages as f64 / b < MIN_BASELINE_S => f64::NAN,
            b => b,
        };
        let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
        let bound = m.back_pressure.total_bytes_high + m.back_pressure.prefetch_limit().bytes;
        let peak_rss = m.peak_rss_mb;
        let per_msg = |cpu_s: f64| cpu_s * 1e6 / m.messages.max(1) as f64;
        ScenarioReport {
            scenario: m.scenario.to_owned(),
            transport: m.transport.to_owned(),
            messages: m.messages,
            keys: m.spread.keys(),
            key_spread: m.spread.describe(),
            elapsed_s: m.elapsed_s,
            throughput_msg_s: throughput,
            p50_ms: ms(latency.p50),
            p95_ms: ms(latency.p95),
            p99_ms: ms(latency.p99),
            p999_ms: ms(latency.p999),
            mean_ms: ms(latency.mean),
            stages: m.checker.stage_percentiles_us().map(|(to, inside)| Stages {
                to_ack_p50_ms: ms(ack.p50),
                to_ack_p99_ms: ms(ack.p99),
                to_engine_p50_ms: ms(to.p50),
                to_engine_p99_ms: ms(to.p99),
                to_engine_mean_ms: ms(to.mean),
                in_engine_p50_ms: ms(inside.p50),
                in_engine_p99_ms: ms(inside.p99),
                in_engine_mean_ms: ms(inside.mean),
                handler_and_retries_mean_ms: (ms(latency.mean) - ms(to.mean) - ms(inside.mean)).max(0.0),
            }),
            retries: m.stats.retries,
            dead_letters: check.dead_lettered,
            order_violations: check.order_violations + check.overlaps,
            lost: check.lost,
            duplicates: check.duplicates,
            baseline_throughput_msg_s: baseline,
            // NaN (null in JSON) unless both were timed.
            ratio_to_baseline: if baseline > 0.0 {
                throughput / baseline
            } else {
                f64::NAN
            },
            cpu_us_per_msg: per_msg(m.cpu_s),
            baseline_cpu_us_per_msg: per_msg(m.baseline_cpu_s),
            cpu_ratio_to_baseline: match m.baseline_cpu_s > 0.0 {
                true => m.cpu_s / m.baseline_cpu_s,
                false => f64::NAN,
            },
            peak_rss_mb: peak_rss,
            rss_after_prefill_mb: m.rss_before_mb,
            rss_after_drain_mb: m.rss_after_drain_mb,
            peak_held: m.stats.peak_held,
            peak_held_mb: mib(m.stats.peak_held_bytes),
            peak_window: m.stats.peak_window,
            configured_bound_mb: mib(bound),
            engine_bound_mb: mib(m.back_pressure.total_bytes_high),
            rss_growth_mb: (peak_rss - m.rss_before_mb).max(0.0),
            completed: m.completed,
            threads: m.threads,
            offered_rate_msg_s: None,
            produced_rate_msg_s: None,
            rate_held: None,
            reference: None,
            at_held_rate: None,
        }
    }

    /// Records a live load's target and achieved producer rate.
    pub fn set_offered(&mut self, target: Option<f64>, produced: f64) {
        self.offered_rate_msg_s = target;
        self.produced_rate_msg_s = Some(produced);
        self.rate_held = target.map(|t| produced >= 0.95 * t && self.throughput_msg_s >= 0.95 * t);
    }

    /// The report as a two-column table, with notes under it on how to read it.
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, String)> = Vec::new();
        let mut notes: Vec<String> = Vec::new();
        let mut row = |k: &str, v: String| rows.push((k.to_owned(), v));
        row("scenario", self.scenario.clone());
        row("transport", self.transport.clone());
        row(
            "messages / keys",
            format!("{} / {} ({})", self.messages, self.keys, self.key_spread),
        );
        row("elapsed", format!("{:.3} s", self.elapsed_s));
        row(
            "throughput",
            match self.throughput_msg_s.is_finite() {
                true => format!("{:.0} msg/s", self.throughput_msg_s),
                false => format!(
                    "not measured: {:.1} ms is too short to time (run more --messages)",
                    self.elapsed_s * 1000.0
                ),
            },
        );
        if let Some(r) = &self.reference {
            row(
                "throughput ÷ target's",
                format!(
                    "{:.2}× ({:.0} msg/s against {:.0})",
                    self.throughput_msg_s / r.throughput_msg_s,
                    self.throughput_msg_s,
                    r.throughput_msg_s
                ),
            );
        }
        self.latency_rows(&mut row, &mut notes, "");
        if let Some(held) = &self.at_held_rate {
            held.latency_rows(&mut row, &mut notes, "at a held rate: ");
            if let Some(r) = &self.reference {
                row(
                    "at a held rate: p50 ÷ target's",
                    format!(
                        "{:.2}× ({:.3} ms against {} ms)",
                        held.p50_ms / r.p50_ms,
                        held.p50_ms,
                        r.p50_ms
                    ),
                );
            }
        }
        if let Some(r) = &self.reference {
            notes.push(format!(
                "The target: {} — {:.0} msg/s, p50 {} ms.",
                r.what, r.throughput_msg_s, r.p50_ms
            ));
        }
        row("retries", self.retries.to_string());
        row("dead letters", self.dead_letters.to_string());
        row("order violations", self.order_violations.to_string());
        row("lost", self.lost.to_string());
        row("duplicates", self.duplicates.to_string());
        let baseline_run = self.baseline_throughput_msg_s != 0.0;
        row(
            "baseline (bare client)",
            match (baseline_run, self.baseline_throughput_msg_s.is_finite()) {
                (false, _) => "not run (--no-baseline)".to_owned(),
                (true, false) => "not measured: its drain took under a millisecond".to_owned(),
                (true, true) => format!("{:.0} msg/s", self.baseline_throughput_msg_s),
            },
        );
        row(
            "ratio to baseline",
            match (baseline_run, self.ratio_to_baseline.is_finite()) {
                (false, _) => "not run".to_owned(),
                (true, false) => "not measured".to_owned(),
                (true, true) => format!("{:.3}", self.ratio_to_baseline),
            },
        );
        if self.cpu_us_per_msg > 0.0 {
            row(
                "CPU per message",
                match self.cpu_ratio_to_baseline.is_finite() {
                    true => format!(
                        "{:.2} µs; bare client {:.2} µs ({:.2}×)",
                        self.cpu_us_per_msg, self.baseline_cpu_us_per_msg, self.cpu_ratio_to_baseline
                    ),
                    false => format!("{:.2} µs", self.cpu_us_per_msg),
                },
            );
        }
        self.memory_rows(&mut row, &mut notes);
        row(
            "result",
            if self.passed() {
                "PASS: every message finished, per-key order held".to_owned()
            } else if !self.completed {
                "FAIL: not every message finished in time".to_owned()
            } else {
                "FAIL: order violated or messages lost".to_owned()
            },
        );
        let width = rows.iter().map(|(k, _)| k.chars().count()).max().unwrap_or(0);
        let value_width = rows.iter().map(|(_, v)| v.chars().count()).max().unwrap_or(0);
        let rule = format!("+-{}-+-{}-+\n", "-".repeat(width), "-".repeat(value_width));
        let mut out = rule.clone();
        for (k, v) in rows {
            let (kp, vp) = (width - k.chars().count(), value_width - v.chars().count());
            out.push_str(&format!("| {k}{} | {v}{} |\n", " ".repeat(kp), " ".repeat(vp)));
        }
        out.push_str(&rule);
        for note in notes {
            out.push_str(&format!("{note}\n"));
        }
        out
    }

    /// The rate, latency and stage rows of this run, each name after `prefix`.
    fn latency_rows(&self, row: &mut impl FnMut(&str, String), notes: &mut Vec<String>, prefix: &str) {
        let name = |what: &str| format!("{prefix}{what}");
        let ms = |v: f64| format!("{v:.3} ms");
        match (self.offered_rate_msg_s, self.produced_rate_msg_s) {
            (Some(offered), produced) => {
                row(
                    &name("offered / produced / consumed"),
                    format!(
                        "{offered:.0} / {:.0} / {:.0} msg/s",
                        produced.unwrap_or(0.0),
                        self.throughput_msg_s
                    ),
                );
                let held = self.rate_held.unwrap_or(false);
                row(&name("rate held"), if held { "yes" } else { "no" }.to_owned());
                if !held {
                    notes.push(format!(
                        "{prefix}the rate was not held: the producer or the consumer stayed more than 5 % below {offered:.0} msg/s, so the latency includes queueing."
                    ));
                }
            }
            (None, Some(produced)) => {
                row(&name("produced rate"), format!("{produced:.0} msg/s"));
                notes.push(format!(
                    "{prefix}latency under an unthrottled producer is mostly queueing behind it (the median waits for half the burst); the held-rate rows show latency at a pace the consumer keeps."
                ));
            }
            (None, None) => {}
        }
        row(
            &name("latency p50 / p95"),
            format!("{} / {}", ms(self.p50_ms), ms(self.p95_ms)),
        );
        row(
            &name("latency p99 / p99.9"),
            format!("{} / {}", ms(self.p99_ms), ms(self.p999_ms)),
        );
        let Some(s) = self.stages else {
            return;
        };
        row(
            &name("latency mean = the stages' means"),
            format!(
                "{} = {:.3} + {:.3} + {:.3}",
                ms(self.mean_ms),
                s.to_engine_mean_ms,
                s.in_engine_mean_ms,
                s.handler_and_retries_mean_ms
            ),
        );
        row(
            &name("1. produce → engine p50 / p99"),
            format!("{} / {}", ms(s.to_engine_p50_ms), ms(s.to_engine_p99_ms)),
        );
        row(
            &name("   of it, produce → broker ack"),
            format!("{} / {}", ms(s.to_ack_p50_ms), ms(s.to_ack_p99_ms)),
        );
        row(
            &name("2. engine → handler p50 / p99"),
            format!("{} / {}", ms(s.in_engine_p50_ms), ms(s.in_engine_p99_ms)),
        );
        row(
            &name("3. handler and retries, mean"),
            ms(s.handler_and_retries_mean_ms),
        );
        if prefix.is_empty() {
            notes.push(
                "Latency is produce → handled. Its mean is the sum of the stages' means: 1. the broker path (first attempts), 2. waiting in the engine behind the key and back-pressure, 3. the handler with the backoff of retried messages; each stage's percentiles are its own and do not add up.".to_owned(),
            );
        }
    }

    /// Resident memory and what the engine held, against their bounds.
    fn memory_rows(&self, row: &mut impl FnMut(&str, String), notes: &mut Vec<String>) {
        row(
            "RSS at start / peak / after the drain",
            format!(
                "{:.1} / {:.1} / {:.1} MiB",
                self.rss_after_prefill_mb, self.peak_rss_mb, self.rss_after_drain_mb
            ),
        );
        if self.threads > 0 {
            row("threads", self.threads.to_string());
        }
        row(
            "RSS growth / bound (engine + prefetch)",
            format!(
                "{:.1} MiB / {:.1} MiB",
                self.rss_growth_mb, self.configured_bound_mb
            ),
        );
        row(
            "engine's peak held / its bound",
            format!(
                "{} messages, {:.1} MiB / {:.1} MiB (window {} offsets)",
                self.peak_held, self.peak_held_mb, self.engine_bound_mb, self.peak_window
            ),
        );
        if self.rss_growth_mb > self.configured_bound_mb {
            let producer = if self.produced_rate_msg_s.is_some() {
                "the producer of this benchmark, which runs in the same process, "
            } else {
                ""
            };
            notes.push(format!(
                "RSS grew {:.1} MiB past the bound: the process holds more than the engine — {}the broker client's own buffers and connections, the allocator's retained pages, the checker's bookkeeping. The engine itself held at most {:.1} MiB of its {:.1} MiB.",
                self.rss_growth_mb - self.configured_bound_mb,
                producer,
                self.peak_held_mb,
                self.engine_bound_mb
            ));
        }
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

/// CPU time this process spent so far, user and system, every thread's (those that ended too),
/// in seconds: what a benchmark charges per message, which a busy machine moves far less than
/// wall time.
pub fn cpu_seconds() -> f64 {
    #[cfg(target_os = "linux")]
    {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
    }
    #[cfg(not(target_os = "linux"))]
    0.0
}

/// Peak resident set size of this process in MiB (Linux `VmHWM`), 0 if unknown.
pub fn peak_rss_mb() -> f64 {
    proc_status_mb("VmHWM:")
}

/// Threads of this process (Linux `Threads`), 0 if unknown.
pub fn thread_count() -> u64 {
    proc_status_field("Threads:").map_or(0, |n| n as u64)
}

/// Current resident set size of this process in MiB (Linux `VmRSS`), 0 if unknown.
pub fn rss_mb() -> f64 {
    proc_status_mb("VmRSS:")
}

fn proc_status_mb(field: &str) -> f64 {
    proc_status_field(field).map_or(0.0, |kb| kb / 1024.0)
}

/// The number after `field` in `/proc/self/status`.
fn proc_status_field(field: &str) -> Option<f64> {
    std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse::<f64>().ok()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(rss_growth_mb: f64, peak_held_bytes: usize) -> ScenarioReport {
        let checker = OrderChecker::new();
        let stats = convoy_core::StatsSnapshot {
            peak_held_bytes,
            ..Default::default()
        };
        ScenarioReport::new(Measured {
            scenario: "custom",
            transport: "memory",
            messages: 1,
            spread: &crate::spread::KeySpread::uniform(1),
            elapsed_s: 1.0,
            completed: true,
            checker: &checker,
            stats,
            baseline_msg_s: 0.0,
            cpu_s: 0.5,
            baseline_cpu_s: 0.0,
            rss_before_mb: 100.0,
            peak_rss_mb: 100.0 + rss_growth_mb,
            rss_after_drain_mb: 100.0,
            threads: 0,
            back_pressure: convoy_core::BackPressure::default(),
        })
    }

    #[test]
    fn resident_memory_above_the_bound_is_explained_with_what_the_engine_held() {
        let within = report(10.0, 1 << 20).table();
        assert!(!within.contains("past the bound"), "{within}");
        let above = report(500.0, 3 << 20);
        let table = above.table();
        let bound = above.engine_bound_mb;
        assert!(
            table.contains("RSS grew")
                && table.contains(&format!(
                    "The engine itself held at most 3.0 MiB of its {bound:.1} MiB"
                )),
            "{table}"
        );
    }
}
