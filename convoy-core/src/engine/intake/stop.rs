//! Stopping: the graceful shutdown (escalated by a second signal), run by the intake's loop like
//! everything else — revokes, losses and completions are still taken while it drains and
//! commits — and stopping on a failure, which never freezes silently.
//!
//! A graceful stop drains (until `drain_timeout`, and early enough to leave a third of
//! `shutdown_timeout` for the rest), cancels what is unfinished, then commits. A final commit
//! the broker refuses (a rebalance under way) is tried again until the stop's deadline, leaving
//! time for the close; if it never goes through, the stop says how many finished messages the
//! next owner handles again.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::task::JoinError;
use tokio::time::Instant;

use super::commit::Purpose;
use super::{after, Intake, CLOSE_TIMEOUT};
use crate::config::Drain;
use crate::engine::shard::Epochs;
use crate::engine::{EngineError, EngineReport};
use crate::message::SourceId;

/// The least time the final commit and the close get, however late the drain ended.
const MIN_FINAL: Duration = Duration::from_millis(500);

/// A final commit that failed waits this long before it is tried again (doubling up to the most).
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MOST: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Lanes finish what they hold until `drain_until`.
    Draining,
    /// What is unfinished is being cancelled: waiting for every shard to say it is gone.
    Cancelling(u64),
    /// The final commit: started once the committer is free (and `retry_at` passed).
    Committing,
    /// Committed (or given up): the transport is closed next.
    Done,
}

pub(super) struct Stopping {
    /// Lanes may finish until then; the second signal moves it to now.
    pub drain_until: Instant,
    /// When the whole stop (drain, final commit, close) must be over.
    deadline: Instant,
    escalated: bool,
    /// Queued work was dropped (a drain of what is in flight only).
    queued_dropped: bool,
    phase: Phase,
    /// Messages unfinished when the drain ended.
    cancelled: usize,
    /// The final commit is in flight.
    committing: bool,
    retry_at: Option<Instant>,
    retry_wait: Duration,
}

impl Stopping {
    /// When the loop must look at the stop again by itself.
    pub fn wake_at(&self) -> Instant {
        match self.phase {
            Phase::Draining => self.drain_until,
            // As a revoke's: only a retry time still ahead (the committer's answer wakes the loop).
            Phase::Committing => self
                .retry_at
                .filter(|&at| at > Instant::now())
                .map_or(self.commit_until(), |at| at.min(self.commit_until())),
            Phase::Cancelling(_) | Phase::Done => self.commit_until(),
        }
    }

    /// Final commits may be tried until then; the rest is the close's.
    fn commit_until(&self) -> Instant {
        self.deadline - CLOSE_RESERVE
    }

    pub fn done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// When the whole stop must be over.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// What a stop keeps for closing the transport after its last commit attempt.
const CLOSE_RESERVE: Duration = MIN_FINAL;

/// What a panicked task said.
pub(super) fn panic_text(e: JoinError) -> String {
    if !e.is_panic() {
        return e.to_string();
    }
    let panic = e.into_panic();
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .map_or_else(|| "it panicked".to_owned(), |text| format!("it panicked: {text}"))
}

impl Intake {
    /// Acts on shutdown signals: the first starts the drain, the second aborts it.
    pub(super) fn take_signals(&mut self) {
        let count = self.signal_count();
        if count >= 1 && self.stopping.is_none() {
            self.begin_stop();
        }
        if count >= 2 {
            if let Some(stopping) = self.stopping.as_mut().filter(|s| !s.escalated) {
                stopping.escalated = true;
                stopping.drain_until = Instant::now();
                tracing::warn!(held = self.held_total, "stop requested again: aborting the drain");
            }
        }
    }

    /// Stops fetching and starts the drain, which ends by the drain timeout and early enough
    /// to leave a third of the shutdown timeout for the final commit and the close.
    pub(super) fn begin_stop(&mut self) {
        if self.stopping.is_some() {
            return;
        }
        let deadline = after(self.config.shutdown_timeout);
        let reserve = self.config.shutdown_timeout / 3;
        let drain_until = after(self.config.drain_timeout).min(deadline - reserve);
        tracing::info!(held = self.held_total, drain = ?self.config.drain, "shutting down: draining lanes");
        self.stopping = Some(Stopping {
            drain_until,
            deadline,
            escalated: false,
            queued_dropped: false,
            phase: Phase::Draining,
            cancelled: 0,
            committing: false,
            retry_at: None,
            retry_wait: RETRY_FIRST,
        });
        // What was held unrouted never started: the next owner reads it.
        for slot in 0..self.sources.len() as u32 {
            if let Some(state) = self.state(slot) {
                state.waiting = None;
            }
            self.drop_unrouted(slot);
        }
        self.apply_flow();
    }

    /// With a message limit: once that many were taken and all of them finished, stop.
    pub(super) fn stop_at_limit(&mut self) {
        if self.stopping.is_some() || !self.limit_reached() {
            return;
        }
        // What waits unrouted (a paused source's, one waiting for its read-back) would never
        // be taken now: it goes uncommitted, and must not keep the engine from stopping.
        if self.sources.iter().flatten().any(|s| !s.unrouted.is_empty()) {
            for slot in 0..self.sources.len() as u32 {
                self.drop_unrouted(slot);
            }
        }
        let reached = self.held_total == 0;
        if reached {
            tracing::info!(
                taken = self.taken,
                "the message limit is reached and every message finished: stopping"
            );
            self.begin_stop();
        }
    }

    /// Moves a stop on as far as it can go now (never waiting for anything).
    pub(super) fn progress_stop(&mut self) {
        let Some(stopping) = self.stopping.as_ref() else {
            return;
        };
        let now = Instant::now();
        if stopping.phase == Phase::Draining {
            if !stopping.queued_dropped && self.config.drain == Drain::InFlight {
                // A drain of what is in flight drops what is queued behind it, once:
                // uncommitted, it goes to the next consumer.
                tracing::info!(
                    held = self.held_total,
                    "shutting down: finishing what is in flight, leaving what is queued to the next consumer"
                );
                self.drop_queued(Epochs::All);
                if let Some(s) = self.stopping.as_mut() {
                    s.queued_dropped = true;
                }
            }
            let drain_until = self.stopping.as_ref().map_or(now, |s| s.drain_until);
            if self.held_total > 0 && now < drain_until {
                return;
            }
            let cancelled = self.held_total;
            let phase = if cancelled > 0 {
                tracing::warn!(
                    cancelled,
                    "drain ended with messages unfinished; cancelling them (uncommitted, they are redelivered)"
                );
                Phase::Cancelling(self.cancel(Epochs::All))
            } else {
                Phase::Committing
            };
            if let Some(s) = self.stopping.as_mut() {
                s.cancelled = cancelled;
                s.phase = phase;
            }
        }
        let Some(stopping) = self.stopping.as_ref() else {
            return;
        };
        if let Phase::Cancelling(request) = stopping.phase {
            if self.cancels.pending(request) && now < stopping.commit_until() {
                return;
            }
            if let Some(s) = self.stopping.as_mut() {
                s.phase = Phase::Committing;
            }
        }
        let Some(stopping) = self.stopping.as_ref() else {
            return;
        };
        if stopping.phase != Phase::Committing || stopping.committing {
            return;
        }
        let until = stopping.commit_until();
        if now >= until {
            self.give_up_final_commit();
            return;
        }
        if stopping.retry_at.is_some_and(|at| now < at) || self.committer.busy() {
            // A commit in flight (periodic or a revoke's) is answered first.
            return;
        }
        let left = until.saturating_duration_since(now);
        let timeout = self.config.commit_timeout.min(left).max(Duration::from_millis(1));
        let started = self.start_commit(None, timeout, Purpose::Stop);
        if let Some(s) = self.stopping.as_mut() {
            if started {
                s.committing = true;
            } else {
                s.phase = Phase::Done; // nothing left to commit
            }
        }
    }

    /// The stop's final commit was answered: done, or tried again while time is left.
    pub(super) fn final_commit_done(&mut self, ok: bool) {
        let Some(stopping) = self.stopping.as_mut() else {
            return;
        };
        stopping.committing = false;
        if ok {
            // Anything that finished while it was in flight goes with one more.
            stopping.retry_at = None;
            return;
        }
        let now = Instant::now();
        stopping.retry_at = Some(now + stopping.retry_wait);
        stopping.retry_wait = (stopping.retry_wait * 2).min(RETRY_MOST);
    }

    /// Messages finished here that no confirmed commit covers, on sources whose last commit
    /// did not go through (a source whose watermark was committed leaves only what lay above an
    /// unfinished message, which at least once hands to the next owner anyway).
    fn uncommitted(&self) -> u64 {
        self.sources
            .iter()
            .flatten()
            .filter(|s| s.dirty())
            .map(|s| s.finished.saturating_sub(s.committed_finished))
            .sum()
    }

    /// The stop's time for committing is over: say what stays uncommitted, then close.
    fn give_up_final_commit(&mut self) {
        let uncommitted = self.uncommitted();
        if uncommitted > 0 {
            tracing::error!(
                uncommitted,
                "the final commit did not go through before the shutdown deadline: up to {uncommitted} messages finished here are handled again by the next owner"
            );
        }
        if let Some(s) = self.stopping.as_mut() {
            s.phase = Phase::Done;
        }
    }

    /// Acknowledges pending revokes, closes the transport with the time left, and reports.
    pub(super) async fn finish_stop(mut self) -> Result<EngineReport, EngineError> {
        self.read_backs.abort();
        self.complete_all_revokes();
        let (cancelled, deadline) = self
            .stopping
            .as_ref()
            .map_or((0, after(CLOSE_TIMEOUT)), |s| (s.cancelled, s.deadline));
        let committed: BTreeMap<SourceId, u64> = self
            .sources
            .iter()
            .flatten()
            .filter_map(|s| {
                let watermark = s.committed.and_then(|next| next.checked_sub(1))?;
                Some((s.id.clone(), watermark))
            })
            .collect();
        let uncommitted = self.uncommitted();
        let left = deadline.saturating_duration_since(Instant::now());
        self.close_transport(left.max(MIN_FINAL)).await;
        self.shards.clear();
        while self.shard_tasks.join_next().await.is_some() {}
        let stats = self.stats.snapshot();
        tracing::info!(?stats, "engine stopped");
        Ok(EngineReport {
            stats,
            committed,
            cancelled,
            uncommitted,
        })
    }

    /// Stops on a failure: every handler is stopped (the shard tasks are aborted and awaited,
    /// so none is alive afterwards), nothing more is committed, the transport is closed, and
    /// the error is what the engine's handle returns.
    pub(super) async fn fail(mut self, error: EngineError) -> Result<EngineReport, EngineError> {
        tracing::error!(%error, "the engine stops");
        self.read_backs.abort();
        self.shards.clear();
        self.shard_tasks.abort_all();
        while self.shard_tasks.join_next().await.is_some() {}
        // Pending revokes are released by dropping their acks.
        self.revokes.clear();
        self.close_transport(CLOSE_TIMEOUT).await;
        Err(error)
    }

    async fn close_transport(&self, within: Duration) {
        match tokio::time::timeout(within, self.control.close()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "closing the transport failed"),
            Err(_) => tracing::warn!(
                timeout = ?within,
                "closing the transport did not finish in time"
            ),
        }
    }
}
