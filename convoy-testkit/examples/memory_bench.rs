//! Benchmark of the convoy engine on the in-memory broker.
//!
//! ```text
//! cargo run --release -p convoy-testkit --example memory_bench -- --keys 10000 --messages 1000000 --json
//! ```
//! Prints one JSON object per run with `--json`, a short summary otherwise.

use std::process::ExitCode;

use clap::Parser;
use convoy_testkit::memory::run_memory;
use convoy_testkit::probe::Latency;
use convoy_testkit::scenario::{bench_main, seed_retry, Scenario};

#[derive(Parser, Debug)]
#[command(about = "Benchmark the convoy engine on the in-memory broker (with a bare-drain baseline)")]
struct Args {
    /// Distinct keys.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    /// Messages to publish and consume.
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Partitions of the topic.
    #[arg(long, default_value_t = 8)]
    partitions: u32,
    /// Engine shards (0: the engine default, four per CPU).
    #[arg(long, default_value_t = 0)]
    shards: usize,
    /// Handler latency in milliseconds (an async timer that ends on time, not CPU work).
    #[arg(long, default_value_t = 0.0)]
    work_ms: f64,
    /// Wait on tokio's timer instead (rounds each wait up to its next 1 ms tick).
    #[arg(long)]
    tokio_timer: bool,
    /// Fraction of messages that fail transiently once (retried in their lane).
    #[arg(long, default_value_t = 0.0)]
    transient_rate: f64,
    /// Skip the bare baseline.
    #[arg(long)]
    no_baseline: bool,
    /// Print exactly one JSON object.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let scenario = Scenario {
        messages: args.messages,
        keys: args.keys.max(1),
        partitions: args.partitions.max(1),
        shards: args.shards,
        latency: Latency::work(args.work_ms, args.tokio_timer),
        transient_rate: args.transient_rate,
        retry: seed_retry(),
        baseline: !args.no_baseline,
        ..Scenario::default()
    };
    bench_main(args.json, run_memory(&scenario, &|_, _| {}))
}
