//! How long a "1 ms" async wait really lasts, on tokio's timer and on the testkit's exact timer,
//! with no convoy involved: `--tasks` tasks each wait `--waits` times in a row, as the keys of
//! the `work` benchmark do.
//!
//! ```text
//! cargo run --release -p convoy-testkit --example timer_precision -- --tasks 1000 --waits 200
//! ```
//! The ceiling it prints is tasks ÷ mean wait: the most messages per second that many serial
//! keys could finish with that timer, whatever the engine.

use std::time::{Duration, Instant};

use clap::Parser;
use convoy_testkit::timer::exact_sleep;
use hdrhistogram::Histogram;

#[derive(Parser, Debug)]
#[command(about = "Measure how long async waits last on tokio's timer and on the exact timer")]
struct Args {
    /// Concurrent tasks (keys).
    #[arg(long, default_value_t = 1_000)]
    tasks: u64,
    /// Waits per task, one after another.
    #[arg(long, default_value_t = 200)]
    waits: u64,
    /// Length of each wait in microseconds.
    #[arg(long, default_value_t = 1_000)]
    micros: u64,
}

#[derive(Clone, Copy)]
enum Clock {
    Tokio,
    Exact,
}

/// Microseconds, 1 µs to 60 s.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

async fn measure(args: &Args, clock: Clock) -> Histogram<u64> {
    let wait = Duration::from_micros(args.micros);
    let waits = args.waits;
    let tasks: Vec<_> = (0..args.tasks)
        .map(|_| {
            tokio::spawn(async move {
                let mut lasted = histogram();
                for _ in 0..waits {
                    let started = Instant::now();
                    match clock {
                        Clock::Tokio => tokio::time::sleep(wait).await,
                        Clock::Exact => exact_sleep(wait).await,
                    }
                    lasted.saturating_record(started.elapsed().as_micros() as u64);
                }
                lasted
            })
        })
        .collect();
    let mut all = histogram();
    for task in tasks {
        if let Ok(lasted) = task.await {
            let _ = all.add(lasted);
        }
    }
    all
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    for (name, clock) in [("tokio", Clock::Tokio), ("exact", Clock::Exact)] {
        let lasted = measure(&args, clock).await;
        let mean_ms = lasted.mean() / 1000.0;
        println!(
            "{name}: {} waits of {} µs: mean {mean_ms:.3} ms, p50 {:.3} ms, p99 {:.3} ms; \
             ceiling for {} serial keys: {:.0} msg/s",
            lasted.len(),
            args.micros,
            lasted.value_at_quantile(0.5) as f64 / 1000.0,
            lasted.value_at_quantile(0.99) as f64 / 1000.0,
            args.tasks,
            args.tasks as f64 / (mean_ms / 1000.0),
        );
    }
}
