//! Consumer *processes* against a real Kafka-protocol broker: members joining and leaving a
//! group mid-stream, and members killed with SIGKILL and restarted. Each process appends what it
//! handled to one shared log (O_APPEND), replayed afterwards through the order checker.
//!
//! The SIGKILL test runs twice: on Tansu (which drops commit metadata, so only the watermark
//! survives a kill) and on librdkafka's mock cluster, which keeps commit metadata — there the
//! offset map must keep every offset it recorded as finished from being handled again.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use convoy_core::SourceId;
use convoy_kafka::convert::source_id;
use convoy_kafka::KafkaPublisher;
use convoy_testkit::probe::publish_load;
use convoy_testkit::{CheckReport, OrderChecker};
use rdkafka::mocking::MockCluster;

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

/// A fresh topic, group and log on the broker named by `CONVOY_KAFKA_BOOTSTRAP`.
async fn setup(partitions: i32) -> Option<Setup> {
    common::init_tracing();
    let bootstrap = common::bootstrap_or_skip()?;
    let topic = common::unique("convoy-proc");
    common::create_topic(&bootstrap, &topic, partitions).await;
    common::create_topic(&bootstrap, &format!("{topic}.dlq"), 1).await;
    Some(setup_on(bootstrap, topic))
}

fn setup_on(bootstrap: String, topic: String) -> Setup {
    let config = common::test_config(&bootstrap, &common::unique("convoy-proc-group"), &topic);
    let log = std::env::temp_dir().join(format!("{topic}.log"));
    let _ = std::fs::remove_file(&log);
    Setup {
        publisher: KafkaPublisher::new(&config, &topic).unwrap(),
        bootstrap,
        group: config.group_id.clone(),
        topic,
        log,
        checker: OrderChecker::new(),
    }
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

/// What the group had committed right after a kill, and how long the log was then.
struct Kill {
    log_len: usize,
    committed: BTreeMap<SourceId, (Option<u64>, Vec<u64>)>,
}

/// Publishes `keys × per_key` probes, runs a consumer and SIGKILLs it three times mid-stream
/// (no drain, no commit, no leave), then lets a last one finish. Returns the log and the kills.
/// With `wait_for_map`, each kill also waits until the group's commits carry an offset map (so
/// the kill lands after the consumer recorded finished offsets above a watermark, however fast
/// or slow the machine is).
async fn kill_three_times(
    s: &Setup,
    partitions: i32,
    args: &[&str],
    wait_for_map: bool,
) -> (Vec<Line>, Vec<Kill>) {
    let (keys, per_key) = (15, 100);
    publish_load(&s.publisher, &s.checker, "k", keys, per_key)
        .await
        .unwrap();
    let total = keys * per_key;
    let config = common::test_config(&s.bootstrap, &s.group, &s.topic);
    let mut kills = Vec::new();
    for round in 1..=3 {
        let mut victim = spawn(&s.bootstrap, &s.topic, &s.group, &s.log, args);
        wait_distinct(&s.log, round * 300).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while wait_for_map
            && common::committed_with_map(&config, &s.topic, partitions)
                .values()
                .all(|(_, above)| above.is_empty())
        {
            assert!(
                Instant::now() < deadline,
                "no commit carried an offset map within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        victim.0.kill().unwrap();
        victim.0.wait().unwrap();
        kills.push(Kill {
            log_len: read_log(&s.log).len(),
            committed: common::committed_with_map(&config, &s.topic, partitions),
        });
    }
    let last = spawn(&s.bootstrap, &s.topic, &s.group, &s.log, args);
    wait_distinct(&s.log, total).await;
    terminate(last);
    let lines = read_log(&s.log);
    let report = replay(&s.checker, &s.log);
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, total as u64);
    eprintln!(
        "{} kills: {} lines for {total} messages, {} re-handled",
        kills.len(),
        lines.len(),
        lines.len() - total
    );
    (lines, kills)
}

/// Messages handled again after a kill although the group had recorded them as finished: at or
/// below the committed watermark, or (`with_map`) in the commit's offset map. Also returns how
/// many finished offsets above the watermark the offset map carried over all kills.
fn rework_of_recorded(s: &Setup, lines: &[Line], kills: &[Kill], with_map: bool) -> (Vec<(i32, u64)>, usize) {
    let mut again = Vec::new();
    let mut mapped = 0;
    for kill in kills {
        let before: HashSet<(i32, u64)> = lines[..kill.log_len]
            .iter()
            .map(|l| (l.partition, l.offset))
            .collect();
        mapped += kill
            .committed
            .values()
            .map(|(_, above)| above.len())
            .sum::<usize>();
        for l in &lines[kill.log_len..] {
            let Some((watermark, above)) = kill.committed.get(&source_id(&s.topic, l.partition)) else {
                continue;
            };
            let recorded =
                watermark.is_some_and(|w| l.offset <= w) || (with_map && above.contains(&l.offset));
            if recorded && before.contains(&(l.partition, l.offset)) {
                again.push((l.partition, l.offset));
            }
        }
    }
    (again, mapped)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_members_restart_without_loss_or_committed_rework() {
    let Some(s) = setup(3).await else { return };
    let (lines, kills) = kill_three_times(&s, 3, &["1"], false).await;
    // Nothing at or below a committed watermark is handled again after a kill; re-handling is
    // confined to the uncommitted window. Tansu drops commit metadata (offset_map_kafka.rs), so
    // finished offsets above the watermark are handled again here.
    let (again, _) = rework_of_recorded(&s, &lines, &kills, false);
    assert!(again.is_empty(), "committed messages handled again: {again:?}");
    let _ = std::fs::remove_file(&s.log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_members_skip_what_the_offset_map_recorded() {
    common::init_tracing();
    // librdkafka's mock cluster keeps commit metadata (Tansu does not); it listens on the
    // loopback, so the consumer processes reach it like a broker.
    let mock = MockCluster::new(1).unwrap();
    let topic = common::unique("convoy-map-proc");
    mock.create_topic(&topic, 3, 1).unwrap();
    mock.create_topic(&format!("{topic}.dlq"), 1, 1).unwrap();
    let s = setup_on(mock.bootstrap_servers(), topic);
    // k0 is slow, so its partition's watermark lags while other keys there finish above it.
    let (lines, kills) = kill_three_times(&s, 3, &["1", "k0=25"], true).await;
    let (again, mapped) = rework_of_recorded(&s, &lines, &kills, true);
    eprintln!("the offset map carried {mapped} finished offsets above the watermark over 3 kills");
    assert!(
        mapped > 0,
        "the slow key should leave finished offsets above the watermark"
    );
    assert!(
        again.is_empty(),
        "offsets the group recorded as finished were handled again: {again:?}"
    );
    let _ = std::fs::remove_file(&s.log);
}
