//! A run: a key's head and the messages of its key queued behind it, handed to a batch handler
//! in one call (gathered with other lanes' runs: `batch.rs`). Each message ends as it would
//! alone — handled, skipped as a duplicate, dead-lettered — and in its key's order: the first
//! failure of a call decides; the messages before it are finished, a transient failure retries
//! the run from it (with the lane's backoff), a terminal one (or exhausted retries)
//! dead-letters it and the run goes on after it. Duplicates and malformed input end alone, in
//! their place.

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::time::Instant;

use super::lane::{
    backoff_wait, dead_letter, remember, screen, timed_out, Failure, Lane, Next, Outcome, PositionId,
    Remembered, Retries, Retrying, ShardContext,
};
use crate::batch::{BatchResults, Batched};
use crate::handler::{Delivery, HandlerError};
use crate::message::Message;
use crate::transport::Lease;

/// A message of a run.
pub(crate) struct RunItem {
    pub message: Arc<Message>,
    /// What may be done with an id derived from the message's position.
    pub position_id: PositionId,
    pub received: Instant,
}

/// What a run's job holds.
pub(crate) struct RunTask {
    /// Consecutive messages of one key, of one assignment.
    pub items: Vec<RunItem>,
    /// The batch handler's gatherer.
    pub batched: Arc<Batched>,
    /// The source's lease, when it is held by one: no attempt starts once it ran out.
    pub lease: Option<Lease>,
    /// How many of the run are finished so far, in order, for the shard.
    pub finished: Arc<AtomicUsize>,
}

/// Runs a run's messages to their end, counting in `finished` how many of them are.
pub(super) async fn process(shard: &ShardContext, task: RunTask) -> Outcome {
    let RunTask {
        items,
        batched,
        lease,
        finished,
    } = task;
    let batched = &*batched;
    let ctx = &*shard.ctx;
    let stats = &*shard.stats;
    let lane = |position_id| Lane {
        ctx,
        shard,
        calls: shard.calls.as_deref().map(|c| (c, shard.index)),
        position_id,
        lease: lease.as_ref(),
    };
    // Messages before this one have been in a call (their queue time is recorded).
    let mut called: usize = 0;
    // The failures of the message at the run's front, while it is retried.
    let mut retries: Option<(Retries, Retrying<'_>)> = None;
    let mut rng = fastrand::Rng::new();
    let mut front = 0;
    while front < items.len() {
        let item = &items[front];
        let at_front = lane(item.position_id);
        if at_front.fenced() {
            return Outcome::Fenced;
        }
        if let Some(outcome) = settle_alone(&at_front, item).await {
            if matches!(outcome, Outcome::Fatal(_) | Outcome::Fenced) {
                return outcome;
            }
            front += 1;
            finished.store(front, Relaxed);
            retries = None;
            continue;
        }
        // The call: from the front, while messages are neither duplicates nor malformed.
        let mut end = front + 1;
        while end < items.len() && is_plain(&lane(items[end].position_id), &items[end]).await {
            end += 1;
        }
        // The front's attempt counts its failures; the messages behind it never failed (a
        // result after a key's first failure is not taken).
        let attempt = retries.as_ref().map_or(1, |(r, _)| r.attempt);
        let Some(results) = call(
            &at_front,
            batched,
            &items[front..end],
            attempt,
            called.saturating_sub(front),
        )
        .await
        else {
            return Outcome::Fenced;
        };
        called = called.max(end);
        let mut failure = None;
        for (item, result) in items[front..end].iter().zip(results) {
            if let Err(error) = result {
                failure = Some(Failure::from(error));
                break;
            }
            stats.handled.fetch_add(1, Relaxed);
            ctx.metrics.handled.increment(1);
            let id = Remembered::of(ctx.idempotency.as_ref(), &item.message);
            remember(id, item.position_id, &Outcome::Handled).await;
            front += 1;
            finished.store(front, Relaxed);
            retries = None;
        }
        let Some(failure) = failure else {
            continue;
        };
        let item = &items[front];
        let (state, retrying) = retries.get_or_insert_with(|| {
            let retrying = Retrying {
                shard,
                message: Arc::as_ptr(&item.message) as usize,
            };
            (Retries::start(), retrying)
        });
        let failed_attempt = state.attempt;
        match state.next(&at_front, &failure, (Instant::now(), SystemTime::now()), &mut rng) {
            Next::Retry(delay) => {
                retrying.attempt(failed_attempt, &failure.text);
                backoff_wait(delay).await;
            }
            Next::DeadLetter(reason) => {
                let outcome = dead_letter(
                    ctx,
                    stats,
                    &item.message,
                    item.position_id,
                    reason,
                    lease.as_ref(),
                    &mut rng,
                )
                .await;
                if matches!(outcome, Outcome::Fatal(_) | Outcome::Fenced) {
                    return outcome;
                }
                let id = Remembered::of(ctx.idempotency.as_ref(), &item.message);
                remember(id, item.position_id, &outcome).await;
                front += 1;
                finished.store(front, Relaxed);
                retries = None;
            }
        }
    }
    Outcome::Handled
}

/// Ends `item` on its own if it is a duplicate (skipped) or malformed (dead-lettered unhandled).
async fn settle_alone(lane: &Lane<'_>, item: &RunItem) -> Option<Outcome> {
    let (ctx, stats) = (lane.ctx, &*lane.shard.stats);
    let id = Remembered::of(ctx.idempotency.as_ref(), &item.message);
    if id.seen(item.position_id).await {
        tracing::debug!(event_id = %id, "skipping duplicate");
        stats.duplicates.fetch_add(1, Relaxed);
        ctx.metrics.duplicates.increment(1);
        return Some(Outcome::Duplicate);
    }
    let problem = screen(ctx, &item.message)?;
    let outcome = lane.malformed(&item.message, problem).await;
    remember(id, item.position_id, &outcome).await;
    Some(outcome)
}

/// True if `item` goes into a call: neither a duplicate nor malformed.
async fn is_plain(lane: &Lane<'_>, item: &RunItem) -> bool {
    let id = Remembered::of(lane.ctx.idempotency.as_ref(), &item.message);
    !id.seen(item.position_id).await && screen(lane.ctx, &item.message).is_none()
}

/// One call of the batch handler for `items` (through the gatherer), in one call slot, the
/// first of them at attempt `attempt`, the first `called` of them in a call before; `None` if
/// the source's lease ran out before it could start.
async fn call(
    lane: &Lane<'_>,
    batched: &Batched,
    items: &[RunItem],
    attempt: u32,
    called: usize,
) -> Option<BatchResults> {
    let ctx = lane.ctx;
    let _slot = match lane.calls {
        Some((slots, home)) => Some(slots.acquire(home).await),
        None => None,
    };
    // Checked last before the call: waiting for a call slot or a backoff may outlast it.
    if lane.fenced() {
        return None;
    }
    let started = Instant::now();
    let deliveries = items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            if i >= called {
                ctx.metrics
                    .queue_time
                    .record(started.saturating_duration_since(item.received).as_secs_f64());
            }
            let attempt = if i == 0 { attempt } else { 1 };
            Delivery::received_at(item.message.clone(), attempt, item.received)
        })
        .collect();
    let results = match ctx.retry.attempt_timeout {
        None => batched.call(deliveries).await,
        Some(limit) => match tokio::time::timeout(limit, batched.call(deliveries)).await {
            Ok(results) => results,
            Err(_) => {
                let error = HandlerError::transient(timed_out(limit).text);
                vec![Err(error); items.len()]
            }
        },
    };
    ctx.metrics
        .handler_duration
        .record(started.elapsed().as_secs_f64());
    Some(results)
}
