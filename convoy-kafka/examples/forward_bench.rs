//! Exactly once against at least once: a transform forwarding every message of one Kafka topic to
//! another, with a transactional id (outputs and the watermark's commit in one transaction) and
//! without (outputs published before their input finishes), on the same data in one run, beside a
//! bare rdkafka consumer draining the input.
//!
//! ```text
//! cargo run --release -p convoy-kafka --example forward_bench -- --bootstrap 127.0.0.1:9092
//! ```
//! Drain: `--messages` pre-filled messages over `--keys` keys, forwarded as fast as possible
//! (the time includes the final commit: for exactly once, when the last output became visible).
//! Live: `--rate` messages per second for `--seconds`, each stamped when produced; a bare
//! `read_committed` consumer of the output records how long each took to become visible
//! downstream. Every output of both phases is checked: each input once, in per-key order.

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use convoy_core::transform::{Output, PublishingOutbox};
use convoy_core::{
    transform_fn, Delivery, Engine, EngineConfig, Message, OutgoingMessage, Publisher, Transport,
    EVENT_ID_HEADER,
};
use convoy_kafka::{admin, baseline, KafkaConfig, KafkaDeadLetterSink, KafkaPublisher, KafkaTransport};
use convoy_testkit::probe::{probe_batch, unix_micros, SENT_AT_HEADER};
use convoy_testkit::scenario::prefill;
use convoy_testkit::OrderChecker;
use hdrhistogram::Histogram;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers as _, Message as _};

#[derive(Parser, Debug)]
#[command(about = "Exactly-once against at-least-once forwarding on Kafka, beside a bare consumer")]
struct Args {
    /// Broker address.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    /// Messages pre-filled for the drain.
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    /// Keys.
    #[arg(long, default_value_t = 1_000)]
    keys: usize,
    /// Partitions of every topic.
    #[arg(long, default_value_t = 8)]
    partitions: u32,
    /// Payload bytes.
    #[arg(long, default_value_t = 100)]
    payload: usize,
    /// The engine's commit interval (ms): how often a transaction commits.
    #[arg(long, default_value_t = 100)]
    commit_interval_ms: u64,
    /// Live run: messages per second offered (0: no live run).
    #[arg(long, default_value_t = 5_000.0)]
    rate: f64,
    /// Live run: seconds of offered load.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

/// The two ways of forwarding.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    AtLeastOnce,
    ExactlyOnce,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::AtLeastOnce => "at least once",
            Mode::ExactlyOnce => "exactly once",
        }
    }
}

fn unique() -> String {
    format!(
        "{:x}",
        std::time::UNIX_EPOCH.elapsed().map_or(0, |d| d.as_nanos())
    )
}

/// A forwarding engine from `input` to `out`, running: with a transactional id, the
/// subscription's own outbox; without, outputs published through a Kafka publisher.
async fn forwarder(
    args: &Args,
    mode: Mode,
    input: &str,
    out: &str,
) -> Result<convoy_core::EngineHandle, String> {
    let u = unique();
    let mut config = KafkaConfig::new(args.bootstrap.as_str(), format!("fwd-{u}"), &[input]);
    config.dlq_topic = Some(format!("{input}.dlq"));
    if mode == Mode::ExactlyOnce {
        config.transactional_id = Some(format!("fwd-{u}"));
    }
    let mut engine_config = EngineConfig::for_group(config.group_id.clone());
    engine_config.commit_interval = Duration::from_millis(args.commit_interval_ms);
    let to = out.to_owned();
    let transform = transform_fn(move |d: Delivery| {
        let to = to.clone();
        async move {
            let m = d.message();
            let mut copy = OutgoingMessage {
                key: m.key.clone(),
                payload: m.payload.clone(),
                headers: Default::default(),
            };
            if let Some(sent) = m.headers.get(SENT_AT_HEADER) {
                copy.headers.insert(SENT_AT_HEADER, sent.clone());
            }
            Ok(vec![Output::new(to, copy)])
        }
    });
    let engine = Engine::transform_builder(transform)
        .config(engine_config.clone())
        .dead_letter_sink(KafkaDeadLetterSink::new(&config).map_err(|e| e.to_string())?)
        .build()
        .map_err(|e| e.to_string())?;
    let transport = KafkaTransport::new(config.clone()).map_err(|e| e.to_string())?;
    let mut subscription = transport
        .subscribe_with(engine_config.back_pressure.prefetch_limit())
        .await
        .map_err(|e| e.to_string())?;
    if subscription.outbox.is_none() {
        let config = config.clone();
        subscription.outbox = Some(Arc::new(PublishingOutbox::new(move |topic| {
            Ok(Arc::new(KafkaPublisher::new(&config, topic)?) as Arc<dyn Publisher>)
        })));
    }
    Ok(engine.spawn(subscription))
}

/// Each input once, in per-key order (payloads are the key's sequence numbers).
fn check(outputs: &[Message], expected: u64) -> Result<(), String> {
    let mut last: HashMap<Vec<u8>, u64> = HashMap::new();
    let mut ids = HashSet::new();
    for o in outputs {
        let seq: u64 = String::from_utf8_lossy(&o.payload)
            .trim()
            .parse()
            .map_err(|_| "an output's payload is not its input's".to_owned())?;
        let key = o.key.clone().unwrap_or_default().to_vec();
        if let Some(before) = last.insert(key, seq) {
            if before >= seq {
                return Err(format!("out of order or twice: {before} then {seq}"));
            }
        }
        ids.insert(o.headers.get(EVENT_ID_HEADER).cloned().unwrap_or_default());
    }
    match (outputs.len() as u64 == expected, ids.len() == outputs.len()) {
        (true, true) => Ok(()),
        _ => Err(format!(
            "{} outputs, {} ids, {expected} inputs",
            outputs.len(),
            ids.len()
        )),
    }
}

/// Forwards the pre-filled `input` as fast as possible: messages per second.
async fn drain(args: &Args, mode: Mode, input: &str, admin: &KafkaConfig) -> Result<f64, String> {
    let out = format!("{input}-{}", unique());
    admin::create_topics(admin, &[(&out, args.partitions as i32)])
        .await
        .map_err(|e| e.to_string())?;
    let running = forwarder(args, mode, input, &out).await?;
    // Timed from the first message handled: joining the group is not forwarding.
    while running.stats().handled == 0 {
        if running.is_finished() {
            return Err(format!("{:?}", running.join().await));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let started = Instant::now();
    while running.stats().handled < args.messages {
        if running.is_finished() {
            return Err(format!("{:?}", running.join().await));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    running.stop().await.map_err(|e| e.to_string())?;
    let rate = args.messages as f64 / started.elapsed().as_secs_f64();
    let outputs = admin::read_topic(admin, &out, Duration::from_secs(3))
        .await
        .map_err(|e| e.to_string())?;
    check(&outputs, args.messages)?;
    Ok(rate)
}

/// Offers `rate` messages per second for `seconds`; returns the produce → visible-downstream
/// latency of every output (µs), read by a bare `read_committed` consumer.
async fn live(args: &Args, mode: Mode, admin: &KafkaConfig) -> Result<Histogram<u64>, String> {
    let u = unique();
    let (input, out) = (format!("fwd-live-{u}"), format!("fwd-live-{u}-out"));
    let parts = args.partitions as i32;
    admin::create_topics(admin, &[(&input, parts), (&out, parts)])
        .await
        .map_err(|e| e.to_string())?;
    let total = (args.rate * args.seconds as f64) as u64;
    let running = forwarder(args, mode, &input, &out).await?;
    // Load starts once the forwarder owns the partitions: joining the group is not latency.
    while running.stats().sources < args.partitions as usize {
        if running.is_finished() {
            return Err(format!("{:?}", running.join().await));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut reader = admin.consumer_config();
    reader
        .set("group.id", format!("fwd-reader-{u}"))
        .set("isolation.level", "read_committed")
        .set("fetch.wait.max.ms", "10");
    let reader: BaseConsumer = reader.create().map_err(|e| e.to_string())?;
    // Assigned, not subscribed: no group join delays the first outputs it sees.
    let mut partitions = rdkafka::TopicPartitionList::new();
    for p in 0..parts {
        partitions
            .add_partition_offset(&out, p, rdkafka::Offset::Beginning)
            .map_err(|e| e.to_string())?;
    }
    reader.assign(&partitions).map_err(|e| e.to_string())?;
    let watching = std::thread::spawn(move || {
        let mut latencies = Histogram::<u64>::new(3).expect("3 significant figures is valid");
        let deadline = Instant::now() + Duration::from_secs(300);
        while latencies.len() < total && Instant::now() < deadline {
            let Some(Ok(record)) = reader.poll(Duration::from_millis(100)) else {
                continue;
            };
            let sent = record.headers().and_then(|h| {
                h.iter()
                    .find(|h| h.key == SENT_AT_HEADER)
                    .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse::<u64>().ok())
            });
            if let Some(sent) = sent {
                let _ = latencies.record(unix_micros().saturating_sub(sent));
            }
        }
        latencies
    });
    let publisher = KafkaPublisher::new(admin, input.as_str()).map_err(|e| e.to_string())?;
    // A first publish waits for the topic's metadata: not the forwarder's latency. (The warm-up
    // message carries no send time, so the reader does not count its output.)
    publisher
        .publish(OutgoingMessage::new("warm-up", "0"))
        .await
        .map_err(|e| e.to_string())?;
    let checker = OrderChecker::new();
    let tick = Duration::from_millis(10);
    let per_tick = ((args.rate * tick.as_secs_f64()) as usize).max(1);
    let started = tokio::time::Instant::now();
    let mut sent = 0usize;
    while (sent as u64) < total {
        let count = per_tick.min(total as usize - sent);
        let now = unix_micros().to_string();
        let batch: Vec<OutgoingMessage> = probe_batch(&checker, "key-", args.keys, sent, count, args.payload)
            .into_iter()
            .map(|m| m.header(SENT_AT_HEADER, now.clone()))
            .collect();
        publisher.publish_all(batch).await.map_err(|e| e.to_string())?;
        sent += count;
        tokio::time::sleep_until(started + tick * (sent / per_tick) as u32).await;
    }
    let latencies = tokio::task::spawn_blocking(move || watching.join())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|_| "the reader thread panicked".to_owned())?;
    running.stop().await.map_err(|e| e.to_string())?;
    if latencies.len() < total {
        return Err(format!("{} of {total} outputs became visible", latencies.len()));
    }
    // Counting outputs is not checking them (a duplicate would hide a loss): each input once,
    // in per-key order, as the drain checks.
    let outputs: Vec<Message> = admin::read_topic(admin, &out, Duration::from_secs(3))
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter(|o| o.key.as_deref() != Some(b"warm-up".as_slice()))
        .collect();
    check(&outputs, total).map_err(|e| format!("live: {e}"))?;
    Ok(latencies)
}

async fn bench(args: Args) -> Result<(), String> {
    let input = format!("fwd-in-{}", unique());
    let admin = KafkaConfig::new(args.bootstrap.as_str(), "fwd-admin", &[input.as_str()]);
    admin::create_topics(&admin, &[(&input, args.partitions as i32)])
        .await
        .map_err(|e| e.to_string())?;
    let publisher = KafkaPublisher::new(&admin, input.as_str()).map_err(|e| e.to_string())?;
    prefill(
        &publisher,
        &OrderChecker::new(),
        args.messages,
        &convoy_testkit::KeySpread::uniform(args.keys),
        args.payload,
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut bare_config = admin.clone();
    bare_config.group_id = format!("fwd-bare-{}", unique());
    let bare = baseline::bare_drain(
        &bare_config,
        &input,
        args.messages,
        Duration::from_secs(300),
        |_, _| {},
    )
    .await
    .map_err(|e| e.to_string())?;
    println!(
        "drain: {} messages, {} keys, {} partitions, {} B payloads, commit every {} ms",
        args.messages, args.keys, args.partitions, args.payload, args.commit_interval_ms
    );
    println!("  bare rdkafka consumer (no output)   {bare:>9.0} msg/s");
    let mut rates = Vec::new();
    for mode in [Mode::AtLeastOnce, Mode::ExactlyOnce] {
        let rate = drain(&args, mode, &input, &admin).await?;
        println!(
            "  forward, {:<14}             {rate:>9.0} msg/s  ({:.2} × bare), every output once, in key order",
            mode.name(),
            rate / bare
        );
        rates.push(rate);
    }
    println!("  exactly once / at least once: {:.2}", rates[1] / rates[0]);
    if args.rate > 0.0 {
        println!(
            "live: {:.0} msg/s for {} s; produce → visible to a read_committed reader",
            args.rate, args.seconds
        );
        for mode in [Mode::AtLeastOnce, Mode::ExactlyOnce] {
            let h = live(&args, mode, &admin).await?;
            let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
            println!(
                "  {:<14} p50 {:>7.1} ms  p99 {:>7.1} ms  p99.9 {:>7.1} ms  max {:>7.1} ms  ({} outputs, each once, in key order)",
                mode.name(),
                ms(0.5),
                ms(0.99),
                ms(0.999),
                h.max() as f64 / 1000.0,
                h.len()
            );
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    match bench(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("forward_bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}
