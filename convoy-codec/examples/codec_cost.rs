//! What a codec costs per message, both ways:
//! - **decode, in the engine:** the same drain of the memory broker (1,000 keys, a handler that
//!   sums a field) with each codec's payloads, against the baseline of a handler that reads the
//!   raw bytes; five alternating runs, the median CPU per message (process user + system);
//! - **encode:** a tight loop encoding the same value, the median of five runs, in ns.
//!
//! `cargo run --release -p convoy-codec --all-features --example codec_cost -- [MESSAGES]`
//! (default 300000). The Confluent codecs need `CONVOY_SCHEMA_REGISTRY` (a registry they
//! register their schemas in; every payload after the first reads its schema from the cache).
//! Every run checks each message was decoded and handled once.

use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use convoy_codec::{
    Avro, ConfluentAvro, ConfluentJson, ConfluentProtobuf, Decoder, Encoder, Json, Protobuf, SchemaRegistry,
};
use convoy_core::{
    handler_fn, typed_with, Delivery, Engine, EngineConfig, Handler, HandlerError, OutgoingMessage,
};
use convoy_testkit::{MemoryBroker, MemoryDeadLetterSink, MemoryTransport};
use serde::{Deserialize, Serialize};

const RUNS: usize = 5;
const KEYS: u64 = 1_000;

const AVRO: &str = r#"{"type":"record","name":"Entry","fields":[{"name":"account","type":"string"},
    {"name":"seq","type":"long"},{"name":"cents","type":"long"},{"name":"memo","type":"string"}]}"#;
const PROTO: &str = "syntax = \"proto3\";\nmessage Entry {\n  string account = 1;\n  int64 seq = 2;\n  int64 cents = 3;\n  string memo = 4;\n}\n";

const JSON_SCHEMA: &str = r#"{"type":"object","properties":{"account":{"type":"string"},
    "seq":{"type":"integer"},"cents":{"type":"integer"},"memo":{"type":"string"}}}"#;

/// One ledger entry: serde for JSON and Avro, prost for Protobuf.
#[derive(Clone, PartialEq, Serialize, Deserialize, prost::Message)]
struct Entry {
    #[prost(string, tag = "1")]
    account: String,
    #[prost(int64, tag = "2")]
    seq: i64,
    #[prost(int64, tag = "3")]
    cents: i64,
    #[prost(string, tag = "4")]
    memo: String,
}

fn entry(n: u64) -> Entry {
    Entry {
        account: format!("acct-{}", n % KEYS),
        seq: (n / KEYS) as i64,
        cents: (n % 997) as i64,
        memo: "monthly fee, card ending 4242".into(),
    }
}

/// User + system CPU time of this process so far (`/proc/self/stat`, ticks of 10 ms).
fn cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    Duration::from_millis((field(11) + field(12)) * 10)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A codec under test: its name, its payloads, and a handler decoding them that adds each
/// entry's cents to `sum`.
struct Case {
    name: &'static str,
    payloads: Vec<Bytes>,
    handler: Box<dyn Fn(Arc<AtomicI64>) -> Arc<dyn Handler>>,
    encode_ns: f64,
}

async fn case<C>(name: &'static str, codec: C, messages: u64) -> Case
where
    C: Decoder<Entry> + Encoder<Entry> + Clone,
{
    let mut payloads = Vec::with_capacity(messages as usize);
    for n in 0..messages {
        payloads.push(codec.encode(&entry(n)).await.expect("the entry encodes"));
    }
    let encode_ns = time_encode(&codec).await;
    let handler = Box::new(move |sum: Arc<AtomicI64>| -> Arc<dyn Handler> {
        Arc::new(typed_with(codec.clone(), move |e: Entry, _d: Delivery| {
            sum.fetch_add(e.cents, Ordering::Relaxed);
            std::future::ready(Ok::<(), HandlerError>(()))
        }))
    });
    Case {
        name,
        payloads,
        handler,
        encode_ns,
    }
}

async fn time_encode<C: Encoder<Entry>>(codec: &C) -> f64 {
    let value = entry(7);
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        let started = Instant::now();
        for _ in 0..100_000 {
            std::hint::black_box(codec.encode(std::hint::black_box(&value)).await.expect("encodes"));
        }
        runs.push(started.elapsed().as_nanos() as f64 / 100_000.0);
    }
    median(runs)
}

/// Drains `payloads` through an engine running `handler`; the CPU per message.
async fn drain(
    payloads: &[Bytes],
    handler: Arc<dyn Handler>,
    sum: &AtomicI64,
    expected_sum: i64,
) -> Duration {
    let broker = MemoryBroker::new();
    broker.create_topic("ledger", 8);
    for (n, payload) in payloads.iter().enumerate() {
        let message = OutgoingMessage::new(format!("acct-{}", n as u64 % KEYS), payload.clone());
        broker
            .publish("ledger", message)
            .expect("the memory broker takes every message");
    }
    let engine = Engine::builder(handler)
        .config(EngineConfig::for_group("cost"))
        .dead_letter_sink(MemoryDeadLetterSink::new(&broker, "ledger.dlq"))
        .build()
        .expect("a valid configuration");
    let cpu_before = cpu();
    let running = engine
        .start(&MemoryTransport::new(&broker, "cost", &["ledger"]))
        .await
        .expect("the engine starts");
    let messages = payloads.len() as u64;
    while running.stats().finished() < messages {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let used = cpu().saturating_sub(cpu_before);
    let report = running.stop().await.expect("the engine stops");
    assert_eq!(report.stats.handled, messages, "every message handled");
    assert_eq!(report.stats.dead_lettered, 0, "every payload decoded");
    assert_eq!(
        sum.swap(0, Ordering::Relaxed),
        expected_sum,
        "every value decoded right, once"
    );
    used / u32::try_from(messages).unwrap_or(u32::MAX)
}

fn run<H: Handler>(h: H) -> Arc<dyn Handler> {
    Arc::new(h)
}

fn noop_raw(sum: Arc<AtomicI64>, sums: Arc<Vec<i64>>) -> Arc<dyn Handler> {
    // The baseline: the payload's bytes are read (its length), the value's field comes from a
    // table, not a decode.
    let seen = Arc::new(AtomicU64::new(0));
    run(handler_fn(move |d: Delivery| {
        let n = seen.fetch_add(1, Ordering::Relaxed) as usize;
        std::hint::black_box(d.payload().len());
        sum.fetch_add(sums[n % sums.len()], Ordering::Relaxed);
        ready_ok()
    }))
}

fn ready_ok() -> impl Future<Output = Result<(), HandlerError>> + Send {
    std::future::ready(Ok(()))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let messages: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(300_000);
    let expected_sum: i64 = (0..messages).map(|n| entry(n).cents).sum();
    let mut cases = vec![
        case("json", Json, messages).await,
        case("protobuf", Protobuf::<Entry>::new(), messages).await,
        case(
            "avro",
            Avro::<Entry>::new(AVRO).expect("the schema parses"),
            messages,
        )
        .await,
    ];
    match std::env::var("CONVOY_SCHEMA_REGISTRY") {
        Ok(url) => {
            let registry = SchemaRegistry::new(&url).expect("a registry address");
            let subject = format!("codec-cost-{}", std::process::id());
            let avro = ConfluentAvro::<Entry>::new(registry.clone(), format!("{subject}-avro"), AVRO)
                .expect("the schema parses");
            cases.push(case("confluent avro", avro, messages).await);
            let proto = ConfluentProtobuf::<Entry>::new(registry.clone(), format!("{subject}-proto"), PROTO);
            cases.push(case("confluent protobuf", proto, messages).await);
            let json = ConfluentJson::<Entry>::new(registry, format!("{subject}-json"), JSON_SCHEMA);
            cases.push(case("confluent json", json, messages).await);
        }
        Err(_) => println!("(CONVOY_SCHEMA_REGISTRY unset: the Confluent codecs are not measured)"),
    }
    let sums = Arc::new((0..messages).map(|n| entry(n).cents).collect::<Vec<_>>());
    let baseline_payloads = cases[0].payloads.clone();

    let sum = Arc::new(AtomicI64::new(0));
    let mut baseline = Vec::new();
    let mut decode: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..RUNS {
        // The raw handler reads payloads in partition order, not publish order: its sum comes
        // from the count of messages, which is the same set.
        let cpu = drain(
            &baseline_payloads,
            noop_raw(sum.clone(), sums.clone()),
            &sum,
            expected_sum,
        )
        .await;
        baseline.push(cpu.as_secs_f64() * 1e6);
        for (i, case) in cases.iter().enumerate() {
            let cpu = drain(&case.payloads, (case.handler)(sum.clone()), &sum, expected_sum).await;
            decode[i].push(cpu.as_secs_f64() * 1e6);
        }
    }
    let base = median(baseline);
    println!("{messages} messages, {KEYS} keys; median of {RUNS} alternating runs");
    println!(
        "{:<20} {:>8} {:>16} {:>14} {:>12}",
        "codec", "bytes", "µs CPU/message", "decode µs", "encode ns"
    );
    println!(
        "{:<20} {:>8} {:>16.2} {:>14} {:>12}",
        "raw (baseline)", "-", base, "-", "-"
    );
    for (case, runs) in cases.iter().zip(decode) {
        let cpu = median(runs);
        println!(
            "{:<20} {:>8} {:>16.2} {:>+14.2} {:>12.0}",
            case.name,
            case.payloads[7].len(),
            cpu,
            cpu - base,
            case.encode_ns
        );
    }
}
