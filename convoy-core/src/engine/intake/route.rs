//! Messages in: each is recorded in its source's watermark tracker, skipped if the offset map
//! says it finished before, and routed to the shard of its key.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering::Relaxed;

use tokio::time::Instant;

use super::Intake;
use crate::config::KeylessPolicy;
use crate::engine::lane::PositionId;
use crate::engine::shard::{shard_of, LaneOf, ShardCommand, Work};
use crate::message::{Message, Offset, SourceId};

impl Intake {
    /// The lane `message` joins, and that lane's hash (which picks the shard).
    fn lane_of(&mut self, message: &Message, epoch: u64) -> (LaneOf, u64) {
        let lane = match (message.ordering_key(), self.config.keyless) {
            (Some(key), _) => return (LaneOf::Key, self.shard_hasher.hash_one(key)),
            (None, KeylessPolicy::PerSource) => LaneOf::Source(epoch),
            (None, KeylessPolicy::Unordered | KeylessPolicy::DeadLetter) => {
                self.next_solo += 1;
                LaneOf::Solo(self.next_solo)
            }
        };
        (lane, self.shard_hasher.hash_one(lane))
    }

    pub(super) fn on_messages(&mut self, source: SourceId, messages: Vec<Message>) {
        let Some(&slot) = self.by_id.get(&source) else {
            // Fetched under an assignment that has ended: the next owner reads them again.
            tracing::debug!(%source, count = messages.len(), "ignoring messages of a source not assigned to this consumer");
            return;
        };
        if self.stopping.is_some() || self.sources[slot as usize].as_ref().is_none_or(|s| s.revoking) {
            // Shutting down, or revoked: uncommitted, so the next owner reads them again.
            return;
        }
        if let (Some((parking, _)), Some(first)) = (&self.parking, messages.first()) {
            parking.received(&source, first.offset);
        }
        if self.holds_unrouted(slot) {
            // Held, unrouted, until the parked keys are read back or an operator resumes the
            // source (back-pressure pauses it meanwhile).
            self.hold_unrouted(slot, messages);
            return;
        }
        self.route(slot, source, messages);
    }

    /// Tracks `messages` of `slot` and routes them to the shards of their lanes.
    pub(super) fn route(&mut self, slot: u32, source: SourceId, mut messages: Vec<Message>) {
        let received = Instant::now();
        let shard_count = self.shards.len();
        let (mut routed, mut routed_bytes) = (0usize, 0usize);
        let wants_above = self.wants_above;
        let limit = self.config.max_messages;
        for message in messages.drain(..) {
            if limit.is_some_and(|max| self.taken >= max) {
                // The limit is reached: the rest is not taken (not tracked, so not committed).
                break;
            }
            let Some(state) = self.sources[slot as usize].as_mut() else {
                return;
            };
            let seq = match state.tracker.receive(message.offset) {
                Ok(seq) => seq,
                Err(e) => {
                    self.reset_position(slot, message.offset, e.last);
                    let Some(state) = self.sources[slot as usize].as_mut() else {
                        return;
                    };
                    match state.tracker.receive(message.offset) {
                        Ok(seq) => seq,
                        Err(e) => {
                            tracing::error!(%source, error = %e, "offset still out of order after a position reset; skipping the message");
                            continue;
                        }
                    }
                }
            };
            let Some(state) = self.sources[slot as usize].as_mut() else {
                return;
            };
            // Skip offsets known finished (from commit metadata) instead of handling them again.
            while state
                .skip
                .get(state.skip_next)
                .is_some_and(|&o| o < message.offset)
            {
                state.skip_next += 1;
            }
            if state.skip.get(state.skip_next) == Some(&message.offset) {
                state.skip_next += 1;
                let progress = state.tracker.finish(seq);
                state.record(progress, wants_above);
                continue;
            }
            let epoch = state.epoch;
            let lease = state.lease.clone();
            let position_id = if !state.offsets_are_positions {
                PositionId::None
            } else if state.rewritten_until.is_some_and(|r| message.offset <= r) {
                PositionId::Rewritten
            } else {
                PositionId::Checked
            };
            let weight = message.weight();
            // Hashed once here: the shard's lane table takes the same hash.
            let (lane, hash) = self.lane_of(&message, epoch);
            let shard = shard_of(hash, shard_count);
            self.routes[shard].push(Work {
                message,
                lane,
                hash,
                slot,
                epoch,
                seq,
                weight,
                position_id,
                received,
                lease,
            });
            routed += 1;
            routed_bytes += weight;
            if limit.is_some() {
                self.taken += 1;
            }
        }
        self.events.recycle(messages);
        if let Some(state) = self.state(slot) {
            state.held += routed;
            state.held_bytes += routed_bytes;
            let window = state.tracker.window_len();
            self.stats.intake.peak_window.fetch_max(window, Relaxed);
        }
        self.held_total += routed;
        self.held_bytes += routed_bytes;
        self.metrics.consumed.increment(routed as u64);
        for (shard, route) in self.routes.iter_mut().enumerate() {
            if !route.is_empty() {
                let batch = std::mem::replace(route, self.spares.work.take());
                // A shard only stops when the intake drops it; a dead one is noticed by the
                // supervision in the main loop, which stops the engine.
                let _ = self.shards[shard].send(ShardCommand::Work(batch));
            }
        }
        self.publish_held();
        self.apply_flow();
    }

    /// The source delivered `offset` at or below `last`, one it delivered before: its log was
    /// truncated and rewritten (Kafka after an unclean leader election). Everything received at
    /// or above `offset` is forgotten (what still runs of it finishes, uncounted), the watermark
    /// moves back below it, and the rewritten messages are taken as new ones.
    fn reset_position(&mut self, slot: u32, offset: Offset, last: Offset) {
        let Some(state) = self.state(slot) else {
            return;
        };
        let before = state.tracker.watermark();
        state.tracker.truncate(offset);
        state.skip.retain(|&o| o < offset);
        state.skip_next = state.skip_next.min(state.skip.len());
        state.rewritten_until = Some(state.rewritten_until.map_or(last, |r| r.max(last)));
        // The position to commit may have moved back: make sure it is committed again.
        state.changes += 1;
        tracing::warn!(
            source = %state.id,
            offset,
            last_received = last,
            watermark_before = ?before,
            watermark_now = ?state.tracker.watermark(),
            "offset went backwards: the source's log was truncated and rewritten; handling it again from there"
        );
        self.stats.intake.resets.fetch_add(1, Relaxed);
    }
}
