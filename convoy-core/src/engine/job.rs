//! A job: what a lane future does with the message at the head of its lane — handle it alone
//! (`lane.rs`), handle a run of its key with a batch handler (`run.rs`), or dead-letter it
//! unhandled (a stuck message). The shard starts one per lane head.

use std::sync::Arc;

use tokio::time::Instant;

use super::lane::{already_finished, dead_letter, process, Outcome, PositionId, ShardContext};
use super::run::RunTask;
use crate::dead_letter::DeadLetterReason;
use crate::message::Message;
use crate::transport::Lease;

/// What a lane future does with its message.
pub(crate) struct Job {
    pub shard: Arc<ShardContext>,
    pub message: Arc<Message>,
    pub task: Task,
}

pub(crate) enum Task {
    /// Handle the message (see [`run`]).
    Handle {
        /// What may be done with an id derived from the message's position.
        position_id: PositionId,
        received: Instant,
        /// The source's lease, when it is held by one: no attempt starts once it ran out.
        lease: Option<Lease>,
    },
    /// Handle a run: the message and the messages of its key queued behind it (see `run.rs`).
    /// Boxed, so that a single message's job stays as small as it was.
    Run(Box<RunTask>),
    /// Dead-letter it unhandled with this reason (a stuck message).
    DeadLetter {
        reason: Box<DeadLetterReason>,
        /// The source's lease: nothing is dead-lettered once it ran out.
        lease: Option<Lease>,
        /// What may be done with an id derived from its position (its record is known by it).
        position_id: PositionId,
    },
}

/// Runs a job to its end. Handling a message ends handled, skipped as a duplicate, or
/// dead-lettered (confirmed by the sink), unless the sink fails fatally. Each attempt first
/// takes one of the engine's call slots (`max_in_flight`).
pub(crate) async fn run(job: Job) -> Outcome {
    let Job { shard, message, task } = job;
    // A transform's input that ends without outputs has none staged: an earlier handling's go.
    let Some(outbox) = shard.ctx.outbox.clone() else {
        return run_task(&shard, message, task).await;
    };
    let input = message.clone();
    let outcome = Box::pin(run_task(&shard, message, task)).await;
    if matches!(outcome, Outcome::DeadLettered | Outcome::Parked) {
        outbox.discard(&input);
    }
    outcome
}

async fn run_task(shard: &Arc<ShardContext>, message: Arc<Message>, task: Task) -> Outcome {
    let shard = shard.clone();
    match task {
        Task::Handle {
            position_id,
            received,
            lease,
        } => process(&shard, message, position_id, received, lease.as_ref()).await,
        // Boxed: a batch handler's path; the state every single message's future carries stays small.
        Task::Run(run) => Box::pin(super::run::process(&shard, *run)).await,
        Task::DeadLetter {
            reason,
            lease,
            position_id,
        } => {
            // A stuck message that ran already (handled by an earlier assignment, delivered
            // again and stuck behind its key) is finished, not dead-lettered: a replay of its
            // dead letter would run it twice.
            if already_finished(&shard, &message).await {
                return Outcome::Duplicate;
            }
            dead_letter(
                &shard.ctx,
                &shard.stats,
                &message,
                position_id,
                *reason,
                lease.as_ref(),
                &mut fastrand::Rng::new(),
            )
            .await
        }
    }
}
