//! One assigned source as the intake sees it, and what happens when sources come and go.

use std::sync::atomic::Ordering::Relaxed;

use tokio::time::Instant;

use super::read_back::Waiting;
use super::Intake;
use crate::backpressure::Gate;
use crate::engine::shard::Completion;
use crate::message::{Message, Offset, SourceId};
use crate::transport::{Assignment, Lease};
use crate::watermark::{Progress, Seq, WatermarkTracker};

pub(super) struct SourceState {
    pub id: SourceId,
    /// This assignment's number: work and completions carry it, so nothing of an earlier
    /// assignment of the same slot is ever committed.
    pub epoch: u64,
    pub tracker: WatermarkTracker,
    /// Finished offsets above the committed watermark, ascending, to skip on receipt.
    pub skip: Vec<Offset>,
    pub skip_next: usize,
    pub held: usize,
    pub held_bytes: usize,
    pub gate: Gate,
    pub window_gate: Gate,
    /// What the transport was last told; `None` right after an assignment, so the desired
    /// state is always re-applied (a transport may keep a pause flag from an earlier
    /// assignment of the same source, as librdkafka does).
    pub fetch_paused: Option<bool>,
    /// The last position committed (every offset below it finished).
    pub committed: Option<Offset>,
    /// The position the last commit started with covers (the committed one at first): how far
    /// the watermark moved since tells when a credit-limited source needs a commit.
    pub commit_base: Offset,
    /// Changes worth a commit so far (the watermark moved; for transports that keep an offset
    /// map, also the finished set grew), and how many of them a confirmed commit covers.
    pub changes: u64,
    pub committed_changes: u64,
    /// Being revoked: its messages are no longer taken.
    pub revoking: bool,
    /// After a position reset, offsets up to this one were delivered before: an event id
    /// derived from the position would name the message the offset held then.
    pub rewritten_until: Option<Offset>,
    /// The assignment's offsets are log positions: ids may be derived from them.
    pub offsets_are_positions: bool,
    /// The transport's mark of the assignment, given back with its commits.
    pub token: u64,
    /// The lowest unfinished message and since when it has been the lowest.
    pub head_since: Option<(Seq, Instant)>,
    pub stuck_reported: Option<Seq>,
    /// Held by lease: its messages carry it, and none starts once it ran out.
    pub lease: Option<Lease>,
    /// Waiting for parked keys to be read back before its messages are routed.
    pub waiting: Option<Waiting>,
    /// Messages received but not routed yet, in order (see `unrouted`).
    pub unrouted: Vec<Vec<Message>>,
    /// Messages finished in this assignment, and how many of them a confirmed commit covers
    /// (what a commit that never went through leaves to be handled again).
    pub finished: u64,
    pub committed_finished: u64,
}

impl SourceState {
    /// True when a commit would tell the transport something new.
    pub fn dirty(&self) -> bool {
        self.changes != self.committed_changes
    }

    /// Counts what finishing a message changed.
    pub fn record(&mut self, progress: Progress, wants_above: bool) {
        match progress {
            Progress::Watermark => self.changes += 1,
            Progress::Above if wants_above => self.changes += 1,
            Progress::Above | Progress::Nothing => {}
        }
    }
}

impl Intake {
    /// Takes an assignment; with `read_back`, its messages wait for that read-back of the
    /// parked keys.
    pub(super) fn assign(&mut self, a: Assignment, read_back: Option<u64>) {
        self.metrics.assigned.increment(1);
        if let Some(&slot) = self.by_id.get(&a.source) {
            tracing::warn!(source = %a.source, "source assigned again without a revoke; restarting it from the committed watermark");
            // The shards take the cancel before any work of the new assignment.
            self.cancel_slots(&[slot]);
            self.remove(slot);
        }
        let bp = self.config.back_pressure;
        let mut skip: Vec<Offset> = a
            .finished_above
            .into_iter()
            .filter(|&o| a.committed.is_none_or(|c| o > c))
            .collect();
        skip.sort_unstable();
        skip.dedup();
        let state = SourceState {
            id: a.source.clone(),
            epoch: self.next_epoch,
            tracker: WatermarkTracker::new(a.committed),
            skip,
            skip_next: 0,
            held: 0,
            held_bytes: 0,
            gate: Gate::new(bp.source_high, bp.source_low),
            window_gate: Gate::new(bp.window_high, bp.window_low),
            fetch_paused: None,
            committed: a.committed.map(|c| c + 1),
            commit_base: a.committed.map_or(0, |c| c + 1),
            changes: 0,
            committed_changes: 0,
            revoking: false,
            rewritten_until: None,
            head_since: None,
            stuck_reported: None,
            lease: a.lease,
            offsets_are_positions: a.offsets_are_positions,
            token: a.token,
            waiting: read_back.map(|read_back| Waiting {
                read_back,
                since: Instant::now(),
            }),
            unrouted: Vec::new(),
            finished: 0,
            committed_finished: 0,
        };
        self.next_epoch += 1;
        tracing::info!(source = %a.source, committed = ?a.committed, "source assigned");
        let slot = match self.sources.iter().position(Option::is_none) {
            Some(free) => {
                self.sources[free] = Some(state);
                free as u32
            }
            None => {
                self.sources.push(Some(state));
                (self.sources.len() - 1) as u32
            }
        };
        if let Some((parking, _)) = &self.parking {
            parking.source_assigned(&a.source, a.offsets_are_positions);
        }
        self.by_id.insert(a.source, slot);
        self.stats.intake.sources.store(self.by_id.len(), Relaxed);
    }

    /// Forgets a source: its held messages no longer count, later completions are ignored.
    pub(super) fn remove(&mut self, slot: u32) {
        if let Some(state) = self.sources.get_mut(slot as usize).and_then(Option::take) {
            self.held_total = self.held_total.saturating_sub(state.held);
            self.held_bytes = self.held_bytes.saturating_sub(state.held_bytes);
            self.by_id.remove(&state.id);
            if let Some((parking, _)) = &self.parking {
                parking.source_gone(&state.id);
            }
        }
        self.stats.intake.sources.store(self.by_id.len(), Relaxed);
        self.publish_held();
    }

    pub(super) fn epochs(&self, slots: &[u32]) -> Vec<u64> {
        slots
            .iter()
            .filter_map(|&s| {
                self.sources
                    .get(s as usize)
                    .and_then(Option::as_ref)
                    .map(|st| st.epoch)
            })
            .collect()
    }

    /// `count` messages of `slot` weighing `weight` are no longer held.
    pub(super) fn unhold(&mut self, slot: u32, count: usize, weight: usize) {
        if let Some(state) = self.state(slot) {
            state.held = state.held.saturating_sub(count);
            state.held_bytes = state.held_bytes.saturating_sub(weight);
        }
        self.held_total = self.held_total.saturating_sub(count);
        self.held_bytes = self.held_bytes.saturating_sub(weight);
        self.publish_held();
    }

    pub(super) fn on_completions(&mut self, mut batch: Vec<Completion>) {
        let mut finished = 0usize;
        let mut weight = 0usize;
        let wants_above = self.wants_above;
        for c in batch.drain(..) {
            let Some(state) = self.sources.get_mut(c.slot as usize).and_then(Option::as_mut) else {
                continue;
            };
            // A completion of an earlier assignment of this slot is never committed.
            if state.epoch != c.epoch {
                continue;
            }
            let progress = state.tracker.finish(c.seq);
            state.record(progress, wants_above);
            if let (Progress::Watermark, Some(half), Some(w)) =
                (progress, self.credit_commit, state.tracker.watermark())
            {
                // The transport delivers no more of this source until it commits.
                if (w + 1).saturating_sub(state.commit_base) >= half {
                    self.credit_due = true;
                }
            }
            state.held = state.held.saturating_sub(1);
            state.held_bytes = state.held_bytes.saturating_sub(c.weight as usize);
            state.finished += 1;
            finished += 1;
            weight += c.weight as usize;
        }
        self.spares.completions.keep(batch);
        self.held_total = self.held_total.saturating_sub(finished);
        self.held_bytes = self.held_bytes.saturating_sub(weight);
        self.finished_since_commit += finished;
        self.publish_held();
        self.apply_flow();
    }
}
