//! Commits run beside the intake, never inline: one at a time, each bounded by
//! `commit_timeout`, so a broker that does not answer (a coordinator fail-over) never stops
//! messages, revokes or shutdown signals from being handled.
//!
//! A source is committed when its watermark moved, and — for transports that keep the finished
//! offsets above the watermark (an offset map) — also when only that set grew, which is exactly
//! when a head message retrying for long makes the map matter. Commits are batched: every
//! `commit_every` finished messages or `commit_interval`, on revoke and at shutdown — and, for a
//! transport whose delivery waits for commits (RabbitMQ's prefetch), as soon as a source has
//! finished half its credit.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Intake, Turn};
use crate::engine::EngineError;
use crate::message::Offset;
use crate::transport::{Commit, SourceControl, TransportError};

/// What one source's part of a commit covers.
pub(super) struct Entry {
    pub slot: u32,
    pub epoch: u64,
    pub next: Offset,
    /// Every offset received below this one is finished, so committed by this commit: the
    /// lowest unfinished offset received, or `next`.
    pub covered: Offset,
    pub changes: u64,
    /// Messages of the assignment finished when the commit started.
    pub finished: u64,
}

/// What a commit is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Purpose {
    /// Committing on the way (every so many messages, on the timer).
    Periodic,
    /// The final commit of this revoke.
    Revoke(u64),
    /// The final commit of a stop.
    Stop,
}

/// A commit sent to the transport and not yet answered.
pub(super) struct InFlight {
    handle: JoinHandle<Result<(), TransportError>>,
    pub entries: Vec<Entry>,
    pub purpose: Purpose,
}

/// At most one commit in flight.
#[derive(Default)]
pub(super) struct Committer {
    in_flight: Option<InFlight>,
}

impl Committer {
    pub fn busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Sends `commits` in a task of its own, failing it if the transport does not confirm
    /// within `timeout`.
    pub fn start(
        &mut self,
        control: Arc<dyn SourceControl>,
        commits: Vec<Commit>,
        entries: Vec<Entry>,
        timeout: Duration,
        purpose: Purpose,
    ) {
        let handle = tokio::spawn(async move {
            match tokio::time::timeout(timeout, control.commit(&commits)).await {
                Ok(result) => result,
                Err(_) => Err(TransportError::Unavailable(format!(
                    "the commit was not confirmed within {timeout:?}"
                ))),
            }
        });
        self.in_flight = Some(InFlight {
            handle,
            entries,
            purpose,
        });
    }

    /// Waits for the commit in flight (pending forever when there is none). Cancel-safe.
    pub async fn done(&mut self) -> (InFlight, Result<(), TransportError>) {
        let Some(in_flight) = self.in_flight.as_mut() else {
            return std::future::pending().await;
        };
        let result = match (&mut in_flight.handle).await {
            Ok(result) => result,
            Err(e) => Err(TransportError::broker("the commit task failed", e)),
        };
        match self.in_flight.take() {
            Some(in_flight) => (in_flight, result),
            None => std::future::pending().await, // taken just above; cannot happen
        }
    }
}

impl Intake {
    /// The commits for these slots (all if `None`) that would tell the transport something new.
    fn pending_commits(&self, only: Option<&[u32]>) -> (Vec<Commit>, Vec<Entry>) {
        let mut commits = Vec::new();
        let mut entries = Vec::new();
        for (slot, state) in self.sources.iter().enumerate() {
            let Some(state) = state else { continue };
            if only.is_some_and(|o| !o.contains(&(slot as u32))) || !state.dirty() {
                continue;
            }
            let Some(next) = state.tracker.next() else {
                continue;
            };
            commits.push(Commit {
                source: state.id.clone(),
                next,
                token: state.token,
                finished_above: if self.wants_above {
                    state.tracker.finished_above()
                } else {
                    Vec::new()
                },
            });
            entries.push(Entry {
                slot: slot as u32,
                epoch: state.epoch,
                next,
                covered: state
                    .tracker
                    .lowest_unfinished()
                    .map_or(next, |(_, offset)| offset),
                changes: state.changes,
                finished: state.finished,
            });
        }
        (commits, entries)
    }

    /// Starts a commit of these slots (all if `None`) unless one is in flight or nothing is new.
    /// Returns true when one was started.
    pub(super) fn start_commit(&mut self, only: Option<&[u32]>, timeout: Duration, purpose: Purpose) -> bool {
        if self.committer.busy() {
            return false;
        }
        let (commits, entries) = self.pending_commits(only);
        if commits.is_empty() {
            return false;
        }
        tracing::trace!(?commits, "committing");
        for entry in &entries {
            if let Some(state) = self.sources.get_mut(entry.slot as usize).and_then(Option::as_mut) {
                state.commit_base = entry.next;
            }
        }
        self.committer
            .start(self.control.clone(), commits, entries, timeout, purpose);
        true
    }

    /// Starts the periodic commit when it is due (by credit, count, or time) and the committer
    /// is free.
    pub(super) fn maybe_commit(&mut self) {
        let due = self.credit_due
            || self.finished_since_commit >= self.config.commit_every
            || self.last_commit.elapsed() >= self.config.commit_interval;
        if due && !self.committer.busy() {
            self.commit_now();
        }
    }

    /// The commit timer fired: commit now, or once the commit in flight is answered.
    pub(super) fn timed_commit(&mut self) {
        if self.committer.busy() {
            // `maybe_commit` starts it after the answer (the interval has passed by then).
            let next = Instant::now() + self.config.commit_interval;
            self.commit_timer.as_mut().reset(next);
        } else {
            self.commit_now();
        }
    }

    fn commit_now(&mut self) {
        self.finished_since_commit = 0;
        self.credit_due = false;
        self.last_commit = Instant::now();
        let next = super::after(self.config.commit_interval);
        self.commit_timer.as_mut().reset(next);
        self.start_commit(None, self.config.commit_timeout, Purpose::Periodic);
    }

    /// Applies a commit's answer: confirmed positions are recorded, a failure is retried on a
    /// later turn, a fatal failure stops the engine.
    pub(super) fn on_committed(&mut self, commit: InFlight, result: Result<(), TransportError>) -> Turn {
        match result {
            Ok(()) => {
                self.stats.intake.commits.fetch_add(1, Relaxed);
                if let Some(since) = self.commits_failing_since.take() {
                    tracing::info!(failing_for = ?since.elapsed(), "commits go through again");
                    self.stats.set_commits_failing(None);
                }
                for e in &commit.entries {
                    let Some(state) = self
                        .sources
                        .get_mut(e.slot as usize)
                        .and_then(Option::as_mut)
                        .filter(|s| s.epoch == e.epoch)
                    else {
                        continue; // revoked or lost meanwhile
                    };
                    state.committed = Some(e.next);
                    if let Some((parking, _)) = &self.parking {
                        parking.committed_below(&state.id, e.covered);
                    }
                    state.committed_changes = state.committed_changes.max(e.changes);
                    state.committed_finished = state.committed_finished.max(e.finished);
                }
                match commit.purpose {
                    Purpose::Revoke(id) => self.complete_revoke(id),
                    Purpose::Stop => self.final_commit_done(true),
                    Purpose::Periodic => {}
                }
                // A commit releases a transform's staged outputs: the bytes they held may let
                // fetching resume.
                if self.outbox.is_some() {
                    self.publish_held();
                    self.apply_flow();
                }
            }
            Err(e) if e.is_fatal() => return Turn::Fail(EngineError::Transport(e)),
            Err(e) => {
                self.metrics.commit_failures.increment(1);
                // Said once per outage (and when it ends), not on every tick.
                match self.commits_failing_since {
                    None => {
                        tracing::warn!(error = %e, "commit failed; retrying on later ticks (said again when commits go through)");
                        let now = Instant::now();
                        self.commits_failing_since = Some(now);
                        self.stats.set_commits_failing(Some(now));
                    }
                    Some(_) => tracing::debug!(error = %e, "commit failed again"),
                }
                match commit.purpose {
                    Purpose::Revoke(id) => self.revoke_commit_failed(id),
                    Purpose::Stop => self.final_commit_done(false),
                    Purpose::Periodic => {}
                }
            }
        }
        Turn::Continue
    }
}
