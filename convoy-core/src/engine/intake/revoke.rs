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

use super::Intake;
use crate::engine::shard::Epochs;
use crate::message::SourceId;
use crate::transport::RevokeAck;

/// The most of a revoke's remaining time kept for cancelling and the final commit.
fn commit_reserve(remaining: Duration, commit_timeout: Duration) -> Duration {
    (remaining / 2).min(commit_timeout.saturating_mul(2))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// In-flight messages may finish until `drain_until`.
    Draining,
    /// Drained (or cancelled): waiting for the committer to be free.
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
}

impl PendingRevoke {
    /// When the loop must look at this revoke again by itself.
    pub fn wake_at(&self) -> Instant {
        match self.phase {
            Phase::Draining => self.drain_until,
            Phase::AwaitCommit | Phase::Committing => self.deadline,
        }
    }
}

impl Intake {
    pub(super) async fn begin_revoke(&mut self, sources: Vec<SourceId>, deadline: Instant, ack: RevokeAck) {
        self.metrics.revoked.increment(sources.len() as u64);
        let slots: Vec<u32> = sources
            .iter()
            .filter_map(|s| self.by_id.get(s).copied())
            .collect();
        let members: Vec<(u32, u64)> = slots
            .into_iter()
            .filter_map(|slot| {
                let state = self.state(slot)?;
                state.revoking = true;
                Some((slot, state.epoch))
            })
            .collect();
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
            self.drop_queued(Epochs::Some(epochs)).await;
        }
        self.revokes.push(PendingRevoke {
            id: self.next_revoke,
            members,
            deadline,
            drain_until,
            ack,
            phase: Phase::Draining,
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

    /// Moves every pending revoke on as far as it can go now.
    pub(super) async fn progress_revokes(&mut self) {
        let mut index = 0;
        while index < self.revokes.len() {
            let now = Instant::now();
            let live = self.live_members(index);
            let revoke = &self.revokes[index];
            let (id, deadline, phase) = (revoke.id, revoke.deadline, revoke.phase);
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
                if held > 0 {
                    tracing::warn!(held, "revoke drain ended; cancelling what still runs (it stays uncommitted and goes to the next owner)");
                    let epochs = self.epochs(&live);
                    self.cancel(Epochs::Some(epochs)).await;
                }
                self.revokes[index].phase = Phase::AwaitCommit;
            }
            match self.revokes[index].phase {
                Phase::AwaitCommit => {
                    let remaining = deadline.saturating_duration_since(now);
                    let timeout = self.config.commit_timeout.min(remaining);
                    if timeout.is_zero() {
                        tracing::warn!("revoke deadline passed before its final commit could run; the next owner handles the uncommitted messages again");
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
                    if self.start_commit(Some(&live), timeout, Some(id)) {
                        self.revokes[index].phase = Phase::Committing;
                    }
                }
                Phase::Committing if now >= deadline => {
                    tracing::warn!(
                        "revoke deadline passed while its final commit was in flight; releasing the sources"
                    );
                    self.complete_revoke(id);
                    continue;
                }
                Phase::Draining | Phase::Committing => {}
            }
            index += 1;
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
    pub(super) async fn lose(&mut self, sources: Vec<SourceId>) {
        self.metrics.lost.increment(sources.len() as u64);
        tracing::warn!(
            ?sources,
            "sources lost without a revoke; their unfinished work will be redelivered to the next owner"
        );
        let slots: Vec<u32> = sources
            .iter()
            .filter_map(|s| self.by_id.get(s).copied())
            .collect();
        self.cancel_slots(&slots).await;
        for slot in slots {
            self.remove(slot);
        }
        // A revoke left with none of its sources has nothing more to do.
        let empty: Vec<u64> = (0..self.revokes.len())
            .filter(|&i| self.live_members(i).is_empty())
            .map(|i| self.revokes[i].id)
            .collect();
        for id in empty {
            self.complete_revoke(id);
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
