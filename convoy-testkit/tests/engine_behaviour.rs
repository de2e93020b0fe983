//! Engine behaviour on the memory transport with a paused clock: retry timing and limits,
//! timeouts, blocking lanes, stuck messages, failing sinks, panics, commit batching, revoke
//! drains, shutdown signals, keyless policies and lag metrics. Time is virtual
//! (`start_paused`), so timing is asserted exactly and no test waits on the wall clock.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy_core::dead_letter::{DL_ATTEMPTS, DL_CAUSE, DL_ERROR};
use convoy_core::{
    handler_fn, Backoff, Delivery, Drain, Engine, EngineConfig, EngineHandle, Handler, HandlerError, Jitter,
    KeylessPolicy, OnExhausted, OutgoingMessage, Publisher, RetryPolicy, SourceId,
};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::{MemoryBed, MemoryTarget};
use convoy_testkit::probe::{probe_key, publish_load, FaultPlan, ProbeHandler, RecordingSink};
use convoy_testkit::script::{message, scripted_with, Reported};
use convoy_testkit::{MemoryBroker, OrderChecker};
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(3600);

fn bed(partitions: u32) -> (MemoryBroker, MemoryBed) {
    let target = MemoryTarget::new();
    let bed = target.memory_bed(partitions);
    (target.broker().clone(), bed)
}

async fn run(
    bed: &MemoryBed,
    handler: impl Handler,
    config: EngineConfig,
    sink: Arc<RecordingSink>,
) -> EngineHandle {
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(sink)
        .build()
        .expect("valid config");
    engine.spawn(bed.subscribe().await.expect("subscribe"))
}

fn sink(bed: &MemoryBed, checker: &Arc<OrderChecker>) -> Arc<RecordingSink> {
    Arc::new(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
}

fn policy(base_ms: u64, factor: f64, max_attempts: Option<u32>) -> RetryPolicy {
    let mut policy = RetryPolicy::with_backoff(Backoff::new(
        Duration::from_millis(base_ms),
        factor,
        Duration::from_secs(60),
        Jitter::None,
    ));
    policy.max_attempts = max_attempts;
    policy
}

/// Records attempt times of one message and fails the first `fail` attempts.
fn failing_times(fail: u32, error: fn() -> HandlerError) -> (impl Handler, Arc<Mutex<Vec<Instant>>>) {
    let times = Arc::new(Mutex::new(Vec::new()));
    let t = times.clone();
    let handler = handler_fn(move |d: Delivery| {
        let t = t.clone();
        async move {
            t.lock().unwrap().push(Instant::now());
            if d.attempt() <= fail {
                Err(error())
            } else {
                Ok(())
            }
        }
    });
    (handler, times)
}

fn gaps(times: &[Instant]) -> Vec<Duration> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

async fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn backoff_delays_follow_the_policy_exactly() {
    let (_, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let (handler, times) = failing_times(3, || HandlerError::transient("busy"));
    let mut config = test_config(bed.group());
    config.retry = policy(100, 2.0, Some(10));
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let engine = run(&bed, handler, config, sink(&bed, &checker)).await;
    wait_until("four attempts", || times.lock().unwrap().len() == 4).await;
    let report = engine.stop().await.unwrap();
    let g = gaps(&times.lock().unwrap());
    assert_eq!(
        g,
        vec![
            Duration::from_millis(100),
            Duration::from_millis(200),
            Duration::from_millis(400)
        ]
    );
    assert_eq!((report.stats.retries, report.stats.handled), (3, 1));
}

#[tokio::test(start_paused = true)]
async fn retry_after_hint_overrides_the_backoff() {
    let (_, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let (handler, times) = failing_times(1, || {
        HandlerError::retry_after("rate limited", Duration::from_secs(5))
    });
    let mut config = test_config(bed.group());
    config.retry = policy(1, 2.0, Some(10));
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let engine = run(&bed, handler, config, sink(&bed, &checker)).await;
    wait_until("two attempts", || times.lock().unwrap().len() == 2).await;
    engine.stop().await.unwrap();
    assert_eq!(gaps(&times.lock().unwrap()), vec![Duration::from_secs(5)]);
}

#[tokio::test(start_paused = true)]
async fn elapsed_limit_dead_letters_after_the_time_budget() {
    let (broker, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let (handler, times) = failing_times(u32::MAX, || HandlerError::transient("down"));
    let mut config = test_config(bed.group());
    config.retry = policy(100, 1.0, None);
    config.retry.max_elapsed = Some(Duration::from_secs(1));
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let engine = run(&bed, handler, config, sink(&bed, &checker)).await;
    wait_until("a dead letter", || {
        !broker.read_all(&format!("{}.dlq", bed.topic())).is_empty()
    })
    .await;
    engine.stop().await.unwrap();
    // Attempt n starts at (n-1)·100 ms; the 11th would start past 1 s after the first failure.
    assert_eq!(times.lock().unwrap().len(), 11);
    let dead = broker.read_all(&format!("{}.dlq", bed.topic()));
    assert_eq!(dead[0].headers.get_str(DL_CAUSE), Some("retries-exhausted"));
    assert_eq!(dead[0].headers.get_str(DL_ATTEMPTS), Some("11"));
}

#[tokio::test(start_paused = true)]
async fn attempt_timeout_is_a_transient_failure() {
    let (broker, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let handler = handler_fn(move |_d: Delivery| {
        c.fetch_add(1, Relaxed);
        std::future::pending::<Result<(), HandlerError>>()
    });
    let mut config = test_config(bed.group());
    config.retry = policy(10, 1.0, Some(3));
    config.retry.attempt_timeout = Some(Duration::from_millis(50));
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let started = Instant::now();
    let engine = run(&bed, handler, config, sink(&bed, &checker)).await;
    let dlq = format!("{}.dlq", bed.topic());
    wait_until("a dead letter", || !broker.read_all(&dlq).is_empty()).await;
    // 3 timed-out attempts and 2 backoffs; the poll above adds at most 1 ms.
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(170) && elapsed <= Duration::from_millis(171),
        "{elapsed:?}"
    );
    engine.stop().await.unwrap();
    assert_eq!(calls.load(Relaxed), 3);
    let dead = broker.read_all(&dlq);
    assert!(dead[0]
        .headers
        .get_str(DL_ERROR)
        .unwrap()
        .contains("timed out after 50ms"));
}

/// An engine whose configuration names no group takes its transport's: its dead letters say so.
#[tokio::test(start_paused = true)]
async fn an_engine_without_a_group_takes_the_transports() {
    let (broker, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let handler = handler_fn(|_d: Delivery| async move { Err::<(), _>(HandlerError::terminal("no")) });
    let engine = Engine::builder(handler)
        .dead_letter_sink(sink(&bed, &checker))
        .build()
        .unwrap();
    assert_eq!(engine.config().group, "", "none named");
    let transport = convoy_testkit::MemoryTransport::new(&broker, "billing", &[bed.topic()]);
    let running = engine.start(&transport).await.unwrap();
    let dlq = format!("{}.dlq", bed.topic());
    wait_until("a dead letter", || !broker.read_all(&dlq).is_empty()).await;
    running.stop().await.unwrap();
    let dead = broker.read_all(&dlq);
    assert_eq!(
        dead[0].headers.get_str(convoy_core::dead_letter::DL_GROUP),
        Some("billing")
    );
}

/// A handler error's cause chain reaches the dead-letter reason (`?` on any error works too).
#[tokio::test(start_paused = true)]
async fn the_cause_chain_of_a_handler_error_reaches_the_dead_letter_reason() {
    #[derive(Debug, thiserror::Error)]
    #[error("the ledger refused the entry")]
    struct Refused(#[source] std::io::Error);
    let (broker, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let handler = handler_fn(|_d: Delivery| async move {
        let refused: Result<(), Refused> = Err(Refused(std::io::Error::other("account 7 is frozen")));
        refused.map_err(|e| HandlerError::terminal("overdraft").with_cause(e))?;
        Ok(())
    });
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let engine = run(&bed, handler, test_config(bed.group()), sink(&bed, &checker)).await;
    let dlq = format!("{}.dlq", bed.topic());
    wait_until("a dead letter", || !broker.read_all(&dlq).is_empty()).await;
    engine.stop().await.unwrap();
    let dead = broker.read_all(&dlq);
    assert_eq!(
        dead[0].headers.get_str(DL_ERROR),
        Some("overdraft: the ledger refused the entry: account 7 is frozen")
    );
    assert_eq!(dead[0].headers.get_str(DL_CAUSE), Some("terminal"));
}

#[tokio::test(start_paused = true)]
async fn exhausted_retries_can_block_the_lane_while_other_keys_flow() {
    let (broker, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let stuck = (probe_key("k", 0), 0u64);
    let plan = FaultPlan {
        transient_forever: [stuck.clone()].into(),
        ..FaultPlan::default()
    };
    let handler = Arc::new(ProbeHandler::with_faults(checker.clone(), plan).counting_calls());
    let receipts = publish_load(bed.publisher().as_ref(), &checker, "k", 5, 4)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    config.retry = policy(100, 2.0, Some(2));
    config.retry.backoff.cap = Duration::from_millis(400);
    config.retry.on_exhausted = OnExhausted::BlockLane;
    config.drain_timeout = Duration::from_secs(1);
    let engine = run(&bed, handler.clone(), config, sink(&bed, &checker)).await;
    // Every message of the other keys finishes: 4 keys × 4.
    wait_until("other keys", || checker.finished() == 16).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        handler.calls_for(&stuck.0, 0) > 10,
        "the blocked message keeps being retried"
    );
    assert_eq!(checker.finished(), 16, "nothing of the blocked key moved");
    assert!(broker.read_all(&format!("{}.dlq", bed.topic())).is_empty());
    engine.stop().await.unwrap();
    let committed = bed.committed().await.unwrap();
    let first = &receipts[0];
    assert!(
        committed.get(&first.source).is_none_or(|w| *w < first.offset),
        "the watermark never passes the blocked message"
    );
}

#[tokio::test(start_paused = true)]
async fn stuck_message_is_dead_lettered_and_the_watermark_moves_on() {
    let (broker, bed) = bed(2);
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let _never = plan.hold_key(probe_key("k", 0));
    let handler = ProbeHandler::with_faults(checker.clone(), plan);
    let receipts = publish_load(bed.publisher().as_ref(), &checker, "k", 4, 5)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    config.stuck_timeout = Some(Duration::from_secs(2));
    let started = Instant::now();
    let engine = run(&bed, handler, config, sink(&bed, &checker)).await;
    // k0's five messages are each held; each is dead-lettered as stuck in turn.
    checker.wait_complete(LIMIT).await;
    let elapsed = started.elapsed();
    let dead = broker.read_all(&format!("{}.dlq", bed.topic()));
    assert_eq!(dead.len(), 5);
    assert!(dead.iter().all(|m| m.headers.get_str(DL_CAUSE) == Some("stuck")));
    assert!(
        elapsed >= Duration::from_secs(10) && elapsed < Duration::from_secs(12),
        "{elapsed:?}"
    );
    let report = engine.stop().await.unwrap();
    assert!(checker.report().is_clean(), "{:?}", checker.report());
    let mut last = std::collections::BTreeMap::new();
    for r in &receipts {
        last.insert(r.source.clone(), r.offset);
    }
    assert_eq!(
        report.committed, last,
        "the watermark passed the dead-lettered messages"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failing_sink_blocks_the_lane_until_it_confirms() {
    let (broker, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let plan = FaultPlan {
        terminal_on: [(probe_key("k", 0), 1)].into(),
        ..FaultPlan::default()
    };
    broker.set_faults(|f| f.fail_dead_letters = 3);
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 3)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    config.dead_letter_backoff = Backoff::new(
        Duration::from_millis(100),
        2.0,
        Duration::from_secs(1),
        Jitter::None,
    );
    let started = Instant::now();
    let engine = run(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        config,
        sink(&bed, &checker),
    )
    .await;
    checker.wait_complete(LIMIT).await;
    // Three failed publishes, 100 + 200 + 400 ms apart, and only then seq 2.
    assert!(started.elapsed() >= Duration::from_millis(700));
    engine.stop().await.unwrap();
    assert_eq!(broker.injected_dead_letter_failures(), 3);
    assert_eq!(broker.read_all(&format!("{}.dlq", bed.topic())).len(), 1);
    let report = checker.report();
    assert!(
        report.is_clean(),
        "seq 2 waited for the dead letter of seq 1: {report:?}"
    );
    assert_eq!((report.handled, report.dead_lettered), (2, 1));
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_dead_letters_the_message_and_the_engine_lives() {
    let (broker, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let c = checker.clone();
    let handler = handler_fn(move |d: Delivery| {
        let c = c.clone();
        async move {
            let seq = convoy_testkit::probe::decode_seq(d.payload()).unwrap();
            if seq == 1 {
                panic!("ledger invariant broken at seq {seq}");
            }
            c.handled(d.key().unwrap(), seq, None);
            Ok(())
        }
    });
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 3)
        .await
        .unwrap();
    let engine = run(&bed, handler, test_config(bed.group()), sink(&bed, &checker)).await;
    checker.wait_complete(LIMIT).await;
    engine.stop().await.unwrap();
    let dead = broker.read_all(&format!("{}.dlq", bed.topic()));
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].headers.get_str(DL_CAUSE), Some("panic"));
    assert!(dead[0]
        .headers
        .get_str(DL_ERROR)
        .unwrap()
        .contains("ledger invariant broken at seq 1"));
    assert!(checker.report().is_clean());
}

#[tokio::test(start_paused = true)]
async fn commits_are_batched_by_count_and_by_timer() {
    let (_, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 120)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    config.commit_every = 50;
    config.commit_interval = Duration::from_secs(10);
    // One message per millisecond, so completions (and count-triggered commits) spread out.
    let plan = FaultPlan {
        latency: convoy_testkit::Latency::Fixed(Duration::from_millis(1)),
        ..FaultPlan::default()
    };
    let engine = run(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        config,
        sink(&bed, &checker),
    )
    .await;
    checker.wait_complete(LIMIT).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    let by_count = bed.committed().await.unwrap().values().copied().next().unwrap();
    assert!(
        (49..119).contains(&by_count),
        "count-triggered commits reached {by_count}"
    );
    assert!(
        engine.stats().commits <= 3,
        "commits are batched, not per message: {}",
        engine.stats().commits
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        bed.committed().await.unwrap().values().copied().next(),
        Some(119),
        "the timer commits the rest"
    );
    engine.stop().await.unwrap();
}

/// A transport that delivers nothing more of a source until it commits (RabbitMQ's prefetch)
/// is committed as soon as half its credit is finished, not after `commit_every` or the timer:
/// otherwise each source would crawl at one credit per `commit_interval`.
#[tokio::test(start_paused = true)]
async fn a_credit_limited_source_is_committed_at_half_its_credit() {
    let (script, subscription) = scripted_with(Reported {
        credit: Some(10),
        ..Reported::default()
    });
    let handler = handler_fn(|_d: Delivery| async { Ok::<(), HandlerError>(()) });
    let mut config = test_config("credit");
    config.commit_every = 1_000;
    config.commit_interval = Duration::from_secs(3600);
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(MemoryTarget::new().memory_bed(1).dead_letter_sink())
        .build()
        .unwrap()
        .spawn(subscription);
    let source = SourceId::new("credit/0");
    let start = Instant::now();
    script.assign(&source);
    // Delivery tags start at 1; the credit of 10 is all delivered.
    let batch = (1..=10)
        .map(|o| message(&source, o, Some(&format!("k{o}")), "x"))
        .collect();
    script.messages(&source, batch).await;
    script.wait_for(|s| s.commits().iter().any(|c| c.next >= 6)).await;
    // The paused clock jumps to the commit timer whenever the runtime idles: a commit before
    // it was due to credit.
    assert!(
        start.elapsed() < Duration::from_secs(3600),
        "committed by the timer, not by credit"
    );
    engine.stop().await.unwrap();
    assert_eq!(
        script.commits().last().map(|c| c.next),
        Some(11),
        "the rest at shutdown"
    );
}

#[tokio::test(start_paused = true)]
async fn revoke_drains_in_flight_work_and_commits_before_handing_over() {
    let (broker, bed) = bed(2);
    let checker = Arc::new(OrderChecker::new());
    let plan = FaultPlan {
        latency: convoy_testkit::Latency::Fixed(Duration::from_millis(300)),
        ..FaultPlan::default()
    };
    publish_load(bed.publisher().as_ref(), &checker, "k", 8, 5)
        .await
        .unwrap();
    let a = run(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan.clone()),
        test_config(bed.group()),
        sink(&bed, &checker),
    )
    .await;
    wait_until("some progress", || checker.finished() >= 8).await;
    let b = run(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        test_config(bed.group()),
        sink(&bed, &checker),
    )
    .await;
    wait_until("two owners", || {
        broker
            .owners(bed.group())
            .values()
            .collect::<std::collections::HashSet<_>>()
            .len()
            == 2
    })
    .await;
    checker.wait_complete(LIMIT).await;
    a.stop().await.unwrap();
    b.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(
        report.duplicates, 0,
        "the drained and committed messages were not redelivered: {report:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn revoke_drain_timeout_cancels_and_leaves_the_message_uncommitted() {
    let (_, bed) = bed(2);
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let _never = plan.hold_key(probe_key("k", 0));
    let receipts = publish_load(bed.publisher().as_ref(), &checker, "k", 6, 3)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    config.drain_timeout = Duration::from_secs(2);
    let a = run(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        config.clone(),
        sink(&bed, &checker),
    )
    .await;
    wait_until("other keys", || checker.finished() == 15).await;
    // A leaves: its drain gives up on k0 after the timeout; k0 is not committed and B redoes it.
    let started = Instant::now();
    a.stop().await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    let k0 = receipts
        .iter()
        .find(|r| r.offset == receipts[0].offset && r.source == receipts[0].source)
        .unwrap();
    let committed = bed.committed().await.unwrap();
    assert!(committed.get(&k0.source).is_none_or(|w| *w < k0.offset));
    let b = run(
        &bed,
        ProbeHandler::new(checker.clone()),
        config,
        sink(&bed, &checker),
    )
    .await;
    checker.wait_complete(LIMIT).await;
    b.stop().await.unwrap();
    assert!(checker.report().is_clean());
}

#[tokio::test(start_paused = true)]
async fn a_second_shutdown_signal_aborts_the_drain() {
    let (broker, bed) = bed(1);
    // The drain may be long; the revoke deadline must stay above it.
    broker.set_faults(|f| f.rebalance_timeout = Duration::from_secs(7200));
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let _never = plan.hold_key(probe_key("k", 0));
    publish_load(bed.publisher().as_ref(), &checker, "k", 2, 2)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    config.drain_timeout = Duration::from_secs(3600);
    config.shutdown_timeout = Duration::from_secs(7200);
    // Everything held is drained, so both of the held key's messages wait in the drain.
    config.drain = Drain::Buffered;
    let engine = run(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        config,
        sink(&bed, &checker),
    )
    .await;
    wait_until("the free key", || checker.finished() == 2).await;
    let started = Instant::now();
    // The handle is busy awaiting the stop; a stopper escalates it from elsewhere (as a second
    // Ctrl-C does).
    let stopper = engine.stopper();
    let stopping = tokio::spawn(engine.stop());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!stopping.is_finished(), "the first signal waits for the drain");
    assert_eq!(stopper.requests(), 1);
    stopper.shutdown();
    let report = stopping.await.unwrap().unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(report.stats.handled, 2);
    assert_eq!(
        report.cancelled, 2,
        "the held key's two messages were cancelled, not handled"
    );
    assert_eq!(
        bed.committed().await.unwrap().values().copied().max(),
        None,
        "the held key's messages sit at the head of the only partition: nothing committed past them"
    );
}

#[tokio::test(start_paused = true)]
async fn keyless_messages_keep_their_source_order_or_run_unordered() {
    for policy in [KeylessPolicy::PerSource, KeylessPolicy::Unordered] {
        let (_, bed) = bed(2);
        let checker = Arc::new(OrderChecker::new());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (now, max) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (s, n, m) = (seen.clone(), now.clone(), max.clone());
        let handler = handler_fn(move |d: Delivery| {
            let (s, n, m) = (s.clone(), n.clone(), m.clone());
            async move {
                m.fetch_max(n.fetch_add(1, Relaxed) + 1, Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
                n.fetch_sub(1, Relaxed);
                s.lock().unwrap().push((d.source().clone(), d.offset()));
                Ok(())
            }
        });
        for i in 0..40 {
            bed.publisher()
                .publish(OutgoingMessage::keyless(format!("{i}")))
                .await
                .unwrap();
        }
        let mut config = test_config(bed.group());
        config.keyless = policy;
        let engine = run(&bed, handler, config, sink(&bed, &checker)).await;
        wait_until("all keyless", || seen.lock().unwrap().len() == 40).await;
        engine.stop().await.unwrap();
        let seen = seen.lock().unwrap();
        match policy {
            KeylessPolicy::PerSource => {
                assert!(
                    max.load(Relaxed) <= 2,
                    "one lane per source: {}",
                    max.load(Relaxed)
                );
                for source in seen
                    .iter()
                    .map(|(s, _)| s.clone())
                    .collect::<std::collections::BTreeSet<_>>()
                {
                    let offsets: Vec<u64> = seen
                        .iter()
                        .filter(|(s, _)| *s == source)
                        .map(|(_, o)| *o)
                        .collect();
                    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{source}: {offsets:?}");
                }
            }
            KeylessPolicy::Unordered => assert!(max.load(Relaxed) > 2, "unordered runs in parallel"),
            KeylessPolicy::DeadLetter => unreachable!("covered by the poison-input conformance case"),
        }
    }
}

/// Many keys that fail forever must not starve the healthy ones (issue 25, item 10; a soak of
/// Parallel Consumer found retry-forever records filling its intake within a minute). 1,000 keys
/// whose one message fails on every attempt, retried forever (`BlockLane`), share one partition
/// with 20 healthy keys × 1,000 messages — more than the watermark window (20,000), so the source
/// must wait for its head once the window is full. The held bound keeps what the engine holds
/// at its mark, and the stuck-gap timeout (30 s) dead-letters every failing message once its
/// handling has run that long — all 1,000 at once, each lane on its own. Before, only a
/// source's lowest unfinished message was judged, one per timeout: 1,000 × 30 s of a blocked
/// window while the healthy keys waited.
#[tokio::test(start_paused = true)]
async fn a_thousand_keys_failing_forever_do_not_starve_the_healthy_ones() {
    let (_, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    for i in 0..1_000 {
        plan.transient_forever.insert((probe_key("failing-", i), 0));
    }
    let mut config = test_config(bed.group());
    config.retry = policy(100, 2.0, None);
    config.retry.on_exhausted = OnExhausted::BlockLane;
    config.retry.backoff.cap = Duration::from_secs(1);
    config.stuck_timeout = Some(Duration::from_secs(30));
    let engine = run(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        config.clone(),
        sink(&bed, &checker),
    )
    .await;
    publish_load(bed.publisher().as_ref(), &checker, "failing-", 1_000, 1)
        .await
        .unwrap();
    publish_load(bed.publisher().as_ref(), &checker, "healthy-", 20, 1_000)
        .await
        .unwrap();
    let started = Instant::now();
    assert!(
        checker.wait_complete(Duration::from_secs(120)).await,
        "the healthy keys starved: {:?}; engine {:?}",
        checker.report(),
        engine.stats()
    );
    let took = started.elapsed();
    let stats = engine.stats();
    assert_eq!(stats.dead_lettered, 1_000, "every failing message, as stuck");
    assert_eq!(stats.handled, 20_000, "every healthy message");
    assert!(
        stats.peak_held <= config.back_pressure.source_high + 1_000,
        "held stays near its bound: {stats:?}"
    );
    assert!(
        took < Duration::from_secs(60),
        "cleared within one stuck timeout or so, not one per key: {took:?}"
    );
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    engine.stop().await.unwrap();
}

/// The watermark gauge shows log positions only (issue 25, item 10): an assignment whose
/// offsets count deliveries (an AMQP channel's tags, starting again at 1 on every channel) gets
/// none — it would jump backwards on every reconnect — while a log's source shows its own.
#[tokio::test(start_paused = true)]
async fn a_watermark_that_is_no_log_position_is_not_exported() {
    use convoy_core::transport::{Assignment, SourceEvent};
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let (_, bed) = bed(1);
    let (script, subscription) = convoy_testkit::script::scripted(Some(Duration::from_secs(60)));
    let mut config = test_config(bed.group());
    config.commit_interval = Duration::from_millis(50);
    let engine = Engine::builder(handler_fn(|_: Delivery| async { Ok::<(), HandlerError>(()) }))
        .config(config)
        .dead_letter_sink(bed.dead_letter_sink())
        .build()
        .unwrap()
        .spawn(subscription);
    let (tags, log) = (SourceId::new("queue/0"), SourceId::new("log/0"));
    script.control(SourceEvent::Assigned(vec![
        Assignment::new(tags.clone(), None).with_delivery_offsets(),
        Assignment::new(log.clone(), None),
    ]));
    for source in [&tags, &log] {
        let batch = (1..=3).map(|o| message(source, o, Some("k"), "x")).collect();
        script.messages(source, batch).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(engine.stats().handled, 6);
    let watermarks: std::collections::HashMap<String, f64> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| key.key().name() == "convoy_watermark")
        .filter_map(|(key, _, _, value)| match value {
            metrics_util::debugging::DebugValue::Gauge(g) => {
                let source = key
                    .key()
                    .labels()
                    .find(|l| l.key() == "source")?
                    .value()
                    .to_owned();
                Some((source, g.into_inner()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(watermarks.get("log/0"), Some(&3.0), "{watermarks:?}");
    assert!(!watermarks.contains_key("queue/0"), "{watermarks:?}");
    engine.stop().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn lag_and_paused_sources_are_reported_while_paused() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let (_, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let latch = plan.hold_key(probe_key("k", 0));
    let mut config = test_config(bed.group());
    config.back_pressure.source_high = 4;
    config.back_pressure.source_low = 1;
    config.commit_interval = Duration::from_millis(50);
    let engine = run(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        config,
        sink(&bed, &checker),
    )
    .await;
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 100)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(engine.stats().paused_sources, 1);
    let gauges = || {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| match value {
                metrics_util::debugging::DebugValue::Gauge(g) => {
                    Some((key.key().name().to_owned(), g.into_inner()))
                }
                _ => None,
            })
            .collect::<std::collections::HashMap<String, f64>>()
    };
    let now = gauges();
    assert_eq!(
        now.get("convoy_source_lag"),
        Some(&100.0),
        "all 100 messages are lag while paused: {now:?}"
    );
    assert_eq!(now.get("convoy_paused_sources"), Some(&1.0), "{now:?}");
    let gauge = |name: &str| gauges().get(name).copied();
    latch.release();
    checker.wait_complete(LIMIT).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(gauge("convoy_source_lag"), Some(0.0));
    engine.stop().await.unwrap();
}

#[tokio::test]
async fn the_builder_rejects_a_missing_sink_and_bad_config_by_field() {
    let missing = Engine::builder(handler_fn(|_d: Delivery| async { Ok(()) })).build();
    assert_eq!(
        missing.err().map(|e| e.field().to_owned()),
        Some("dead_letter_sink".to_owned())
    );
    let (_, bed) = bed(1);
    let mut config = EngineConfig::default();
    config.retry.backoff.factor = f64::NAN;
    let bad = Engine::builder(handler_fn(|_d: Delivery| async { Ok(()) }))
        .config(config)
        .dead_letter_sink(bed.dead_letter_sink())
        .build();
    let err = bad.err().expect("rejected");
    assert_eq!(err.field(), "retry.backoff.factor");
    assert!(err.to_string().contains("retry.backoff.factor"));
}

#[tokio::test(start_paused = true)]
async fn a_traceparent_header_is_carried_to_the_handler() {
    let (_, bed) = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let parent = convoy_core::TraceContext::new_root();
    let mut message = OutgoingMessage::new("k", "0");
    parent.child().inject(&mut message.headers);
    bed.publisher().publish(message).await.unwrap();
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    let handler = handler_fn(move |d: Delivery| {
        let g = g.clone();
        async move {
            *g.lock().unwrap() = convoy_core::TraceContext::extract(d.headers());
            Ok(())
        }
    });
    let engine = run(&bed, handler, test_config(bed.group()), sink(&bed, &checker)).await;
    wait_until("the message", || got.lock().unwrap().is_some()).await;
    engine.stop().await.unwrap();
    assert_eq!(got.lock().unwrap().unwrap().trace_id, parent.trace_id);
}

/// Lanes whose handlers wait on timers that all fire at once (a paused clock): their futures
/// end in one round, and the slots they free are taken by the next messages of their lanes
/// before the rest of the round is handled. Each end must complete its own lane — not another
/// lane now running in the reused slot — or that lane's next message overtakes this one.
///
/// A lane lookup by hash is offered every lane of its table group whose hash shares seven tag
/// bits (1 in 128), so the case needs lanes that collide: one shard with 12 lanes (one group),
/// and 24 different sets of keys, so that some set holds a colliding pair (each set does with
/// a chance of 40 %: all 24 miss with a chance below 1 in 100,000).
#[tokio::test(start_paused = true)]
async fn lane_futures_ending_together_complete_their_own_lanes() {
    for set in 0..24 {
        let (_broker, bed) = bed(4);
        let checker = Arc::new(OrderChecker::new());
        let plan = FaultPlan {
            latency: convoy_testkit::Latency::Fixed(Duration::from_millis(1)),
            ..FaultPlan::default()
        };
        let handler = ProbeHandler::with_faults(checker.clone(), plan);
        publish_load(bed.publisher().as_ref(), &checker, &format!("set{set}-"), 12, 100)
            .await
            .unwrap();
        let mut config = test_config(bed.group());
        config.shards = 1;
        let engine = run(&bed, handler, config, sink(&bed, &checker)).await;
        wait_until("every message", || checker.complete()).await;
        engine.stop().await.unwrap();
        let report = checker.report();
        assert!(report.is_clean(), "key set {set}: {report:?}");
        assert_eq!(report.finished, 1_200);
    }
}
