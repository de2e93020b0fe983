//! The fence of a member cut off without a close (issue 25, item 8), with a long backlog in
//! hand: frozen (its whole runtime stalled, as SIGSTOP or a VM pause would), or behind a silent
//! network partition (the testkit's proxy stops forwarding, sockets stay open). The broker drops
//! its connection after a heartbeat timeout and another member takes the partitions; the
//! cut-off member must have stopped starting work before that — its connection's lease ran
//! out — so it starts 0 messages after the next owner started its first.
//!
//! Without the lease the frozen member, thawed, went on through what it had in hand before it
//! heard its connection was gone. The partitioned one was saved by its own heartbeat check
//! noticing the silence first — luck of timing the lease now makes a guarantee.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use convoy_amqp::{AmqpConfig, AmqpDeadLetterSink, AmqpTransport};
use convoy_core::{Delivery, Engine, EngineHandle, Handler, HandlerError};
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{decode_seq, publish_load};
use convoy_testkit::OrderChecker;

const LIMIT: Duration = Duration::from_secs(120);
const HEARTBEAT_S: u16 = 3;

/// Every attempt started, in one order over both members.
#[derive(Default)]
struct Starts {
    next: AtomicU64,
    /// (member, order of the start).
    log: Mutex<Vec<(&'static str, u64)>>,
}

impl Starts {
    fn of(&self, member: &str) -> Vec<u64> {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter(|(m, _)| *m == member)
            .map(|(_, n)| *n)
            .collect()
    }
}

/// Records each start, works `work`, then tells the checker.
struct Recording {
    member: &'static str,
    work: Duration,
    starts: Arc<Starts>,
    checker: Arc<OrderChecker>,
}

#[async_trait]
impl Handler for Recording {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        {
            let mut log = self.starts.log.lock().unwrap();
            log.push((self.member, self.starts.next.fetch_add(1, SeqCst)));
        }
        let key = delivery.key().cloned().unwrap_or_default();
        let seq = decode_seq(delivery.payload()).ok_or_else(|| HandlerError::terminal("no probe"))?;
        let guard = self.checker.enter(&key);
        tokio::time::sleep(self.work).await; // the handler's own work
        guard.handled(seq, None);
        Ok(())
    }
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The bed both tests share: a 2-partition topic, 8 keys × 100 messages published (ten
/// seconds of the first member's work per key, far longer than the broker takes to notice it is
/// gone), heartbeats every `HEARTBEAT_S`.
struct Fence {
    bed: common::AmqpBed,
    checker: Arc<OrderChecker>,
    starts: Arc<Starts>,
}

impl Fence {
    async fn new(uri: &str) -> Fence {
        let mut bed = common::AmqpBed::new(uri, 2).await;
        bed.config.heartbeat_s = HEARTBEAT_S;
        let checker = Arc::new(OrderChecker::new());
        let publisher = convoy_amqp::AmqpPublisher::new(&bed.config, &bed.topic);
        publish_load(&publisher, &checker, "key-", 8, 100).await.unwrap();
        Fence {
            bed,
            checker,
            starts: Arc::default(),
        }
    }

    /// A member whose every attempt takes `work`, connecting with `config`.
    async fn member(&self, member: &'static str, work: Duration, config: AmqpConfig) -> EngineHandle {
        Engine::builder(Recording {
            member,
            work,
            starts: self.starts.clone(),
            checker: self.checker.clone(),
        })
        .config(test_config(&self.bed.config.group))
        .dead_letter_sink(Arc::new(AmqpDeadLetterSink::new(&self.bed.config)))
        .build()
        .unwrap()
        .start(&AmqpTransport::new(config).unwrap())
        .await
        .unwrap()
    }

    /// The first member is well into its backlog.
    async fn first_at_work(&self) {
        wait_for("the first member is at work", || {
            self.starts.of("cut-off").len() >= 16
        })
        .await;
    }

    /// The next owner took over and finished everything; the cut-off member started nothing
    /// after the next owner's first start.
    async fn nothing_started_after_the_move(&self) {
        assert!(
            self.checker.wait_complete(LIMIT).await,
            "the next owner did not finish the partitions: {:?}",
            self.checker.report()
        );
        let first_of_next = self.starts.of("next owner").into_iter().min().unwrap();
        let late: Vec<u64> = self
            .starts
            .of("cut-off")
            .into_iter()
            .filter(|n| *n > first_of_next)
            .collect();
        assert!(
            late.is_empty(),
            "the cut-off member started {} messages after the next owner started (starts {late:?}, next owner's first {first_of_next})",
            late.len()
        );
    }

    /// Nothing lost, no key overtaken; two calls of a key overlapped at most `overlaps` times.
    fn all_handled_in_order(&self, overlaps: u64) {
        let report = self.checker.report();
        assert_eq!((report.lost, report.order_violations), (0, 0), "{report:#?}");
        assert!(report.overlaps <= overlaps, "{report:#?}");
        assert_eq!(report.finished, 800, "every message handled");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cut_off_silently_starts_nothing_after_its_partitions_moved() {
    let Some(uri) = common::uri() else {
        return;
    };
    let fence = Fence::new(&uri).await;
    let (proxy, through_proxy) = common::behind_proxy(&uri, &fence.bed.config).await;
    let cut_off = fence
        .member("cut-off", Duration::from_millis(100), through_proxy)
        .await;
    fence.first_at_work().await;
    proxy.stall();
    let next_owner = fence
        .member("next owner", Duration::from_millis(1), fence.bed.config.clone())
        .await;
    fence.nothing_started_after_the_move().await;
    proxy.resume();
    next_owner.stop().await.unwrap();
    cut_off.stop().await.unwrap();
    fence.all_handled_in_order(0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_member_starts_nothing_after_its_partitions_moved() {
    let Some(uri) = common::uri() else { return };
    let fence = Arc::new(Fence::new(&uri).await);
    // Through a proxy only to keep it from rejoining while the test looks: once thawed it
    // reconnects, rightly takes partitions again, and would start their messages anew.
    let (proxy, through_proxy) = common::behind_proxy(&uri, &fence.bed.config).await;
    // The member to freeze runs on a runtime of its own, on one thread: a task that blocks that
    // thread stops everything of the member — reading, heartbeats, timers, lanes — at once.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let frozen_rt = runtime.handle().clone();
    let (end_tx, end_rx) = tokio::sync::oneshot::channel::<()>();
    let driver = std::thread::spawn(move || runtime.block_on(end_rx));
    let cut_off = {
        let (fence, config) = (fence.clone(), through_proxy);
        frozen_rt
            .spawn(async move { fence.member("cut-off", Duration::from_millis(100), config).await })
            .await
            .unwrap()
    };
    fence.first_at_work().await;
    let (thaw, thawed) = std::sync::mpsc::channel::<()>();
    frozen_rt.spawn(async move {
        let _ = thawed.recv(); // blocks the member's only thread until thawed
    });
    let next_owner = fence
        .member("next owner", Duration::from_millis(1), fence.bed.config.clone())
        .await;
    // Thawed once the next owner is at work on the partitions.
    wait_for("the next owner took over", || {
        !fence.starts.of("next owner").is_empty()
    })
    .await;
    proxy.stall();
    thaw.send(()).unwrap();
    fence.nothing_started_after_the_move().await;
    proxy.resume();
    next_owner.stop().await.unwrap();
    frozen_rt
        .spawn(async move { cut_off.stop().await })
        .await
        .unwrap()
        .unwrap();
    let _ = end_tx.send(());
    driver.join().unwrap().unwrap();
    // A call in progress when the member froze finishes when it thaws (no engine can take a
    // running call back; the lease stops what has not started): one per key at most, overlapping
    // the next owner's handling of that key.
    fence.all_handled_in_order(8);
}
