//! Benchmarks of convoy on a Kafka-protocol broker, each with a bare rdkafka consumer draining
//! the same topic in the same run as the baseline.
//!
//! ```text
//! cargo run --release -p convoy-kafka --example kafka_bench -- --bootstrap 127.0.0.1:9092 --scenario seed --json
//! ```
//! Scenarios: `seed` (50,000 messages, 10 keys, 10 % transient once, backoff 1 ms ×2 cap 100 ms
//! full jitter; a live producer, latency produce → handled), `seed-load` (1,000 keys, no-op
//! handler, no failures, a live producer offering `--rate` msg/s for `--duration` seconds),
//! `keys` (1,000 keys, no-op handler, pre-filled topic drained), `work` (1,000 keys, 1 ms of async
//! work per message, drained); `--keys`, `--work-us`, `--rate` and `--partitions` change them
//! (`scripts/bench/curves` sweeps them).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use clap::{Parser, ValueEnum};
use convoy_core::transport::{PrefetchLimit, SourceEvent, Subscription};
use convoy_core::{DeadLetterSink, Publisher, Transport, TransportError};
use convoy_kafka::{admin, baseline, KafkaConfig, KafkaDeadLetterSink, KafkaPublisher, KafkaTransport};
use convoy_testkit::probe::{unix_micros, Latency};
use convoy_testkit::scenario::{
    bench_main, peak_rss_mb, prefill, reset_peak_rss, rss_mb, run, seed_load, seed_retry, Load, RecordCheck,
    Scenario, ScenarioBed, ScenarioReport,
};
use convoy_testkit::{KeySpread, OrderChecker};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Name {
    Seed,
    SeedLoad,
    Keys,
    Work,
}

#[derive(Parser, Debug)]
#[command(about = "Benchmark convoy on a Kafka-protocol broker against a bare rdkafka consumer")]
struct Args {
    /// Broker address.
    #[arg(long, default_value = "127.0.0.1:9092")]
    bootstrap: String,
    /// Which benchmark.
    #[arg(long, value_enum)]
    scenario: Name,
    /// Override the scenario's message count.
    #[arg(long)]
    messages: Option<u64>,
    /// Override the scenario's key count (the sweeps of `scripts/bench/curves`).
    #[arg(long)]
    keys: Option<usize>,
    /// Spread messages over the keys Zipf-skewed with this exponent (1.0: a few hot keys)
    /// instead of round-robin.
    #[arg(long, value_name = "S")]
    zipf: Option<f64>,
    /// Override the handler's work: this many microseconds of async work per message (0: none).
    #[arg(long)]
    work_us: Option<u64>,
    /// Partitions of the benchmark topic.
    #[arg(long, default_value_t = 8)]
    partitions: u32,
    /// Print exactly one JSON object.
    #[arg(long)]
    json: bool,
    /// Live scenarios: offer messages at this rate (msg/s) instead of as fast as possible
    /// (`seed-load`: 50,000 unless given).
    #[arg(long)]
    rate: Option<f64>,
    /// `seed-load`: seconds of offered load.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Back-pressure: pause a partition when the engine holds this many of its messages
    /// (resume at half; the total bound is four times this).
    #[arg(long)]
    source_high: Option<usize>,
    /// Diagnostics: drain the topic through convoy's Kafka transport without the engine.
    #[arg(long)]
    transport_only: bool,
    /// Extra librdkafka property for convoy's clients, `name=value` (repeatable).
    #[arg(long = "property", value_parser = parse_property)]
    property: Vec<(String, String)>,
}

fn parse_property(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected name=value, got {text:?}"))
}

fn scenario(args: &Args) -> Result<Scenario, String> {
    let (messages, keys, transient_rate, latency, load) = match args.scenario {
        Name::Seed => (50_000, 10, 0.1, Latency::None, Load::Live { rate: args.rate }),
        Name::SeedLoad => {
            let (messages, keys, load) = seed_load(args.rate.unwrap_or(50_000.0), args.duration)?;
            (messages, keys, 0.0, Latency::None, load)
        }
        Name::Keys => (200_000, 1_000, 0.0, Latency::None, Load::Prefill),
        Name::Work => (
            200_000,
            1_000,
            0.0,
            Latency::Exact(Duration::from_millis(1)),
            Load::Prefill,
        ),
    };
    let name = match args.scenario {
        Name::Seed => "seed",
        Name::SeedLoad => "seed-load",
        Name::Keys => "keys",
        Name::Work => "work",
    };
    let latency = match args.work_us {
        None => latency,
        Some(0) => Latency::None,
        Some(us) => Latency::Exact(Duration::from_micros(us)),
    };
    let mut s = Scenario {
        name: name.to_owned(),
        messages: args.messages.unwrap_or(messages),
        keys: args.keys.unwrap_or(keys),
        zipf: args.zipf,
        partitions: args.partitions.max(1),
        transient_rate,
        latency,
        load,
        seed: 7,
        retry: seed_retry(),
        ..Scenario::default()
    };
    if let Some(high) = args.source_high {
        let bp = &mut s.back_pressure;
        (bp.source_high, bp.source_low) = (high, high / 2);
        (bp.total_high, bp.total_low) = (high * 4, high * 2);
    }
    Ok(s)
}

/// A fresh topic, group and dead-letter topic on the broker.
struct KafkaBed {
    config: KafkaConfig,
    topic: String,
    partitions: u32,
    publisher: Arc<KafkaPublisher>,
    sink: Arc<KafkaDeadLetterSink>,
}

impl KafkaBed {
    async fn new(args: &Args) -> Result<Self, TransportError> {
        let unique = format!("{}-{:x}", std::process::id(), unix_micros());
        let topic = format!("convoy-bench-{unique}");
        let mut config = KafkaConfig::new(
            args.bootstrap.as_str(),
            format!("convoy-bench-group-{unique}"),
            &[topic.as_str()],
        );
        // Room for a pre-filled topic in the producer's queue; --property overrides any default.
        config
            .properties
            .insert("queue.buffering.max.messages".into(), "1000000".into());
        config.properties.extend(args.property.iter().cloned());
        admin::check_reachable(&config).await?;
        admin::create_topics(
            &config,
            &[(&topic, args.partitions as i32), (&config.dlq_topic(), 1)],
        )
        .await?;
        Ok(KafkaBed {
            // Plain records, as the seed's producer sent them (convoy's publisher would add an
            // event id and a traceparent to each; `convoy bench --url kafka://…` measures that).
            publisher: Arc::new(KafkaPublisher::new(&config, topic.as_str())?.without_stamps()),
            sink: Arc::new(KafkaDeadLetterSink::new(&config)?),
            partitions: args.partitions,
            config,
            topic,
        })
    }
}

#[async_trait]
impl ScenarioBed for KafkaBed {
    fn transport(&self) -> &str {
        "kafka"
    }

    fn group(&self) -> &str {
        &self.config.group_id
    }

    fn partitions(&self) -> u32 {
        self.partitions
    }

    fn publisher(&self) -> Arc<dyn Publisher> {
        self.publisher.clone()
    }

    fn dead_letter_sink(&self) -> Arc<dyn DeadLetterSink> {
        self.sink.clone()
    }

    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        KafkaTransport::new(self.config.clone())
            .map_err(|e| TransportError::Unavailable(e.to_string()))?
            .subscribe_with(limit)
            .await
    }

    async fn bare_drain(
        &self,
        expected: u64,
        limit: Duration,
        check: RecordCheck,
    ) -> Result<f64, TransportError> {
        baseline::bare_drain(&self.config, &self.topic, expected, limit, move |k, p| {
            check(k, p)
        })
        .await
    }
}

/// Diagnostics: how fast convoy's transport alone delivers the topic (no engine).
async fn transport_only(bed: &KafkaBed, scenario: &Scenario) -> Result<ScenarioReport, String> {
    let spread = KeySpread::new(scenario.keys, scenario.zipf).map_err(|e| e.to_string())?;
    prefill(
        bed.publisher.as_ref(),
        &OrderChecker::new(),
        scenario.messages,
        &spread,
        scenario.payload_bytes,
    )
    .await
    .map_err(|e| e.to_string())?;
    // Resident memory as the engine's runs report it: what the client and its prefetch take.
    let rss_start = rss_mb();
    reset_peak_rss();
    let mut sub = bed
        .subscribe_with(scenario.back_pressure.prefetch_limit())
        .await
        .map_err(|e| e.to_string())?;
    let (mut seen, mut started, mut events) = (0u64, None, 0u64);
    while seen < scenario.messages {
        match sub.events.recv().await {
            Some(SourceEvent::Messages { messages, .. }) => {
                started.get_or_insert_with(Instant::now);
                seen += messages.len() as u64;
                events += 1;
            }
            Some(SourceEvent::Revoked { ack, .. }) => ack.done(),
            Some(_) => {}
            None => break,
        }
    }
    let elapsed = started.map_or(0.0, |s| s.elapsed().as_secs_f64());
    eprintln!(
        "transport only: {seen} messages in {events} events, {elapsed:.3} s = {:.0} msg/s; RSS at \
         start {rss_start:.1} MiB, peak {:.1} MiB, after the drain {:.1} MiB",
        seen as f64 / elapsed,
        peak_rss_mb(),
        rss_mb()
    );
    let _ = sub.control.close().await;
    Err("diagnostic run only".into())
}

async fn bench(args: Args) -> Result<ScenarioReport, String> {
    if args.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
        return Err("--rate must be positive".into());
    }
    let scenario = scenario(&args)?;
    let bed = KafkaBed::new(&args).await.map_err(|e| e.to_string())?;
    if args.transport_only {
        return transport_only(&bed, &scenario).await;
    }
    run(&bed, &scenario, &|_, _| {}).await
}

fn main() -> ExitCode {
    if std::env::var("RUST_LOG").is_ok() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args = Args::parse();
    bench_main(args.json, bench(args))
}
