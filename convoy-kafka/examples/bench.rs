//! Benchmarks of convoy on a Kafka-protocol broker, each with a bare rdkafka consumer draining
//! the same topic in the same run as the baseline.
//!
//! ```text
//! cargo run --release -p convoy-kafka --example bench -- --bootstrap 127.0.0.1:9092 --scenario seed --json
//! ```
//! Scenarios: `seed` (50,000 messages, 10 keys, 10 % transient once, backoff 1 ms ×2 cap 100 ms
//! full jitter; a live producer, latency produce → handled), `keys` (1,000 keys, no-op handler,
//! pre-filled topic drained), `work` (1,000 keys, 1 ms of async work per message, drained).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use convoy_core::{Backoff, Engine, EngineConfig, Jitter, OutgoingMessage, RetryPolicy, Transport};
use convoy_kafka::{KafkaConfig, KafkaDeadLetterSink, KafkaTransport};
use convoy_testkit::probe::{
    probe_batch, unix_micros, FaultPlan, Latency, ProbeHandler, RecordingSink, SENT_AT_HEADER,
};
use convoy_testkit::scenario::{bench_main, rss_mb, Measured, ScenarioReport};
use convoy_testkit::OrderChecker;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message as _};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Scenario {
    Seed,
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
    scenario: Scenario,
    /// Override the scenario's message count.
    #[arg(long)]
    messages: Option<u64>,
    /// Partitions of the benchmark topic.
    #[arg(long, default_value_t = 8)]
    partitions: i32,
    /// Print exactly one JSON object.
    #[arg(long)]
    json: bool,
    /// Live scenarios: offer messages at this rate (msg/s) instead of as fast as possible.
    #[arg(long)]
    rate: Option<f64>,
    /// Back-pressure: pause a partition when the engine holds this many of its messages
    /// (resume at half; the total bound is four times this).
    #[arg(long)]
    source_high: Option<usize>,
    /// Diagnostics: drain the topic through convoy's Kafka transport without the engine.
    #[arg(long)]
    transport_only: bool,
    /// Extra librdkafka consumer property for convoy's consumer, `name=value` (repeatable).
    #[arg(long = "property", value_parser = parse_property)]
    property: Vec<(String, String)>,
}

fn parse_property(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected name=value, got {text:?}"))
}

struct Plan {
    messages: u64,
    keys: usize,
    transient_rate: f64,
    work: Option<Duration>,
    live: bool,
}

fn plan(scenario: Scenario) -> Plan {
    match scenario {
        Scenario::Seed => Plan {
            messages: 50_000,
            keys: 10,
            transient_rate: 0.1,
            work: None,
            live: true,
        },
        Scenario::Keys => Plan {
            messages: 200_000,
            keys: 1_000,
            transient_rate: 0.0,
            work: None,
            live: false,
        },
        Scenario::Work => Plan {
            messages: 200_000,
            keys: 1_000,
            transient_rate: 0.0,
            work: Some(Duration::from_millis(1)),
            live: false,
        },
    }
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{:x}", std::process::id(), unix_micros())
}

async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .map_err(|e| e.to_string())?;
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .map_err(|e| format!("cannot reach {bootstrap}: {e}"))?;
    for r in results {
        r.map_err(|(t, e)| format!("creating topic {t}: {e}"))?;
    }
    Ok(())
}

/// Produces every message, pipelined, stamping the send time when `stamp` (latency is then
/// produce → handled), as fast as possible or at `rate` msg/s; returns when all are confirmed.
async fn produce(
    producer: &FutureProducer,
    topic: &str,
    messages: &[OutgoingMessage],
    stamp: bool,
    rate: Option<f64>,
) -> Result<(), String> {
    let mut pending: Vec<DeliveryFuture> = Vec::with_capacity(messages.len());
    let start = Instant::now();
    for (i, m) in messages.iter().enumerate() {
        if let Some(rate) = rate {
            // Open loop: message i is due at start + i / rate.
            let due = start + Duration::from_secs_f64(i as f64 / rate);
            if let Some(ahead) = due.checked_duration_since(Instant::now()) {
                if ahead > Duration::from_millis(1) {
                    tokio::time::sleep(ahead).await;
                }
            }
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(m.payload.as_ref());
        if stamp {
            let sent = unix_micros().to_string();
            record = record.headers(OwnedHeaders::new().insert(Header {
                key: SENT_AT_HEADER,
                value: Some(sent.as_bytes()),
            }));
        }
        if let Some(key) = &m.key {
            record = record.key(key.as_ref());
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    pending.push(delivery);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((e, _)) => return Err(format!("produce failed: {e}")),
            }
        }
    }
    for delivery in pending {
        match delivery.await {
            Ok(Ok(_)) => {}
            Ok(Err((e, _))) => return Err(format!("delivery failed: {e}")),
            Err(_) => return Err("delivery cancelled".into()),
        }
    }
    Ok(())
}

/// A bare rdkafka consumer (new group, no ordering, no engine) draining `expected` messages.
fn bare_drain(bootstrap: &str, topic: &str, expected: u64) -> Result<f64, String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("convoy-bench-bare"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .create()
        .map_err(|e| e.to_string())?;
    consumer.subscribe(&[topic]).map_err(|e| e.to_string())?;
    let mut seen = 0u64;
    let mut sum = 0u64;
    let mut started = None;
    let deadline = Instant::now() + Duration::from_secs(600);
    while seen < expected && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            started.get_or_insert_with(Instant::now);
            sum = sum.wrapping_add(m.payload().map_or(0, |p| p.len() as u64));
            seen += 1;
        }
    }
    std::hint::black_box(sum);
    // Measured from the first message, so the group join is not counted against the baseline.
    let elapsed = started.map_or(f64::INFINITY, |s| s.elapsed().as_secs_f64());
    Ok(seen as f64 / elapsed)
}

async fn run(args: &Args) -> Result<ScenarioReport, String> {
    let plan = plan(args.scenario);
    let messages_total = args.messages.unwrap_or(plan.messages);
    let topic = unique("convoy-bench");
    create_topic(&args.bootstrap, &topic, args.partitions).await?;
    let mut config = KafkaConfig::new(
        args.bootstrap.as_str(),
        unique("convoy-bench-group"),
        &[topic.as_str()],
    );
    config.session_timeout_ms = 6_000;
    config
        .properties
        .insert("heartbeat.interval.ms".into(), "500".into());
    for (k, v) in &args.property {
        config.properties.insert(k.clone(), v.clone());
    }
    create_topic(&args.bootstrap, &config.dlq_topic(), 1).await?;

    if args.transport_only {
        let messages = probe_batch(
            &OrderChecker::new(),
            "key-",
            plan.keys,
            0,
            messages_total as usize,
        );
        let producer: FutureProducer = config.producer_config().create().map_err(|e| e.to_string())?;
        produce(&producer, &topic, &messages, false, None).await?;
        let mut sub = KafkaTransport::new(config.clone())
            .map_err(|e| e.to_string())?
            .subscribe()
            .await
            .map_err(|e| e.to_string())?;
        let (mut seen, mut started, mut events) = (0u64, None, 0u64);
        while seen < messages_total {
            match sub.events.recv().await {
                Some(convoy_core::SourceEvent::Messages { messages, .. }) => {
                    started.get_or_insert_with(Instant::now);
                    seen += messages.len() as u64;
                    events += 1;
                }
                Some(convoy_core::SourceEvent::Revoked { ack, .. }) => ack.done(),
                Some(_) => {}
                None => break,
            }
        }
        let elapsed = started.map_or(0.0, |s| s.elapsed().as_secs_f64());
        eprintln!(
            "transport only: {seen} messages in {events} events, {elapsed:.3} s = {:.0} msg/s",
            seen as f64 / elapsed
        );
        let _ = sub.control.close().await;
        return Err("diagnostic run only".into());
    }
    let checker = Arc::new(OrderChecker::with_capacity(plan.keys));
    let messages = probe_batch(&checker, "key-", plan.keys, 0, messages_total as usize);
    let producer: FutureProducer = config
        .producer_config()
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .map_err(|e| e.to_string())?;
    if !plan.live {
        produce(&producer, &topic, &messages, false, None).await?;
    }

    let handler = ProbeHandler::with_faults(
        checker.clone(),
        FaultPlan {
            seed: 7,
            transient_rate: plan.transient_rate,
            transient_attempts: 1,
            latency: plan.work.map_or(Latency::None, Latency::Fixed),
            ..FaultPlan::default()
        },
    );
    let engine_config = EngineConfig {
        group: config.group_id.clone(),
        retry: RetryPolicy {
            backoff: Backoff {
                base: Duration::from_millis(1),
                factor: 2.0,
                cap: Duration::from_millis(100),
                jitter: Jitter::Full,
            },
            ..RetryPolicy::default()
        },
        ..EngineConfig::default()
    };
    let mut engine_config = engine_config;
    if let Some(high) = args.source_high {
        engine_config.back_pressure = convoy_core::BackPressure {
            source_high: high,
            source_low: high / 2,
            total_high: high * 4,
            total_low: high * 2,
        };
    }
    let sink = RecordingSink::new(
        Arc::new(KafkaDeadLetterSink::new(&config).map_err(|e| e.to_string())?),
        checker.clone(),
    );
    let engine = Engine::builder(handler)
        .config(engine_config)
        .dead_letter_sink(sink)
        .build()
        .map_err(|e| e.to_string())?;
    let transport = KafkaTransport::new(config.clone()).map_err(|e| e.to_string())?;
    let rss_before = rss_mb();
    let running = engine.spawn(transport.subscribe().await.map_err(|e| e.to_string())?);
    // Wait for the group join so the clock measures consumption, not coordination (the
    // baseline's clock likewise starts at its first message).
    let joined = Instant::now() + Duration::from_secs(60);
    while running.stats().sources < args.partitions as usize && Instant::now() < joined {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    if !plan.live {
        // Like the baseline's, the drain clock starts at the first message: the first fetch
        // after an assignment waits on offset lookups that are the broker's, not the consumer's.
        while checker.finished() == 0 && Instant::now() < joined {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    let started = Instant::now();
    if plan.live {
        let (producer, topic, rate) = (producer.clone(), topic.clone(), args.rate);
        tokio::spawn(async move {
            if let Err(e) = produce(&producer, &topic, &messages, true, rate).await {
                eprintln!("{e}");
            }
        });
    }
    let completed = checker.wait_complete(Duration::from_secs(600)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let report = running.stop().await.map_err(|e| e.to_string())?;
    let (bootstrap, bare_topic) = (args.bootstrap.clone(), topic.clone());
    let baseline = tokio::task::spawn_blocking(move || bare_drain(&bootstrap, &bare_topic, messages_total))
        .await
        .map_err(|e| e.to_string())??;
    Ok(ScenarioReport::new(Measured {
        transport: "kafka",
        messages: messages_total,
        keys: plan.keys,
        elapsed_s: elapsed,
        completed,
        checker: &checker,
        stats: report.stats,
        baseline_msg_s: baseline,
        rss_before_mb: rss_before,
    }))
}

fn main() -> ExitCode {
    if std::env::var("RUST_LOG").is_ok() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args = Args::parse();
    bench_main(args.json, run(&args))
}
