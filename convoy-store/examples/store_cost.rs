//! What a persistent idempotency store costs per message: the same drain of the memory broker
//! (messages with event ids over many keys, a no-op handler) with the in-memory store, the redb
//! store and — with `CONVOY_POSTGRES_URL` and the `postgres` feature — the PostgreSQL store,
//! alternating, five runs each; the median of each, its CPU per message (this process's user +
//! system time, the store's writer included; the database server's own CPU is not counted) and
//! the ratio to the in-memory store.
//!
//! `cargo run --release -p convoy-store --features postgres --example store_cost -- [MESSAGES] [KEYS]`
//! (defaults 500000 and 1000). Every run checks that each message ran exactly once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use convoy_core::{
    handler_fn, Delivery, Engine, EngineConfig, IdempotencyStore, MemoryIdempotencyStore, OutgoingMessage,
};
use convoy_store::{RedbIdempotencyStore, Retention};
use convoy_testkit::{MemoryBroker, MemoryDeadLetterSink, MemoryTransport};

const RUNS: usize = 5;

/// User + system CPU time of this process so far (Linux `/proc/self/stat`, in clock ticks of
/// 10 ms).
fn cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line: 11 and 12 after the name (the state
    // letter is field 3, index 0).
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    let ticks = field(11) + field(12);
    Duration::from_millis(ticks * 10)
}

struct Run {
    seconds: f64,
    cpu_per_message: Duration,
}

async fn drain(messages: u64, keys: u64, store: Arc<dyn IdempotencyStore>) -> Run {
    let broker = MemoryBroker::new();
    broker.create_topic("orders", 8);
    for n in 0..messages {
        let message = OutgoingMessage::new(format!("k{}", n % keys), "{}").event_id(format!("{n:032x}"));
        broker
            .publish("orders", message)
            .expect("the memory broker takes every message");
    }
    let ran = Arc::new(AtomicU64::new(0));
    let counted = ran.clone();
    let handler = handler_fn(move |_d: Delivery| {
        counted.fetch_add(1, Ordering::Relaxed);
        async { Ok(()) }
    });
    let engine = Engine::builder(handler)
        .config(EngineConfig::for_group("cost"))
        .idempotency_store(store)
        .dead_letter_sink(MemoryDeadLetterSink::new(&broker, "orders.dlq"))
        .build()
        .expect("a valid configuration");
    let (started, cpu_before) = (Instant::now(), cpu());
    let running = engine
        .start(&MemoryTransport::new(&broker, "cost", &["orders"]))
        .await
        .expect("the engine starts");
    while running.stats().finished() < messages {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let used = cpu().saturating_sub(cpu_before);
    let report = running.stop().await.expect("the engine stops");
    assert_eq!(ran.load(Ordering::Relaxed), messages, "every message ran once");
    assert_eq!(report.stats.duplicates, 0);
    Run {
        seconds,
        cpu_per_message: used / u32::try_from(messages).unwrap_or(u32::MAX),
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = std::env::args().skip(1);
    let messages: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(500_000);
    let keys: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1_000);
    let dir = std::env::temp_dir().join(format!(
        "convoy-store-cost-{}-{}",
        std::process::id(),
        UNIX_EPOCH.elapsed().map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let (mut memory, mut redb, mut postgres) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..RUNS {
        memory.push(drain(messages, keys, Arc::new(MemoryIdempotencyStore::new(100_000))).await);
        let path = dir.join(format!("run-{run}.redb"));
        let store = RedbIdempotencyStore::open(&path, Retention::default()).expect("the store opens");
        redb.push(drain(messages, keys, Arc::new(store)).await);
        if let Some(store) = shared_store(run).await {
            postgres.push(drain(messages, keys, store).await);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let line = |name: &str, runs: &[Run]| {
        let rate = median(runs.iter().map(|r| messages as f64 / r.seconds).collect());
        let cpu_us = median(
            runs.iter()
                .map(|r| r.cpu_per_message.as_secs_f64() * 1e6)
                .collect(),
        );
        println!("{name:<8} {rate:>12.0} msg/s  {cpu_us:>8.2} µs CPU/message");
        (rate, cpu_us)
    };
    println!("{messages} messages, {keys} keys, event ids; median of {RUNS} alternating runs");
    let (memory_rate, memory_cpu) = line("memory", &memory);
    let (redb_rate, redb_cpu) = line("redb", &redb);
    println!(
        "redb / memory: {:.2} of the throughput, {:+.2} µs CPU per message",
        redb_rate / memory_rate,
        redb_cpu - memory_cpu
    );
    if !postgres.is_empty() {
        let (rate, cpu) = line("postgres", &postgres);
        println!(
            "postgres / memory: {:.2} of the throughput, {:+.2} µs CPU per message (this process)",
            rate / memory_rate,
            cpu - memory_cpu
        );
    }
}

/// A PostgreSQL store of a group of its own per run, when `CONVOY_POSTGRES_URL` names one.
#[cfg(feature = "postgres")]
async fn shared_store(run: usize) -> Option<Arc<dyn IdempotencyStore>> {
    let url = std::env::var("CONVOY_POSTGRES_URL").ok()?;
    let group = format!("store-cost-{}-{run}", std::process::id());
    let store = convoy_store::PostgresIdempotencyStore::connect(&url, &group, Retention::default())
        .await
        .expect("the database takes the connection");
    Some(Arc::new(store))
}

#[cfg(not(feature = "postgres"))]
async fn shared_store(_run: usize) -> Option<Arc<dyn IdempotencyStore>> {
    None
}
