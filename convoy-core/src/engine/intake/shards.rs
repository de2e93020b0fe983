//! Commands to the shards whose answers come back as reports of the intake's loop: the intake
//! never waits for a shard. A shard handles its commands in the order they were sent, so work
//! routed after a drop or a cancel is never touched by it; an answer says the shard got that
//! far (for a cancel: no handler of those assignments is alive in it any more).

use std::collections::BTreeMap;

use super::Intake;
use crate::engine::shard::{Dropped, Epochs, ShardCommand};

/// Cancels sent to the shards and not yet answered by every one of them.
#[derive(Default)]
pub(super) struct Cancels {
    next: u64,
    /// Per request, the answers still to come.
    waiting: BTreeMap<u64, usize>,
}

impl Cancels {
    /// True while request `id` has not been answered by every shard it reached.
    pub fn pending(&self, id: u64) -> bool {
        self.waiting.contains_key(&id)
    }

    /// A shard answered request `id`.
    fn answered(&mut self, id: u64) {
        if let Some(left) = self.waiting.get_mut(&id) {
            *left = left.saturating_sub(1);
            if *left == 0 {
                self.waiting.remove(&id);
            }
        }
    }
}

impl Intake {
    /// Has every shard drop its queued messages of `epochs`; the held counts go down as the
    /// answers arrive.
    pub(super) fn drop_queued(&mut self, epochs: Epochs) {
        for shard in &self.shards {
            let _ = shard.send(ShardCommand::DropQueued {
                epochs: epochs.clone(),
            });
        }
    }

    /// A shard dropped queued messages: they are no longer held.
    pub(super) fn on_dropped(&mut self, answer: Vec<(u64, Dropped)>) {
        for (epoch, d) in answer {
            if let Some(state) = self.sources.iter_mut().flatten().find(|s| s.epoch == epoch) {
                state.held = state.held.saturating_sub(d.count);
                state.held_bytes = state.held_bytes.saturating_sub(d.weight);
                self.held_total = self.held_total.saturating_sub(d.count);
                self.held_bytes = self.held_bytes.saturating_sub(d.weight);
            }
        }
        self.publish_held();
        self.apply_flow();
    }

    /// Has every shard drop its queued and abort its in-flight messages of `epochs` (their
    /// completions are never reported); returns the request, pending until every shard answered.
    pub(super) fn cancel(&mut self, epochs: Epochs) -> u64 {
        let id = self.cancels.next;
        self.cancels.next += 1;
        let mut reached = 0;
        for shard in &self.shards {
            let sent = shard.send(ShardCommand::Cancel {
                epochs: epochs.clone(),
                request: id,
            });
            reached += usize::from(sent.is_ok());
        }
        if reached > 0 {
            self.cancels.waiting.insert(id, reached);
        }
        id
    }

    /// A shard answered cancel request `id`.
    pub(super) fn on_cancelled(&mut self, id: u64) {
        self.cancels.answered(id);
    }

    /// Drops queued and aborts in-flight work of these sources; returns the cancel request
    /// (`None` when none of them is assigned).
    pub(super) fn cancel_slots(&mut self, slots: &[u32]) -> Option<u64> {
        let epochs = self.epochs(slots);
        if epochs.is_empty() {
            return None;
        }
        Some(self.cancel(Epochs::Some(epochs)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_pending_until_every_shard_answered() {
        let mut cancels = Cancels::default();
        cancels.waiting.insert(0, 2);
        cancels.answered(0);
        assert!(cancels.pending(0));
        cancels.answered(0);
        assert!(!cancels.pending(0));
        cancels.answered(0);
        assert!(!cancels.pending(0), "a late answer changes nothing");
    }
}
