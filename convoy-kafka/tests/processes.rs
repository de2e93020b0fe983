//! Consumer *processes* against a real Kafka-protocol broker: members joining and leaving a
//! group mid-stream, and members killed with SIGKILL and restarted. Each process appends what it
//! handled to one shared log (O_APPEND), replayed afterwards through the order checker.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use convoy_kafka::KafkaPublisher;
use convoy_testkit::probe::publish_load;
use convoy_testkit::{CheckReport, OrderChecker};

struct Line {
    key: String,
    seq: u64,
    partition: i32,
    offset: u64,
    pid: u32,
}

fn consumer_binary() -> PathBuf {
    // tests run from target/<profile>/deps; cargo builds examples beside them.
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("probe_consumer")
}

/// A consumer process; killed if still running when dropped (a failing test leaves none behind).
struct Consumer(Child);

impl Drop for Consumer {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn spawn(bootstrap: &str, topic: &str, group: &str, log: &Path, extra: &[&str]) -> Consumer {
    Consumer(
        Command::new(consumer_binary())
            .args([bootstrap, topic, group, log.to_str().unwrap()])
            .args(extra)
            .stdin(Stdio::null())
            .spawn()
            .expect("probe_consumer example is built by cargo test"),
    )
}

fn terminate(mut consumer: Consumer) {
    let child = &mut consumer.0;
    let pid = child.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "graceful stop failed: {status}");
            return;
        }
        assert!(Instant::now() < deadline, "consumer {pid} did not stop");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_log(path: &Path) -> Vec<Line> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            Some(Line {
                key: f.next()?.to_owned(),
                seq: f.next()?.parse().ok()?,
                partition: f.next()?.parse().ok()?,
                offset: f.next()?.parse().ok()?,
                pid: f.next()?.parse().ok()?,
            })
        })
        .collect()
}

fn distinct(lines: &[Line]) -> usize {
    lines
        .iter()
        .map(|l| (&l.key, l.seq))
        .collect::<HashSet<_>>()
        .len()
}

async fn wait_distinct(log: &Path, at_least: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while distinct(&read_log(log)) < at_least {
        assert!(
            Instant::now() < deadline,
            "only {} of {at_least} handled",
            distinct(&read_log(log))
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Replays the shared log, in handling order, through the checker.
fn replay(checker: &OrderChecker, log: &Path) -> CheckReport {
    for line in read_log(log) {
        checker.handled(line.key.as_bytes(), line.seq, None);
    }
    checker.report()
}

struct Setup {
    bootstrap: String,
    topic: String,
    group: String,
    log: PathBuf,
    publisher: KafkaPublisher,
    checker: OrderChecker,
}

async fn setup(partitions: i32) -> Option<Setup> {
    common::init_tracing();
    let bootstrap = common::bootstrap().or_else(|| {
        eprintln!(
            "skipped: {} is not set (scripts/test sets it)",
            common::BOOTSTRAP_VAR
        );
        None
    })?;
    let topic = common::unique("convoy-proc");
    common::create_topic(&bootstrap, &topic, partitions).await;
    let config = common::test_config(&bootstrap, &common::unique("convoy-proc-group"), &topic);
    common::create_topic(&bootstrap, &config.dlq_topic(), 1).await;
    let log = std::env::temp_dir().join(format!("{topic}.log"));
    let _ = std::fs::remove_file(&log);
    Some(Setup {
        publisher: KafkaPublisher::new(&config, &topic).unwrap(),
        bootstrap,
        group: config.group_id.clone(),
        topic,
        log,
        checker: OrderChecker::new(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_joining_and_leaving_mid_stream_lose_nothing() {
    let Some(s) = setup(4).await else { return };
    publish_load(&s.publisher, &s.checker, "k", 20, 30).await.unwrap();
    let a = spawn(&s.bootstrap, &s.topic, &s.group, &s.log, &["2"]);
    wait_distinct(&s.log, 150).await;
    let b = spawn(&s.bootstrap, &s.topic, &s.group, &s.log, &["2"]);
    publish_load(&s.publisher, &s.checker, "k", 20, 30).await.unwrap();
    wait_distinct(&s.log, 800).await;
    terminate(a);
    publish_load(&s.publisher, &s.checker, "k", 20, 30).await.unwrap();
    wait_distinct(&s.log, 1800).await;
    terminate(b);
    let report = replay(&s.checker, &s.log);
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 1800);
    let pids: HashSet<u32> = read_log(&s.log).iter().map(|l| l.pid).collect();
    assert_eq!(pids.len(), 2, "both processes handled messages");
    let _ = std::fs::remove_file(&s.log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_members_restart_without_loss_or_committed_rework() {
    let Some(s) = setup(3).await else { return };
    let (keys, per_key) = (15, 100);
    publish_load(&s.publisher, &s.checker, "k", keys, per_key)
        .await
        .unwrap();
    let total = keys * per_key;
    let args = ["1"];
    let config = common::test_config(&s.bootstrap, &s.group, &s.topic);
    // After each kill: how long the log was, and what the group had committed.
    let mut kills = Vec::new();
    for round in 1..=3 {
        let mut victim = spawn(&s.bootstrap, &s.topic, &s.group, &s.log, &args);
        wait_distinct(&s.log, round * 300).await;
        victim.0.kill().unwrap(); // SIGKILL: no drain, no commit, no leave
        victim.0.wait().unwrap();
        let committed = common::committed(&config, &s.topic, 3);
        kills.push((read_log(&s.log).len(), committed));
    }
    let last = spawn(&s.bootstrap, &s.topic, &s.group, &s.log, &args);
    wait_distinct(&s.log, total).await;
    terminate(last);
    let lines = read_log(&s.log);
    let report = replay(&s.checker, &s.log);
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, total as u64);
    // Nothing at or below a committed watermark is handled again after a kill; re-handling is
    // confined to the uncommitted window (keys of a partition running ahead of its slowest
    // key). On a broker that keeps commit metadata the offset map skips that window too; Tansu
    // drops metadata (see offset_map_kafka.rs), so here it is handled again.
    let mut committed_again = Vec::new();
    for (at, committed) in &kills {
        let before: HashSet<(i32, u64)> = lines[..*at].iter().map(|l| (l.partition, l.offset)).collect();
        for l in &lines[*at..] {
            let watermark = committed.get(&convoy_kafka::convert::source_id(&s.topic, l.partition));
            if watermark.is_some_and(|w| l.offset <= *w) && before.contains(&(l.partition, l.offset)) {
                committed_again.push((l.partition, l.offset));
            }
        }
    }
    let rehandled = lines.len() - total;
    eprintln!(
        "{} kills: {} lines for {total} messages, {rehandled} re-handled",
        kills.len(),
        lines.len()
    );
    assert!(
        committed_again.is_empty(),
        "committed messages handled again: {committed_again:?}"
    );
    let _ = std::fs::remove_file(&s.log);
}
