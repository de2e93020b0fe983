//! A revoked, lost or aborted source is never handled by two members at once: revokes carry a
//! deadline the engine cancels by, cancelling drops every handler future before anyone hears
//! back, commits never hold the intake up, and the drain timeout is checked against the
//! transport's revoke timeout. On a paused clock, with a scripted transport where the test
//! plays the broker, plus a chaos run of engines aborted at random on a multi-threaded runtime.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use convoy_core::transport::{Assignment, Lease, SourceEvent};
use convoy_core::{
    handler_fn, Delivery, Engine, EngineConfig, EngineError, EngineHandle, Handler, HandlerError, SourceId,
};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::MemoryTarget;
use convoy_testkit::probe::{publish_load, FaultPlan, Latency, ProbeHandler, RecordingSink};
use convoy_testkit::script::{message, scripted, Script};
use convoy_testkit::{MemoryBroker, OrderChecker};
use tokio::time::Instant;

/// Counts handler futures alive: one is created per call and dropped with its future.
#[derive(Clone, Default)]
struct Alive(Arc<AtomicUsize>);

struct AliveGuard(Arc<AtomicUsize>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

impl Alive {
    fn enter(&self) -> AliveGuard {
        self.0.fetch_add(1, SeqCst);
        AliveGuard(self.0.clone())
    }

    fn count(&self) -> usize {
        self.0.load(SeqCst)
    }
}

/// Yields by waking itself at once, as busy-polling futures (and `futures`-style `yield_now`) do.
async fn yield_busily() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

/// A handler that never finishes for keys starting with `hang` (counted in `alive` while their
/// future exists), and busy-polls forever for keys starting with `spin`: futures that wake
/// themselves while polled are what made `FuturesUnordered` end a round (after two of them)
/// before it reached the aborted futures.
fn hanging_handler(alive: &Alive) -> impl Handler {
    let alive = alive.clone();
    handler_fn(move |d: Delivery| {
        let key = d.message().key_display().into_owned();
        let guard = key.starts_with("hang").then(|| alive.enter());
        async move {
            let _guard = guard;
            if key.starts_with("spin") {
                loop {
                    yield_busily().await;
                }
            }
            std::future::pending::<()>().await;
            Ok::<(), HandlerError>(())
        }
    })
}

fn config(drain: Duration) -> EngineConfig {
    let mut config = test_config("ownership");
    config.drain_timeout = drain;
    config.retry.max_attempts = None;
    config
}

fn engine(handler: impl Handler, config: EngineConfig) -> Engine {
    let target = MemoryTarget::new();
    let bed = target.memory_bed(1);
    Engine::builder(handler)
        .config(config)
        .dead_letter_sink(bed.dead_letter_sink())
        .build()
        .unwrap()
}

/// An engine on a scripted transport holding one source, `t/0`, by a lease that runs out a
/// second from now.
fn one_leased_source(handler: impl Handler) -> (Script, EngineHandle, SourceId, Lease) {
    let (script, subscription) = scripted(Some(Duration::from_secs(60)));
    let running = engine(handler, config(Duration::from_secs(5))).spawn(subscription);
    let source = SourceId::new("t/0");
    let lease = Lease::new(Instant::now() + Duration::from_secs(1));
    script.control(SourceEvent::Assigned(vec![
        Assignment::new(source.clone(), None).with_lease(lease.clone())
    ]));
    (script, running, source, lease)
}

/// Assigns `source` and sends it `keys` messages, one per key.
async fn feed(script: &Script, source: &SourceId, keys: &[String]) {
    script.assign(source);
    let messages = keys
        .iter()
        .enumerate()
        .map(|(i, k)| message(source, i as u64, Some(k), "x"))
        .collect();
    script.messages(source, messages).await;
}

async fn wait_alive(alive: &Alive, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while alive.count() < n {
        assert!(Instant::now() < deadline, "handlers never started");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Fails without the revoke deadline: the engine used to drain for its whole drain timeout
/// (30 s here) and acknowledge long after the transport had handed the source on.
#[tokio::test(start_paused = true)]
async fn a_revoke_cancels_in_flight_work_before_its_deadline() {
    let alive = Alive::default();
    let (script, subscription) = scripted(Some(Duration::from_secs(60)));
    let running = engine(hanging_handler(&alive), config(Duration::from_secs(30))).spawn(subscription);
    let source = SourceId::new("t/0");
    feed(&script, &source, &["hang-a".into(), "hang-b".into()]).await;
    wait_alive(&alive, 2).await;
    // The transport's wait started earlier: only 200 ms are left of it.
    let deadline = Instant::now() + Duration::from_millis(200);
    let acked = script.revoke(std::slice::from_ref(&source), deadline);
    acked.await.expect("the revoke was acknowledged");
    assert!(Instant::now() <= deadline, "acknowledged after the deadline");
    assert_eq!(alive.count(), 0, "a handler of the revoked source is still alive");
    let report = running.stop().await.unwrap();
    assert_eq!(report.stats.handled, 0);
}

/// Fails without reaping: `FuturesUnordered` ends a round once two futures yielded, so with
/// lanes of another source spinning through sub-millisecond backoffs the shard answered the
/// cancel while aborted handler futures of the revoked source were still alive.
#[tokio::test(flavor = "current_thread")]
async fn cancelling_drops_every_handler_even_while_lanes_yield() {
    for round in 0..5 {
        let alive = Alive::default();
        let (script, subscription) = scripted(Some(Duration::from_secs(60)));
        let mut config = config(Duration::from_millis(20));
        config.shards = 1;
        let running = engine(hanging_handler(&alive), config).spawn(subscription);
        let spinning = SourceId::new(format!("spin/{round}"));
        let spin_keys: Vec<String> = (0..400).map(|i| format!("spin-{i}")).collect();
        feed(&script, &spinning, &spin_keys).await;
        let revoked = SourceId::new(format!("hang/{round}"));
        let hang_keys: Vec<String> = (0..32).map(|i| format!("hang-{i}")).collect();
        feed(&script, &revoked, &hang_keys).await;
        wait_alive(&alive, 32).await;
        let acked = script.revoke(
            std::slice::from_ref(&revoked),
            Instant::now() + Duration::from_secs(10),
        );
        acked.await.expect("the revoke was acknowledged");
        assert_eq!(
            alive.count(),
            0,
            "round {round}: handler futures of the revoked source outlived the cancel"
        );
        let stopper = running.stopper();
        stopper.shutdown();
        stopper.shutdown(); // the spinning lanes never finish: abort the drain
        running.join().await.unwrap();
    }
}

/// Fails with commits awaited inline: a commit that never returns (no group coordinator) froze
/// the intake — no message, revoke or shutdown was handled after it.
#[tokio::test(start_paused = true)]
async fn a_commit_that_never_returns_holds_nothing_up() {
    let handled = Arc::new(AtomicUsize::new(0));
    let count = handled.clone();
    let handler = handler_fn(move |_d: Delivery| {
        let count = count.clone();
        async move {
            count.fetch_add(1, SeqCst);
            Ok::<(), HandlerError>(())
        }
    });
    let (script, subscription) = scripted(Some(Duration::from_secs(60)));
    script.hang_commits();
    let mut config = config(Duration::from_secs(5));
    config.commit_every = 1;
    config.commit_timeout = Duration::from_secs(1);
    let running = engine(handler, config).spawn(subscription);
    let first = SourceId::new("t/0");
    feed(&script, &first, &["a".into(), "b".into()]).await;
    let second = SourceId::new("t/1");
    for round in 0..20u64 {
        // Messages keep flowing while commits hang (each gives up after its timeout).
        script.assign(&second);
        let batch = (0..10)
            .map(|i| message(&second, round * 10 + i, Some("k"), "x"))
            .collect();
        script.messages(&second, batch).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let revoke_deadline = Instant::now() + Duration::from_secs(10);
        script
            .revoke(std::slice::from_ref(&second), revoke_deadline)
            .await
            .expect("revoked while commits hang");
        assert!(Instant::now() <= revoke_deadline);
    }
    assert_eq!(handled.load(SeqCst), 2 + 200);
    let stopped = Instant::now();
    let report = running.stop().await.unwrap();
    assert!(
        stopped.elapsed() < Duration::from_secs(60),
        "the shutdown waited on the broker"
    );
    assert!(script.closed());
    assert_eq!(report.stats.commits, 0, "no commit was ever confirmed");
}

/// Fails without the startup check: a drain timeout of 90 s under a 60 s revoke timeout ran,
/// and a 75 s handler overlapped the next owner.
#[tokio::test(start_paused = true)]
async fn a_drain_timeout_not_below_the_revoke_timeout_is_refused() {
    let alive = Alive::default();
    let engine = engine(hanging_handler(&alive), config(Duration::from_secs(90)));
    let (_script, subscription) = scripted(Some(Duration::from_secs(60)));
    let err = engine.spawn(subscription).join().await.unwrap_err();
    let EngineError::Config(config) = &err else {
        panic!("expected a configuration error, got {err}")
    };
    assert_eq!(config.field(), "drain_timeout");
    assert!(err.to_string().contains("revoke timeout"), "{err}");
    // Through `start` the error comes before anything runs.
    let target = MemoryTarget::new();
    target
        .broker()
        .set_faults(|f| f.rebalance_timeout = Duration::from_secs(60));
    let bed = target.memory_bed(1);
    let err = match engine.start(&bed_transport(&bed)).await {
        Ok(_) => panic!("started with a drain timeout above the revoke timeout"),
        Err(e) => e,
    };
    assert!(matches!(err, EngineError::Config(_)), "{err}");
}

fn bed_transport(bed: &convoy_testkit::memory::MemoryBed) -> convoy_testkit::MemoryTransport {
    convoy_testkit::MemoryTransport::new(bed.broker(), bed.group(), &[bed.topic()])
}

/// Engines of one group on one memory broker, aborted (as crashes), stopped and started at
/// random on a multi-threaded runtime while handlers retry sub-millisecond backoffs and sleep:
/// no key is ever in flight on two of them at once, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_aborted_at_random_never_overlap_a_key() {
    let seeds: u64 = std::env::var("OWNERSHIP_CHAOS_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let mut overlaps = 0;
    for seed in 0..seeds {
        let report = abort_chaos(seed).await;
        assert!(
            report.order_violations == 0 && report.lost == 0 && report.finished == report.published,
            "seed {seed}: {report:#?}"
        );
        overlaps += report.overlaps;
    }
    assert_eq!(overlaps, 0, "a key was in flight on two engines at once");
}

async fn start_member(
    bed: &convoy_testkit::memory::MemoryBed,
    checker: &Arc<OrderChecker>,
    plan: &FaultPlan,
) -> EngineHandle {
    let mut config = test_config(bed.group());
    config.shards = 2;
    config.drain_timeout = Duration::from_secs(2);
    config.retry.backoff.base = Duration::from_micros(200);
    config.retry.backoff.cap = Duration::from_micros(800);
    let engine = Engine::builder(ProbeHandler::with_faults(checker.clone(), plan.clone()))
        .config(config)
        .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
        .build()
        .unwrap();
    engine.spawn(bed.subscribe().await.unwrap())
}

async fn abort_chaos(seed: u64) -> convoy_testkit::CheckReport {
    let mut rng = fastrand::Rng::with_seed(seed);
    let broker = MemoryBroker::new();
    broker.set_faults(|f| {
        f.max_batch = rng.usize(1..=16);
        f.rebalance_timeout = Duration::from_secs(5);
    });
    let target = MemoryTarget::on(broker);
    let bed = target.memory_bed(4);
    let checker = Arc::new(OrderChecker::new());
    let plan = FaultPlan {
        seed,
        transient_rate: 0.2,
        transient_attempts: 3,
        latency: Latency::Uniform(Duration::ZERO, Duration::from_millis(2)),
        ..FaultPlan::default()
    };
    let mut engines: Vec<EngineHandle> = Vec::new();
    for _ in 0..4 {
        engines.push(start_member(&bed, &checker, &plan).await);
    }
    for _round in 0..8 {
        publish_load(bed.publisher().as_ref(), &checker, "key-", 12, 4)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(rng.u64(1..20))).await;
        match rng.u8(0..3) {
            0 if !engines.is_empty() => {
                let victim = engines.swap_remove(rng.usize(..engines.len()));
                victim.abort().await;
            }
            1 if !engines.is_empty() => {
                let leaving = engines.swap_remove(rng.usize(..engines.len()));
                leaving.stop().await.unwrap();
            }
            _ => {}
        }
        while engines.len() < 4 {
            engines.push(start_member(&bed, &checker, &plan).await);
        }
    }
    assert!(
        checker.wait_complete(Duration::from_secs(120)).await,
        "seed {seed}: not complete: {:?}",
        checker.report()
    );
    for engine in engines {
        engine.stop().await.unwrap();
    }
    checker.report()
}

/// A source held by lease: once the lease ran out, nothing of it starts — not a queued message
/// behind a slow one, not the next attempt of a retrying one — while what was already running
/// ends by itself. A member frozen past its lease (SIGSTOP, a long pause) wakes up with every
/// task runnable at once; this is what keeps it from handling a partition another member owns.
#[tokio::test(start_paused = true)]
async fn nothing_of_a_source_starts_after_its_lease_ran_out() {
    let release = Arc::new(tokio::sync::Notify::new());
    let calls = Arc::new(std::sync::Mutex::new(Vec::<(String, u64)>::new()));
    let handler = {
        let (release, calls) = (release.clone(), calls.clone());
        handler_fn(move |d: Delivery| {
            let key = d.message().key_display().into_owned();
            calls.lock().unwrap().push((key.clone(), d.message().offset));
            let release = release.clone();
            async move {
                match key.as_str() {
                    "slow" => release.notified().await,
                    "flaky" => return Err(HandlerError::retry_after("not yet", Duration::from_millis(100))),
                    _ => {}
                }
                Ok::<(), HandlerError>(())
            }
        })
    };
    let (script, running, source, lease) = one_leased_source(handler);
    let batch = vec![
        message(&source, 0, Some("slow"), "x"),
        message(&source, 1, Some("slow"), "x"),
        message(&source, 2, Some("flaky"), "x"),
    ];
    script.messages(&source, batch).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let flaky_before = calls.lock().unwrap().iter().filter(|(k, _)| k == "flaky").count();
    assert!(
        flaky_before >= 2,
        "the flaky message was retrying: {flaky_before}"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!lease.is_valid());
    let flaky_at_expiry = calls.lock().unwrap().iter().filter(|(k, _)| k == "flaky").count();
    release.notify_waiters(); // the slow handler running since before the expiry ends now
    tokio::time::sleep(Duration::from_secs(5)).await;
    let calls = calls.lock().unwrap().clone();
    assert!(
        !calls.contains(&("slow".into(), 1)),
        "the message queued behind the slow one started after the lease ran out: {calls:?}"
    );
    let flaky_after = calls.iter().filter(|(k, _)| k == "flaky").count();
    assert_eq!(
        flaky_after, flaky_at_expiry,
        "the flaky message kept retrying after the lease ran out"
    );
    let report = running.stop().await.unwrap();
    assert_eq!(
        report.stats.handled, 1,
        "only the message running at the expiry finished"
    );
}

/// Nor is anything dead-lettered once the lease ran out (issue 25, item 10): a call that was
/// running at the expiry and then fails terminally leaves its message to the next owner —
/// before, its dead letter was published by a member that no longer owned the partition (the
/// next owner then handled the message as well, or dead-lettered it a second time).
#[tokio::test(start_paused = true)]
async fn nothing_is_dead_lettered_after_the_lease_ran_out() {
    let release = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let release = release.clone();
        handler_fn(move |_: Delivery| {
            let release = release.clone();
            async move {
                release.notified().await;
                Err::<(), HandlerError>(HandlerError::terminal("this order is broken"))
            }
        })
    };
    let (script, running, source, lease) = one_leased_source(handler);
    script
        .messages(&source, vec![message(&source, 0, Some("doomed"), "x")])
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!lease.is_valid());
    release.notify_waiters(); // the call running since before the expiry fails now
    tokio::time::sleep(Duration::from_secs(5)).await;
    let report = running.stop().await.unwrap();
    assert_eq!(
        (report.stats.dead_lettered, report.stats.handled),
        (0, 0),
        "the message is left to the next owner"
    );
}
