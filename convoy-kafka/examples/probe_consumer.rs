//! A convoy consumer process for multi-process tests: consumes probe messages from Kafka and
//! appends `key seq partition offset pid` per handled message to a shared log file (O_APPEND,
//! so lines of several processes interleave in handling order). SIGTERM or SIGINT stops it
//! gracefully (drain, commit, leave); SIGKILL is a crash.
//!
//! ```text
//! cargo run -p convoy-kafka --example probe_consumer -- BOOTSTRAP TOPIC GROUP LOG_FILE [WORK_MS [SLOW_KEY=MS]]
//! ```
//! `SLOW_KEY=MS` makes one key's messages take longer, so its partition's watermark lags while
//! other keys finish above it (what the offset map in commit metadata is for).
//! `PROBE_KAFKA_PARAMS` (`name=value&…`, as in a `kafka://` URL) sets more of the consumer's
//! settings, e.g. `group_protocol=consumer` or `assignor=range`; `CONVOY_KAFKA_DEBUG` sets
//! librdkafka's `debug` contexts (e.g. `cgrp`).

use std::io::Write;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy_core::{handler_fn, Delivery, Engine, EngineConfig, HandlerError, Transport};
use convoy_kafka::convert::topic_partition;
use convoy_kafka::{KafkaConfig, KafkaDeadLetterSink, KafkaTransport};

#[tokio::main]
async fn main() -> ExitCode {
    if std::env::var("RUST_LOG").is_ok() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [bootstrap, topic, group, log, rest @ ..] = args.as_slice() else {
        eprintln!("usage: probe_consumer BOOTSTRAP TOPIC GROUP LOG_FILE [WORK_MS [SLOW_KEY=MS]]");
        return ExitCode::from(2);
    };
    let millis = |text: &str| Duration::from_micros(text.parse::<f64>().map_or(0, |ms| (ms * 1000.0) as u64));
    let work = rest.first().map_or(Duration::ZERO, |w| millis(w));
    let slow: Option<(bytes::Bytes, Duration)> = rest
        .get(1)
        .and_then(|s| s.split_once('='))
        .map(|(key, ms)| (bytes::Bytes::copy_from_slice(key.as_bytes()), millis(ms)));
    let file = match std::fs::OpenOptions::new().create(true).append(true).open(log) {
        Ok(f) => Arc::new(Mutex::new(f)),
        Err(e) => {
            eprintln!("cannot open {log}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut config = KafkaConfig::new(bootstrap.as_str(), group.as_str(), &[topic.as_str()]);
    let params = std::env::var("PROBE_KAFKA_PARAMS").unwrap_or_default();
    for (name, value) in params.split('&').filter_map(|p| p.split_once('=')) {
        if let Err(e) = config.apply_param(name, value) {
            eprintln!("PROBE_KAFKA_PARAMS: {e}");
            return ExitCode::from(2);
        }
    }
    if let Ok(debug) = std::env::var("CONVOY_KAFKA_DEBUG") {
        config.properties.insert("debug".into(), debug);
    }
    let pid = std::process::id();
    let handler = handler_fn(move |d: Delivery| {
        let file = file.clone();
        let delay = match &slow {
            Some((key, slow)) if d.key() == Some(key) => *slow,
            _ => work,
        };
        async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let key = String::from_utf8_lossy(d.key().map_or(&[][..], |k| k.as_ref())).into_owned();
            let seq = std::str::from_utf8(d.payload()).unwrap_or("?").to_owned();
            let partition = topic_partition(d.source()).map_or(-1, |(_, p)| p);
            let line = format!("{key} {seq} {partition} {} {pid}\n", d.offset());
            let mut f = file.lock().unwrap_or_else(|p| p.into_inner());
            // One write per line: O_APPEND makes it atomic among processes.
            f.write_all(line.as_bytes()).map_err(HandlerError::transient)?;
            Ok(())
        }
    });
    let mut engine_config = EngineConfig::for_group(group.clone());
    engine_config.commit_interval = Duration::from_millis(100);
    engine_config.drain_timeout = Duration::from_secs(10);
    let sink = match KafkaDeadLetterSink::new(&config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let engine = match Engine::builder(handler)
        .config(engine_config)
        .dead_letter_sink(sink)
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let transport = match KafkaTransport::new(config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let subscription = match transport.subscribe().await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let running = engine.spawn(subscription);
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot listen for SIGTERM: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    match running.stop().await {
        Ok(report) => {
            eprintln!("probe_consumer {pid} stopped: {:?}", report.stats);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
