//! The redb store: header ids outlive the store and its process's engine (position ids do
//! not), retention forgets the oldest by count and by age, and an engine restarted on the reopened file skips what the one before
//! it finished — where a fresh in-memory store lets every message run again.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use convoy_core::{
    handler_fn, Delivery, Engine, EngineConfig, EventId, IdempotencyStore, MemoryIdempotencyStore,
    OutgoingMessage, Publisher, SourceId,
};
use convoy_store::{RedbIdempotencyStore, Retention};
use convoy_testkit::{MemoryBroker, MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};

/// A file of its own under the system's temporary directory, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str) -> TempFile {
        let unique = format!(
            "convoy-store-{name}-{}-{}.redb",
            std::process::id(),
            UNIX_EPOCH.elapsed().unwrap().as_nanos()
        );
        TempFile(std::env::temp_dir().join(unique))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn header(n: u64) -> EventId {
    EventId::Header(Bytes::from(format!("ev-{n}")))
}

#[tokio::test]
async fn ids_outlive_the_store() {
    let file = TempFile::new("outlive");
    let position = EventId::Position(SourceId::partition("orders", 3), 41);
    {
        let store = RedbIdempotencyStore::open(&file.0, Retention::default()).unwrap();
        assert!(!store.contains(&header(1)).await);
        store.insert(header(1)).await;
        assert_eq!(store.insert_now(position.clone()).map_err(|_| ()), Ok(()));
        // Known at once, written or on its way.
        assert_eq!(store.contains_now(&header(1)), Some(true));
        assert!(store.contains(&position).await);
    }
    let store = RedbIdempotencyStore::open(&file.0, Retention::default()).unwrap();
    assert_eq!(store.len(), 1, "only the header id went to the file");
    assert!(store.contains(&header(1)).await);
    assert!(!store.contains(&header(2)).await);
    // A position is remembered by its process only: a topic created again restarts offsets.
    assert!(!store.contains(&position).await);
    assert_eq!(store.failures(), 0);
}

#[tokio::test]
async fn retention_keeps_the_newest_ids_by_count() {
    let file = TempFile::new("count");
    let store = RedbIdempotencyStore::open(&file.0, Retention::unlimited().max_ids(100)).unwrap();
    for n in 0..250 {
        store.insert(header(n)).await;
    }
    assert!(store.flush());
    assert_eq!(store.len(), 100);
    for n in 0..150 {
        assert!(
            !store.contains(&header(n)).await,
            "ev-{n} is among the oldest: forgotten"
        );
    }
    for n in 150..250 {
        assert!(
            store.contains(&header(n)).await,
            "ev-{n} is among the newest: kept"
        );
    }
}

#[tokio::test]
async fn retention_forgets_ids_older_than_its_age() {
    let file = TempFile::new("age");
    let now = Arc::new(AtomicU64::new(1_790_000_000_000));
    let clock = {
        let now = now.clone();
        Arc::new(move || UNIX_EPOCH + Duration::from_millis(now.load(Ordering::Relaxed)))
    };
    let retention = Retention::unlimited().max_age(Duration::from_secs(60));
    let store = RedbIdempotencyStore::open_with_clock(&file.0, retention, clock).unwrap();
    for n in 0..10 {
        store.insert(header(n)).await;
    }
    assert!(store.flush());
    now.fetch_add(30_000, Ordering::Relaxed);
    store.insert(header(10)).await;
    assert!(store.flush());
    assert_eq!(store.len(), 11, "30 s old: kept");
    now.fetch_add(31_000, Ordering::Relaxed);
    store.insert(header(11)).await;
    assert!(store.flush());
    assert_eq!(store.len(), 2, "61 s old: forgotten; 31 s old and new: kept");
    assert!(!store.contains(&header(0)).await);
    assert!(store.contains(&header(10)).await && store.contains(&header(11)).await);
}

/// The child half of [`a_process_killed_mid_write_keeps_what_it_flushed`]: records 1,000 ids,
/// flushes, says so, then records ids without end until it is killed.
fn record_until_killed(path: &str) {
    let store = RedbIdempotencyStore::open(path, Retention::default()).unwrap();
    for n in 0..1_000 {
        assert!(store.insert_now(header(n)).is_ok());
    }
    assert!(store.flush());
    println!("flushed");
    for n in 1_000.. {
        let _ = store.insert_now(header(n));
        std::thread::yield_now();
    }
}

#[test]
fn a_process_killed_mid_write_keeps_what_it_flushed() {
    const CHILD: &str = "CONVOY_STORE_TEST_CHILD";
    if let Ok(path) = std::env::var(CHILD) {
        return record_until_killed(&path);
    }
    let file = TempFile::new("killed");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_process_killed_mid_write_keeps_what_it_flushed",
            "--nocapture",
        ])
        .env(CHILD, &file.0)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let flushed = std::io::BufRead::lines(std::io::BufReader::new(stdout))
        .map_while(Result::ok)
        .any(|line| line == "flushed");
    assert!(flushed, "the child process said it flushed");
    child.kill().unwrap(); // SIGKILL: no drop, no final sync, maybe mid-transaction
    assert!(!child.wait().unwrap().success());

    // The file opens (redb recovers what was committed) and holds every flushed id.
    let store = RedbIdempotencyStore::open(&file.0, Retention::default()).unwrap();
    assert!(store.len() >= 1_000, "{} ids", store.len());
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    for n in 0..1_000 {
        assert!(
            runtime.block_on(store.contains(&header(n))),
            "ev-{n} was flushed before the kill"
        );
    }
}

/// Publishes `count` messages of 10 keys with event ids `ev-0 …`.
async fn publish(broker: &MemoryBroker, count: u64) {
    let publisher = MemoryPublisher::new(broker, "orders");
    for n in 0..count {
        let message =
            OutgoingMessage::new(format!("k{}", n % 10), format!("{n}")).event_id(format!("ev-{n}"));
        publisher.publish(message).await.unwrap();
    }
}

/// Runs an engine of group `billing` with `store` until `count` messages finished; how many its
/// handler ran and how many it skipped as duplicates.
async fn drain(broker: &MemoryBroker, store: Arc<dyn IdempotencyStore>, count: u64) -> (u64, u64) {
    let ran = Arc::new(AtomicU64::new(0));
    let handler = {
        let ran = ran.clone();
        handler_fn(move |_d: Delivery| {
            let ran = ran.clone();
            async move {
                ran.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        })
    };
    let engine = Engine::builder(handler)
        .config(EngineConfig::for_group("billing"))
        .idempotency_store(store)
        .dead_letter_sink(MemoryDeadLetterSink::new(broker, "orders.dlq"))
        .build()
        .unwrap();
    let running = engine
        .start(&MemoryTransport::new(broker, "billing", &["orders"]))
        .await
        .unwrap();
    while running.stats().finished() < count {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let report = running.stop().await.unwrap();
    (ran.load(Ordering::Relaxed), report.stats.duplicates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_on_the_reopened_store_skips_what_ran_before() {
    let file = TempFile::new("engine");
    let broker = MemoryBroker::new();
    broker.create_topic("orders", 4);
    publish(&broker, 200).await;
    let store = Arc::new(RedbIdempotencyStore::open(&file.0, Retention::default()).unwrap());
    assert_eq!(drain(&broker, store.clone(), 200).await, (200, 0));
    drop(store); // the process ends: what it recorded is written and synced

    // The producer publishes the same 200 events again (a retry after a lost answer).
    publish(&broker, 200).await;
    let reopened = Arc::new(RedbIdempotencyStore::open(&file.0, Retention::default()).unwrap());
    assert_eq!(reopened.len(), 200);
    assert_eq!(
        drain(&broker, reopened, 200).await,
        (0, 200),
        "every event finished before is skipped"
    );

    // The control: a fresh in-memory store (what a restart had before) runs them all again.
    publish(&broker, 200).await;
    let fresh = Arc::new(MemoryIdempotencyStore::new(10_000));
    assert_eq!(drain(&broker, fresh, 200).await, (200, 0));
}
