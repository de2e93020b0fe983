//! Stopping: the graceful shutdown drain (escalated by a second signal), and stopping on a
//! failure, which never freezes silently.

use std::collections::BTreeMap;

use tokio::task::JoinError;
use tokio::time::Instant;

use super::{after, Intake, CLOSE_TIMEOUT};
use crate::engine::shard::Epochs;
use crate::engine::{EngineError, EngineReport};
use crate::message::SourceId;

pub(super) struct Stopping {
    /// Lanes may finish until then; the second signal moves it to now.
    pub drain_until: Instant,
    escalated: bool,
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

    /// Stops fetching and starts the drain.
    pub(super) fn begin_stop(&mut self) {
        if self.stopping.is_some() {
            return;
        }
        tracing::info!(held = self.held_total, "shutting down: draining lanes");
        self.stopping = Some(Stopping {
            drain_until: after(self.config.drain_timeout),
            escalated: false,
        });
        self.apply_flow();
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
        if self.start_commit(None, self.config.commit_timeout, None) {
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
        self.close_transport().await;
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
        self.close_transport().await;
        Err(error)
    }

    async fn close_transport(&self) {
        match tokio::time::timeout(CLOSE_TIMEOUT, self.control.close()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "closing the transport failed"),
            Err(_) => tracing::warn!(
                timeout = ?CLOSE_TIMEOUT,
                "closing the transport did not finish in time"
            ),
        }
    }
}
