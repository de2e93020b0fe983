//! Scenarios of the `convoy` binary against a real broker, run by each broker's test file with
//! its URL: dead-letter replay end to end, the benchmark, consume with Prometheus metrics,
//! escaped output lines and a drain aborted by a second Ctrl-C; consumer processes joining,
//! leaving and killed (`processes`); a cluster losing nodes, or a broker restarted and members
//! killed, under load from convoy's publisher or a foreign one (`failover`).

#![allow(clippy::unwrap_used, dead_code)] // shared by several test crates, each using a part

pub mod failover;
pub mod processes;
pub mod soak;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use convoy::{
    typed, Delivery, Engine, EngineConfig, HandlerError, MemoryIdempotencyStore, OutgoingMessage, Transport,
};

pub use convoy_testkit::support::unique;

/// Deletes what a connection to `url` declared for a topic (its queues or streams and the
/// dead-letter topic; on NATS the group's buckets) when dropped, even after a failure: the
/// machine's RabbitMQ and NATS are shared.
pub struct CleanUp(pub String, pub String);

impl Drop for CleanUp {
    fn drop(&mut self) {
        let (url, topic) = (self.0.clone(), self.1.clone());
        convoy_testkit::support::block_on_side(async move {
            if let Ok(connection) = convoy::connect(&url).await {
                let _ = connection.delete_topic(&topic).await;
            }
        });
    }
}

/// The interpreter of the interop virtualenv (`CONVOY_PYTHON`; scripts/test sets it).
pub fn python() -> Option<String> {
    convoy_testkit::support::required("CONVOY_PYTHON")
}

/// The path of a script in `scripts/interop/`.
pub fn interop_script(name: &str) -> String {
    convoy_testkit::support::repo_file(&format!("scripts/interop/{name}"))
}

pub fn convoy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

#[derive(serde::Deserialize)]
struct Entry {
    n: u32,
}

/// Runs an engine until `expected` messages finished; returns what the handler saw, in order.
async fn consume(
    connection: &convoy::Connection,
    store: Arc<MemoryIdempotencyStore>,
    fail_on: Option<u32>,
    expected: u64,
) -> Vec<(String, u32)> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let handler = typed(move |e: Entry, d: Delivery| {
        let seen = s.clone();
        async move {
            let key = d.message().key_display().into_owned();
            if Some(e.n) == fail_on && key == "acct-1" {
                return Err(HandlerError::terminal(format!("bug: cannot apply entry {}", e.n)));
            }
            seen.lock().unwrap().push((key, e.n));
            Ok(())
        }
    });
    let engine = Engine::builder(handler)
        .config(EngineConfig::for_group(connection.endpoint().group.clone()))
        .dead_letter_sink(connection.dead_letter_sink().unwrap())
        .idempotency_store(store)
        .build()
        .unwrap();
    let running = engine.spawn(connection.subscribe().await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(90);
    while {
        let s = running.stats();
        s.handled + s.dead_lettered + s.duplicates < expected
    } {
        assert!(Instant::now() < deadline, "not finished: {:?}", running.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = running.stop().await.unwrap();
    assert_eq!(
        report.stats.duplicates, 0,
        "nothing may be skipped as a duplicate"
    );
    let seen = seen.lock().unwrap().clone();
    seen
}

/// `convoy pause --key` on a running `convoy consume --control`: the key's messages wait (the
/// others are handled) until `convoy resume`, then run in order.
pub fn pause_and_resume(url: &str) {
    let port = convoy_testkit::support::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args([
            "--url",
            url,
            "consume",
            "--create",
            "--metrics-addr",
            &addr,
            "--control",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard = KillOnDrop(child.id());
    let deadline = Instant::now() + Duration::from_secs(60);
    // Ready: its endpoint answers (it binds before connecting) and says so.
    while std::net::TcpStream::connect(&addr).is_err() || !get(&addr, "/readyz").starts_with("HTTP/1.1 200") {
        assert!(Instant::now() < deadline, "the consumer never got ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    let paused = convoy(&["pause", "--addr", &addr, "--key", "held key"]);
    let stdout = String::from_utf8_lossy(&paused.stdout);
    assert!(
        paused.status.success(),
        "{}",
        String::from_utf8_lossy(&paused.stderr)
    );
    assert!(stdout.contains(r#""paused_keys":["held key"]"#), "{stdout}");

    // The printed lines, as they come.
    let (lines_tx, lines) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let input: String = (0..5)
        .flat_map(|n| [format!("held key\t{n}\n"), format!("free\t{n}\n")])
        .collect();
    let produced = convoy_with_input(&["--url", url, "produce"], input.as_bytes());
    assert!(
        produced.status.success(),
        "{}",
        String::from_utf8_lossy(&produced.stderr)
    );
    let next = || {
        lines
            .recv_timeout(Duration::from_secs(60))
            .expect("a line within 60 s")
    };
    let seq = |line: &str| line.rsplit(' ').next().unwrap().to_owned();
    let free: Vec<String> = (0..5).map(|_| next()).collect();
    assert!(
        free.iter().all(|l| l.contains("key=free")),
        "only the free key runs: {free:?}"
    );
    assert_eq!(
        free.iter().map(|l| seq(l)).collect::<Vec<_>>(),
        ["0", "1", "2", "3", "4"]
    );
    // The held key's messages arrived and wait in its lane.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !get(&addr, "/lanes").contains(r#""key":"held key""#) {
        assert!(Instant::now() < deadline, "the held key's messages never arrived");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(lines.try_recv().is_err(), "nothing of the held key ran");

    let resumed = convoy(&["resume", "--addr", &addr, "--key", "held key"]);
    assert!(String::from_utf8_lossy(&resumed.stdout).contains(r#""paused_keys":[]"#));
    let held: Vec<String> = (0..5).map(|_| next()).collect();
    assert!(held.iter().all(|l| l.contains("key=held key")), "{held:?}");
    assert_eq!(
        held.iter().map(|l| seq(l)).collect::<Vec<_>>(),
        ["0", "1", "2", "3", "4"]
    );

    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let status = wait_exit(&mut child);
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    std::mem::forget(guard);
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("stopped: 10 handled"), "{stderr}");
}

/// A dead letter replayed with `convoy dlq replay` after the handler is fixed is handled, in
/// order, before what its key gets next (one idempotency store across both runs). The listing
/// then marks it replayed; a second replay skips it (nothing runs again), and only `--force`
/// replays it again.
pub async fn dead_letter_replay(url: &str, topic: &str) {
    let (url, topic) = (url.to_owned(), topic.to_owned());
    let connection = convoy::connect(&url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(&topic).unwrap();
    let entry = |key: &str, n: u32| OutgoingMessage::new(key.to_owned(), format!(r#"{{"n":{n}}}"#));
    publisher
        .publish_all(
            (1..=3)
                .flat_map(|n| [entry("acct-1", n), entry("acct-2", n)])
                .collect(),
        )
        .await
        .unwrap();
    // One idempotency store for both runs: it remembers the dead-lettered original.
    let store = Arc::new(MemoryIdempotencyStore::new(10_000));

    // The buggy handler dead-letters acct-1's entry 2; the lane goes on with entry 3.
    let first = consume(&connection, store.clone(), Some(2), 6).await;
    let acct1: Vec<u32> = first
        .iter()
        .filter(|(k, _)| k == "acct-1")
        .map(|(_, n)| *n)
        .collect();
    assert_eq!(acct1, [1, 3]);

    // The operator names the group and the topic, not its partition count: the replay
    // partitions as the topic does (read from the broker), never by a default count.
    let url = url.replace("&partitions=4", "");
    let listed = convoy(&["--url", &url, "dlq", "list"]);
    let table = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(
        table.contains("acct-1") && table.contains("terminal") && table.contains("bug: cannot apply entry 2"),
        "{table}"
    );
    let as_json = convoy(&["--url", &url, "dlq", "list", "--json"]);
    let record: serde_json::Value = serde_json::from_slice(&as_json.stdout).unwrap();
    assert_eq!(record["key"], "acct-1");
    assert!(
        record["original_source"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{topic}/")),
        "{record}"
    );
    assert_eq!(record["cause"], "terminal");
    assert_eq!(record["replays"], 0);
    assert!(
        record["dead_lettered_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{record}"
    );

    // Nothing for acct-2: the selection is respected.
    let none = convoy(&["--url", &url, "dlq", "replay", "--key", "acct-2"]);
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("nothing to replay"),
        "{}",
        String::from_utf8_lossy(&none.stderr)
    );
    let replayed = convoy(&[
        "--url", &url, "dlq", "replay", "--key", "acct-1", "--reason", "bug",
    ]);
    let stderr = String::from_utf8_lossy(&replayed.stderr);
    assert!(
        replayed.status.success() && stderr.contains("replayed 1 dead letters"),
        "{stderr}"
    );

    // After the fix, the replayed entry is handled, then what acct-1 gets next.
    publisher.publish(entry("acct-1", 4)).await.unwrap();
    let second = consume(&connection, store.clone(), None, 2).await;
    assert_eq!(second, [("acct-1".to_owned(), 2), ("acct-1".to_owned(), 4)]);

    // The listing marks it replayed, with when.
    let listed = dead_letters(&url);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["replays"], 1, "{listed:?}");
    assert!(listed[0]["last_replayed_at"].as_str().is_some(), "{listed:?}");
    let table = convoy(&["--url", &url, "dlq", "list"]);
    assert!(String::from_utf8_lossy(&table.stdout).contains(" replayed "));

    // The same command again replays nothing: entry 2 does not run twice. Had it been
    // published again, it would arrive before entry 5 (one key, one partition) and be either
    // handled or skipped as a duplicate: `consume` fails on both.
    let again = convoy(&["--url", &url, "dlq", "replay", "--key", "acct-1"]);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        again.status.success()
            && stderr.contains("skipped 1 dead letters replayed before")
            && stderr.contains("nothing to replay"),
        "{stderr}"
    );
    publisher.publish(entry("acct-1", 5)).await.unwrap();
    let third = consume(&connection, store.clone(), None, 1).await;
    assert_eq!(third, [("acct-1".to_owned(), 5)]);

    // --force replays it again, under an id of its own: the same store lets it through, and
    // so does a broker that deduplicates by id (NATS within its window).
    let forced = convoy(&["--url", &url, "dlq", "replay", "--key", "acct-1", "--force"]);
    let stderr = String::from_utf8_lossy(&forced.stderr);
    assert!(
        forced.status.success() && stderr.contains("replayed 1 dead letters"),
        "{stderr}"
    );
    publisher.publish(entry("acct-1", 6)).await.unwrap();
    let fourth = consume(&connection, store, None, 2).await;
    assert_eq!(fourth, [("acct-1".to_owned(), 2), ("acct-1".to_owned(), 6)]);
    assert_eq!(dead_letters(&url)[0]["replays"], 2);
}

/// Runs an engine that parks keys until `expected` messages finished, failing the entries
/// `fails` names; what the handler ran, in order.
async fn consume_parking(
    connection: &convoy::Connection,
    fails: &'static [(&'static str, u32)],
    expected: u64,
) -> Vec<(String, u32)> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let handler = typed(move |e: Entry, d: Delivery| {
        let seen = s.clone();
        async move {
            let key = d.message().key_display().into_owned();
            if fails.iter().any(|(k, n)| *k == key && *n == e.n) {
                return Err(HandlerError::terminal(format!(
                    "cannot apply entry {} of {key}",
                    e.n
                )));
            }
            seen.lock().unwrap().push((key, e.n));
            Ok(())
        }
    });
    let mut config = EngineConfig::for_group(connection.endpoint().group.clone());
    config.park_keys = true;
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(connection.dead_letter_sink().unwrap())
        .build()
        .unwrap();
    let running = engine.spawn(connection.subscribe().await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(90);
    while running.stats().finished() < expected {
        assert!(Instant::now() < deadline, "not finished: {:?}", running.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.stop().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    seen
}

/// A parked key with thousands of messages set aside — more than one header can name — is
/// replayed whole by `convoy dlq replay --key`: its replay marker is written in parts, every
/// message handled once, in order, each dead letter listed as replayed once, the key unparked.
pub async fn a_parked_key_holding_thousands_replays_whole(url: &str, topic: &str) {
    const ENTRIES: u32 = 3_000;
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    let entries: Vec<OutgoingMessage> = (1..=ENTRIES)
        .map(|n| OutgoingMessage::new("acct-big", format!(r#"{{"n":{n}}}"#)))
        .collect();
    for batch in entries.chunks(500) {
        publisher.publish_all(batch.to_vec()).await.unwrap();
    }

    // Entry 1 fails: everything after it is set aside.
    let first = consume_parking(&connection, &[("acct-big", 1)], ENTRIES.into()).await;
    assert_eq!(first, []);
    let replayed = convoy(&["--url", url, "dlq", "replay", "--key", "acct-big"]);
    let stderr = String::from_utf8_lossy(&replayed.stderr);
    assert!(replayed.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "replayed parked key acct-big: {ENTRIES} messages in order"
        )),
        "{stderr}"
    );

    let second = consume_parking(&connection, &[], ENTRIES.into()).await;
    let expected: Vec<(String, u32)> = (1..=ENTRIES).map(|n| ("acct-big".to_owned(), n)).collect();
    assert!(
        second == expected,
        "not every entry once, in order: {} handled",
        second.len()
    );
    let listed = dead_letters(url);
    assert_eq!(listed.len(), ENTRIES as usize);
    assert!(listed.iter().all(|r| r["replays"] == 1), "{:?}", &listed[..3]);
    let still = convoy(&["--url", url, "dlq", "list"]);
    let stderr = String::from_utf8_lossy(&still.stderr);
    assert!(stderr.contains(", 0 keys parked in group"), "{stderr}");
}

/// `convoy dlq unpark` passes over a parked key's failed message with an audit record and
/// replays what was set aside behind it, in order; the listing marks the message skipped and
/// a replay leaves it out. `convoy dlq purge` hides dead letters from listings and replays,
/// and refuses a parked key's.
pub async fn unpark_and_purge(url: &str, topic: &str) {
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    let entry = |key: &str, n: u32| OutgoingMessage::new(key.to_owned(), format!(r#"{{"n":{n}}}"#));
    let mut entries: Vec<OutgoingMessage> = (1..=4).map(|n| entry("acct-1", n)).collect();
    entries.extend((1..=2).map(|n| entry("acct-3", n)));
    publisher.publish_all(entries).await.unwrap();

    // acct-1's entry 2 fails: 3 and 4 are set aside behind it. acct-3's entry 1 too.
    let first = consume_parking(&connection, &[("acct-1", 2), ("acct-3", 1)], 6).await;
    assert_eq!(first, [("acct-1".to_owned(), 1)]);

    let unparked = convoy(&[
        "--url",
        url,
        "dlq",
        "unpark",
        "--key",
        "acct-1",
        "--note",
        "fixed by hand, ticket 4711",
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&unparked.stdout),
        String::from_utf8_lossy(&unparked.stderr),
    );
    assert!(unparked.status.success(), "{stderr}");
    assert!(
        stdout.contains("passed over") && stdout.contains("key=acct-1"),
        "{stdout}"
    );
    assert!(
        stderr.contains("the 2 messages behind it replayed in order"),
        "{stderr}"
    );

    // Entries 3 and 4 run, in order; entry 2 does not. acct-3 stays parked.
    let second = consume_parking(&connection, &[], 2).await;
    assert_eq!(second, [("acct-1".to_owned(), 3), ("acct-1".to_owned(), 4)]);

    let listed = dead_letters(url);
    let head: Vec<_> = listed
        .iter()
        .filter(|r| r["key"] == "acct-1" && r["cause"] == "terminal")
        .collect();
    assert_eq!(head.len(), 1, "{listed:?}");
    assert!(
        head[0]["skipped_at"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{listed:?}"
    );
    assert_eq!(head[0]["replays"], 0, "{listed:?}");
    let table = String::from_utf8_lossy(&convoy(&["--url", url, "dlq", "list"]).stdout).into_owned();
    assert!(table.contains(" skipped "), "{table}");

    // A replay of acct-1 leaves its skipped message (and the replayed ones) alone.
    let replay = convoy(&["--url", url, "dlq", "replay", "--key", "acct-1"]);
    let stderr = String::from_utf8_lossy(&replay.stderr);
    assert!(
        replay.status.success()
            && stderr.contains("skipped 3 dead letters")
            && stderr.contains("nothing to replay"),
        "{stderr}"
    );
    let again = convoy(&[
        "--url", url, "dlq", "unpark", "--key", "acct-1", "--note", "twice",
    ]);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && stderr.contains("acct-1 is not parked"),
        "{stderr}"
    );

    // A parked key's dead letters are not purged; acct-1's are.
    let refused = convoy(&[
        "--url", url, "dlq", "purge", "--key", "acct-3", "--note", "closed",
    ]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("acct-3 is parked in group"),
        "{stderr}"
    );
    let dry = convoy(&[
        "--url",
        url,
        "dlq",
        "purge",
        "--key",
        "acct-1",
        "--note",
        "closed",
        "--dry-run",
    ]);
    assert!(String::from_utf8_lossy(&dry.stderr).contains("would purge 3 dead letters"));
    let purged = convoy(&[
        "--url",
        url,
        "dlq",
        "purge",
        "--key",
        "acct-1",
        "--note",
        "account closed",
    ]);
    let stderr = String::from_utf8_lossy(&purged.stderr);
    assert!(
        purged.status.success() && stderr.contains("purged 3 dead letters"),
        "{stderr}"
    );
    let listed = dead_letters(url);
    assert!(
        listed.iter().all(|r| r["key"] == "acct-3"),
        "purged ones are not listed: {listed:?}"
    );
    let with_purged = convoy(&["--url", url, "dlq", "list", "--json", "--purged"]);
    let purged_ones = String::from_utf8_lossy(&with_purged.stdout)
        .lines()
        .filter(|l| l.contains("\"purged_at\":\""))
        .count();
    assert_eq!(purged_ones, 3);
    let replay = convoy(&["--url", url, "dlq", "replay", "--key", "acct-1", "--force"]);
    assert!(
        String::from_utf8_lossy(&replay.stderr).contains("nothing to replay"),
        "a purged dead letter is never replayed, forced or not"
    );
}

/// `convoy dlq list --json`, one object per dead letter.
fn dead_letters(url: &str) -> Vec<serde_json::Value> {
    let listed = convoy(&["--url", url, "dlq", "list", "--json"]);
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .filter(|v: &serde_json::Value| v.get("parked_key").is_none())
        .collect()
}

/// `convoy bench` on the broker: every message finished in order, the baseline ran.
pub fn bench_seed(url: &str, transport: &str) {
    let out = convoy(&["--url", url, "bench", "--messages", "5000", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["transport"], transport);
    assert_eq!(
        (report["completed"].as_bool(), report["lost"].as_u64()),
        (Some(true), Some(0))
    );
    assert_eq!(report["order_violations"], 0);
    assert!(report["baseline_throughput_msg_s"].as_f64().unwrap() > 0.0);
}

fn handled_total(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("convoy_handled_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn scrape(addr: &str) -> String {
    get(addr, "/metrics")
}

/// Waits (at most a minute) until the consumer serving metrics at `addr` reports a lag of 0 on
/// every source it holds: everything it received is committed.
pub fn wait_lag_zero(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let page = scrape(addr);
        let lags: Vec<&str> = page
            .lines()
            .filter(|l| l.starts_with("convoy_source_lag{"))
            .collect();
        if !lags.is_empty() && lags.iter().all(|l| l.ends_with(" 0")) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "lag never came to 0 everywhere at {addr}: {lags:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `GET path` from the consumer's endpoint: the whole response, status line first.
pub fn get(addr: &str, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// `convoy produce` then `convoy consume`: per-key ordered lines, Prometheus metrics, a
/// graceful stop on SIGINT.
pub fn consume_prints_and_serves_metrics(url: &str) {
    let url = url.to_owned();
    let mut produce = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", &url, "produce", "--generate", "200", "--keys", "5"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(produce.wait().unwrap().success());

    let port = convoy_testkit::support::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", &url, "consume", "--metrics-addr", &addr])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard = KillOnDrop(child.id());
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut per_key: std::collections::HashMap<String, Vec<u64>> = Default::default();
    for _ in 0..200 {
        let line = lines.next().unwrap().unwrap();
        // "<topic>/<p>@<offset> key=<key> attempt=<n> {"key":..,"seq":..}"
        let key = line
            .split(" key=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_owned();
        let seq: u64 = line
            .rsplit("\"seq\":")
            .next()
            .unwrap()
            .trim_end_matches('}')
            .parse()
            .unwrap();
        assert!(line.contains("attempt=1"), "{line}");
        per_key.entry(key).or_default().push(seq);
    }
    assert_eq!(per_key.len(), 5);
    for seqs in per_key.values() {
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "per-key order: {seqs:?}");
    }
    // The handler prints before the engine counts the message as handled: wait for the count
    // instead of assuming which of the two happened first.
    let deadline = Instant::now() + Duration::from_secs(60);
    let metrics = loop {
        let metrics = scrape(&addr);
        if handled_total(&metrics) >= 200.0 || Instant::now() >= deadline {
            break metrics;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(metrics.starts_with("HTTP/1.1 200 OK"), "{metrics}");
    for name in [
        "convoy_handled_total",
        "convoy_active_lanes",
        "convoy_in_flight",
        "convoy_handler_duration_seconds",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
    assert_eq!(handled_total(&metrics), 200.0);
    // Help text, histograms (buckets add up across replicas), and sources labelled by topic
    // and partition (the gauges come with the next lag query: wait for them).
    assert!(metrics.contains("# HELP convoy_handled_total"), "{metrics}");
    // Help texts name the label values their series carry, and say what a gauge counts.
    let help = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("# HELP {name} ")))
            .unwrap_or_else(|| panic!("no help for {name}:\n{metrics}"))
            .to_owned()
    };
    for (name, label) in [
        ("convoy_dead_lettered_total", "cause"),
        ("convoy_handled_total", "outcome"),
    ] {
        let text = help(name);
        let values: std::collections::BTreeSet<&str> = metrics
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter_map(|l| l.split(&format!("{label}=\"")).nth(1)?.split('"').next())
            .collect();
        assert!(!values.is_empty(), "no {name} series:\n{metrics}");
        for value in values {
            assert!(
                text.contains(value),
                "the help of {name} does not name {label} {value}: {text}"
            );
        }
    }
    assert!(help("convoy_dead_lettered_total").contains("retries-exhausted"));
    assert!(
        help("convoy_in_flight").contains("queued in lanes"),
        "{}",
        help("convoy_in_flight")
    );
    assert!(
        metrics.contains("convoy_handler_duration_seconds_bucket{"),
        "{metrics}"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !scrape(&addr)
        .lines()
        .any(|l| l.starts_with("convoy_source_lag{") && l.contains("partition=\""))
    {
        assert!(
            Instant::now() < deadline,
            "no convoy_source_lag with topic and partition labels"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Everything handled and committed: every source's lag comes to 0 — the empty ones' too
    // (5 keys leave partitions without messages), which alerts and autoscalers read.
    wait_lag_zero(&addr);
    // Alive, ready (it holds sources, its commits go through), the live view, nothing else.
    assert!(get(&addr, "/healthz").starts_with("HTTP/1.1 200"));
    let ready = get(&addr, "/readyz");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    assert!(get(&addr, "/anything").starts_with("HTTP/1.1 404"));
    let lanes = get(&addr, "/lanes");
    let body = lanes.split("\r\n\r\n").nth(1).unwrap_or_default();
    let view: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {lanes}"));
    assert!(!view["sources"].as_array().unwrap().is_empty(), "{view}");
    assert_eq!(view["totals"]["handled"], 200, "{view}");
    let table = convoy(&["lanes", "--addr", &addr]);
    let shown = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.status.success(),
        "{}",
        String::from_utf8_lossy(&table.stderr)
    );
    assert!(
        shown.contains("handled 200") && shown.contains("watermark"),
        "{shown}"
    );
    // Pauses only when the consumer was started to take them.
    let refused = convoy(&["pause", "--addr", &addr, "--key", "k1"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("--control"),
        "{stderr}"
    );
    // Ctrl-C: drain, commit, leave, report.
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let status = wait_exit(&mut child);
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    std::mem::forget(guard); // exited and reaped: its pid may be reused
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("stopped: 200 handled"), "{stderr}");
}

/// Waits for `child` to exit, at most two minutes (a test never hangs on a process).
pub fn wait_exit(child: &mut std::process::Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the process did not exit within 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn interrupt(child: &std::process::Child) {
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
}

fn gauge(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A second Ctrl-C aborts a drain that would otherwise wait for its timeout (30 s) behind
/// messages taking a minute; and one message is one output line whatever its payload holds.
pub async fn second_ctrl_c(url: &str, topic: &str) {
    let (url, topic) = (url.to_owned(), topic.to_owned());
    let connection = convoy::connect(&url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(&topic).unwrap();
    for (key, payload) in [("k1", "line one\nstill one"), ("k2", "tab\there")] {
        publisher
            .publish(OutgoingMessage::new(key, payload))
            .await
            .unwrap();
    }
    let port = convoy_testkit::support::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    // Every message takes a minute: the drain can only end by its timeout, or a second Ctrl-C.
    let mut child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args([
            "--url",
            &url,
            "consume",
            "--work-ms",
            "60000",
            "--metrics-addr",
            &addr,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard = KillOnDrop(child.id());
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    // Both messages are in their handlers once the engine holds two.
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(&addr).is_err() || gauge(&scrape(&addr), "convoy_in_flight") < 2.0 {
        assert!(Instant::now() < deadline, "the consumer never took both messages");
        std::thread::sleep(Duration::from_millis(50));
    }
    interrupt(&child);
    let mut seen = Vec::new();
    for line in stderr.by_ref() {
        let line = line.unwrap();
        let draining = line.contains("SIGINT: stopping");
        seen.push(line);
        if draining {
            break;
        }
    }
    interrupt(&child);
    let status = wait_exit(&mut child);
    let rest: Vec<String> = stderr.map_while(Result::ok).collect();
    std::mem::forget(guard); // exited and reaped: its pid may be reused
    let all = [seen, rest].concat().join("\n");
    assert_eq!(status.code(), Some(130), "{all}");
    assert!(all.contains("second SIGINT: aborting the drain"), "{all}");
    assert!(all.contains("2 cancelled unfinished"), "{all}");

    // Never finished, so never committed: consumed again, each on one line, escaped.
    let output = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", &url, "consume", "--max-messages", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(
        lines[0].ends_with("key=k1 attempt=1 line one\\nstill one"),
        "{stdout}"
    );
    assert!(lines[1].ends_with("key=k2 attempt=1 tab\\there"), "{stdout}");
}

/// `convoy consume | head -1`: once the reader of stdout has gone, the consumer stops at once,
/// with exit status 0, having committed only what it printed. Nothing is dead-lettered, and
/// what it could not print is handled by the next consumer.
pub async fn closed_stdout(url: &str, topic: &str) {
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    publisher.publish(OutgoingMessage::new("k0", "m0")).await.unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", url, "--log-format", "json", "consume"])
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard = KillOnDrop(child.id());
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(first.trim_end().ends_with("key=k0 attempt=1 m0"), "{first}");
    drop(stdout); // as `head -1` does once it has its line
                  // Published after the reader went: none of these can be printed.
    for n in 1..20 {
        publisher
            .publish(OutgoingMessage::new(format!("k{}", n % 4), format!("m{n}")))
            .await
            .unwrap();
    }
    let status = wait_exit(&mut child);
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    std::mem::forget(guard); // exited and reaped: its pid may be reused
    assert!(
        status.success(),
        "a closed stdout is not a failure: {status:?}\n{stderr}"
    );
    assert!(stderr.contains("stdout closed: stopping"), "{stderr}");
    assert!(stderr.contains("stopped: 1 handled, 0 dead-lettered"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Its log lines are JSON objects (--log-format json), without colours on a pipe.
    let logged: Vec<serde_json::Value> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(
        logged
            .iter()
            .any(|l| l["level"] == "INFO" && l["fields"]["message"].is_string()),
        "{stderr}"
    );
    assert!(!stderr.contains('\u{1b}'), "no colours on a pipe: {stderr}");

    // The other 19 were never committed: the next consumer prints each of them once.
    let output = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", url, "consume", "--max-messages", "19"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut payloads: Vec<u32> = stdout
        .lines()
        .filter_map(|l| l.rsplit(" m").next()?.parse().ok())
        .collect();
    payloads.sort_unstable();
    assert_eq!(payloads, (1..20).collect::<Vec<u32>>(), "{stdout}");
    let listed = convoy(&["--url", url, "dlq", "list"]);
    let said = String::from_utf8_lossy(&listed.stderr);
    assert!(
        said.lines().any(|l| l.starts_with("0 dead letters")),
        "nothing is dead-lettered: {said}"
    );
}

/// Listings whose reader closed stdout before the first line (`| head -0`) end quietly with
/// exit status 0, never with a panic. `url` names the topic and its group.
pub async fn listings_to_a_closed_stdout(url: &str) {
    convoy::connect(url).await.unwrap().create_topics().await.unwrap();
    for args in [
        &["topic", "list"][..],
        &["topic", "list", "--json"],
        &["dlq", "list"],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_convoy"))
            .args(["--url", url])
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "convoy {args:?} | head -0: {:?}\n{stderr}",
            out.status
        );
        assert!(
            !stderr.contains("panicked"),
            "convoy {args:?} | head -0:\n{stderr}"
        );
    }
}

/// Kills the consumer if an assertion fails first, so no process outlives the test.
pub struct KillOnDrop(pub u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-KILL", &self.0.to_string()]).status();
    }
}

/// `convoy produce` then `convoy consume` through a secured listener at `url` (TLS, a CA the
/// test made, the broker's own login), every message printed once; then the same with
/// `refused_url` (a wrong password, or no trust in the CA) ends at once with an error whose text
/// has `says`.
pub fn secured_produce_and_consume(url: &str, refused_url: &str, says: &str) {
    let produced = convoy(&["--url", url, "produce", "--generate", "200", "--keys", "10"]);
    assert!(
        produced.status.success(),
        "{}",
        String::from_utf8_lossy(&produced.stderr)
    );
    let consumed = convoy(&["--url", url, "consume", "--max-messages", "200"]);
    assert!(
        consumed.status.success(),
        "{}",
        String::from_utf8_lossy(&consumed.stderr)
    );
    let lines = String::from_utf8_lossy(&consumed.stdout)
        .lines()
        .filter(|l| l.contains(" key="))
        .count();
    assert!(lines >= 200, "{lines} of 200 messages printed");

    let started = Instant::now();
    let refused = convoy(&["--url", refused_url, "consume", "--max-messages", "1"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    println!("refused after {:?}: {stderr}", started.elapsed());
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(says), "{stderr}");
}

/// `convoy topic create`, `list` and `delete` on the broker `url` names: the topic appears with
/// its partitions (and, where groups are declared — RabbitMQ — the group), then goes.
pub fn topic_commands(url: &str, topic: &str, lists_groups: bool) {
    let ok = |out: Output| {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let created = convoy(&[
        "--url",
        url,
        "topic",
        "create",
        topic,
        "--partitions",
        "3",
        "--for-group",
        "billing",
    ]);
    let said = String::from_utf8_lossy(&created.stderr).into_owned();
    ok(created);
    // What create says of the group agrees with what list shows of it.
    match lists_groups {
        true => assert!(said.contains("for groups billing"), "{said}"),
        false => assert!(said.contains("--for-group matters only on RabbitMQ"), "{said}"),
    }
    let listed = ok(convoy(&["--url", url, "topic", "list", "--json"]));
    let entry: serde_json::Value = listed
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|t| t["topic"] == topic)
        .unwrap_or_else(|| panic!("{topic} not listed: {listed}"));
    assert_eq!(entry["partitions"], 3, "{entry}");
    match lists_groups {
        true => assert_eq!(entry["groups"], serde_json::json!(["billing"]), "{entry}"),
        false => assert_eq!(entry["groups"], serde_json::json!([]), "{entry}"),
    }
    // A topic made with 3 partitions is used as it is, without naming its count again.
    let produced = convoy_with_input(&["--url", url, "--topic", topic, "produce"], b"k1\tv1\n");
    assert!(
        produced.status.success(),
        "{}",
        String::from_utf8_lossy(&produced.stderr)
    );
    let consumed = ok(convoy(&[
        "--url",
        url,
        "--topic",
        topic,
        "--group",
        "billing",
        "consume",
        "--max-messages",
        "1",
    ]));
    assert!(consumed.trim_end().ends_with("key=k1 attempt=1 v1"), "{consumed}");
    ok(convoy(&[
        "--url",
        url,
        "topic",
        "delete",
        topic,
        "--for-group",
        "billing",
    ]));
    // Kafka deletes a topic asynchronously: it leaves the listing within moments.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let listed = ok(convoy(&["--url", url, "topic", "list", "--json"]));
        if !listed.lines().any(|l| l.contains(&format!("\"{topic}\""))) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{topic} still listed 30 s after delete: {listed}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // What convoy keeps on a delete is named: on NATS a group's buckets, shared with its other
    // topics, unless the delete names the group.
    let kept = format!("{topic}-kept");
    ok(convoy(&[
        "--url",
        url,
        "topic",
        "create",
        &kept,
        "--partitions",
        "1",
    ]));
    let deleted = convoy(&["--url", url, "topic", "delete", &kept]);
    let said = String::from_utf8_lossy(&deleted.stderr).into_owned();
    ok(deleted);
    assert_eq!(
        said.contains("kept: the state of the groups that read it"),
        url.starts_with("nats"),
        "{said}"
    );
    // What does not exist is said so, and a typo creates nothing.
    let missing = format!("{topic}-nosuch");
    let deleted = convoy(&["--url", url, "topic", "delete", &missing]);
    assert!(!deleted.status.success());
    let said = String::from_utf8_lossy(&deleted.stderr);
    assert!(
        said.contains(&format!("topic {missing} does not exist")),
        "{said}"
    );
    let typo = convoy(&["--url", url, "--topic", &missing, "consume"]);
    assert!(!typo.status.success());
    let said = String::from_utf8_lossy(&typo.stderr);
    assert!(
        said.contains(&format!("topic {missing} does not exist")),
        "{said}"
    );
    assert!(said.contains("--create"), "{said}");
    let listed = ok(convoy(&["--url", url, "topic", "list", "--json"]));
    assert!(!listed.contains(&missing), "a typo created {missing}: {listed}");
}

/// Runs `convoy` with `input` on its stdin.
pub fn convoy_with_input(args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// A broker outage under a running `convoy consume` is not passed in silence (issue 21, item
/// 4): with the default log level the consumer says when the broker went away (`says_lost`,
/// once) and when it is back (`says_back`). `down` kills the broker, `up` brings it back.
pub fn an_outage_is_logged(
    url: &str,
    says_lost: &str,
    says_back: &str,
    down: impl FnOnce(),
    up: impl FnOnce(),
) {
    let mut consume = Command::new(env!("CARGO_BIN_EXE_convoy"));
    consume
        .args(["--url", url, "consume", "--create"])
        .env_remove("RUST_LOG");
    if let Ok(filter) = std::env::var("CONVOY_TEST_CHILD_LOG") {
        consume.env("RUST_LOG", filter); // to read what happened in a failure
    }
    let mut child = consume
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let guard = KillOnDrop(child.id());
    let (line_tx, lines) = std::sync::mpsc::channel::<String>();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line_tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    let wait_for = |what: &str, seen: &mut Vec<String>| {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    let found = line.contains(what);
                    seen.push(line);
                    if found {
                        return Instant::now();
                    }
                }
                Err(_) => panic!("the consumer never said {what:?}; it said:\n{}", seen.join("\n")),
            }
        }
    };
    wait_for("source assigned", &mut seen);
    let killed = Instant::now();
    down();
    let said_lost = wait_for(says_lost, &mut seen);
    up();
    let back = Instant::now();
    let said_back = wait_for(says_back, &mut seen);
    println!(
        "outage: said {says_lost:?} {:?} after the kill, {says_back:?} {:?} after the broker was back",
        said_lost - killed,
        said_back.saturating_duration_since(back)
    );
    let lost_lines = seen.iter().filter(|l| l.contains(says_lost)).count();
    assert_eq!(
        lost_lines,
        1,
        "the outage is said once, not on every retry:\n{}",
        seen.join("\n")
    );
    interrupt(&child);
    let status = wait_exit(&mut child);
    std::mem::forget(guard);
    assert!(status.success(), "{}", seen.join("\n"));
}

/// What an operator gets wrong is named, through the binary: a key parked in another group
/// than the command names (none named: `convoy`), `--reason` on a parked key, `CONVOY_GROUP`
/// against the URL's `group=`, an empty offset range, a misspelled topic or `--forward-to`;
/// and the dead-letter topic `topic delete` keeps is named and deletable. `base` is the
/// broker's URL with `?topics=<topic>` and no group.
pub fn operator_mistakes(base: &str, topic: &str) {
    let group = unique("billing");
    let url = format!("{base}&group={group}");
    let stderr = |out: &Output| String::from_utf8_lossy(&out.stderr).into_owned();
    let ok = |out: Output| {
        assert!(out.status.success(), "{}", stderr(&out));
        stderr(&out)
    };
    let fails_with = |out: Output, text: &str| {
        assert!(
            !out.status.success(),
            "should fail with {text:?}: {}",
            stderr(&out)
        );
        assert!(stderr(&out).contains(text), "{text:?} not in: {}", stderr(&out));
    };
    ok(convoy(&[
        "--url",
        &url,
        "topic",
        "create",
        topic,
        "--partitions",
        "2",
        "--for-group",
        &group,
    ]));
    fails_with(
        convoy(&["--url", &url, "topic", "create", topic, "--partitions", "4"]),
        "exists with 2 partitions, not 4",
    );
    ok(convoy_with_input(
        &["--url", &url, "produce"],
        b"acct-1\tpoison\nacct-1\tafter\n",
    ));
    let consumed = ok(convoy(&[
        "--url",
        &url,
        "consume",
        "--park-keys",
        "--fail-on",
        "poison",
        "--max-messages",
        "2",
        "--quiet",
    ]));
    assert!(
        consumed.contains("1 dead-lettered, 1 set aside behind a parked key"),
        "{consumed}"
    );
    // Binary payloads print as `produce --payload-encoding` reads them.
    ok(convoy_with_input(
        &["--url", &url, "produce", "--payload-encoding", "base64"],
        b"acct-2\t/w==\n",
    ));
    let printed = convoy(&[
        "--url",
        &url,
        "consume",
        "--payload-encoding",
        "base64",
        "--max-messages",
        "1",
    ]);
    let line = String::from_utf8_lossy(&printed.stdout).into_owned();
    ok(printed);
    assert!(
        line.contains("key=acct-2") && line.trim_end().ends_with(" /w=="),
        "{line}"
    );

    // No group named: the command's is `convoy`, and the key is parked in another.
    let listed = ok(convoy(&["--url", base, "dlq", "list"]));
    assert!(
        listed.contains(&format!("1 keys parked in group {group} (acct-1)")),
        "{listed}"
    );
    fails_with(
        convoy(&["--url", base, "dlq", "replay", "--key", "acct-1"]),
        &format!("acct-1 is parked in group {group}, not in convoy"),
    );
    fails_with(
        convoy(&[
            "--url", &url, "dlq", "replay", "--key", "acct-1", "--reason", "poison",
        ]),
        "a parked key is replayed whole",
    );
    // A stale CONVOY_GROUP does not move the command to another group than its URL names.
    let stale = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", &url, "dlq", "list"])
        .env("CONVOY_GROUP", "someone-else")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let listed = ok(stale);
    assert!(
        listed.contains(&format!("1 keys parked in group {group}\n")) && !listed.contains("someone-else"),
        "{listed}"
    );
    fails_with(
        convoy(&["--url", &url, "dlq", "list", "--offsets", "5..2"]),
        "is empty",
    );
    let misspelled = url.replace(&format!("topics={topic}"), &format!("topics={topic}x"));
    fails_with(convoy(&["--url", &misspelled, "dlq", "list"]), "does not exist");
    fails_with(
        convoy(&[
            "--url",
            &url,
            "consume",
            "--forward-to",
            &format!("{topic}-typo"),
            "--max-messages",
            "1",
        ]),
        "(--forward-to) does not exist",
    );

    // `/lanes` counts what a parked key set aside, beside what was handled and dead-lettered.
    ok(convoy_with_input(
        &["--url", &url, "produce"],
        b"acct-3\tpoison\nacct-3\tafter\nacct-4\tfine\n",
    ));
    let addr = format!("127.0.0.1:{}", convoy_testkit::support::free_port().unwrap());
    let mut consume = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args([
            "--url",
            &url,
            "consume",
            "--park-keys",
            "--fail-on",
            "poison",
            "--quiet",
        ])
        .args(["--metrics-addr", &addr])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _kill = KillOnDrop(consume.id());
    let deadline = Instant::now() + Duration::from_secs(60);
    let totals = loop {
        if std::net::TcpStream::connect(&addr).is_ok() {
            let lanes = get(&addr, "/lanes");
            let body = lanes.split("\r\n\r\n").nth(1).unwrap_or_default();
            if let Ok(view) = serde_json::from_str::<serde_json::Value>(body) {
                let totals = view["totals"].clone();
                let count = |what: &str| totals[what].as_u64().unwrap_or(0);
                if count("handled") + count("dead_lettered") + count("parked") >= 3 {
                    break totals;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "/lanes never counted the three messages"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        (&totals["handled"], &totals["dead_lettered"], &totals["parked"]),
        (
            &serde_json::json!(1),
            &serde_json::json!(1),
            &serde_json::json!(1)
        ),
        "{totals}"
    );
    let interrupted = Command::new("kill")
        .args(["-INT", &consume.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    assert!(wait_exit(&mut consume).success());

    let dlq = format!("{topic}.dlq");
    let deleted = ok(convoy(&[
        "--url",
        &url,
        "topic",
        "delete",
        topic,
        "--for-group",
        &group,
    ]));
    assert!(
        deleted.contains(&format!("kept: its dead-letter topic {dlq}")),
        "{deleted}"
    );
    let deleted = ok(convoy(&["--url", &url, "topic", "delete", &dlq]));
    assert!(deleted.contains(&format!("topic {dlq} deleted")), "{deleted}");
    fails_with(
        convoy(&["--url", &url, "topic", "delete", &dlq]),
        "does not exist",
    );
}
