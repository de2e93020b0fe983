//! The broker path's own latency, without convoy: a bare librdkafka consumer (its own group)
//! reads the topics a live `convoy bench` run writes and reports, per message, the time from the
//! load generator's stamp (`probe-sent-us`) to its receipt here, and from the producer's record
//! timestamp (CreateTime, set when librdkafka took the record) to its receipt. Run it beside a
//! `convoy bench --scenario seed-load` to see which part of convoy's produce → handler latency the
//! broker path (producer batching, broker append, fetch) already takes.
//!
//! ```text
//! cargo run --release -p convoy-kafka --example bare_latency -- BOOTSTRAP SECONDS [FETCH_WAIT_MS]
//! ```
//! It waits for the next new `convoy-bench-*` topic to appear (start it before the bench), reads
//! every partition of it from its start (assigned, no group), and prints one line of percentiles per second of messages, then a total.

use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, Timestamp};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const SENT_AT_HEADER: &str = "probe-sent-us";

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn line(label: &str, h: &Histogram<u64>) -> String {
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    format!(
        "{label}: n={} p50={:.1}ms p99={:.1}ms p99.9={:.1}ms max={:.1}ms",
        h.len(),
        ms(0.5),
        ms(0.99),
        ms(0.999),
        h.max() as f64 / 1000.0
    )
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [bootstrap, seconds, rest @ ..] = args.as_slice() else {
        eprintln!("usage: bare_latency BOOTSTRAP SECONDS [FETCH_WAIT_MS]");
        return ExitCode::from(2);
    };
    let Ok(seconds) = seconds.parse::<u64>() else {
        eprintln!("SECONDS must be a whole number, got {seconds}");
        return ExitCode::from(2);
    };
    let fetch_wait = rest.first().map_or("5", String::as_str);
    let consumer: BaseConsumer = match ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("bare-latency-{}", std::process::id()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", fetch_wait)
        .create()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot create the consumer: {e}");
            return ExitCode::FAILURE;
        }
    };
    let topics = |c: &BaseConsumer| -> Vec<String> {
        c.fetch_metadata(None, Duration::from_secs(5))
            .map(|m| m.topics().iter().map(|t| t.name().to_owned()).collect())
            .unwrap_or_default()
    };
    let before = topics(&consumer);
    let wait_until = Instant::now() + Duration::from_secs(60);
    let topic = loop {
        let new = topics(&consumer)
            .into_iter()
            .find(|t| t.starts_with("convoy-bench-") && !t.ends_with(".dlq") && !before.contains(t));
        match new {
            Some(t) => break t,
            None if Instant::now() > wait_until => {
                eprintln!("no new convoy-bench-* topic appeared within a minute");
                return ExitCode::FAILURE;
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    // Assigned, not subscribed: no group join delays the first fetch.
    let partitions = consumer
        .fetch_metadata(Some(&topic), Duration::from_secs(5))
        .map(|m| m.topics().first().map_or(0, |t| t.partitions().len()))
        .unwrap_or(0);
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        if let Err(e) = assignment.add_partition_offset(&topic, p, Offset::Beginning) {
            eprintln!("cannot assign {topic}/{p}: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Err(e) = consumer.assign(&assignment) {
        eprintln!("cannot assign {topic}: {e}");
        return ExitCode::FAILURE;
    }
    eprintln!("reading {topic} ({partitions} partitions)");
    let new = || Histogram::<u64>::new_with_bounds(1, 60_000_000, 3);
    let (Ok(mut stamp_all), Ok(mut create_all), Ok(mut stamp), Ok(mut create)) = (new(), new(), new(), new())
    else {
        return ExitCode::FAILURE;
    };
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut tick = Instant::now() + Duration::from_secs(1);
    while Instant::now() < end {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            let now = now_us();
            let sent = m.headers().and_then(|hs| {
                hs.iter()
                    .find(|h| h.key == SENT_AT_HEADER)
                    .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse::<u64>().ok())
            });
            if let Some(sent) = sent {
                let _ = stamp.record(now.saturating_sub(sent).max(1));
            }
            if let Timestamp::CreateTime(ms) = m.timestamp() {
                let _ = create.record(now.saturating_sub(ms.max(0) as u64 * 1000).max(1));
            }
        }
        if Instant::now() >= tick && !stamp.is_empty() {
            println!(
                "{} | {}",
                line("stamp→bare", &stamp),
                line("create→bare", &create)
            );
            let _ = stamp_all.add(&stamp);
            let _ = create_all.add(&create);
            stamp.reset();
            create.reset();
            tick = Instant::now() + Duration::from_secs(1);
        }
    }
    let _ = stamp_all.add(&stamp);
    let _ = create_all.add(&create);
    println!(
        "total {} | {}",
        line("stamp→bare", &stamp_all),
        line("create→bare", &create_all)
    );
    ExitCode::SUCCESS
}
