//! What happens to one message at the head of its lane: the duplicate check, attempts with
//! in-lane retry, and dead-lettering. Later messages of the key wait behind this future;
//! other keys never do.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::FutureExt;
use tokio::time::Instant;
use tracing::{field, Instrument};

use super::parking::{Gate, Parking};
use super::slots::CallSlots;
use super::stats::ShardStats;
use crate::dead_letter::{DeadLetter, DeadLetterCause, DeadLetterReason, DeadLetterSink};
use crate::handler::{Delivery, ErrorClass, Handler, HandlerError};
use crate::idempotency::{Idempotency, IdempotencyStore, MemoryIdempotencyStore};
use crate::message::Headers;
use crate::message::{EventId, IdRef, Message};
use crate::metrics::LaneMetrics;
use crate::parking::{ParkingChange, ReplayTag, DL_PARK_ID, REPLAY, REPLAY_PART};
use crate::retry::{Backoff, OnExhausted, RetryPolicy};
use crate::trace_context::TraceContext;
use crate::transform::Outbox;
use crate::transport::{Lease, TransportError};

/// Everything a lane needs, shared by all lanes of an engine. Its trait objects are called
/// through an explicit deref (`(*ctx.handler).handle(…)`): method lookup would otherwise pick the
/// `Arc` blanket impls first and box every call's future twice.
pub(crate) struct LaneContext {
    pub handler: Arc<dyn Handler>,
    pub retry: RetryPolicy,
    pub dead_letter_backoff: Backoff,
    pub sink: Arc<dyn DeadLetterSink>,
    pub idempotency: Option<Idempotency>,
    pub reject_keyless: bool,
    pub max_payload_bytes: Option<usize>,
    pub group: String,
    pub metrics: LaneMetrics,
    /// A batch handler's gatherer, when its runs hold several messages of a key (see `run.rs`).
    pub runs: Option<Arc<crate::batch::Batched>>,
    /// The group's parked keys, when it parks them (one view per running engine).
    pub parking: Option<Arc<Parking>>,
    /// A transform's outbox (bound to the subscription): told when an input ends without
    /// outputs, and asked before a duplicate is skipped.
    pub outbox: Option<Arc<dyn Outbox>>,
}

impl LaneContext {
    /// The same context for consumer group `group` (its dead-letter reasons and metrics, a
    /// view of its parked keys of its own).
    /// `transform`, if given, replaces the engine's handler (a transform bound to a
    /// subscription's outbox, which the lanes tell how inputs ended).
    pub fn in_group(
        &self,
        group: &str,
        transform: Option<(Arc<dyn Handler>, Arc<dyn Outbox>)>,
    ) -> LaneContext {
        let (handler, outbox) = match transform {
            Some((handler, outbox)) => (handler, Some(outbox)),
            None => (self.handler.clone(), self.outbox.clone()),
        };
        LaneContext {
            handler,
            outbox,
            retry: self.retry,
            dead_letter_backoff: self.dead_letter_backoff,
            sink: self.sink.clone(),
            idempotency: self.idempotency.clone(),
            reject_keyless: self.reject_keyless,
            max_payload_bytes: self.max_payload_bytes,
            group: group.to_owned(),
            metrics: LaneMetrics::new(group),
            runs: self.runs.clone(),
            parking: self
                .parking
                .as_ref()
                .map(|p| Arc::new(Parking::new(group, p.checkpoint_after()))),
        }
    }
}

/// How a message finished.
#[derive(Debug)]
pub(crate) enum Outcome {
    Handled,
    Duplicate,
    DeadLettered,
    /// Set aside behind a dead letter of its key (recorded in the dead-letter destination).
    Parked,
    /// Not finished, and never will be by this engine: the dead-letter sink failed fatally.
    Fatal(TransportError),
    /// Not finished: the source's lease ran out before an attempt could start (the source is
    /// someone else's now, or about to be).
    Fenced,
}

/// A failed attempt, classified for the retry decision.
pub(super) struct Failure {
    class: &'static str,
    pub text: String,
    retryable: bool,
    cause: DeadLetterCause,
    retry_after: Option<Duration>,
}

impl From<HandlerError> for Failure {
    fn from(e: HandlerError) -> Self {
        let (class, retryable, cause) = match e.class() {
            ErrorClass::Transient => ("transient", true, DeadLetterCause::RetriesExhausted),
            ErrorClass::Terminal => ("terminal", false, DeadLetterCause::Terminal),
            ErrorClass::Malformed => ("malformed", false, DeadLetterCause::Malformed),
        };
        Failure {
            class,
            text: e.chain(),
            retryable,
            cause,
            retry_after: e.retry_after_hint(),
        }
    }
}

/// What the lane futures of one shard share: the engine's lane context, the shard's counters
/// and the engine's call slots. One per shard, cloned for each message, so the count touched
/// per message is that shard's alone (one `Arc` shared by every shard bounced between cores
/// twice a message).
pub(crate) struct ShardContext {
    pub ctx: Arc<LaneContext>,
    pub stats: Arc<ShardStats>,
    /// The engine's `max_in_flight` handler call slots, if limited (shared by all shards).
    pub calls: Option<Arc<CallSlots>>,
    /// This shard's number (its stripe of the call slots).
    pub index: usize,
    /// Messages being retried, by their address: attempts so far and the last failure (for
    /// an operator's view). Touched on the retry path only.
    pub retrying: std::sync::Mutex<std::collections::HashMap<usize, (u32, String)>>,
    /// Messages (by address) whose handling is over, waiting only for their replay's end marker
    /// to be written: never dead-lettered as stuck. Touched on that rare path only.
    pub finishing: std::sync::Mutex<std::collections::HashSet<usize>>,
}

impl ShardContext {
    pub(super) fn finishing(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<usize>> {
        self.finishing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True if `message`'s handling is over (only its replay's end marker is being written).
    pub(super) fn is_finishing(&self, message: &Arc<Message>) -> bool {
        self.finishing().contains(&(Arc::as_ptr(message) as usize))
    }

    pub(super) fn retrying(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<usize, (u32, String)>> {
        self.retrying.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Marks a message whose handling is over while its lane writes its replay's end marker (see
/// [`ShardContext::finishing`]); unmarked however that ends.
struct Finishing<'a> {
    shard: &'a ShardContext,
    message: usize,
}

impl<'a> Finishing<'a> {
    fn of(shard: &'a ShardContext, message: &Arc<Message>) -> Self {
        let message = Arc::as_ptr(message) as usize;
        shard.finishing().insert(message);
        Finishing { shard, message }
    }
}

impl Drop for Finishing<'_> {
    fn drop(&mut self) {
        self.shard.finishing().remove(&self.message);
    }
}

/// Removes a message from its shard's retrying list however its retries end (handled, dead-
/// lettered, or the future dropped by a revoke or a stop).
pub(super) struct Retrying<'a> {
    pub shard: &'a ShardContext,
    pub message: usize,
}

impl Retrying<'_> {
    pub fn attempt(&self, attempts: u32, failure: &str) {
        self.shard
            .retrying()
            .insert(self.message, (attempts, failure.to_owned()));
    }
}

impl Drop for Retrying<'_> {
    fn drop(&mut self) {
        self.shard.retrying().remove(&self.message);
    }
}

/// True when the idempotency store knows `message`'s header id as finished (counted as a
/// duplicate). Asked before a message is set aside or dead-lettered unhandled.
pub(super) async fn already_finished(shard: &ShardContext, message: &Message) -> bool {
    let id = Remembered::of(shard.ctx.idempotency.as_ref(), message);
    if !id.is_header_id() || !id.seen(PositionId::None).await {
        return false;
    }
    if shard.ctx.outbox.as_ref().is_some_and(|o| !o.covers(message)) {
        return false; // a transform's outputs that were never committed: not finished
    }
    tracing::debug!(event_id = %id, "finished before: not set aside or dead-lettered again");
    shard.stats.duplicates.fetch_add(1, Relaxed);
    shard.ctx.metrics.duplicates.increment(1);
    true
}

/// Handles one message at the head of its lane, inside its span.
pub(super) async fn process(
    shard: &ShardContext,
    message: Arc<Message>,
    position_id: PositionId,
    received: Instant,
    lease: Option<&Lease>,
) -> Outcome {
    let lane = Lane {
        ctx: &shard.ctx,
        shard,
        calls: shard.calls.as_deref().map(|c| (c, shard.index)),
        position_id,
        lease,
    };
    // DEBUG, not INFO: an application's usual INFO subscriber must not format a span per message.
    let span = tracing::debug_span!(
        "convoy.message",
        key = %message.key_display(),
        source = %message.source,
        offset = message.offset,
        attempt = field::Empty,
        trace_id = field::Empty,
        parent_span_id = field::Empty,
    );
    if span.is_disabled() {
        // No subscriber wants it: skip entering and leaving a span on every poll.
        return lane.handle_to_the_end(message, received, span).await;
    }
    if let Some(parent) = TraceContext::extract(&message.headers) {
        span.record("trace_id", parent.trace_id_hex());
        span.record("parent_span_id", parent.span_id_hex());
        // The producer's span is this span's parent in OpenTelemetry: one trace across the broker.
        #[cfg(feature = "opentelemetry")]
        {
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let _ = span.set_parent(parent.to_otel());
        }
    }
    // Boxed so that the common case above does not carry a second copy of the state.
    Box::pin(
        lane.handle_to_the_end(message, received, span.clone())
            .instrument(span),
    )
    .await
}

/// One lane future's view of its shard.
pub(super) struct Lane<'a> {
    pub ctx: &'a LaneContext,
    /// Its shard (counters, the retrying list).
    pub shard: &'a ShardContext,
    /// The call slots, and this shard's stripe of them.
    pub calls: Option<(&'a CallSlots, usize)>,
    pub position_id: PositionId,
    pub lease: Option<&'a Lease>,
}

/// What follows a failed attempt.
pub(super) enum Next {
    /// Retry after this delay.
    Retry(Duration),
    /// Give up: dead-letter with this reason.
    DeadLetter(DeadLetterReason),
}

/// Where a message's retries stand: its attempts, its first failure, whether exhaustion under
/// `OnExhausted::BlockLane` was reported.
pub(super) struct Retries {
    pub attempt: u32,
    first: (Instant, SystemTime),
    reported_exhausted: bool,
}

impl Retries {
    /// After the first failed attempt, now.
    pub fn start() -> Self {
        Retries {
            attempt: 1,
            first: (Instant::now(), SystemTime::now()),
            reported_exhausted: false,
        }
    }

    /// Decides what follows `failure` of attempt `self.attempt` (failed at `now`), logs it,
    /// and counts a retry: a dead letter for a terminal error or exhausted retries (unless the
    /// lane blocks), else a retry after the backoff (or the handler's `retry_after`).
    pub fn next(
        &mut self,
        lane: &Lane<'_>,
        failure: &Failure,
        now: (Instant, SystemTime),
        rng: &mut fastrand::Rng,
    ) -> Next {
        let (ctx, stats) = (lane.ctx, &*lane.shard.stats);
        let attempt = self.attempt;
        if !failure.retryable {
            tracing::warn!(error = %failure.text, class = failure.class, attempt, "dead-lettering");
            return Next::DeadLetter(reason(ctx, failure, attempt, self.first.1, now.1));
        }
        let delay = failure
            .retry_after
            .unwrap_or_else(|| ctx.retry.backoff.delay(attempt, rng));
        if ctx.retry.exhausted(attempt, now.0 - self.first.0, delay) {
            match ctx.retry.on_exhausted {
                OnExhausted::DeadLetter => {
                    tracing::warn!(error = %failure.text, attempt, "retries exhausted, dead-lettering");
                    return Next::DeadLetter(reason(ctx, failure, attempt, self.first.1, now.1));
                }
                OnExhausted::BlockLane if !self.reported_exhausted => {
                    self.reported_exhausted = true;
                    tracing::error!(error = %failure.text, attempt, "retries exhausted; the lane stays blocked and keeps retrying");
                }
                OnExhausted::BlockLane => {}
            }
        } else {
            tracing::debug!(error = %failure.text, attempt, ?delay, "transient failure, retrying in the lane");
        }
        stats.retries.fetch_add(1, Relaxed);
        ctx.metrics.retries.increment(1);
        self.attempt = attempt.saturating_add(1);
        Next::Retry(delay)
    }
}

impl Lane<'_> {
    /// True once the source's lease ran out: nothing more of it may start here.
    pub fn fenced(&self) -> bool {
        self.lease.is_some_and(|l| !l.is_valid())
    }

    async fn handle_to_the_end(
        &self,
        message: Arc<Message>,
        received: Instant,
        span: tracing::Span,
    ) -> Outcome {
        if self.fenced() {
            return Outcome::Fenced;
        }
        // A replayed message asks even while no key is parked: it may be a copy of a replay that
        // ended, delivered again (a redelivery, a resumed replay), which must not run again.
        let asks = |p: &&Arc<Parking>| p.any_parked() || message.headers.get(REPLAY).is_some();
        if let Some(parking) = self.ctx.parking.as_ref().filter(asks) {
            match parking.gate(&message, park_id(&message, self.position_id).as_deref(), false) {
                Gate::Free => {}
                gate => return Box::pin(self.parked(parking, gate, message, received, span)).await,
            }
        }
        self.handle_free(message, received, span).await
    }

    /// A message of a parked key (a rare path, boxed): set aside, or handled as part of its
    /// key's replay, whose last message ends it.
    async fn parked(
        &self,
        parking: &Parking,
        mut gate: Gate,
        message: Arc<Message>,
        received: Instant,
        span: tracing::Span,
    ) -> Outcome {
        if gate == Gate::ReadBack {
            parking.read_back(&*self.ctx.sink).await;
            gate = parking.gate(&message, park_id(&message, self.position_id).as_deref(), true);
        }
        let outcome = match gate {
            Gate::Free | Gate::Replay => self.handle_free(message.clone(), received, span).await,
            Gate::AlreadySetAside => {
                tracing::debug!("set aside before: its key is parked");
                Outcome::Parked
            }
            Gate::Duplicate => {
                tracing::debug!("a message of a replay that ended: skipping the duplicate");
                self.shard.stats.duplicates.fetch_add(1, Relaxed);
                self.ctx.metrics.duplicates.increment(1);
                Outcome::Duplicate
            }
            Gate::SetAside | Gate::ReadBack if already_finished(self.shard, &message).await => {
                // A copy of a replay's message that ran already, delivered again: setting it
                // aside would have the next replay run it a second time.
                Outcome::Duplicate
            }
            Gate::SetAside | Gate::ReadBack => {
                let id = Remembered::of(self.ctx.idempotency.as_ref(), &message);
                let now = SystemTime::now();
                let reason = DeadLetterReason {
                    cause: DeadLetterCause::Parked,
                    error_class: "parked".to_owned(),
                    error: "its key is parked behind an earlier dead letter: replay the key (convoy dlq replay --key) to handle it".to_owned(),
                    attempts: 0,
                    first_failure: now,
                    last_failure: now,
                    group: self.ctx.group.clone(),
                    parks_key: false,
                };
                let mut rng = fastrand::Rng::new();
                let outcome = dead_letter(
                    self.ctx,
                    &self.shard.stats,
                    &message,
                    self.position_id,
                    reason,
                    self.lease,
                    &mut rng,
                )
                .await;
                remember(id, self.position_id, &outcome).await;
                outcome
            }
        };
        if matches!(outcome, Outcome::Fatal(_) | Outcome::Fenced) {
            return outcome;
        }
        // The replay's last message ends it however it ended (a message of a replay that
        // failed earlier is set aside, but still its last).
        match parking.ending_replay(&message) {
            Some((tag, part)) => {
                // Its handling is over: a stuck check must not dead-letter it while only the
                // marker waits for the dead-letter destination (a replay would run it again).
                let _finishing = Finishing::of(self.shard, &message);
                match self.end_replay(&message, &tag, part).await {
                    Ok(()) => outcome,
                    Err(unfinished) => unfinished,
                }
            }
            None => outcome,
        }
    }

    /// Writes the marker that ends `part` (a topic) of the key's replay `tag`, before the
    /// part's last message is finished (a crash before its commit writes it again).
    async fn end_replay(
        &self,
        message: &Message,
        tag: &ReplayTag,
        part: Option<String>,
    ) -> Result<(), Outcome> {
        // The replayed messages' originals sit below the copies in their source: once the key is
        // unparked, an original delivered again (a crash before their commit) would run again.
        // The part ends only when everything below its last copy is committed.
        if let Some(parking) = &self.ctx.parking {
            parking.wait_committed_below(message, || self.fenced()).await;
        }
        let mut headers = Headers::new();
        headers.insert(REPLAY, tag.header_value());
        if let Some(part) = &part {
            headers.insert(REPLAY_PART, part.clone());
        }
        let now = SystemTime::now();
        let marker = DeadLetter {
            message: Message {
                key: message.key.clone(),
                payload: bytes::Bytes::new(),
                headers,
                source: message.source.clone(),
                offset: message.offset,
            },
            reason: DeadLetterReason {
                cause: DeadLetterCause::ReplayDone,
                error_class: String::new(),
                error: format!("replay {} ended", tag.id),
                attempts: 0,
                first_failure: now,
                last_failure: now,
                group: self.ctx.group.clone(),
                parks_key: false,
            },
        };
        publish_record(self.ctx, &marker, self.lease, &mut fastrand::Rng::new()).await?;
        if let (Some(parking), Some(key)) = (&self.ctx.parking, message.ordering_key().cloned()) {
            parking.record(key, ParkingChange::ReplayDone(tag.id.clone(), part.clone()));
        }
        tracing::info!(replay = %tag.id, part = ?part, "a topic's part of the replay of a parked key ended");
        Ok(())
    }

    /// A message whose key is not parked (or one of its key's replay): the duplicate check,
    /// the attempts, the dead letter.
    async fn handle_free(&self, message: Arc<Message>, received: Instant, span: tracing::Span) -> Outcome {
        let (ctx, stats) = (self.ctx, &*self.shard.stats);
        let id = Remembered::of(ctx.idempotency.as_ref(), &message);
        // A transform's input whose outputs went with its ownership runs again.
        if id.seen(self.position_id).await && ctx.outbox.as_ref().is_none_or(|o| o.covers(&message)) {
            tracing::debug!(event_id = %id, "skipping duplicate");
            stats.duplicates.fetch_add(1, Relaxed);
            ctx.metrics.duplicates.increment(1);
            return Outcome::Duplicate;
        }

        let outcome = match screen(ctx, &message) {
            Some(problem) => self.malformed(&message, problem).await,
            None => match self.attempt(&message, 1, received, &span).await {
                Ok(outcome) => outcome,
                // Retries and dead letters are a boxed future of their own, so the state every
                // message's future carries is only the first attempt's (see `backoff_wait`).
                Err(failure) => Box::pin(self.after_failure(&message, received, &span, failure)).await,
            },
        };
        remember(id, self.position_id, &outcome).await;
        outcome
    }

    /// Dead-letters input refused before any attempt.
    pub async fn malformed(&self, message: &Message, problem: String) -> Outcome {
        tracing::warn!(error = %problem, "dead-lettering malformed input unhandled");
        let now = SystemTime::now();
        let failure = Failure {
            class: "malformed",
            text: problem,
            retryable: false,
            cause: DeadLetterCause::Malformed,
            retry_after: None,
        };
        let reason = reason(self.ctx, &failure, 0, now, now);
        dead_letter(
            self.ctx,
            &self.shard.stats,
            message,
            self.position_id,
            reason,
            self.lease,
            &mut fastrand::Rng::new(),
        )
        .await
    }

    /// One attempt: a call slot, the lease check, the call. `Ok` once handled (or fenced).
    async fn attempt(
        &self,
        message: &Arc<Message>,
        attempt: u32,
        received: Instant,
        span: &tracing::Span,
    ) -> Result<Outcome, Failure> {
        let (ctx, stats) = (self.ctx, &*self.shard.stats);
        span.record("attempt", attempt);
        let (result, started) = {
            let _call = match self.calls {
                Some((calls, home)) => Some(calls.acquire(home).await),
                None => None,
            };
            // Checked last before the call: waiting for a call slot or a backoff may outlast it.
            if self.fenced() {
                return Ok(Outcome::Fenced);
            }
            // One clock read for both figures: queueing ends where the first attempt starts.
            let started = Instant::now();
            if attempt == 1 {
                ctx.metrics
                    .queue_time
                    .record(started.saturating_duration_since(received).as_secs_f64());
            }
            let delivery = Delivery::received_at(message.clone(), attempt, received);
            (attempt_once(ctx, delivery).await, started)
        };
        ctx.metrics
            .handler_duration
            .record(started.elapsed().as_secs_f64());
        result?;
        stats.handled.fetch_add(1, Relaxed);
        ctx.metrics.handled.increment(1);
        Ok(Outcome::Handled)
    }

    /// After a failed first attempt: retries in the lane with backoff until handled, or a dead
    /// letter (terminal error, retries exhausted).
    async fn after_failure(
        &self,
        message: &Arc<Message>,
        received: Instant,
        span: &tracing::Span,
        mut failure: Failure,
    ) -> Outcome {
        let (ctx, stats) = (self.ctx, &*self.shard.stats);
        let mut retries = Retries::start();
        let mut now = retries.first;
        let retrying = Retrying {
            shard: self.shard,
            message: Arc::as_ptr(message) as usize,
        };
        let mut rng = fastrand::Rng::new();
        loop {
            let failed_attempt = retries.attempt;
            match retries.next(self, &failure, now, &mut rng) {
                Next::DeadLetter(reason) => {
                    return dead_letter(
                        ctx,
                        stats,
                        message,
                        self.position_id,
                        reason,
                        self.lease,
                        &mut rng,
                    )
                    .await
                }
                Next::Retry(delay) => {
                    retrying.attempt(failed_attempt, &failure.text);
                    backoff_wait(delay).await;
                }
            }
            failure = match self.attempt(message, retries.attempt, received, span).await {
                Ok(outcome) => return outcome,
                Err(failure) => failure,
            };
            now = (Instant::now(), SystemTime::now());
        }
    }
}

/// Records the id of a message that ended (handled, dead-lettered), unless it is derived from a
/// position that names nothing; a message left unfinished (fenced, a fatal sink) is not.
pub(super) async fn remember(id: Remembered<'_>, position_id: PositionId, outcome: &Outcome) {
    let recorded = id.is_header_id() || !matches!(position_id, PositionId::None);
    if recorded && !matches!(outcome, Outcome::Fatal(_) | Outcome::Fenced) {
        id.remember().await;
    }
}

/// What may be done with an id derived from a message's position (source, offset) — the id of
/// every message that carries none of its own. A header id is always checked and recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PositionId {
    /// Checked before handling and recorded after.
    Checked,
    /// Recorded, not checked: the offset was rewritten after a position reset, so the id would
    /// match the message the offset held before.
    Rewritten,
    /// Neither: the source's offsets count deliveries and name no position (an AMQP delivery
    /// tag restarts on every channel), so they identify nothing.
    None,
}

/// A message's event id as its lane holds it from the duplicate check to the record (after
/// handling or dead-lettering; never for a message left unfinished): borrowed and hashed once
/// for the engine's in-memory store, owned for any other.
pub(super) enum Remembered<'m> {
    Off,
    Memory(&'m MemoryIdempotencyStore, u64, IdRef<'m>),
    Custom(&'m dyn IdempotencyStore, EventId),
}

impl<'m> Remembered<'m> {
    pub fn of(store: Option<&'m Idempotency>, message: &'m Message) -> Self {
        match store {
            None => Remembered::Off,
            Some(Idempotency::Memory(store)) => {
                let id = IdRef::of(message);
                Remembered::Memory(store, store.hash(id), id)
            }
            Some(Idempotency::Custom(store)) => Remembered::Custom(&**store, message.event_id()),
        }
    }

    /// True when the id was finished before. An id derived from the message's position is
    /// checked only where `position` says so; a header id always is.
    pub async fn seen(&self, position: PositionId) -> bool {
        match self {
            Remembered::Off => false,
            _ if !(matches!(position, PositionId::Checked) || self.is_header_id()) => false,
            Remembered::Memory(store, hash, id) => store.contains_hashed(*hash, *id),
            Remembered::Custom(store, id) => match store.contains_now(id) {
                Some(answer) => answer,
                None => store.contains(id).await,
            },
        }
    }

    pub fn is_header_id(&self) -> bool {
        matches!(
            self,
            Remembered::Memory(_, _, IdRef::Header(_)) | Remembered::Custom(_, EventId::Header(_))
        )
    }

    pub async fn remember(self) {
        match self {
            Remembered::Off => {}
            // Checked by `seen` before the message was handled (a header id always is).
            Remembered::Memory(store, hash, id) => store.insert_checked(hash, id),
            Remembered::Custom(store, id) => {
                if let Err(id) = store.insert_now(id) {
                    store.insert(id).await;
                }
            }
        }
    }
}

impl std::fmt::Display for Remembered<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Remembered::Off => Ok(()),
            Remembered::Memory(_, _, id) => id.fmt(f),
            Remembered::Custom(_, id) => id.fmt(f),
        }
    }
}

/// Waits out a retry delay. Tokio's timer rounds every sleep up to the next millisecond, which
/// would turn a sub-millisecond jittered backoff into ≥ 1 ms of lane time; delays under a
/// millisecond are waited by yielding instead (other lanes keep running meanwhile). Yielding
/// stops after at most one yield per microsecond of the delay whatever the Tokio clock says
/// (a yield takes longer than that), and the timer takes over: a clock that does not move (a
/// paused one) still ends the wait, and the wait never depends on the real clock (a simulation
/// replays it exactly).
///
/// Boxed, like every path a message rarely takes: a lane future's state is as large as its
/// largest await, and each message's future is moved into place (measured: 1.4 KiB per message
/// copied, ~10 % of the engine's instructions, before the rare paths were boxed).
pub(super) fn backoff_wait(delay: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    Box::pin(wait(delay))
}

async fn wait(delay: Duration) {
    if delay >= Duration::from_millis(1) {
        tokio::time::sleep(delay).await;
        return;
    }
    let deadline = Instant::now() + delay;
    for _ in 0..delay.as_micros() {
        if Instant::now() >= deadline {
            return;
        }
        tokio::task::yield_now().await;
    }
    // A timer sleep completes on a later driver turn even when already due: only used when the
    // clock really lags (paused), not as the normal way out.
    if Instant::now() < deadline {
        tokio::time::sleep_until(deadline).await;
    }
}

/// Input the engine refuses before any attempt, and why.
pub(super) fn screen(ctx: &LaneContext, message: &Message) -> Option<String> {
    if ctx.reject_keyless && message.ordering_key().is_none() {
        return Some(
            "message has no key (or an empty one), and keyless messages are dead-lettered (KeylessPolicy::DeadLetter)".into(),
        );
    }
    match ctx.max_payload_bytes {
        Some(max) if message.payload.len() > max => Some(format!(
            "payload of {} bytes exceeds max_payload_bytes ({max})",
            message.payload.len()
        )),
        _ => None,
    }
}

/// One attempt: panics and timeouts become failures like any other.
async fn attempt_once(ctx: &LaneContext, delivery: Delivery) -> Result<(), Failure> {
    let call = std::panic::catch_unwind(AssertUnwindSafe(|| (*ctx.handler).handle(delivery)));
    let future = match call {
        Ok(future) => AssertUnwindSafe(future).catch_unwind(),
        Err(panic) => return Err(panicked(panic)),
    };
    let result = match ctx.retry.attempt_timeout {
        None => future.await,
        // Boxed: a timer is large, and most configurations have no attempt timeout.
        Some(limit) => match Box::pin(tokio::time::timeout(limit, future)).await {
            Ok(result) => result,
            Err(_) => return Err(timed_out(limit)),
        },
    };
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.into()),
        Err(panic) => Err(panicked(panic)),
    }
}

/// An attempt that outlasted `attempt_timeout`: transient.
pub(super) fn timed_out(limit: Duration) -> Failure {
    Failure {
        class: "transient",
        text: format!("attempt timed out after {limit:?}"),
        retryable: true,
        cause: DeadLetterCause::RetriesExhausted,
        retry_after: None,
    }
}

fn panicked(panic: Box<dyn Any + Send>) -> Failure {
    Failure {
        class: "panic",
        text: crate::handler::panic_text(panic.as_ref()),
        retryable: false,
        cause: DeadLetterCause::Panic,
        retry_after: None,
    }
}

fn reason(
    ctx: &LaneContext,
    f: &Failure,
    attempts: u32,
    first: SystemTime,
    last: SystemTime,
) -> DeadLetterReason {
    DeadLetterReason {
        cause: f.cause,
        error_class: f.class.to_owned(),
        error: f.text.clone(),
        attempts,
        first_failure: first,
        last_failure: last,
        group: ctx.group.clone(),
        parks_key: false,
    }
}

/// The reason for a message dead-lettered because it held the watermark back too long.
pub(crate) fn stuck_reason(ctx: &LaneContext, waited: Duration) -> DeadLetterReason {
    let now = SystemTime::now();
    DeadLetterReason {
        cause: DeadLetterCause::Stuck,
        error_class: "stuck".to_owned(),
        error: format!("unfinished for {waited:?}, over the stuck timeout; processing was cancelled"),
        attempts: 0,
        first_failure: now,
        last_failure: now,
        group: ctx.group.clone(),
        parks_key: false,
    }
}

/// Publishes a dead letter, retrying the sink until it confirms: the message is never
/// dropped, and its lane stays blocked meanwhile. Boxed (a rare path: see `backoff_wait`).
pub(crate) fn dead_letter<'a>(
    ctx: &'a LaneContext,
    stats: &'a ShardStats,
    message: &'a Message,
    position_id: PositionId,
    reason: DeadLetterReason,
    lease: Option<&'a Lease>,
    rng: &'a mut fastrand::Rng,
) -> Pin<Box<dyn Future<Output = Outcome> + Send + 'a>> {
    Box::pin(publish_dead_letter(
        ctx,
        stats,
        message,
        position_id,
        reason,
        lease,
        rng,
    ))
}

/// Publishes a dead letter, retrying the sink with backoff — unless the source's `lease` ran
/// out, checked before every publish as before every attempt: the next owner handles the
/// message (a dead letter here would be a decision about a message this member no longer owns,
/// and its later commit is refused anyway).
async fn publish_dead_letter(
    ctx: &LaneContext,
    stats: &ShardStats,
    message: &Message,
    position_id: PositionId,
    mut reason: DeadLetterReason,
    lease: Option<&Lease>,
    rng: &mut fastrand::Rng,
) -> Outcome {
    let cause = reason.cause;
    // Keyless messages (the empty key included) are not one chain: their dead letters park
    // nothing.
    let parks = ctx.parking.is_some() && message.ordering_key().is_some();
    reason.parks_key = parks && cause != DeadLetterCause::Parked;
    let mut dead_letter = DeadLetter {
        message: message.clone(),
        reason,
    };
    // A record is known by its message's identity; one whose message has none (no event id,
    // and offsets that name no position) gets one of its own, so that the record is never
    // counted twice (a read-back that saw it, and the change applied again after it).
    let id = parks.then(|| Parking::record_id(park_id(message, position_id)));
    if let Some(id) = &id {
        dead_letter.message.headers.insert(DL_PARK_ID, id.clone());
    }
    if let Some(parking) = ctx.parking.as_ref().filter(|_| dead_letter.reason.parks_key) {
        parking
            .wait_committed_below(message, || lease.is_some_and(|l| !l.is_valid()))
            .await;
    }
    if let Err(unfinished) = publish_record(ctx, &dead_letter, lease, rng).await {
        return unfinished;
    }
    if let Some(parking) = ctx.parking.as_ref().filter(|_| parks) {
        parking.set_aside(message, id, cause != DeadLetterCause::Parked);
    }
    if cause == DeadLetterCause::Parked {
        stats.parked.fetch_add(1, Relaxed);
        ctx.metrics.parked.increment(1);
        return Outcome::Parked;
    }
    stats.dead_lettered.fetch_add(1, Relaxed);
    ctx.metrics.dead_lettered.increment(1);
    ctx.metrics.dead_letter_cause(&ctx.group, cause.as_str());
    Outcome::DeadLettered
}

/// What a message of a parked key is known by: its event id, or where it was read when offsets
/// are positions (a delivery tag, or an offset rewritten after a reset, names nothing).
pub(super) fn park_id(message: &Message, position_id: PositionId) -> Option<String> {
    match message.headers.get_str(crate::header_names::EVENT_ID_HEADER) {
        Some(id) => Some(id.to_owned()),
        None => {
            (position_id == PositionId::Checked).then(|| format!("{}@{}", message.source, message.offset))
        }
    }
}

/// Publishes `record` to the dead-letter sink, retrying with backoff until it confirms. `Err`
/// with the message's outcome (unfinished) when the source's lease ran out or the sink failed
/// fatally.
async fn publish_record(
    ctx: &LaneContext,
    record: &DeadLetter,
    lease: Option<&Lease>,
    rng: &mut fastrand::Rng,
) -> Result<(), Outcome> {
    let message = &record.message;
    let fenced = || lease.is_some_and(|l| !l.is_valid());
    let mut failures = 0u32;
    loop {
        if fenced() {
            tracing::warn!(source = %message.source, offset = message.offset, "not dead-lettering: the source's lease ran out (its next owner handles the message)");
            return Err(Outcome::Fenced);
        }
        let Err(e) = (*ctx.sink).publish(record).await else {
            return Ok(());
        };
        if e.is_fatal() {
            tracing::error!(error = %e, "dead-letter sink failed fatally; the engine stops (the message is kept: it stays uncommitted)");
            return Err(Outcome::Fatal(e));
        }
        failures = failures.saturating_add(1);
        ctx.metrics.sink_failures.increment(1);
        let delay = ctx.dead_letter_backoff.delay(failures, rng);
        tracing::error!(error = %e, failures, ?delay, "dead-letter sink failed; the lane waits and retries (the message is kept)");
        tokio::time::sleep(delay).await;
    }
}
