//! Messages a source received but does not route yet: it waits for its parked keys to be read
//! back, or an operator paused it. Fetching stops at a pause, but what a transport fetched
//! before it heard (a prefetch, a batch already on its way, the first fetch of a source
//! assigned after the pause) still arrives: it is held here, in order, counted by
//! back-pressure, and routed once nothing holds the source any more. A revoke or a stop drops
//! it uncommitted, so the next owner reads it again.

use super::Intake;
use crate::message::{Message, SourceId};

impl Intake {
    /// True when `slot`'s messages must not be routed now.
    pub(super) fn holds_unrouted(&self, slot: u32) -> bool {
        self.sources[slot as usize]
            .as_ref()
            .is_some_and(|s| s.waiting.is_some() || !s.unrouted.is_empty() || self.paused_by_operator(&s.id))
    }

    pub(super) fn paused_by_operator(&self, source: &SourceId) -> bool {
        !self.paused_sources.is_empty() && self.paused_sources.contains(source)
    }

    /// With a message limit: true once that many were taken.
    pub(super) fn limit_reached(&self) -> bool {
        self.config.max_messages.is_some_and(|max| self.taken >= max)
    }

    /// Holds `messages` of `slot` behind what it holds already (past the message limit they
    /// would never be taken: they are left, uncommitted).
    pub(super) fn hold_unrouted(&mut self, slot: u32, messages: Vec<Message>) {
        if self.limit_reached() {
            return;
        }
        let (count, weight) = size(&messages);
        let Some(state) = self.state(slot) else {
            return;
        };
        state.unrouted.push(messages);
        state.held += count;
        state.held_bytes += weight;
        self.held_total += count;
        self.held_bytes += weight;
        self.publish_held();
        self.apply_flow();
    }

    /// Routes what `slot` held, in order, unless something still holds it.
    pub(super) fn release_unrouted(&mut self, slot: u32) {
        let Some(state) = self.sources[slot as usize].as_ref() else {
            return;
        };
        if state.waiting.is_some() || self.paused_by_operator(&state.id) {
            return;
        }
        let Some(state) = self.state(slot) else {
            return;
        };
        let source = state.id.clone();
        for batch in std::mem::take(&mut state.unrouted) {
            let (count, weight) = size(&batch);
            self.unhold(slot, count, weight);
            self.route(slot, source.clone(), batch);
        }
    }

    /// Forgets what `slot` held (it never started): the next owner reads it again.
    pub(super) fn drop_unrouted(&mut self, slot: u32) {
        let Some(state) = self.state(slot) else {
            return;
        };
        let unrouted = std::mem::take(&mut state.unrouted);
        let count = unrouted.iter().map(Vec::len).sum();
        let weight = unrouted.iter().flatten().map(Message::weight).sum();
        self.unhold(slot, count, weight);
    }
}

/// A batch's message count and weight, as back-pressure counts them.
fn size(batch: &[Message]) -> (usize, usize) {
    (batch.len(), batch.iter().map(Message::weight).sum())
}
