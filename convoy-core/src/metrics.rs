//! Metric names and pre-registered handles, through the `metrics` facade.
//!
//! Handles are registered once per engine (not per message) so the per-message cost is a
//! call on a handle; with no recorder installed it is a no-op.

use metrics::{Counter, Gauge, Histogram};

use crate::message::SourceId;

/// Messages received from the transport.
pub const CONSUMED: &str = "convoy_consumed_total";
/// Messages finished, labelled `outcome` = `handled` | `dead_lettered` | `duplicate` | `parked`.
pub const HANDLED: &str = "convoy_handled_total";
/// Transient failures that were retried.
pub const RETRIES: &str = "convoy_retries_total";
/// Messages dead-lettered, labelled `cause`.
pub const DEAD_LETTERED: &str = "convoy_dead_lettered_total";
/// Failed attempts to publish a dead letter (each one retried).
pub const DEAD_LETTER_SINK_FAILURES: &str = "convoy_dead_letter_sink_failures_total";
/// Handler duration per attempt, seconds.
pub const HANDLER_DURATION: &str = "convoy_handler_duration_seconds";
/// Time from receipt to the start of the first attempt, seconds (waiting behind the key's earlier
/// messages, and for a handler call slot under `max_in_flight`).
pub const QUEUE_TIME: &str = "convoy_queue_time_seconds";
/// Lanes (active keys) alive now.
pub const ACTIVE_LANES: &str = "convoy_active_lanes";
/// Messages held: queued in lanes plus being handled (not only handler calls: the name is kept
/// for dashboards that read it).
pub const IN_FLIGHT: &str = "convoy_in_flight";
/// Per source: newest offset minus committed watermark (reported while paused too).
pub const SOURCE_LAG: &str = "convoy_source_lag";
/// Per source: the contiguous watermark.
pub const WATERMARK: &str = "convoy_watermark";
/// Sources whose fetching is paused by back-pressure.
pub const PAUSED_SOURCES: &str = "convoy_paused_sources";
/// Bytes held: keys, payloads and headers of the messages buffered in lanes and in flight.
pub const HELD_BYTES: &str = "convoy_held_bytes";
/// Sources assigned, revoked or lost, labelled `change` = `assigned` | `revoked` | `lost`:
/// their rate is the rebalance rate.
pub const SOURCE_CHANGES: &str = "convoy_source_changes_total";
/// Commits the transport refused or failed (retried on the next tick).
pub const COMMIT_FAILURES: &str = "convoy_commit_failures_total";
/// Operational failures: a source's lowest unfinished message exceeded the stuck timeout.
pub const STUCK: &str = "convoy_stuck_total";

/// Assigned sources whose committed position the broker no longer holds, labelled `reason` =
/// `deleted` (messages removed before the group consumed them) | `past_end` (the destination
/// was deleted and created again): each one is an error in the log too.
pub const SOURCE_HOLES: &str = "convoy_source_holes_total";

/// Partitions a subscribed topic gained while the group consumed it (keys moved to other
/// partitions: their order across the change is not kept), by group and topic.
pub const PARTITIONS_ADDED: &str = "convoy_partitions_added_total";

/// Messages per call of a batch handler (`batch::batched`).
pub const BATCH_MESSAGES: &str = "convoy_batch_messages";
/// Gauge: keys parked now (their later messages set aside until replayed), by group.
pub const PARKED_KEYS: &str = "convoy_parked_keys";

/// Buckets of every `*_seconds` histogram, for exporters that need them set: 100 µs to 60 s.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Buckets of [`BATCH_MESSAGES`]: 1 to 10,000 messages per call.
pub const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 10_000.0,
];

/// How long an exporter keeps a gauge nobody sets any more. The engine sets its gauges on
/// every tick (well under a second); those of a source this member handed over or lost are
/// never set again, and should leave the dashboards after this long.
pub const GAUGE_IDLE_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// Gives every metric its help text and unit (once per process): exporters print them
/// (Prometheus's `# HELP`). Called before any handle is registered: an exporter that fixes an
/// instrument's description when it creates it (OpenTelemetry) sees them too.
pub fn describe() {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
        describe_counter!(CONSUMED, Unit::Count, "Messages received from the broker and taken into lanes.");
        describe_counter!(
            HANDLED,
            Unit::Count,
            "Messages finished, by outcome: handled, dead_lettered, parked (set aside behind its key's dead letter), duplicate (skipped by event id)."
        );
        describe_counter!(RETRIES, Unit::Count, "Transient handler failures retried inside their lane.");
        describe_counter!(DEAD_LETTERED, Unit::Count, "Messages dead-lettered, by cause: terminal, retries-exhausted, malformed, panic, stuck, parked (set aside behind its key's dead letter).");
        describe_counter!(
            DEAD_LETTER_SINK_FAILURES,
            Unit::Count,
            "Failed attempts to publish a dead letter; each is retried while its lane waits."
        );
        describe_histogram!(HANDLER_DURATION, Unit::Seconds, "Duration of each handler attempt.");
        describe_histogram!(
            QUEUE_TIME,
            Unit::Seconds,
            "Time from receipt to a message's first attempt: waiting behind its key's earlier messages and for a call slot."
        );
        describe_gauge!(ACTIVE_LANES, Unit::Count, "Lanes (keys with work) alive now.");
        describe_gauge!(IN_FLIGHT, Unit::Count, "Messages held now, not only those in a handler call: queued in lanes (behind their key's earlier messages, or for a call slot) plus being handled.");
        describe_gauge!(
            SOURCE_LAG,
            Unit::Count,
            "Per source: the newest offset minus the committed watermark (reported while paused too)."
        );
        describe_gauge!(WATERMARK, Unit::Count, "Per source: the contiguous watermark (every offset up to it finished).");
        describe_gauge!(PAUSED_SOURCES, Unit::Count, "Sources whose fetching back-pressure has paused.");
        describe_gauge!(HELD_BYTES, Unit::Bytes, "Bytes held: keys, payloads and headers of the messages in lanes and in flight.");
        describe_counter!(
            SOURCE_CHANGES,
            Unit::Count,
            "Sources assigned, revoked (handed over after a drain) or lost (taken without one), by change: rebalances."
        );
        describe_counter!(
            SOURCE_HOLES,
            Unit::Count,
            "Assigned sources whose committed position the broker no longer held, by reason: deleted (messages removed before they were consumed) or past_end (the destination was created again)."
        );
        describe_counter!(
            PARTITIONS_ADDED,
            Unit::Count,
            "Partitions a subscribed topic gained while the group consumed it: keys moved to other partitions, so their order across the change is not kept."
        );
        describe_histogram!(BATCH_MESSAGES, Unit::Count, "Messages per call of a batch handler.");
        describe_gauge!(PARKED_KEYS, Unit::Count, "Keys parked now: their later messages are set aside until an operator replays them.");
        describe_counter!(COMMIT_FAILURES, Unit::Count, "Commits the broker refused or did not confirm in time (retried).");
        describe_counter!(
            STUCK,
            Unit::Count,
            "Messages found stuck (handled longer than the stuck timeout) and dead-lettered with cause stuck."
        );
    });
}

/// Why an assigned source's committed position was not held (see [`SOURCE_HOLES`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoleReason {
    /// Messages below the first one kept were removed (retention, delete-records) before the
    /// group consumed them.
    Deleted,
    /// The position is past the source's end: it was deleted and created again, or truncated.
    PastEnd,
}

/// Counts a hole a transport found in `source` of `group` (it logs the error itself).
pub fn source_hole(group: &str, source: &SourceId, reason: HoleReason) {
    let reason = match reason {
        HoleReason::Deleted => "deleted",
        HoleReason::PastEnd => "past_end",
    };
    metrics::counter!(SOURCE_HOLES, "group" => group.to_owned(), "source" => source.as_str().to_owned(), "reason" => reason)
        .increment(1);
}

/// Counts `added` partitions `topic` gained under `group` (the transport logs the warning).
pub fn partitions_added(group: &str, topic: &str, added: u64) {
    metrics::counter!(PARTITIONS_ADDED, "group" => group.to_owned(), "topic" => topic.to_owned())
        .increment(added);
}

/// Handles used on the per-message path.
pub(crate) struct LaneMetrics {
    pub handled: Counter,
    pub duplicates: Counter,
    pub dead_lettered: Counter,
    /// Messages set aside behind a dead letter of their key.
    pub parked: Counter,
    pub retries: Counter,
    pub sink_failures: Counter,
    /// Messages a shard found stuck in their lane (the intake counts stuck watermark heads).
    pub stuck: Counter,
    pub handler_duration: Histogram,
    pub queue_time: Histogram,
}

impl LaneMetrics {
    pub fn new(group: &str) -> Self {
        describe();
        let g = group.to_owned();
        LaneMetrics {
            handled: {
                Self::register_causes(group);
                metrics::counter!(HANDLED, "group" => g.clone(), "outcome" => "handled")
            },
            duplicates: metrics::counter!(HANDLED, "group" => g.clone(), "outcome" => "duplicate"),
            dead_lettered: metrics::counter!(HANDLED, "group" => g.clone(), "outcome" => "dead_lettered"),
            parked: metrics::counter!(HANDLED, "group" => g.clone(), "outcome" => "parked"),
            retries: metrics::counter!(RETRIES, "group" => g.clone()),
            sink_failures: metrics::counter!(DEAD_LETTER_SINK_FAILURES, "group" => g.clone()),
            stuck: metrics::counter!(STUCK, "group" => g.clone()),
            handler_duration: metrics::histogram!(HANDLER_DURATION, "group" => g.clone()),
            queue_time: metrics::histogram!(QUEUE_TIME, "group" => g),
        }
    }

    /// Registers the dead-letter counter of every cause at 0, so dashboards and alerts find
    /// the series before the first dead letter.
    pub fn register_causes(group: &str) {
        use crate::dead_letter::DeadLetterCause::*;
        for cause in [Terminal, Malformed, Panic, RetriesExhausted, Stuck] {
            metrics::counter!(DEAD_LETTERED, "group" => group.to_owned(), "cause" => cause.as_str())
                .increment(0);
        }
    }

    pub fn dead_letter_cause(&self, group: &str, cause: &'static str) {
        metrics::counter!(DEAD_LETTERED, "group" => group.to_owned(), "cause" => cause).increment(1);
    }
}

/// Handles used by the intake.
pub(crate) struct IntakeMetrics {
    pub consumed: Counter,
    pub in_flight: Gauge,
    pub held_bytes: Gauge,
    pub assigned: Counter,
    pub revoked: Counter,
    pub lost: Counter,
    pub active_lanes: Gauge,
    pub paused_sources: Gauge,
    pub commit_failures: Counter,
    pub stuck: Counter,
}

impl IntakeMetrics {
    pub fn new(group: &str) -> Self {
        describe();
        let g = group.to_owned();
        IntakeMetrics {
            consumed: metrics::counter!(CONSUMED, "group" => g.clone()),
            in_flight: metrics::gauge!(IN_FLIGHT, "group" => g.clone()),
            held_bytes: metrics::gauge!(HELD_BYTES, "group" => g.clone()),
            assigned: metrics::counter!(SOURCE_CHANGES, "group" => g.clone(), "change" => "assigned"),
            revoked: metrics::counter!(SOURCE_CHANGES, "group" => g.clone(), "change" => "revoked"),
            lost: metrics::counter!(SOURCE_CHANGES, "group" => g.clone(), "change" => "lost"),
            active_lanes: metrics::gauge!(ACTIVE_LANES, "group" => g.clone()),
            paused_sources: metrics::gauge!(PAUSED_SOURCES, "group" => g.clone()),
            commit_failures: metrics::counter!(COMMIT_FAILURES, "group" => g.clone()),
            stuck: metrics::counter!(STUCK, "group" => g),
        }
    }

    /// A source's gauges, labelled with the group, the source and — for a partition — its
    /// `topic` and `partition`, so dashboards can sum by topic across replicas.
    pub fn source_gauges(group: &str, source: &SourceId, watermark: Option<u64>, lag: Option<u64>) {
        let (topic, partition) = match source.topic_partition() {
            Some((topic, partition)) => (topic.to_owned(), partition.to_string()),
            None => (source.as_str().to_owned(), String::new()),
        };
        let labels = [
            ("group", group.to_owned()),
            ("source", source.as_str().to_owned()),
            ("topic", topic),
            ("partition", partition),
        ];
        if let Some(w) = watermark {
            metrics::gauge!(WATERMARK, &labels).set(w as f64);
        }
        if let Some(l) = lag {
            metrics::gauge!(SOURCE_LAG, &labels).set(l as f64);
        }
    }
}
