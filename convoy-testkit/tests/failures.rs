//! Failures are visible and limits hold: a panic outside the handler or a fatal transport error
//! stops the engine with an error (never a silent freeze), user-given durations cannot overflow,
//! a rewritten log is handled again, memory stays within the configured bounds (held messages,
//! held bytes, watermark windows), handler concurrency is capped, empty keys follow the keyless
//! policy, the offset map is committed while the head retries, and the per-message span stays
//! below INFO. Paused clock and the memory broker unless said otherwise.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::dead_letter::DL_CAUSE;
use convoy_core::transport::SourceEvent;
use convoy_core::{
    handler_fn, DeadLetter, DeadLetterSink, Delivery, Engine, EngineConfig, EngineError, Handler,
    HandlerError, KeylessPolicy, OutgoingMessage, Publisher, TransportError,
};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::{MemoryBed, MemoryTarget};
use convoy_testkit::probe::{probe_key, publish_load, FaultPlan, Latency, ProbeHandler, RecordingSink};
use convoy_testkit::script::scripted;
use convoy_testkit::OrderChecker;
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(3600);

fn bed(partitions: u32) -> MemoryBed {
    MemoryTarget::new().memory_bed(partitions)
}

async fn wait_until(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn spawn(
    bed: &MemoryBed,
    handler: impl Handler,
    config: EngineConfig,
    sink: impl DeadLetterSink,
) -> convoy_core::EngineHandle {
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(sink)
        .build()
        .unwrap();
    let subscription = futures_lite_block(bed.subscribe()).unwrap();
    engine.spawn(subscription)
}

/// The memory transport subscribes without awaiting anything real; run it inline.
fn futures_lite_block<F: std::future::Future>(f: F) -> F::Output {
    futures_util::FutureExt::now_or_never(f).expect("the memory transport subscribes at once")
}

struct PanickingSink;

#[async_trait]
impl DeadLetterSink for PanickingSink {
    async fn publish(&self, _: &DeadLetter) -> Result<(), TransportError> {
        panic!("sink bug: index out of bounds")
    }
}

/// Fails without shard supervision: the panic killed the shard task silently, its lanes never
/// completed, and `join` waited forever while the member kept its partitions.
#[tokio::test(start_paused = true)]
async fn a_panicking_dead_letter_sink_stops_the_engine_with_an_error() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {})); // the panic is expected; keep the output clean
    let bed = bed(1);
    let handler = handler_fn(|_d: Delivery| async { Err::<(), _>(HandlerError::terminal("poison")) });
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let running = spawn(&bed, handler, test_config(bed.group()), PanickingSink);
    let outcome = tokio::time::timeout(LIMIT, running.join()).await;
    std::panic::set_hook(default_hook);
    let err = outcome.expect("the engine stopped").unwrap_err();
    assert!(matches!(err, EngineError::Shard(_)), "{err}");
    assert!(err.to_string().contains("sink bug"), "{err}");
}

struct FencedSink;

#[async_trait]
impl DeadLetterSink for FencedSink {
    async fn publish(&self, _: &DeadLetter) -> Result<(), TransportError> {
        Err(TransportError::Fatal("producer fenced".into()))
    }
}

/// A dead-letter sink whose client can never publish again ends the engine with that error
/// instead of retrying forever.
#[tokio::test(start_paused = true)]
async fn a_fatal_sink_error_stops_the_engine_with_it() {
    let bed = bed(1);
    let handler = handler_fn(|_d: Delivery| async { Err::<(), _>(HandlerError::terminal("poison")) });
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let running = spawn(&bed, handler, test_config(bed.group()), FencedSink);
    let err = tokio::time::timeout(LIMIT, running.join())
        .await
        .expect("the engine stopped")
        .unwrap_err();
    assert!(
        matches!(err, EngineError::Transport(ref e) if e.is_fatal()),
        "{err}"
    );
    assert!(err.to_string().contains("producer fenced"), "{err}");
    assert!(
        bed.committed().await.unwrap().is_empty(),
        "the message was not finished"
    );
}

/// A transport reporting a failure it cannot recover from (fenced member, authorization)
/// ends the engine with that error.
#[tokio::test(start_paused = true)]
async fn a_failed_transport_ends_the_engine_with_its_error() {
    let (script, subscription) = scripted(None);
    let handler = handler_fn(|_d: Delivery| async { Ok::<(), HandlerError>(()) });
    let sink = MemoryTarget::new().memory_bed(1).dead_letter_sink();
    let running = Engine::builder(handler)
        .config(test_config("failed"))
        .dead_letter_sink(sink)
        .build()
        .unwrap()
        .spawn(subscription);
    script.control(SourceEvent::Failed(TransportError::Fatal(
        "GroupAuthorizationFailed".into(),
    )));
    let err = running.join().await.unwrap_err();
    assert!(err.to_string().contains("GroupAuthorizationFailed"), "{err}");
    assert!(script.closed(), "the transport was closed on the way out");
}

/// Fails with unchecked arithmetic: `since_first_failure + Duration::MAX` overflowed and the
/// panic killed the shard.
#[tokio::test(start_paused = true)]
async fn retry_after_the_end_of_time_with_a_time_budget_dead_letters() {
    let bed = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let handler = handler_fn(|_d: Delivery| async {
        Err::<(), _>(HandlerError::retry_after("come back never", Duration::MAX))
    });
    let mut config = test_config(bed.group());
    config.retry.max_elapsed = Some(Duration::from_secs(60));
    config.retry.max_attempts = None;
    bed.publisher()
        .publish(OutgoingMessage::new("k", "x"))
        .await
        .unwrap();
    let sink = Arc::new(RecordingSink::new(bed.dead_letter_sink(), checker.clone()));
    let running = spawn(&bed, handler, config, sink.clone());
    wait_until("the dead letter", || sink.recorded().len() == 1).await;
    assert_eq!(sink.recorded()[0].reason.cause.as_str(), "retries-exhausted");
    running.stop().await.unwrap();
}

/// Fails without position resets: offsets at or below ones received before were dropped as
/// repeats, so the messages rewritten after a log truncation were never handled.
#[tokio::test(start_paused = true)]
async fn a_truncated_and_rewritten_log_is_handled_again() {
    let bed = bed(1);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 2, 10)
        .await
        .unwrap();
    let running = spawn(
        &bed,
        ProbeHandler::new(checker.clone()),
        test_config(bed.group()),
        RecordingSink::new(bed.dead_letter_sink(), checker.clone()),
    );
    checker.wait_complete(LIMIT).await;
    wait_until("everything committed", || {
        futures_lite_block(bed.committed()).unwrap().values().next() == Some(&19)
    })
    .await;
    // An unclean leader election: offsets 12.. are gone, and new messages take them again. The
    // new messages are the keys' next ones (the checker expects them after what was handled).
    let source = convoy_memory::broker::source_id(bed.topic(), 0);
    bed.broker().truncate(&source, 12);
    let rewritten = publish_load(bed.publisher().as_ref(), &checker, "k", 2, 4)
        .await
        .unwrap();
    assert_eq!(rewritten[0].offset, 12, "the log continues from the cut");
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "the rewritten messages were not handled: {:?}",
        checker.report()
    );
    let report = running.stop().await.unwrap();
    assert_eq!(report.stats.resets, 1);
    assert_eq!(report.stats.handled, 28);
    assert_eq!(report.committed.values().next(), Some(&19));
    assert!(checker.report().is_clean(), "{:?}", checker.report());
}

/// Fails without the window gate: one key hung at the head of a busy source let the engine
/// take in the whole source (`held` stayed low, the watermark window grew without bound).
#[tokio::test(start_paused = true)]
async fn a_blocked_head_bounds_its_sources_window() {
    let bed = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let latch = plan.hold_key(probe_key("k", 0));
    publish_load(bed.publisher().as_ref(), &checker, "k", 50, 40)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    config.back_pressure.window_high = 200;
    config.back_pressure.window_low = 100;
    let running = spawn(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        config,
        RecordingSink::new(bed.dead_letter_sink(), checker.clone()),
    );
    wait_until("the source paused on its window", || {
        running.stats().paused_sources == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stats = running.stats();
    // The window is bounded by its mark plus what was already fetched when the source paused.
    let max_prefetch = (convoy_memory::broker::EVENT_CAPACITY + 2) * 32;
    assert!(
        stats.peak_window <= 200 + max_prefetch,
        "window {} over its bound",
        stats.peak_window
    );
    assert!(
        checker.finished() < 2_000 - 40,
        "the source kept flowing past its window"
    );
    latch.release();
    checker.wait_complete(LIMIT).await;
    running.stop().await.unwrap();
    assert!(checker.report().is_clean());
}

/// Fails without the bytes gate: with 16 KiB payloads the message bounds alone let the engine
/// hold thousands of them (tens of MiB) whatever the configuration said about memory.
#[tokio::test(start_paused = true)]
async fn held_bytes_stay_within_their_bound_whatever_the_payload_size() {
    let bed = bed(4);
    let payload = Bytes::from(vec![b' '; 16 << 10]);
    let publisher = bed.publisher();
    for i in 0..2_000u64 {
        let message = OutgoingMessage::new(format!("k{}", i % 100), payload.clone());
        publisher.publish(message).await.unwrap();
    }
    let handled = Arc::new(AtomicUsize::new(0));
    let count = handled.clone();
    let handler = handler_fn(move |_d: Delivery| {
        let count = count.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            count.fetch_add(1, SeqCst);
            Ok::<(), HandlerError>(())
        }
    });
    let mut config = test_config(bed.group());
    config.back_pressure.total_bytes_high = 1 << 20;
    config.back_pressure.total_bytes_low = 512 << 10;
    let running = spawn(
        &bed,
        handler,
        config,
        RecordingSink::new(bed.dead_letter_sink(), Arc::new(OrderChecker::new())),
    );
    wait_until("every message", || handled.load(SeqCst) == 2_000).await;
    let report = running.stop().await.unwrap();
    let max_prefetch_bytes = (convoy_memory::broker::EVENT_CAPACITY + 2) * 32 * (16 << 10);
    assert!(
        report.stats.peak_held_bytes <= (1 << 20) + max_prefetch_bytes,
        "held {} bytes at once",
        report.stats.peak_held_bytes
    );
    assert!(report.stats.pauses > 0);
}

/// At most `max_in_flight` handler calls at once, whatever the number of active lanes.
#[tokio::test(start_paused = true)]
async fn handler_calls_are_capped_by_max_in_flight() {
    let bed = bed(4);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 200, 3)
        .await
        .unwrap();
    let plan = FaultPlan {
        latency: Latency::Fixed(Duration::from_millis(10)),
        ..FaultPlan::default()
    };
    let handler = Arc::new(ProbeHandler::with_faults(checker.clone(), plan));
    let mut config = test_config(bed.group());
    config.max_in_flight = Some(7);
    let running = spawn(
        &bed,
        handler.clone(),
        config,
        RecordingSink::new(bed.dead_letter_sink(), checker.clone()),
    );
    checker.wait_complete(LIMIT).await;
    running.stop().await.unwrap();
    assert!(
        handler.max_in_flight() <= 7,
        "{} handler calls at once",
        handler.max_in_flight()
    );
    assert!(
        handler.max_in_flight() >= 4,
        "the limit still lets calls run in parallel"
    );
    assert!(checker.report().is_clean());
}

/// Fails when `""` is a key: every message with an empty key, from every source, queued in one
/// global lane. It follows the keyless policy instead (producers whose default partitioner
/// spreads empty keys at random — librdkafka's `consistent_random` — put them on every source).
#[tokio::test(start_paused = true)]
async fn an_empty_key_follows_the_keyless_policy() {
    for policy in [KeylessPolicy::PerSource, KeylessPolicy::DeadLetter] {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let handled = Arc::new(AtomicUsize::new(0));
        let (now, peak, done) = (in_flight.clone(), most.clone(), handled.clone());
        let handler = handler_fn(move |_d: Delivery| {
            let (now, peak, done) = (now.clone(), peak.clone(), done.clone());
            async move {
                let running = now.fetch_add(1, SeqCst) + 1;
                peak.fetch_max(running, SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                now.fetch_sub(1, SeqCst);
                done.fetch_add(1, SeqCst);
                Ok::<(), HandlerError>(())
            }
        });
        let mut config = test_config("empty-keys");
        config.keyless = policy;
        let sink = Arc::new(RecordingSink::new(
            bed(1).dead_letter_sink(),
            Arc::new(OrderChecker::new()),
        ));
        let (script, subscription) = scripted(None);
        let running = Engine::builder(handler)
            .config(config)
            .dead_letter_sink(sink.clone())
            .build()
            .unwrap()
            .spawn(subscription);
        for p in 0..4 {
            let source = convoy_core::SourceId::new(format!("t/{p}"));
            script.assign(&source);
            let batch = (0..10)
                .map(|o| convoy_testkit::script::message(&source, o, Some(""), "x"))
                .collect();
            script.messages(&source, batch).await;
        }
        match policy {
            KeylessPolicy::PerSource => {
                wait_until("all handled", || handled.load(SeqCst) == 40).await;
                assert_eq!(
                    most.load(SeqCst),
                    4,
                    "one lane per source: the four sources' empty-key messages ran in parallel"
                );
            }
            _ => {
                wait_until("all dead-lettered", || sink.recorded().len() == 40).await;
                assert_eq!(handled.load(SeqCst), 0);
                assert!(sink.recorded()[0].reason.error.contains("no key"));
            }
        }
        running.stop().await.unwrap();
    }
}

/// Fails with commits only on watermark moves: while the head message retried, the finished
/// offsets above it were never committed — exactly when the offset map matters.
#[tokio::test(start_paused = true)]
async fn the_offset_map_is_committed_while_the_head_retries() {
    let bed = bed(1);
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let latch = plan.hold_key(probe_key("k", 0));
    let receipts = publish_load(bed.publisher().as_ref(), &checker, "k", 5, 4)
        .await
        .unwrap();
    let mut config = test_config(bed.group());
    config.commit_interval = Duration::from_millis(100);
    let running = spawn(
        &bed,
        ProbeHandler::with_faults(checker.clone(), plan),
        config,
        RecordingSink::new(bed.dead_letter_sink(), checker.clone()),
    );
    wait_until("the free keys", || checker.finished() == 16).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let source = receipts[0].source.clone();
    let (next, above) = bed
        .broker()
        .committed_position(bed.group(), &source)
        .expect("a commit carrying the offset map");
    assert_eq!(next, 0, "offset 0 (key k0) is still unfinished");
    let expected: Vec<u64> = receipts
        .iter()
        .filter(|r| r.offset % 5 != 0)
        .map(|r| r.offset)
        .collect();
    assert_eq!(
        above, expected,
        "every finished offset above the head is in the map"
    );
    latch.release();
    checker.wait_complete(LIMIT).await;
    running.stop().await.unwrap();
}

/// A layer counting the per-message spans an INFO subscriber would format.
struct SpanCounter(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for SpanCounter {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() == "convoy.message" {
            self.0.fetch_add(1, SeqCst);
        }
    }
}

/// Fails with the span at INFO: an application's usual INFO subscriber built a span per message.
#[tokio::test(start_paused = true)]
async fn an_info_subscriber_sees_no_per_message_span() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer as _;
    let spans = Arc::new(AtomicUsize::new(0));
    let subscriber = tracing_subscriber::registry()
        .with(SpanCounter(spans.clone()).with_filter(tracing_subscriber::filter::LevelFilter::INFO));
    let _default = tracing::subscriber::set_default(subscriber);
    let bed = bed(1);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 3, 3)
        .await
        .unwrap();
    let running = spawn(
        &bed,
        ProbeHandler::new(checker.clone()),
        test_config(bed.group()),
        RecordingSink::new(bed.dead_letter_sink(), checker.clone()),
    );
    checker.wait_complete(LIMIT).await;
    running.stop().await.unwrap();
    assert_eq!(spans.load(SeqCst), 0);
    let dead = bed.dead_letters(0).await.unwrap();
    assert!(dead.iter().all(|m| m.headers.get_str(DL_CAUSE).is_some()));
}

/// Fails without `Assignment::offsets_are_positions`: a message without an event id of its own
/// is identified by (source, offset), so after a new assignment whose offsets count deliveries
/// again from 1 (an AMQP channel), different messages at the same offsets were skipped as
/// duplicates — and committed. With log positions the same offsets are the same messages, and
/// are skipped.
#[tokio::test(start_paused = true)]
async fn delivery_offsets_never_identify_a_message_log_positions_do() {
    use convoy_core::transport::Assignment;
    use convoy_core::SourceId;
    use convoy_testkit::script::message;
    for log_positions in [false, true] {
        let (script, subscription) = scripted(None);
        let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let s = seen.clone();
        let handler = handler_fn(move |d: Delivery| {
            let s = s.clone();
            async move {
                s.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(d.payload()).into_owned());
                Ok::<(), HandlerError>(())
            }
        });
        let running = Engine::builder(handler)
            .config(test_config("positions"))
            .dead_letter_sink(bed(1).dead_letter_sink())
            .build()
            .unwrap()
            .spawn(subscription);
        let source = SourceId::partition("t", 0);
        let assignment = |token: u64| {
            let a = Assignment::new(source.clone(), None).with_token(token);
            let a = if log_positions {
                a
            } else {
                a.with_delivery_offsets()
            };
            SourceEvent::Assigned(vec![a])
        };
        let batch = |channel: &str| {
            (1..=3)
                .map(|tag| message(&source, tag, Some("k"), &format!("{channel}-{tag}")))
                .collect::<Vec<_>>()
        };
        script.control(assignment(1));
        script.messages(&source, batch("first")).await;
        wait_until("the first three", || seen.lock().unwrap().len() == 3).await;
        script.control(SourceEvent::Lost(vec![source.clone()]));
        script.control(assignment(2));
        script.messages(&source, batch("second")).await;
        if log_positions {
            wait_until("the repeats skipped", || running.stats().duplicates == 3).await;
            assert_eq!(
                seen.lock().unwrap().len(),
                3,
                "the same positions: the same messages"
            );
        } else {
            wait_until("the next three", || seen.lock().unwrap().len() == 6).await;
            assert_eq!(running.stats().duplicates, 0);
            let commits = script.commits();
            assert!(
                commits.iter().filter(|c| c.token == 2).all(|c| c.next <= 4),
                "{commits:?}"
            );
        }
        running.stop().await.unwrap();
    }
}
