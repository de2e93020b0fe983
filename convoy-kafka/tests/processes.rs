//! Consumer *processes* against Apache Kafka: three members joining and leaving a group every
//! few seconds while a producer publishes (in each group protocol), members killed with SIGKILL
//! and restarted, and a member killed while one key's head blocks thousands of finished offsets
//! above its watermark. Each process appends what it handled to one shared log (O_APPEND),
//! replayed afterwards through the order checker.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Protocol;
use convoy_core::SourceId;
use convoy_kafka::convert::source_id;
use convoy_kafka::KafkaPublisher;
use convoy_testkit::probe::{probe_key, publish_load, publish_probe};
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

impl Consumer {
    /// A crash: no drain, no commit, no leave. Fails if the process had already exited (the
    /// kill a test counts must have happened).
    fn kill(mut self) {
        assert!(
            matches!(self.0.try_wait(), Ok(None)),
            "the consumer to kill had already exited"
        );
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

/// Graceful stop by SIGTERM: drain, commit, leave; the process must exit 0.
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
    let deadline = Instant::now() + Duration::from_secs(180);
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
    protocol: Protocol,
    publisher: KafkaPublisher,
    checker: OrderChecker,
}

impl Setup {
    /// A fresh topic, group and log on the broker named by `CONVOY_KAFKA_BOOTSTRAP`.
    async fn new(partitions: i32, protocol: Protocol) -> Option<Setup> {
        common::init_tracing();
        let bootstrap = common::bootstrap()?;
        let topic = common::unique("convoy-proc");
        common::create_topic(&bootstrap, &topic, partitions).await;
        common::create_topic(&bootstrap, &format!("{topic}.dlq"), 1).await;
        let config = common::test_config(&bootstrap, &common::unique("convoy-proc-group"), &topic);
        let log = std::env::temp_dir().join(format!("{topic}.log"));
        let _ = std::fs::remove_file(&log);
        Some(Setup {
            publisher: KafkaPublisher::new(&config, &topic).unwrap(),
            bootstrap,
            group: config.group_id.clone(),
            topic,
            log,
            protocol,
            checker: OrderChecker::new(),
        })
    }

    /// A probe consumer process of the group; `args` are `[WORK_MS [SLOW_KEY=MS]]`.
    fn spawn(&self, args: &[&str]) -> Consumer {
        Consumer(
            Command::new(consumer_binary())
                .args([
                    &self.bootstrap,
                    &self.topic,
                    &self.group,
                    self.log.to_str().unwrap(),
                ])
                .args(args)
                .env("PROBE_KAFKA_PARAMS", self.protocol.params())
                .stdin(Stdio::null())
                .spawn()
                .expect("probe_consumer example is built by cargo test"),
        )
    }

    /// The group's committed watermark and offset map per partition.
    fn committed(&self, partitions: i32) -> BTreeMap<SourceId, (Option<u64>, Vec<u64>)> {
        let config = common::test_config(&self.bootstrap, &self.group, &self.topic);
        common::committed_with_map(&config, &self.topic, partitions)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Three member processes join and leave (SIGTERM: drain, commit, leave) every two seconds or
/// so while a producer publishes; at the end every message was handled in per-key order, and
/// what was handled twice is bounded by what a leave can leave uncommitted.
async fn churn(protocol: Protocol) {
    let Some(s) = Setup::new(6, protocol).await else {
        return;
    };
    let s = Arc::new(s);
    let (keys, rounds, per_round) = (30, 10, 20);
    let producer = {
        let s = s.clone();
        tokio::spawn(async move {
            for _ in 0..rounds {
                publish_load(&s.publisher, &s.checker, "k", keys, per_round)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
        })
    };
    let mut members: Vec<Consumer> = (0..2).map(|_| s.spawn(&["1"])).collect();
    let started = Instant::now();
    let mut leaves = 0;
    // Until the producer is done: every two seconds the oldest member leaves and a new one joins.
    while !producer.is_finished() || started.elapsed() < Duration::from_secs(6) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        members.push(s.spawn(&["1"]));
        tokio::time::sleep(Duration::from_millis(500)).await;
        terminate(members.remove(0));
        leaves += 1;
    }
    producer.await.unwrap();
    let total = keys * rounds * per_round;
    wait_distinct(&s.log, total).await;
    for member in members {
        terminate(member);
    }
    let lines = read_log(&s.log);
    let report = replay(&s.checker, &s.log);
    let pids: HashSet<u32> = lines.iter().map(|l| l.pid).collect();
    let twice = lines.len() - total;
    eprintln!(
        "{protocol:?}: {leaves} leaves, {} processes, {} handled for {total} messages ({twice} twice)",
        pids.len(),
        lines.len()
    );
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, total as u64);
    assert!(pids.len() >= 4, "members came and went: {} processes", pids.len());
    // A leave drains and commits before its partitions move, so what is handled twice is what
    // finished after the last commit the broker accepted. Eager and KIP-848 revokes commit
    // within the generation that owns the partitions: about nothing. Under cooperative-sticky
    // a second rebalance starting while a revoke drains makes the broker refuse that member's
    // commits (IllegalGeneration / RebalanceInProgress, librdkafka issue #4059) until it
    // rejoins — seen: ~600 of 6,000 in one run of five.
    let bound = match protocol {
        Protocol::Cooperative => total / 5,
        Protocol::Eager | Protocol::Consumer => total / 100,
    };
    assert!(
        twice <= bound,
        "{twice} handled twice over {leaves} leaves (bound {bound})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_joining_and_leaving_cooperative_sticky() {
    churn(Protocol::Cooperative).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_joining_and_leaving_eager() {
    churn(Protocol::Eager).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_joining_and_leaving_kip848() {
    churn(Protocol::Consumer).await;
}

/// What the group had committed right after a kill, and how long the log was then.
struct Kill {
    log_len: usize,
    committed: BTreeMap<SourceId, (Option<u64>, Vec<u64>)>,
}

/// Messages handled again after a kill although the group had recorded them as finished: at or
/// below the committed watermark or in the commit's offset map. Also returns how many finished
/// offsets above the watermark the offset map carried over all kills.
fn rework_of_recorded(s: &Setup, lines: &[Line], kills: &[Kill]) -> (Vec<(i32, u64)>, usize) {
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
            let recorded = watermark.is_some_and(|w| l.offset <= w) || above.contains(&l.offset);
            if recorded && before.contains(&(l.partition, l.offset)) {
                again.push((l.partition, l.offset));
            }
        }
    }
    (again, mapped)
}

/// Publishes 15 × 100 probes, runs a consumer whose key k0 is slow (so its partition's
/// watermark lags while other keys finish above it) and SIGKILLs it three times mid-stream,
/// each time once the group's commits carry an offset map; a last one finishes. Nothing the
/// group recorded as finished — at or below a watermark, or in an offset map — is handled again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_members_skip_what_the_group_recorded_as_finished() {
    let Some(s) = Setup::new(3, Protocol::Cooperative).await else {
        return;
    };
    let (keys, per_key) = (15, 100);
    publish_load(&s.publisher, &s.checker, "k", keys, per_key)
        .await
        .unwrap();
    let total = keys * per_key;
    let mut kills = Vec::new();
    for round in 1..=3 {
        let victim = s.spawn(&["1", "k0=25"]);
        wait_distinct(&s.log, round * 300).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while s.committed(3).values().all(|(_, above)| above.is_empty()) {
            assert!(
                Instant::now() < deadline,
                "no commit carried an offset map within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        victim.kill();
        kills.push(Kill {
            log_len: read_log(&s.log).len(),
            committed: s.committed(3),
        });
    }
    let last = s.spawn(&["1", "k0=25"]);
    wait_distinct(&s.log, total).await;
    terminate(last);
    let lines = read_log(&s.log);
    let report = replay(&s.checker, &s.log);
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, total as u64);
    let (again, mapped) = rework_of_recorded(&s, &lines, &kills);
    eprintln!(
        "3 kills: {} lines for {total} messages, {} re-handled; the offset maps carried {mapped} \
         finished offsets above the watermarks",
        lines.len(),
        lines.len() - total
    );
    assert!(
        mapped > 0,
        "the slow key leaves finished offsets above the watermark"
    );
    assert!(
        again.is_empty(),
        "offsets the group recorded as finished were handled again: {again:?}"
    );
}

/// One partition; the first message of key k0 blocks its lane (its handler takes an hour), so
/// the watermark stays below it while thousands of other keys' messages finish above it. Once
/// the group's commit records all of them in its offset map, the member is SIGKILLed. The next
/// owner handles again exactly what was unfinished at the kill — k0's messages — and not one of
/// the finished offsets above the watermark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_head_with_thousands_finished_above_it_survives_a_kill() {
    let Some(s) = Setup::new(1, Protocol::Cooperative).await else {
        return;
    };
    let (keys, per_key) = (50, 80);
    // k0 first, so the blocked head is the partition's lowest offset.
    publish_probe(&s.publisher, &s.checker, probe_key("k", 0))
        .await
        .unwrap();
    for round in 0..per_key {
        for k in (0..keys).filter(|k| round > 0 || *k != 0) {
            publish_probe(&s.publisher, &s.checker, probe_key("k", k))
                .await
                .unwrap();
        }
    }
    let total = keys * per_key;
    let k0_messages = per_key;
    let victim = s.spawn(&["0", "k0=3600000"]);
    wait_distinct(&s.log, total - k0_messages).await;
    let finished: BTreeSet<u64> = read_log(&s.log).iter().map(|l| l.offset).collect();
    assert_eq!(finished.len(), total - k0_messages);
    // The kill lands once a commit recorded every finished offset above the head.
    let source = source_id(&s.topic, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let committed = loop {
        let committed = s.committed(1).remove(&source);
        if let Some((_, above)) = &committed {
            if above.len() == finished.len() {
                break committed.unwrap();
            }
        }
        assert!(
            Instant::now() < deadline,
            "the offset map never covered the {} finished offsets: {committed:?}",
            finished.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        committed.0, None,
        "the head is the lowest offset: no watermark yet"
    );
    assert_eq!(committed.1.iter().copied().collect::<BTreeSet<_>>(), finished);
    victim.kill();
    let at_kill = read_log(&s.log).len();
    let next = s.spawn(&["0"]);
    wait_distinct(&s.log, total).await;
    terminate(next);
    let lines = read_log(&s.log);
    let again: Vec<u64> = lines[at_kill..]
        .iter()
        .map(|l| l.offset)
        .filter(|o| finished.contains(o))
        .collect();
    let handled_next: BTreeSet<&str> = lines[at_kill..].iter().map(|l| l.key.as_str()).collect();
    eprintln!(
        "at the kill: {} finished above the head, {k0_messages} unfinished (the head in flight, \
         {} queued behind it); the next owner handled {}, {} of them already finished",
        finished.len(),
        k0_messages - 1,
        lines.len() - at_kill,
        again.len()
    );
    assert!(again.is_empty(), "finished offsets handled again: {again:?}");
    assert_eq!(lines.len() - at_kill, k0_messages, "exactly the unfinished ones");
    assert_eq!(handled_next.into_iter().collect::<Vec<_>>(), ["k0"]);
    let report = replay(&s.checker, &s.log);
    assert!(report.is_clean(), "{report:#?}");
}
