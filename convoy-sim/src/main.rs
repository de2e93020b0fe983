//! `convoy-sim`: runs seeds of the simulation. `--seed N` replays one (with its trace);
//! `--seeds N` hunts through many and reports seeds per second. Exits 1 when a seed fails.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use clap::Parser;
use convoy_sim::{run, Outcome};

#[derive(Parser)]
#[command(
    about = "Deterministic simulation of convoy: several engines, one thread, a virtual clock, every event and fault from a seed"
)]
struct Args {
    /// Replay this one seed, printing its plan, trace and violations (and checking that a second
    /// run gives the same trace).
    #[arg(long, conflicts_with = "seeds")]
    seed: Option<u64>,
    /// Run this many seeds (from --from on).
    #[arg(long)]
    seeds: Option<u64>,
    /// The first seed of --seeds.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Threads running seeds (each seed runs on one thread, deterministically).
    #[arg(long)]
    jobs: Option<usize>,
    /// Run every this-many-th seed twice and compare the traces' hashes (0: never).
    #[arg(long, default_value_t = 50)]
    determinism_every: u64,
    /// With --seed: print the whole trace (default: its last 60 lines).
    #[arg(long)]
    full_trace: bool,
    /// A seed taking longer than this many seconds of real time is reported as hung (a busy
    /// loop under a paused clock never lets virtual time move).
    #[arg(long, default_value_t = 60)]
    hang_after_s: u64,
    /// With --seeds: stop at the first seed that fails (a long hunt for one planted fault).
    #[arg(long)]
    first: bool,
}

fn main() {
    let args = Args::parse();
    let code = match (args.seed, args.seeds) {
        (Some(seed), _) => replay(seed, &args),
        (None, Some(count)) => hunt(args.from, count, &args),
        (None, None) => hunt(0, 1000, &args),
    };
    std::process::exit(code);
}

/// Runs `seed` on a thread of its own; `None` if it did not end within the hang limit.
fn run_guarded(seed: u64, keep_trace: bool, hang_after: Duration) -> Option<Outcome> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(format!("seed-{seed}"))
        .spawn(move || {
            let _ = tx.send(run(seed, keep_trace));
        })
        .ok()?;
    rx.recv_timeout(hang_after).ok()
}

fn replay(seed: u64, args: &Args) -> i32 {
    let hang_after = Duration::from_secs(args.hang_after_s);
    let Some(outcome) = run_guarded(seed, true, hang_after) else {
        eprintln!("seed {seed} hung: no end within {hang_after:?} of real time (a busy loop, or a task that never lets the virtual clock move)");
        return 1;
    };
    let shown = if args.full_trace { outcome.trace.len() } else { 60 };
    let skipped = outcome.trace.len().saturating_sub(shown);
    if skipped > 0 {
        println!("… {skipped} earlier events (--full-trace shows them)");
    }
    for line in &outcome.trace[skipped..] {
        println!("{line}");
    }
    println!("\n{}", outcome.plan);
    println!(
        "{} handler calls, trace hash {:016x}",
        outcome.calls, outcome.hash
    );
    let mut code = 0;
    match run_guarded(seed, false, hang_after) {
        Some(again) if again.hash == outcome.hash => {
            println!("deterministic: a second run gave the same trace")
        }
        Some(again) => {
            println!(
                "NOT DETERMINISTIC: a second run gave trace hash {:016x}",
                again.hash
            );
            code = 1;
        }
        None => {
            println!("NOT DETERMINISTIC: a second run hung");
            code = 1;
        }
    }
    if outcome.passed() {
        println!("seed {seed}: passed");
    } else {
        println!("seed {seed}: {} violations", outcome.violations.len());
        for v in &outcome.violations {
            println!("  - {v}");
        }
        code = 1;
    }
    code
}

fn hunt(from: u64, count: u64, args: &Args) -> i32 {
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let hang_after = Duration::from_secs(args.hang_after_s);
    let next = Arc::new(AtomicU64::new(from));
    let failed = Arc::new(AtomicUsize::new(0));
    let calls = Arc::new(AtomicU64::new(0));
    let end = from.saturating_add(count);
    let started = Instant::now();
    let determinism_every = args.determinism_every;
    let first = args.first;
    let workers: Vec<_> = (0..jobs)
        .map(|_| {
            let (next, failed, calls) = (next.clone(), failed.clone(), calls.clone());
            std::thread::spawn(move || loop {
                let seed = next.fetch_add(1, SeqCst);
                if seed >= end || (first && failed.load(SeqCst) > 0) {
                    return;
                }
                let Some(outcome) = run_guarded(seed, false, hang_after) else {
                    eprintln!("seed {seed} HUNG (no end within {hang_after:?} of real time): scripts/sim --seed {seed}");
                    failed.fetch_add(1, SeqCst);
                    continue;
                };
                calls.fetch_add(outcome.calls, SeqCst);
                if !outcome.passed() {
                    failed.fetch_add(1, SeqCst);
                    eprintln!("seed {seed} FAILED: {}", outcome.violations[0]);
                    eprintln!("  replay it: scripts/sim --seed {seed}");
                    continue;
                }
                if determinism_every > 0 && seed % determinism_every == 0 {
                    match run_guarded(seed, false, hang_after) {
                        Some(again) if again.hash == outcome.hash => {}
                        _ => {
                            failed.fetch_add(1, SeqCst);
                            eprintln!("seed {seed} NOT DETERMINISTIC: a second run differed: scripts/sim --seed {seed}");
                        }
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.join();
    }
    let elapsed = started.elapsed();
    let failed = failed.load(SeqCst);
    let count = next.load(SeqCst).min(end) - from;
    let end = from + count;
    println!(
        "{count} seeds ({from}..{end}) in {:.1} s: {:.1} seeds/s on {jobs} threads, {} handler calls; {failed} failed",
        elapsed.as_secs_f64(),
        count as f64 / elapsed.as_secs_f64().max(1e-9),
        calls.load(SeqCst)
    );
    i32::from(failed > 0)
}
