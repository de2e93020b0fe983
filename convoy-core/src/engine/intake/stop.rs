//! Stopping: the graceful shutdown drain (escalated by a second signal), and stopping on a
//! failure, which never freezes silently.

use std::collections::BTreeMap;

use tokio::task::JoinError;
use tokio::time::Instant;

use std::time::Duration;

use super::{after, Intake, CLOSE_TIMEOUT};
use crate::config::Drain;

/// The least time the final commit and the close get, however late the drain ended.
const MIN_FINAL: Duration = Duration::from_millis(500);
use crate::engine::shard::Epochs;
use crate::engine::{EngineError, EngineReport};
use crate::message::SourceId;

pub(super) struct Stopping {
    /// Lanes may finish until then; the second signal moves it to now.
    pub drain_until: Instant,
    /// When the whole stop (drain, final commit, close) must be over.
    deadline: Instant,
    escalated: bool,
    /// Queued work was dropped (a drain of what is in flight only).
    queued_dropped: bool,
}

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
                tracing::warn!(
                    held = self.held_total,
                    "second shutdown signal: aborting the drain"
                );
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
        });
        self.apply_flow();
    }

    /// A drain of what is in flight drops what is queued behind it, once: uncommitted, it goes
    /// to the next consumer.
    pub(super) async fn drop_queued_for_stop(&mut self) {
        let due = self
            .stopping
            .as_ref()
            .is_some_and(|s| !s.queued_dropped && self.config.drain == Drain::InFlight);
        if !due {
            return;
        }
        let held = self.held_total;
        self.drop_queued(Epochs::All).await;
        tracing::info!(
            dropped = held - self.held_total,
            in_flight = self.held_total,
            "shutting down: finishing what is in flight, leaving what is queued to the next consumer"
        );
        if let Some(stopping) = self.stopping.as_mut() {
            stopping.queued_dropped = true;
        }
    }

    /// With a message limit: once that many were taken and all of them finished, stop.
    pub(super) fn stop_at_limit(&mut self) {
        let reached = self
            .config
            .max_messages
            .is_some_and(|max| self.taken >= max && self.held_total == 0);
        if reached && self.stopping.is_none() {
            tracing::info!(
                taken = self.taken,
                "the message limit is reached and every message finished: stopping"
            );
            self.begin_stop();
        }
    }

    /// True once the drain is over: nothing held, or its time is up.
    pub(super) fn stop_complete(&self) -> bool {
        self.stopping
            .as_ref()
            .is_some_and(|s| self.held_total == 0 || Instant::now() >= s.drain_until)
    }

    /// Cancels what is unfinished (not dead-lettered: it stays uncommitted and is redelivered),
    /// commits, acknowledges pending revokes, closes the transport.
    pub(super) async fn finish_stop(mut self) -> Result<EngineReport, EngineError> {
        let cancelled = self.held_total;
        if cancelled > 0 {
            tracing::warn!(
                cancelled,
                "drain ended with messages unfinished; cancelling them (uncommitted, they are redelivered)"
            );
            self.drop_queued(Epochs::All).await;
            self.cancel(Epochs::All).await;
        }
        if self.committer.busy() {
            let (commit, result) = self.committer.done().await;
            // A fatal commit error here changes nothing: the engine is stopping anyway.
            let _ = self.on_committed(commit, result);
        }
        // The final commit gets half of what is left before the deadline (the close the rest).
        let deadline = self
            .stopping
            .as_ref()
            .map_or_else(|| after(CLOSE_TIMEOUT), |s| s.deadline);
        let left = deadline.saturating_duration_since(Instant::now());
        let commit_timeout = self.config.commit_timeout.min(left / 2).max(MIN_FINAL);
        if self.start_commit(None, commit_timeout, None) {
            let (commit, result) = self.committer.done().await;
            let _ = self.on_committed(commit, result);
        }
        self.complete_all_revokes();
        let committed: BTreeMap<SourceId, u64> = self
            .sources
            .iter()
            .flatten()
            .filter_map(|s| {
                let watermark = s.committed.and_then(|next| next.checked_sub(1))?;
                Some((s.id.clone(), watermark))
            })
            .collect();
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
        })
    }

    /// Stops on a failure: every handler is stopped (the shard tasks are aborted and awaited,
    /// so none is alive afterwards), nothing more is committed, the transport is closed, and
    /// the error is what the engine's handle returns.
    pub(super) async fn fail(mut self, error: EngineError) -> Result<EngineReport, EngineError> {
        tracing::error!(%error, "the engine stops");
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
