//! The conformance suite: one set of cases every transport must pass.
//!
//! A transport's test crate implements [`ConformanceTarget`] (fresh, isolated beds: a topic or
//! queue set, a consumer group, a dead-letter destination) and calls
//! [`conformance_tests!`](crate::conformance_tests), which makes each case a separately named
//! test. Cases assert outcomes — every message finished, per-key order, what was committed,
//! what reached the dead-letter destination with which reason — never just "no error".

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::dead_letter::{
    DL_ATTEMPTS, DL_CAUSE, DL_ERROR, DL_ERROR_CLASS, DL_GROUP, DL_OFFSET, DL_SOURCE,
};
use convoy_core::transport::{Commit, SourceEvent, Subscription};
use convoy_core::{
    typed, BatchConfig, DeadLetterSink, Delivery, Engine, EngineConfig, EngineHandle, Handler, HandlerError,
    Message, Offset, OutgoingMessage, Publisher, Receipt, SourceId, Transport, TransportError,
};

use crate::checker::{CheckReport, OrderChecker};
pub use crate::parking::{
    a_replay_of_one_message_ends_on_a_quiet_source, checkpoint_parts_are_kept_apart_at_full_size,
    parked_key_waits_for_its_replay, parked_keys_read_back_from_a_checkpoint,
};
use crate::probe::{
    self, decode_seq, probe_key, BatchLog, BatchProbe, FaultPlan, Latency, ProbeHandler, RecordingSink,
};
pub use crate::transforms::transform_outputs_follow_their_inputs;

/// What a transport can and cannot do, declared once instead of weakening a case.
#[derive(Clone, Copy, Debug)]
pub struct Capabilities {
    /// The most messages the engine may hold beyond the high-water mark: the batch that crossed
    /// it plus what the transport had already fetched or buffered when fetching was paused.
    pub max_prefetch: usize,
    /// What offsets are, which decides how a case checks what was committed.
    pub positions: Positions,
    /// The broker itself drops a re-published event (same event id) within a window
    /// (JetStream's `Nats-Msg-Id` deduplication): the copy is never stored, its receipt names the
    /// original, and the engine never sees it. Elsewhere the engine's idempotency store skips it.
    pub deduplicates_publishes: bool,
}

/// What a transport's offsets are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Positions {
    /// Positions in a log (Kafka offsets, stream sequences): a publish receipt carries the
    /// offset, every consumer sees the same one, and a commit is a position the group keeps
    /// (`TestBed::committed`). Cases compare committed positions with receipts.
    Log,
    /// Delivery tags of one consumer's channel (RabbitMQ): they restart with every channel, and
    /// a commit acknowledges — removes — what it covers. Cases check instead that nothing the
    /// group should have committed is left (`TestBed::remaining`), and that redelivery after a
    /// crash stays within the unacknowledged window (`max_prefetch`).
    Delivery,
}

/// What every bed has, whatever the transport: where to publish, where dead letters go, the
/// group, and the transport its members join through.
pub struct BedParts {
    /// Publishes keyed messages to the bed's sources.
    pub publisher: Arc<dyn Publisher>,
    /// The transport's native dead-letter sink for this bed.
    pub dead_letter_sink: Arc<dyn DeadLetterSink>,
    /// The consumer group name.
    pub group: String,
    /// The transport configured for the bed's topic and group.
    pub transport: Arc<dyn Transport>,
}

/// An isolated environment for one case.
#[async_trait]
pub trait TestBed: Send + Sync {
    /// The bed's publisher, sink, group and transport.
    fn parts(&self) -> &BedParts;
    /// Publishes keyed messages to the bed's sources.
    fn publisher(&self) -> Arc<dyn Publisher> {
        self.parts().publisher.clone()
    }
    /// The transport's native dead-letter sink for this bed.
    fn dead_letter_sink(&self) -> Arc<dyn DeadLetterSink> {
        self.parts().dead_letter_sink.clone()
    }
    /// The consumer group name.
    fn group(&self) -> &str {
        &self.parts().group
    }
    /// Joins the group as a new member.
    async fn subscribe(&self) -> Result<Subscription, TransportError> {
        self.parts().transport.subscribe().await
    }
    /// Reads the dead-letter destination, waiting (bounded) until `expected` are there.
    async fn dead_letters(&self, expected: usize) -> Result<Vec<Message>, TransportError>;
    /// The group's committed watermarks (transports with [`Positions::Log`]).
    async fn committed(&self) -> Result<BTreeMap<SourceId, Offset>, TransportError>;
    /// Messages published to the bed that its group has not committed, read once no member
    /// holds any (transports with [`Positions::Delivery`]).
    async fn remaining(&self) -> Result<u64, TransportError> {
        Err(TransportError::broker(
            "counting remaining messages",
            "this transport keeps log positions: compare committed() with the receipts",
        ))
    }
}

/// Makes fresh beds for the suite.
#[async_trait]
pub trait ConformanceTarget: Send + Sync {
    /// What the transport supports.
    fn capabilities(&self) -> Capabilities;
    /// Why the suite cannot run here (e.g. a broker address variable is unset), if so: the case
    /// is skipped, or fails under [`crate::support::REQUIRE_ALL`], which the project's test
    /// script sets (so CI never skips).
    fn skip_reason(&self) -> Option<String> {
        None
    }
    /// A fresh bed whose destination has `partitions` sources.
    async fn bed(&self, partitions: u32) -> Result<Box<dyn TestBed>, TransportError>;
}

/// Expands to one `#[tokio::test]` per conformance case, each calling the case with the
/// target built by `$target` (an expression evaluated per test).
#[macro_export]
macro_rules! conformance_tests {
    ($target:expr) => {
        $crate::conformance_tests!(@cases $target;
            per_key_order_under_parallelism,
            transient_retry_without_overtaking,
            terminal_error_dead_letters_and_lane_continues,
            retries_exhausted_dead_letters,
            crash_without_commit_redelivers_from_watermark,
            restart_redelivers_nothing_committed,
            rebalance_two_consumers_mid_stream,
            slow_handler_fast_producer_bounded_memory,
            graceful_shutdown_commits,
            a_stop_hands_over_only_what_is_unfinished,
            malformed_payload_dead_letters,
            duplicate_delivery_skipped,
            hot_key_does_not_stall_others,
            batch_handler_keeps_order_and_results_per_message,
            poison_input_dead_letters_with_reasons,
            newest_offsets_cover_what_was_received,
            parked_key_waits_for_its_replay,
            a_replay_of_one_message_ends_on_a_quiet_source,
            parked_keys_read_back_from_a_checkpoint,
            checkpoint_parts_are_kept_apart_at_full_size,
            transform_outputs_follow_their_inputs,
        );
    };
    (@cases $target:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let target = $target;
                if let Some(reason) = $crate::conformance::ConformanceTarget::skip_reason(&target) {
                    return $crate::support::skip(reason);
                }
                $crate::conformance::$case(&target).await;
            }
        )*
    };
}

/// Upper bound for any wait in a case; a healthy run takes a small fraction of it.
const LIMIT: Duration = Duration::from_secs(60);

/// Fast settings for tests: short backoff, frequent commits.
pub fn test_config(group: &str) -> EngineConfig {
    let mut config = EngineConfig::for_group(group);
    config.shards = 4;
    config.retry.max_attempts = Some(5);
    config.retry.backoff.base = Duration::from_millis(1);
    config.retry.backoff.cap = Duration::from_millis(20);
    config.commit_interval = Duration::from_millis(20);
    config.commit_every = 100;
    config.drain_timeout = Duration::from_secs(8);
    config
}

pub(crate) async fn bed(target: &dyn ConformanceTarget, partitions: u32) -> Box<dyn TestBed> {
    match target.bed(partitions).await {
        Ok(bed) => bed,
        Err(e) => panic!("the target could not make a test bed: {e}"),
    }
}

pub(crate) fn start(
    bed_sink: Arc<dyn DeadLetterSink>,
    handler: impl Handler,
    config: EngineConfig,
    subscription: Subscription,
) -> EngineHandle {
    match Engine::builder(handler)
        .config(config)
        .dead_letter_sink(bed_sink)
        .build()
    {
        Ok(engine) => engine.spawn(subscription),
        Err(e) => panic!("test engine config rejected: {e}"),
    }
}

pub(crate) async fn subscribe(bed: &dyn TestBed) -> Subscription {
    match bed.subscribe().await {
        Ok(s) => s,
        Err(e) => panic!("subscribe failed: {e}"),
    }
}

async fn load(
    bed: &dyn TestBed,
    checker: &OrderChecker,
    prefix: &str,
    keys: usize,
    per_key: usize,
) -> Vec<Receipt> {
    match probe::publish_load(bed.publisher().as_ref(), checker, prefix, keys, per_key).await {
        Ok(r) => r,
        Err(e) => panic!("publishing the load failed: {e}"),
    }
}

pub(crate) async fn wait_complete(checker: &OrderChecker, what: &str) {
    if !checker.wait_complete(LIMIT).await {
        panic!(
            "{what}: not every message finished within {LIMIT:?}: {:?}",
            checker.report()
        );
    }
}

pub(crate) fn assert_clean(report: &CheckReport, what: &str) {
    assert!(report.is_clean(), "{what}: {report:#?}");
    assert_eq!(report.finished, report.published, "{what}: {report:#?}");
}

pub(crate) async fn stop(handle: EngineHandle) -> convoy_core::EngineReport {
    match handle.stop().await {
        Ok(r) => r,
        Err(e) => panic!("engine did not stop cleanly: {e}"),
    }
}

fn last_offsets(receipts: &[Receipt]) -> BTreeMap<SourceId, Offset> {
    let mut last = BTreeMap::new();
    for r in receipts {
        let e = last.entry(r.source.clone()).or_insert(r.offset);
        *e = (*e).max(r.offset);
    }
    last
}

async fn remaining(bed: &dyn TestBed) -> u64 {
    match bed.remaining().await {
        Ok(n) => n,
        Err(e) => panic!("counting remaining messages failed: {e}"),
    }
}

pub(crate) async fn committed(bed: &dyn TestBed) -> BTreeMap<SourceId, Offset> {
    match bed.committed().await {
        Ok(c) => c,
        Err(e) => panic!("reading committed positions failed: {e}"),
    }
}

/// Many keys over several sources with random latency: per-key order holds, no key runs
/// twice at once, and different keys really run in parallel.
pub async fn per_key_order_under_parallelism(target: &dyn ConformanceTarget) {
    let bed = bed(target, 4).await;
    let checker = Arc::new(OrderChecker::new());
    let plan = FaultPlan {
        latency: Latency::Uniform(Duration::ZERO, Duration::from_millis(2)),
        ..FaultPlan::default()
    };
    let handler = Arc::new(ProbeHandler::with_faults(checker.clone(), plan));
    load(bed.as_ref(), &checker, "k", 40, 25).await;
    let consumer = start(
        bed.dead_letter_sink(),
        handler.clone(),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "per-key order").await;
    let report = stop(consumer).await;
    let check = checker.report();
    assert_clean(&check, "per-key order");
    assert_eq!((check.duplicates, check.dead_lettered), (0, 0), "{check:#?}");
    assert_eq!(report.stats.handled, 1000);
    assert!(
        handler.max_in_flight() >= 4,
        "keys ran in parallel: at most {} at once",
        handler.max_in_flight()
    );
}

/// Transient failures retry inside the lane: later messages of the key never overtake, and
/// each failing message is retried exactly as often as it failed.
pub async fn transient_retry_without_overtaking(target: &dyn ConformanceTarget) {
    let bed = bed(target, 3).await;
    let checker = Arc::new(OrderChecker::new());
    let plan = FaultPlan {
        seed: 11,
        transient_rate: 0.2,
        transient_attempts: 2,
        ..FaultPlan::default()
    };
    let receipts = load(bed.as_ref(), &checker, "k", 20, 25).await;
    let failing = (0..25u64)
        .flat_map(|seq| (0..20).map(move |k| (probe_key("k", k), seq)))
        .filter(|(k, s)| plan.fails_transiently(k, *s))
        .count() as u64;
    assert!(failing > 50, "the plan must fail a fair share: {failing}");
    let handler = Arc::new(ProbeHandler::with_faults(checker.clone(), plan));
    let consumer = start(
        bed.dead_letter_sink(),
        handler.clone(),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "transient retry").await;
    let report = stop(consumer).await;
    let check = checker.report();
    assert_clean(&check, "transient retry");
    assert_eq!(check.dead_lettered, 0);
    assert_eq!(
        report.stats.retries,
        failing * 2,
        "two retries per failing message"
    );
    assert_eq!(handler.calls(), receipts.len() as u64 + failing * 2);
}

fn header<'a>(m: &'a Message, name: &str) -> &'a str {
    m.headers
        .get_str(name)
        .unwrap_or_else(|| panic!("dead letter lacks header {name}: {m:?}"))
}

/// A terminal error dead-letters the message at once, with its reason, and the lane goes on.
pub async fn terminal_error_dead_letters_and_lane_continues(target: &dyn ConformanceTarget) {
    let bed = bed(target, 2).await;
    let checker = Arc::new(OrderChecker::new());
    let poison: HashSet<(Bytes, u64)> = [
        (probe_key("k", 3), 5),
        (probe_key("k", 3), 6),
        (probe_key("k", 7), 0),
    ]
    .into();
    let plan = FaultPlan {
        terminal_on: poison.clone(),
        ..FaultPlan::default()
    };
    let receipts = load(bed.as_ref(), &checker, "k", 10, 20).await;
    let handler = Arc::new(ProbeHandler::with_faults(checker.clone(), plan).counting_calls());
    let sink = Arc::new(RecordingSink::new(bed.dead_letter_sink(), checker.clone()));
    let consumer = start(
        sink.clone(),
        handler.clone(),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "terminal error").await;
    stop(consumer).await;
    let check = checker.report();
    assert_clean(&check, "terminal error");
    assert_eq!(check.dead_lettered, 3);
    assert_eq!(check.handled, receipts.len() as u64 - 3);
    for (key, seq) in &poison {
        assert_eq!(handler.calls_for(key, *seq), 1, "terminal errors are not retried");
    }
    let dead = match bed.dead_letters(3).await {
        Ok(d) => d,
        Err(e) => panic!("reading dead letters failed: {e}"),
    };
    assert_eq!(
        dead.len(),
        3,
        "exactly the poison messages reached the destination: {dead:?}"
    );
    for m in &dead {
        let seq = decode_seq(&m.payload).expect("dead letter keeps the original payload");
        let key = m.key.clone().expect("dead letter keeps the original key");
        assert!(poison.contains(&(key.clone(), seq)));
        assert_eq!(header(m, DL_CAUSE), "terminal");
        assert_eq!(header(m, DL_ERROR_CLASS), "terminal");
        assert!(header(m, DL_ERROR).contains("injected terminal failure"));
        assert_eq!(header(m, DL_ATTEMPTS), "1");
        assert_eq!(header(m, DL_GROUP), bed.group());
        let original = receipts
            .iter()
            .zip(0..)
            .find(|(_, i)| *i / 10 == seq as usize && probe_key("k", i % 10) == key)
            .map(|(r, _)| r)
            .expect("receipt of the poison message");
        assert_eq!(header(m, DL_SOURCE), original.source.as_str());
        match target.capabilities().positions {
            Positions::Log => assert_eq!(header(m, DL_OFFSET), original.offset.to_string()),
            // A delivery tag: known only to the channel that received it.
            Positions::Delivery => assert!(header(m, DL_OFFSET).parse::<u64>().is_ok_and(|t| t >= 1)),
        }
    }
}

/// A message that keeps failing transiently is dead-lettered after the attempt limit, and its
/// key's later messages are then handled.
pub async fn retries_exhausted_dead_letters(target: &dyn ConformanceTarget) {
    let bed = bed(target, 2).await;
    let checker = Arc::new(OrderChecker::new());
    let stubborn = (probe_key("k", 1), 3u64);
    let plan = FaultPlan {
        transient_forever: [stubborn.clone()].into(),
        ..FaultPlan::default()
    };
    load(bed.as_ref(), &checker, "k", 5, 10).await;
    let handler = Arc::new(ProbeHandler::with_faults(checker.clone(), plan).counting_calls());
    let sink = Arc::new(RecordingSink::new(bed.dead_letter_sink(), checker.clone()));
    let mut config = test_config(bed.group());
    config.retry.max_attempts = Some(4);
    let consumer = start(
        sink.clone(),
        handler.clone(),
        config,
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "retries exhausted").await;
    let report = stop(consumer).await;
    let check = checker.report();
    assert_clean(&check, "retries exhausted");
    assert_eq!(check.dead_lettered, 1);
    assert_eq!(
        handler.calls_for(&stubborn.0, stubborn.1),
        4,
        "exactly max_attempts attempts"
    );
    assert_eq!(report.stats.retries, 3);
    let dead = bed.dead_letters(1).await.expect("dead letters readable");
    assert_eq!(dead.len(), 1);
    assert_eq!(header(&dead[0], DL_CAUSE), "retries-exhausted");
    assert_eq!(header(&dead[0], DL_ERROR_CLASS), "transient");
    assert_eq!(header(&dead[0], DL_ATTEMPTS), "4");
}

fn min_offsets(offsets: &[(SourceId, Offset)]) -> BTreeMap<SourceId, Offset> {
    let mut min = BTreeMap::new();
    for (s, o) in offsets {
        let e = min.entry(s.clone()).or_insert(*o);
        *e = (*e).min(*o);
    }
    min
}

/// A consumer crashes (no drain, no commit) mid-stream; its successor resumes after the
/// committed watermark: nothing lost, nothing committed handled again, order intact.
pub async fn crash_without_commit_redelivers_from_watermark(target: &dyn ConformanceTarget) {
    let bed = bed(target, 3).await;
    let checker = Arc::new(OrderChecker::new());
    let receipts = load(bed.as_ref(), &checker, "k", 12, 50).await;
    let plan = FaultPlan {
        latency: Latency::Uniform(Duration::ZERO, Duration::from_millis(1)),
        ..FaultPlan::default()
    };
    let first = Arc::new(ProbeHandler::with_faults(checker.clone(), plan.clone()));
    let mut config = test_config(bed.group());
    config.commit_every = 50;
    let consumer = start(
        bed.dead_letter_sink(),
        first.clone(),
        config.clone(),
        subscribe(bed.as_ref()).await,
    );
    assert!(
        checker.wait_for(LIMIT, |c| c.finished() >= 300).await,
        "first consumer made no progress"
    );
    consumer.abort().await;
    let positions = target.capabilities().positions;
    let at_crash = match positions {
        Positions::Log => committed(bed.as_ref()).await,
        Positions::Delivery => BTreeMap::new(),
    };
    let handled_before = checker.finished();
    assert!(
        handled_before < receipts.len() as u64,
        "the crash must happen mid-stream"
    );

    let second = Arc::new(ProbeHandler::with_faults(checker.clone(), plan).recording_offsets());
    let consumer = start(
        bed.dead_letter_sink(),
        second.clone(),
        config,
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "after crash").await;
    stop(consumer).await;
    let report = checker.report();
    assert_clean(&report, "after crash");
    match positions {
        Positions::Log => {
            for (source, min) in min_offsets(&second.handled_offsets()) {
                if let Some(w) = at_crash.get(&source) {
                    assert!(
                        min > *w,
                        "{source}: offset {min} at or below the committed watermark {w} was handled again"
                    );
                }
            }
            assert_eq!(
                committed(bed.as_ref()).await,
                last_offsets(&receipts),
                "everything committed at the end"
            );
        }
        Positions::Delivery => {
            // Acknowledged messages are gone from the broker: only the unacknowledged window can
            // come back.
            assert!(
                report.duplicates <= target.capabilities().max_prefetch as u64,
                "redelivered {} messages, more than the unacknowledged window: {report:#?}",
                report.duplicates
            );
            assert_eq!(
                remaining(bed.as_ref()).await,
                0,
                "everything committed at the end"
            );
        }
    }
}

/// A consumer that stopped gracefully committed everything: its successor handles only new
/// messages.
pub async fn restart_redelivers_nothing_committed(target: &dyn ConformanceTarget) {
    let bed = bed(target, 3).await;
    let checker = Arc::new(OrderChecker::new());
    let first_load = load(bed.as_ref(), &checker, "k", 10, 30).await;
    let consumer = start(
        bed.dead_letter_sink(),
        ProbeHandler::new(checker.clone()),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "first run").await;
    stop(consumer).await;
    match target.capabilities().positions {
        Positions::Log => assert_eq!(
            committed(bed.as_ref()).await,
            last_offsets(&first_load),
            "graceful stop committed every source's end"
        ),
        Positions::Delivery => assert_eq!(
            remaining(bed.as_ref()).await,
            0,
            "graceful stop committed everything"
        ),
    }

    let second_load = load(bed.as_ref(), &checker, "k", 10, 30).await;
    let second = Arc::new(ProbeHandler::new(checker.clone()).recording_offsets());
    let consumer = start(
        bed.dead_letter_sink(),
        second.clone(),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "second run").await;
    stop(consumer).await;
    let check = checker.report();
    assert_clean(&check, "restart");
    assert_eq!(
        check.duplicates, 0,
        "nothing committed was redelivered: {check:#?}"
    );
    assert_eq!(second.handled_offsets().len(), second_load.len());
}

/// A second consumer joins mid-stream, then the first leaves: sources move twice with
/// in-flight work drained and committed in between.
pub async fn rebalance_two_consumers_mid_stream(target: &dyn ConformanceTarget) {
    let bed = bed(target, 4).await;
    let checker = Arc::new(OrderChecker::new());
    let plan = FaultPlan {
        latency: Latency::Uniform(Duration::ZERO, Duration::from_millis(1)),
        ..FaultPlan::default()
    };
    let a = Arc::new(ProbeHandler::with_faults(checker.clone(), plan.clone()));
    let b = Arc::new(ProbeHandler::with_faults(checker.clone(), plan));
    load(bed.as_ref(), &checker, "k", 20, 20).await;
    let first = start(
        bed.dead_letter_sink(),
        a.clone(),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    assert!(checker.wait_for(LIMIT, |c| c.finished() >= 100).await);
    let second = start(
        bed.dead_letter_sink(),
        b.clone(),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    load(bed.as_ref(), &checker, "k", 20, 20).await;
    assert!(checker.wait_for(LIMIT, |c| c.finished() >= 600).await);
    stop(first).await;
    load(bed.as_ref(), &checker, "k", 20, 20).await;
    wait_complete(&checker, "rebalance").await;
    stop(second).await;
    assert_clean(&checker.report(), "rebalance");
    assert!(
        a.calls() > 0 && b.calls() > 0,
        "both consumers worked: {} / {}",
        a.calls(),
        b.calls()
    );
}

/// A slow handler behind a fast producer: the engine pauses fetching instead of buffering
/// without bound, and nothing is dropped.
pub async fn slow_handler_fast_producer_bounded_memory(target: &dyn ConformanceTarget) {
    let partitions = 4;
    let bed = bed(target, partitions).await;
    let checker = Arc::new(OrderChecker::new());
    let plan = FaultPlan {
        latency: Latency::Fixed(Duration::from_millis(1)),
        ..FaultPlan::default()
    };
    let mut config = test_config(bed.group());
    let bp = &mut config.back_pressure;
    (bp.source_high, bp.source_low, bp.total_high, bp.total_low) = (20, 10, 40, 20);
    let consumer = start(
        bed.dead_letter_sink(),
        ProbeHandler::with_faults(checker.clone(), plan),
        config.clone(),
        subscribe(bed.as_ref()).await,
    );
    load(bed.as_ref(), &checker, "k", 50, 20).await;
    wait_complete(&checker, "bounded memory").await;
    let report = stop(consumer).await;
    assert_clean(&checker.report(), "bounded memory");
    let bound = config.back_pressure.total_high + target.capabilities().max_prefetch;
    assert!(
        report.stats.peak_held <= bound,
        "held {} messages at once, bound {bound}",
        report.stats.peak_held
    );
    assert!(report.stats.pauses > 0, "back-pressure must have paused fetching");
}

/// A graceful shutdown commits the final watermarks even when no timer commit happened.
pub async fn graceful_shutdown_commits(target: &dyn ConformanceTarget) {
    let bed = bed(target, 3).await;
    let checker = Arc::new(OrderChecker::new());
    let receipts = load(bed.as_ref(), &checker, "k", 10, 30).await;
    let mut config = test_config(bed.group());
    config.commit_interval = Duration::from_secs(3600);
    config.commit_every = usize::MAX;
    let consumer = start(
        bed.dead_letter_sink(),
        ProbeHandler::new(checker.clone()),
        config,
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "shutdown").await;
    let positions = target.capabilities().positions;
    if positions == Positions::Log {
        assert!(
            committed(bed.as_ref()).await.is_empty(),
            "no commit before shutdown with these settings"
        );
    }
    let report = stop(consumer).await;
    match positions {
        Positions::Log => {
            let expected = last_offsets(&receipts);
            assert_eq!(committed(bed.as_ref()).await, expected);
            assert_eq!(report.committed, expected);
        }
        Positions::Delivery => {
            assert_eq!(
                remaining(bed.as_ref()).await,
                0,
                "the final commit covered everything"
            );
            let sources: std::collections::BTreeSet<&SourceId> = receipts.iter().map(|r| &r.source).collect();
            assert_eq!(
                report.committed.keys().collect::<std::collections::BTreeSet<_>>(),
                sources,
                "every source's watermark was committed at shutdown"
            );
        }
    }
}

/// A stop that leaves a gap hands the next member only what is unfinished: key `a`'s first
/// message never finishes (its handler hangs until the stop's deadline ends it) and its next
/// two wait behind it, while every later message of other keys finishes. The watermark stays
/// below `a`'s first; the messages finished above it are kept with it (Kafka's offset map, a
/// NATS watermark entry, RabbitMQ's acknowledgement of each when it hands the partition over),
/// so the next member handles `a`'s three and nothing else again.
pub async fn a_stop_hands_over_only_what_is_unfinished(target: &dyn ConformanceTarget) {
    let bed = bed(target, 1).await;
    let publisher = bed.publisher();
    let mut above = HashSet::new();
    for (key, payload) in [("gap-a", "a1"), ("gap-a", "a2"), ("gap-a", "a3")] {
        publish(publisher.as_ref(), key, payload).await;
    }
    for k in 0..8 {
        for n in 0..2 {
            let (key, payload) = (format!("gap-b{k}"), format!("b{k}.{n}"));
            publish(publisher.as_ref(), &key, &payload).await;
            above.insert(payload);
        }
    }
    let first = Recorder::new(Some("a1"));
    let mut config = test_config(bed.group());
    config.shutdown_timeout = Duration::from_secs(3);
    let consumer = start(
        bed.dead_letter_sink(),
        first.handler(),
        config,
        subscribe(bed.as_ref()).await,
    );
    let started = first
        .wait_until(|seen| seen.contains("a1") && above.iter().all(|b| seen.contains(b)))
        .await;
    assert!(
        started,
        "the first member did not take a1 and finish the rest: {:?}",
        first.seen()
    );
    stop(consumer).await;
    assert!(
        !first.seen().contains("a2"),
        "a2 waits behind a1, which never finished"
    );

    // A message published after the stop: once the next member handled it and drained what it
    // received, anything handed over again would have been handled too.
    publish(publisher.as_ref(), "gap-z", "end").await;
    let next = Recorder::new(None);
    let mut config = test_config(bed.group());
    config.drain = convoy_core::Drain::Buffered;
    let consumer = start(
        bed.dead_letter_sink(),
        next.handler(),
        config,
        subscribe(bed.as_ref()).await,
    );
    let done = next
        .wait_until(|seen| ["a1", "a2", "a3", "end"].iter().all(|m| seen.contains(*m)))
        .await;
    assert!(
        done,
        "the next member did not get a's messages: {:?}",
        next.seen()
    );
    stop(consumer).await;
    let again: Vec<String> = next.seen().intersection(&above).cloned().collect();
    assert!(
        again.is_empty(),
        "finished before the stop, handled again: {again:?}"
    );
    assert_eq!(
        next.handled(),
        vec!["a1", "a2", "a3", "end"].len(),
        "{:?}",
        next.seen()
    );
}

async fn publish(publisher: &dyn Publisher, key: &str, payload: &str) {
    if let Err(e) = publisher
        .publish(OutgoingMessage::new(key.to_owned(), payload.to_owned()))
        .await
    {
        panic!("publishing {payload} failed: {e}");
    }
}

/// What a member's handler handled, by payload; the payload `hang` names never finishes.
#[derive(Clone)]
struct Recorder {
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    hang: Option<&'static str>,
}

impl Recorder {
    fn new(hang: Option<&'static str>) -> Self {
        Recorder {
            seen: Arc::default(),
            hang,
        }
    }

    fn handler(&self) -> impl Handler {
        let recorder = self.clone();
        convoy_core::handler_fn(move |d: Delivery| {
            let recorder = recorder.clone();
            async move {
                let payload = String::from_utf8_lossy(d.payload()).into_owned();
                let hang = recorder.hang == Some(payload.as_str());
                recorder.lock().push(payload);
                if hang {
                    std::future::pending::<()>().await;
                }
                Ok(())
            }
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn seen(&self) -> HashSet<String> {
        self.lock().iter().cloned().collect()
    }

    /// Messages handled (started), counting repeats.
    fn handled(&self) -> usize {
        self.lock().len()
    }

    /// Waits (bounded by the case limit) until `done` holds for what was seen.
    async fn wait_until(&self, done: impl Fn(&HashSet<String>) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + LIMIT;
        while tokio::time::Instant::now() < deadline {
            if done(&self.seen()) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        done(&self.seen())
    }
}

/// Undecodable payloads are dead-lettered with reason `malformed` while their lanes go on.
pub async fn malformed_payload_dead_letters(target: &dyn ConformanceTarget) {
    let bed = bed(target, 2).await;
    let checker = Arc::new(OrderChecker::new());
    let publisher = bed.publisher();
    let mut garbage = 0;
    for round in 0..10 {
        for k in 0..5 {
            let key = probe_key("k", k);
            probe::publish_probe(publisher.as_ref(), &checker, key.clone())
                .await
                .expect("publish");
            if (round + k) % 4 == 0 {
                publisher
                    .publish(OutgoingMessage::new(key, "{not json"))
                    .await
                    .expect("publish garbage");
                garbage += 1;
            }
        }
    }
    let probe_checker = checker.clone();
    // The typed layer decodes JSON (a probe payload is a JSON number) before the handler runs.
    let handler = typed(move |seq: u64, d: Delivery| {
        let checker = probe_checker.clone();
        async move {
            let key = d.key().cloned().unwrap_or_default();
            checker.enter(&key).handled(seq, None);
            Ok::<(), HandlerError>(())
        }
    });
    let sink = Arc::new(RecordingSink::new(bed.dead_letter_sink(), checker.clone()));
    let consumer = start(
        sink.clone(),
        handler,
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "malformed").await;
    assert!(
        checker
            .wait_for(LIMIT, |_| sink.recorded().len() >= garbage)
            .await
    );
    stop(consumer).await;
    assert_clean(&checker.report(), "malformed");
    let dead = bed.dead_letters(garbage).await.expect("dead letters readable");
    assert_eq!(dead.len(), garbage);
    for m in dead {
        assert_eq!(&m.payload[..], b"{not json", "original payload kept");
        assert_eq!(header(&m, DL_CAUSE), "malformed");
        assert!(header(&m, DL_ERROR).contains("not valid JSON"));
    }
}

/// The same event published twice (same event id) is handled once; both copies are committed.
pub async fn duplicate_delivery_skipped(target: &dyn ConformanceTarget) {
    let bed = bed(target, 2).await;
    let checker = Arc::new(OrderChecker::new());
    let publisher = bed.publisher();
    let mut receipts = Vec::new();
    let mut republished = 0u64;
    for round in 0..20 {
        for k in 0..5 {
            let key = probe_key("k", k);
            let seq = checker.expect(&key);
            let message = OutgoingMessage::new(key.clone(), seq.to_string())
                .event_id(format!("evt-{}-{seq}", String::from_utf8_lossy(&key)));
            let original = publisher.publish(message.clone()).await.expect("publish");
            receipts.push(original.clone());
            if (round * 5 + k) % 4 == 0 {
                // A producer retry: the same event again.
                let copy = publisher.publish(message).await.expect("publish");
                if target.capabilities().deduplicates_publishes {
                    assert_eq!(copy, original, "the broker stored a re-published event again");
                }
                receipts.push(copy);
                republished += 1;
            }
        }
    }
    let handler = Arc::new(ProbeHandler::new(checker.clone()).counting_calls());
    let consumer = start(
        bed.dead_letter_sink(),
        handler.clone(),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "duplicates").await;
    // Wait for the engine to also finish the trailing copies before stopping.
    let positions = target.capabilities().positions;
    let expected = last_offsets(&receipts);
    let deadline = tokio::time::Instant::now() + LIMIT;
    while tokio::time::Instant::now() < deadline {
        let done = match positions {
            Positions::Log => committed(bed.as_ref()).await == expected,
            Positions::Delivery => consumer.stats().duplicates >= republished,
        };
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let report = stop(consumer).await;
    let check = checker.report();
    assert_clean(&check, "duplicates");
    assert_eq!(
        check.duplicates, 0,
        "a re-published event was handled again: {check:#?}"
    );
    let skipped_by_engine = if target.capabilities().deduplicates_publishes {
        0
    } else {
        republished
    };
    assert_eq!(report.stats.duplicates, skipped_by_engine);
    assert_eq!(handler.calls(), 100);
    match positions {
        Positions::Log => assert_eq!(
            committed(bed.as_ref()).await,
            expected,
            "skipped copies are finished and committed too"
        ),
        Positions::Delivery => assert_eq!(
            remaining(bed.as_ref()).await,
            0,
            "skipped copies are finished and committed too"
        ),
    }
}

/// One key's handler hangs; every other key is handled meanwhile. Released, it finishes too.
pub async fn hot_key_does_not_stall_others(target: &dyn ConformanceTarget) {
    let bed = bed(target, 2).await;
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    let latch = plan.hold_key(probe_key("k", 0));
    load(bed.as_ref(), &checker, "k", 20, 20).await;
    let consumer = start(
        bed.dead_letter_sink(),
        ProbeHandler::with_faults(checker.clone(), plan),
        test_config(bed.group()),
        subscribe(bed.as_ref()).await,
    );
    assert!(
        checker.wait_for(LIMIT, |c| c.finished() >= 380).await,
        "other keys stalled behind the hot key: {:?}",
        checker.report()
    );
    assert_eq!(
        checker.finished(),
        380,
        "the held key finished nothing while held"
    );
    latch.release();
    wait_complete(&checker, "hot key").await;
    stop(consumer).await;
    assert_clean(&checker.report(), "hot key");
}

/// A batch handler (`Engine::batch_builder`): calls hold runs of a key's consecutive messages,
/// in order, beside other keys'; each message keeps its own result — a transient failure
/// retries its key from it without overtaking, a terminal one is dead-lettered and its key goes
/// on, the rest finish once.
pub async fn batch_handler_keeps_order_and_results_per_message(target: &dyn ConformanceTarget) {
    let bed = bed(target, 3).await;
    let checker = Arc::new(OrderChecker::new());
    let poison: HashSet<(Bytes, u64)> = [(probe_key("b", 2), 4), (probe_key("b", 9), 0)].into();
    let mut plan = FaultPlan {
        seed: 23,
        transient_rate: 0.2,
        transient_attempts: 1,
        terminal_on: poison.clone(),
        ..FaultPlan::default()
    };
    // One key is held until messages queue behind its head: its next runs hold several.
    let held = probe_key("b", 5);
    let latch = plan.hold_key(held.clone());
    let receipts = load(bed.as_ref(), &checker, "b", 20, 25).await;
    let failing = (0..25u64)
        .flat_map(|seq| (0..20).map(move |k| (probe_key("b", k), seq)))
        .filter(|(k, s)| !poison.contains(&(k.clone(), *s)) && plan.fails_transiently(k, *s))
        .count() as u64;
    assert!(failing > 50, "the plan must fail a fair share: {failing}");
    let probe = Arc::new(ProbeHandler::with_faults(checker.clone(), plan).counting_calls());
    let log = Arc::new(BatchLog::default());
    let batch = BatchConfig::new(16, Duration::from_millis(50)).per_key(4);
    let handler = BatchProbe::new(probe.clone()).logging(log.clone());
    let sink = Arc::new(RecordingSink::new(bed.dead_letter_sink(), checker.clone()));
    let engine = match Engine::batch_builder(handler, batch)
        .and_then(|b| b.config(test_config(bed.group())).dead_letter_sink(sink).build())
    {
        Ok(engine) => engine,
        Err(e) => panic!("test engine config rejected: {e}"),
    };
    let consumer = engine.spawn(subscribe(bed.as_ref()).await);
    let held_name = String::from_utf8_lossy(&held).into_owned();
    let queued_behind = tokio::time::timeout(LIMIT, async {
        loop {
            let queued = consumer
                .inspector()
                .inspect(20)
                .await
                .and_then(|i| i.backlog.iter().find(|l| l.key == held_name).map(|l| l.queued));
            if queued.is_some_and(|q| q >= 8) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        queued_behind.is_ok(),
        "the held key's messages never queued behind it"
    );
    latch.release();
    wait_complete(&checker, "batch handler").await;
    let report = stop(consumer).await;
    let check = checker.report();
    assert_clean(&check, "batch handler");
    assert_eq!(check.dead_lettered, 2, "{check:#?}");
    assert_eq!(check.handled, receipts.len() as u64 - 2);
    assert_eq!(report.stats.retries, failing, "one retry per failing message");
    for (key, seq) in &poison {
        assert_eq!(probe.calls_for(key, *seq), 1, "terminal errors are not retried");
    }
    let sizes = log.sizes();
    assert!(
        sizes.iter().all(|&n| (1..=16).contains(&n)),
        "batches of 1 to 16: {sizes:?}"
    );
    assert_eq!(
        log.broken_runs(),
        0,
        "a key's messages in a batch are together, consecutive and in order"
    );
    let longest = log.longest_run();
    assert!(
        (2..=4).contains(&longest),
        "runs of the held key, at most 4: longest {longest}"
    );
    let dead = match bed.dead_letters(2).await {
        Ok(d) => d,
        Err(e) => panic!("reading dead letters failed: {e}"),
    };
    assert_eq!(dead.len(), 2, "exactly the poison messages: {dead:?}");
    for m in &dead {
        assert_eq!(header(m, DL_CAUSE), "terminal");
        assert!(header(m, DL_ERROR).contains("injected terminal failure"));
    }
}

/// Poison input — a message without a key where keys are required, an oversized payload, an
/// undecodable payload — is dead-lettered with its reason, unhandled, while its lane goes on.
pub async fn poison_input_dead_letters_with_reasons(target: &dyn ConformanceTarget) {
    let bed = bed(target, 2).await;
    let checker = Arc::new(OrderChecker::new());
    let publisher = bed.publisher();
    let mut poison = 0;
    let mut undecodable = 0;
    for round in 0..8 {
        for k in 0..4 {
            let key = probe_key("k", k);
            probe::publish_probe(publisher.as_ref(), &checker, key.clone())
                .await
                .expect("publish");
            let bad = match (round + k) % 6 {
                0 => Some(OutgoingMessage::keyless(format!("keyless-{round}"))),
                1 => Some(OutgoingMessage::new(key, "x".repeat(4096))),
                2 => Some(OutgoingMessage::new(key, "{\"not\": \"a probe\"}")),
                _ => None,
            };
            if let Some(bad) = bad {
                publisher.publish(bad).await.expect("publish poison");
                poison += 1;
                undecodable += usize::from((round + k) % 6 == 2);
            }
        }
    }
    let mut config = test_config(bed.group());
    config.keyless = convoy_core::KeylessPolicy::DeadLetter;
    config.max_payload_bytes = Some(1024);
    let handler = Arc::new(ProbeHandler::new(checker.clone()).counting_calls());
    let sink = Arc::new(RecordingSink::new(bed.dead_letter_sink(), checker.clone()));
    let consumer = start(
        sink.clone(),
        handler.clone(),
        config,
        subscribe(bed.as_ref()).await,
    );
    wait_complete(&checker, "poison input").await;
    assert!(checker.wait_for(LIMIT, |_| sink.recorded().len() >= poison).await);
    stop(consumer).await;
    assert_clean(&checker.report(), "poison input");
    assert_eq!(
        handler.calls() as usize,
        32 + undecodable,
        "only undecodable payloads reach the handler"
    );
    let dead = bed.dead_letters(poison).await.expect("dead letters readable");
    assert_eq!(dead.len(), poison);
    let mut reasons = std::collections::BTreeMap::new();
    for m in &dead {
        assert_eq!(header(m, DL_CAUSE), "malformed");
        let error = header(m, DL_ERROR);
        let kind = if error.contains("no key") {
            assert!(m.key.is_none());
            "missing key"
        } else if error.contains("exceeds max_payload_bytes") {
            assert_eq!(m.payload.len(), 4096, "the original payload is kept");
            "oversized"
        } else {
            assert!(error.contains("not a probe sequence number"), "{error}");
            "undecodable"
        };
        *reasons.entry(kind).or_insert(0) += 1;
    }
    assert_eq!(reasons.len(), 3, "{reasons:?}");
}

/// The newest offset a control reports for each owned source — the engine's lag is it minus the
/// watermark — is at least the last offset received from it: once everything is received and
/// nothing committed, while the sources are paused, and once everything is committed (lag 0,
/// still reported). Kafka runs it on librdkafka's mock cluster (Tansu's memory storage answers
/// ListOffsets(latest) wrongly).
pub async fn newest_offsets_cover_what_was_received(target: &dyn ConformanceTarget) {
    let bed = bed(target, 2).await;
    let checker = OrderChecker::new();
    let published = load(bed.as_ref(), &checker, "newest", 10, 20).await.len();
    let Subscription {
        mut events, control, ..
    } = subscribe(bed.as_ref()).await;
    let mut last: BTreeMap<SourceId, Offset> = BTreeMap::new();
    let mut tokens: BTreeMap<SourceId, u64> = BTreeMap::new();
    let mut received = 0;
    let deadline = tokio::time::Instant::now() + LIMIT;
    while received < published {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(SourceEvent::Messages { source, messages })) => {
                received += messages.len();
                if let Some(newest) = messages.iter().map(|m| m.offset).max() {
                    let at = last.entry(source).or_insert(newest);
                    *at = (*at).max(newest);
                }
            }
            Ok(Some(SourceEvent::Assigned(assignments))) => {
                tokens.extend(assignments.into_iter().map(|a| (a.source, a.token)));
            }
            Ok(Some(SourceEvent::Failed(e))) => panic!("the subscription failed: {e}"),
            Ok(Some(_)) => {}
            Ok(None) => panic!("the subscription ended after {received} of {published} messages"),
            Err(_) => panic!("{received} of {published} messages arrived within {LIMIT:?}"),
        }
    }
    let sources: Vec<SourceId> = last.keys().cloned().collect();
    // The engine asks at every tick and skips a source the broker did not answer about in time;
    // asked again and again, every source's figure must come, and cover what was received.
    let covered = |newest: &[Option<Offset>]| {
        sources
            .iter()
            .zip(newest)
            .all(|(source, n)| n.is_some_and(|n| n >= last[source]))
    };
    let newest_covering = |when: &'static str| {
        let (control, sources, last) = (&control, &sources, &last);
        async move {
            let deadline = tokio::time::Instant::now() + LIMIT;
            loop {
                let newest = control.last_offsets(sources).await;
                if covered(&newest) {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{when}: the newest offsets {newest:?} of {sources:?} never covered the last received, {last:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    newest_covering("received, not committed").await;
    if let Err(e) = control.pause(&sources) {
        panic!("pausing failed: {e}");
    }
    newest_covering("paused").await;
    let commits: Vec<Commit> = last
        .iter()
        .map(|(source, &offset)| Commit {
            token: tokens.get(source).copied().unwrap_or_default(),
            source: source.clone(),
            next: offset + 1,
            finished_above: Vec::new(),
        })
        .collect();
    if let Err(e) = control.commit(&commits).await {
        panic!("committing everything failed: {e}");
    }
    newest_covering("committed").await;
    if let Err(e) = control.close().await {
        panic!("closing the subscription failed: {e}");
    }
}
