//! Batch handler against per-message handler, on the same data, in one run.
//!
//! ```text
//! cargo run --release -p convoy-testkit --example batch_bench -- --keys 1000 --messages 100000
//! ```
//! The handler writes to a simulated database: a pool of `--pool` connections, each call (one
//! message, or one batch) holding a connection for `--round-trip-ms` (a timer, not CPU). Both
//! handlers consume the same prefilled topic shape on a fresh memory broker; every message is
//! checked in order for its key. Prints throughput, the ratio and latency percentiles.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use clap::Parser;
use convoy_core::batch::{BatchConfig, BatchHandler, BatchResults};
use convoy_core::{Delivery, Engine, EngineConfig, Handler, HandlerError};
use convoy_memory::MemoryBroker;
use convoy_testkit::checker::OrderChecker;
use convoy_testkit::conformance::TestBed;
use convoy_testkit::memory::MemoryTarget;
use convoy_testkit::probe::{decode_seq, probe_batch};
use convoy_testkit::timer::exact_sleep;
use tokio::sync::Semaphore;

#[derive(Parser, Debug)]
#[command(about = "Batch handler against per-message handler on a simulated database (memory broker)")]
struct Args {
    /// Distinct keys.
    #[arg(long, default_value_t = 1_000)]
    keys: usize,
    /// Messages per run.
    #[arg(long, default_value_t = 100_000)]
    messages: usize,
    /// Partitions of the topic.
    #[arg(long, default_value_t = 8)]
    partitions: u32,
    /// The database's connections: calls at once.
    #[arg(long, default_value_t = 8)]
    pool: usize,
    /// What one call costs: a round trip holding a connection, in milliseconds.
    #[arg(long, default_value_t = 1.0)]
    round_trip_ms: f64,
    /// The most messages per batch.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// The most consecutive messages of one key in a batch (at most --batch; 1: one message
    /// per key, batches gathered across keys only).
    #[arg(long, default_value_t = 100)]
    per_key: usize,
    /// How long a batch waits to fill, in milliseconds.
    #[arg(long, default_value_t = 2.0)]
    max_wait_ms: f64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The simulated database.
struct Database {
    pool: Semaphore,
    round_trip: Duration,
}

impl Database {
    async fn write(&self) -> Result<(), HandlerError> {
        let _connection = self
            .pool
            .acquire()
            .await
            .map_err(|_| HandlerError::transient("the pool is closed"))?;
        exact_sleep(self.round_trip).await;
        Ok(())
    }
}

fn record(checker: &OrderChecker, delivery: &Delivery) -> Result<(), HandlerError> {
    let seq = decode_seq(delivery.payload()).ok_or_else(|| HandlerError::malformed("not a probe"))?;
    let key: &[u8] = delivery.key().map_or(&[], |k| k.as_ref());
    checker.handled(key, seq, Some(delivery.received().elapsed()));
    Ok(())
}

struct PerMessage {
    db: Arc<Database>,
    checker: Arc<OrderChecker>,
}

#[async_trait]
impl Handler for PerMessage {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        self.db.write().await?;
        record(&self.checker, &delivery)
    }
}

struct PerBatch {
    db: Arc<Database>,
    checker: Arc<OrderChecker>,
    calls: std::sync::atomic::AtomicU64,
}

#[async_trait]
impl BatchHandler for PerBatch {
    async fn handle_batch(&self, batch: Vec<Delivery>) -> Result<BatchResults, HandlerError> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.db.write().await?;
        Ok(batch.iter().map(|d| record(&self.checker, d)).collect())
    }
}

struct Run {
    rate: f64,
    p50_ms: f64,
    p99_ms: f64,
    calls: u64,
}

async fn run(args: &Args, batch: bool) -> Result<Run, String> {
    let target = MemoryTarget::on(MemoryBroker::new());
    let bed = target.memory_bed(args.partitions);
    let checker = Arc::new(OrderChecker::with_capacity(args.keys));
    let messages = probe_batch(&checker, "key-", args.keys, 0, args.messages, 0);
    bed.publisher()
        .publish_all(messages)
        .await
        .map_err(|e| format!("prefill failed: {e}"))?;
    let db = Arc::new(Database {
        pool: Semaphore::new(args.pool.max(1)),
        round_trip: Duration::from_secs_f64(args.round_trip_ms / 1000.0),
    });
    let mut config = EngineConfig::for_group(bed.group());
    config.retry.max_attempts = Some(3);
    let per_batch = Arc::new(PerBatch {
        db: db.clone(),
        checker: checker.clone(),
        calls: Default::default(),
    });
    let builder = if batch {
        let batching = BatchConfig::new(args.batch, Duration::from_secs_f64(args.max_wait_ms / 1000.0))
            .per_key(args.per_key);
        Engine::batch_builder(per_batch.clone(), batching).map_err(|e| e.to_string())?
    } else {
        Engine::builder(PerMessage {
            db: db.clone(),
            checker: checker.clone(),
        })
    };
    let engine = builder
        .config(config)
        .dead_letter_sink(bed.dead_letter_sink())
        .build()
        .map_err(|e| e.to_string())?;
    let subscription = bed.subscribe().await.map_err(|e| e.to_string())?;
    let started = Instant::now();
    let handle = engine.spawn(subscription);
    if !checker.wait_complete(Duration::from_secs(600)).await {
        return Err(format!("not every message finished: {:?}", checker.report()));
    }
    let elapsed = started.elapsed();
    handle.stop().await.map_err(|e| e.to_string())?;
    let report = checker.report();
    if !report.is_clean() || report.handled != args.messages as u64 {
        return Err(format!("order or completeness violated: {report:#?}"));
    }
    let latency = checker.latency_percentiles_us();
    Ok(Run {
        rate: args.messages as f64 / elapsed.as_secs_f64(),
        p50_ms: latency.p50 as f64 / 1000.0,
        p99_ms: latency.p99 as f64 / 1000.0,
        calls: if batch {
            per_batch.calls.load(std::sync::atomic::Ordering::Relaxed)
        } else {
            args.messages as u64
        },
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let single = run(&args, false).await?;
        let batch = run(&args, true).await?;
        Ok::<_, String>((single, batch))
    });
    let (single, batch) = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("batch_bench failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ratio = batch.rate / single.rate;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "keys": args.keys, "messages": args.messages, "pool": args.pool,
                "round_trip_ms": args.round_trip_ms, "max_batch": args.batch, "per_key": args.per_key, "max_wait_ms": args.max_wait_ms,
                "per_message": {"msg_per_s": single.rate, "p50_ms": single.p50_ms, "p99_ms": single.p99_ms, "calls": single.calls},
                "batch": {"msg_per_s": batch.rate, "p50_ms": batch.p50_ms, "p99_ms": batch.p99_ms, "calls": batch.calls,
                          "mean_batch": args.messages as f64 / batch.calls.max(1) as f64},
                "ratio": ratio,
                "order_verified": true,
            })
        );
    } else {
        println!(
            "{} messages, {} keys, pool of {} connections, {} ms per call, batches of {} (up to {} per key); order verified for every key",
            args.messages, args.keys, args.pool, args.round_trip_ms, args.batch, args.per_key
        );
        println!(
            "per-message: {:>10.0} msg/s  p50 {:>8.1} ms  p99 {:>8.1} ms  {} calls",
            single.rate, single.p50_ms, single.p99_ms, single.calls
        );
        println!(
            "batch:       {:>10.0} msg/s  p50 {:>8.1} ms  p99 {:>8.1} ms  {} calls (mean {:.1} per batch)",
            batch.rate,
            batch.p50_ms,
            batch.p99_ms,
            batch.calls,
            args.messages as f64 / batch.calls.max(1) as f64
        );
        println!("batch / per-message: {ratio:.2}×");
    }
    ExitCode::SUCCESS
}
