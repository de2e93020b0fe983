//! Revoked and lost sources.
//!
//! A revoke runs beside the rest of the engine (other sources keep flowing): its queued
//! messages are dropped at once (the next owner reads them), its in-flight ones may finish
//! until the drain ends, then whatever still runs is cancelled — and dropped — before its
//! watermarks are committed and the revoke acknowledged. The drain ends at `drain_timeout`, and
//! never later than the revoke's deadline minus the time reserved for the final commit: the
//! transport hands the sources on at its deadline, and by then no handler of them is alive.

use std::time::Duration;

use tokio::time::Instant;

use super::commit::Purpose;
use super::Intake;
use crate::engine::shard::Epochs;
use crate::message::SourceId;
use crate::transport::RevokeAck;

/// The most of a revoke's remaining time kept for cancelling and the final commit.
fn commit_reserve(remaining: Duration, commit_timeout: Duration) -> Duration {
    (remaining / 2).min(commit_timeout.saturating_mul(2))
}

/// How long a final commit that failed waits before it is tried again (doubling up to the
/// most), while its deadline allows.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MOST: Duration = Duration::from_secs(1);

/// A revoke is acknowledged this long before its deadline at the latest: the transport hands the
/// sources on at the deadline, and an acknowledgement that arrives with it is too late.
const ACK_MARGIN: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// In-flight messages may finish until `drain_until`.
    Draining,
    /// What still ran is being cancelled: waiting for every shard to say it is gone.
    Cancelling(u64),
    /// Drained (or cancelled): waiting for the committer to be free, or for `retry_at`.
    AwaitCommit,
    /// The final commit is in flight.
    Committing,
}

pub(super) struct PendingRevoke {
    id: u64,
    /// (slot, epoch) of each revoked source this engine had.
    members: Vec<(u32, u64)>,
    deadline: Instant,
    drain_until: Instant,
    ack: RevokeAck,
    phase: Phase,
    /// After a failed final commit: when to try again, and the wait after that.
    retry_at: Option<Instant>,
    retry_wait: Duration,
}

impl PendingRevoke {
    /// When the loop must look at this revoke again by itself.
    pub fn wake_at(&self) -> Instant {
        let last = self.ack_by();
        match self.phase {
            Phase::Draining => self.drain_until.min(last),
            // Waiting for the committer: its answer wakes the loop. Only a retry time still
            // ahead is a reason to wake (one passed would wake the loop at once, forever).
            Phase::AwaitCommit => self
                .retry_at
                .filter(|&at| at > Instant::now())
                .map_or(last, |at| at.min(last)),
            Phase::Cancelling(_) | Phase::Committing => last,
        }
    }

    /// The latest the revoke is acknowledged, committed or not.
    fn ack_by(&self) -> Instant {
        let window = self.deadline.saturating_duration_since(self.drain_until);
        self.deadline - ACK_MARGIN.min(window / 2)
    }

    /// When the transport hands its sources on, acknowledged or not.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

impl Intake {
    pub(super) fn begin_revoke(&mut self, sources: Vec<SourceId>, deadline: Instant, ack: RevokeAck) {
        self.metrics.revoked.increment(sources.len() as u64);
        let slots: Vec<u32> = sources
            .iter()
            .filter_map(|s| self.by_id.get(s).copied())
            .collect();
        let mut members = Vec::with_capacity(slots.len());
        for slot in slots {
            let Some(state) = self.state(slot) else {
                continue;
            };
            state.revoking = true;
            let epoch = state.epoch;
            // What was held unrouted never started: the next owner reads it.
            state.waiting = None;
            self.drop_unrouted(slot);
            members.push((slot, epoch));
        }
        let now = Instant::now();
        let remaining = deadline.saturating_duration_since(now);
        let drain_until = super::after(self.config.drain_timeout)
            .min(deadline - commit_reserve(remaining, self.config.commit_timeout));
        tracing::info!(
            ?sources,
            drain_for = ?drain_until.saturating_duration_since(now),
            deadline_in = ?remaining,
            "sources revoked; draining their in-flight messages before committing"
        );
        // Not-yet-started messages belong to the next owner now.
        let epochs: Vec<u64> = members.iter().map(|&(_, epoch)| epoch).collect();
        if !epochs.is_empty() {
            self.drop_queued(Epochs::Some(epochs));
        }
        self.revokes.push(PendingRevoke {
            id: self.next_revoke,
            members,
            deadline,
            drain_until,
            ack,
            phase: Phase::Draining,
            retry_at: None,
            retry_wait: RETRY_FIRST,
        });
        self.next_revoke += 1;
        self.apply_flow();
    }

    /// The revoked slots still holding the assignment they had when the revoke came.
    fn live_members(&self, index: usize) -> Vec<u32> {
        self.revokes[index]
            .members
            .iter()
            .filter(|&&(slot, epoch)| self.state_of(slot, epoch).is_some())
            .map(|&(slot, _)| slot)
            .collect()
    }

    /// Moves every pending revoke on as far as it can go now (never waiting for anything).
    pub(super) fn progress_revokes(&mut self) {
        let mut index = 0;
        while index < self.revokes.len() {
            let now = Instant::now();
            let live = self.live_members(index);
            let revoke = &self.revokes[index];
            // Everything below ends by the acknowledgement's latest time, a little before the
            // transport's deadline.
            let (id, deadline, phase) = (revoke.id, revoke.ack_by(), revoke.phase);
            if phase == Phase::Draining {
                let held: usize = live
                    .iter()
                    .filter_map(|&slot| self.sources[slot as usize].as_ref())
                    .map(|s| s.held)
                    .sum();
                let aborted = self.stopping.as_ref().is_some_and(|s| now >= s.drain_until);
                if held > 0 && now < self.revokes[index].drain_until && !aborted {
                    index += 1;
                    continue;
                }
                self.revokes[index].phase = if held > 0 {
                    tracing::warn!(held, "revoke drain ended; cancelling what still runs (it stays uncommitted and goes to the next owner)");
                    let epochs = self.epochs(&live);
                    Phase::Cancelling(self.cancel(Epochs::Some(epochs)))
                } else {
                    Phase::AwaitCommit
                };
            }
            if let Phase::Cancelling(request) = self.revokes[index].phase {
                if self.cancels.pending(request) {
                    if now < deadline {
                        index += 1;
                        continue;
                    }
                    tracing::error!("revoke deadline passed before every cancelled handler was gone; releasing the sources");
                    self.complete_revoke(id);
                    continue;
                }
                self.revokes[index].phase = Phase::AwaitCommit;
            }
            match self.revokes[index].phase {
                Phase::AwaitCommit => {
                    let retry_later = self.revokes[index].retry_at.is_some_and(|at| now < at);
                    if retry_later && now < deadline {
                        index += 1;
                        continue;
                    }
                    let remaining = deadline.saturating_duration_since(now);
                    let timeout = self.config.commit_timeout.min(remaining);
                    if timeout.is_zero() {
                        self.release_uncommitted(
                            index,
                            "the revoke deadline passed before its final commit went through",
                        );
                        self.complete_revoke(id);
                        continue;
                    }
                    let dirty = live
                        .iter()
                        .any(|&slot| self.sources[slot as usize].as_ref().is_some_and(|s| s.dirty()));
                    if !dirty {
                        self.complete_revoke(id);
                        continue;
                    }
                    if self.start_commit(Some(&live), timeout, Purpose::Revoke(id)) {
                        self.revokes[index].phase = Phase::Committing;
                    }
                }
                Phase::Committing if now >= deadline => {
                    self.release_uncommitted(
                        index,
                        "the revoke deadline passed while its final commit was in flight",
                    );
                    self.complete_revoke(id);
                    continue;
                }
                Phase::Draining | Phase::Cancelling(_) | Phase::Committing => {}
            }
            index += 1;
        }
    }

    /// A revoke's final commit failed: it is tried again while the deadline allows (a broker in
    /// the middle of a rebalance refuses commits until the member's generation is current).
    pub(super) fn revoke_commit_failed(&mut self, id: u64) {
        let Some(revoke) = self.revokes.iter_mut().find(|r| r.id == id) else {
            return;
        };
        let now = Instant::now();
        revoke.phase = Phase::AwaitCommit;
        revoke.retry_at = Some(now + revoke.retry_wait);
        revoke.retry_wait = (revoke.retry_wait * 2).min(RETRY_MOST);
    }

    /// Says loudly what a revoke leaves to be handled again: messages finished here whose
    /// commit never went through.
    fn release_uncommitted(&self, index: usize, why: &str) {
        let uncommitted: u64 = self
            .live_members(index)
            .iter()
            .filter_map(|&slot| self.sources[slot as usize].as_ref())
            .filter(|s| s.dirty())
            .map(|s| s.finished.saturating_sub(s.committed_finished))
            .sum();
        if uncommitted > 0 {
            tracing::error!(
                uncommitted,
                "{why}: releasing the sources; up to {uncommitted} messages finished here are handled again by the next owner"
            );
        } else {
            tracing::warn!("{why}: releasing the sources");
        }
    }

    /// Forgets a revoke's sources and acknowledges it.
    pub(super) fn complete_revoke(&mut self, id: u64) {
        let Some(index) = self.revokes.iter().position(|r| r.id == id) else {
            return;
        };
        for slot in self.live_members(index) {
            self.remove(slot);
        }
        let revoke = self.revokes.swap_remove(index);
        revoke.ack.done();
        self.apply_flow();
    }

    /// Sources gone without a revoke: cancel everything of them, commit nothing.
    pub(super) fn lose(&mut self, sources: Vec<SourceId>) {
        self.metrics.lost.increment(sources.len() as u64);
        tracing::warn!(
            ?sources,
            "sources lost without a revoke; their unfinished work will be redelivered to the next owner"
        );
        let slots: Vec<u32> = sources
            .iter()
            .filter_map(|s| self.by_id.get(s).copied())
            .collect();
        let request = self.cancel_slots(&slots);
        for slot in slots {
            self.remove(slot);
        }
        // A revoke left with none of its sources has nothing to commit: it is acknowledged once
        // what ran of them is gone.
        for index in 0..self.revokes.len() {
            if self.live_members(index).is_empty() {
                let revoke = &mut self.revokes[index];
                revoke.phase = match (revoke.phase, request) {
                    (Phase::Committing, _) => Phase::Committing,
                    (_, Some(request)) => Phase::Cancelling(request),
                    (_, None) => Phase::AwaitCommit,
                };
            }
        }
        self.apply_flow();
    }

    /// Acknowledges every pending revoke (at the end of a shutdown, after the final commit).
    pub(super) fn complete_all_revokes(&mut self) {
        let ids: Vec<u64> = self.revokes.iter().map(|r| r.id).collect();
        for id in ids {
            self.complete_revoke(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commit_reserve_never_exceeds_half_the_remaining_time() {
        let ten = Duration::from_secs(10);
        assert_eq!(
            commit_reserve(Duration::from_secs(60), ten),
            Duration::from_secs(20)
        );
        assert_eq!(
            commit_reserve(Duration::from_millis(100), ten),
            Duration::from_millis(50)
        );
        assert_eq!(commit_reserve(Duration::ZERO, ten), Duration::ZERO);
    }
}
