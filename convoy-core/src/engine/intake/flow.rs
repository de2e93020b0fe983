//! Back-pressure: a source fetches only while it holds fewer messages than its bound, its
//! watermark window is shorter than its bound, and the engine as a whole holds fewer messages
//! and bytes than the totals allow — and an operator has not paused it. The transport is told
//! only when the wanted state changes.

use std::sync::atomic::Ordering::Relaxed;

use super::Intake;

impl Intake {
    pub(super) fn publish_held(&self) {
        let s = &self.stats.intake;
        s.held.store(self.held_total, Relaxed);
        s.peak_held.fetch_max(self.held_total, Relaxed);
        let staged = self.outbox.as_ref().map_or(0, |o| o.held_bytes());
        s.held_bytes.store(self.held_bytes, Relaxed);
        s.peak_held_bytes.fetch_max(self.held_bytes, Relaxed);
        s.staged_bytes.store(staged, Relaxed);
        self.metrics.in_flight.set(self.held_total as f64);
        self.metrics.held_bytes.set(self.held_bytes as f64);
    }

    /// Re-evaluates every gate and pauses or resumes fetching where the wanted state flipped.
    pub(super) fn apply_flow(&mut self) {
        self.total_gate.update(self.held_total);
        // Outputs staged until a commit are held too (a transform's exactly-once outbox).
        let staged = self.outbox.as_ref().map_or(0, |o| o.held_bytes());
        self.bytes_gate.update(self.held_bytes + staged);
        let all_paused =
            self.total_gate.is_paused() || self.bytes_gate.is_paused() || self.stopping.is_some();
        let mut pause = Vec::new();
        let mut resume = Vec::new();
        for state in self.sources.iter_mut().flatten() {
            state.gate.update(state.held);
            state.window_gate.update(state.tracker.window_len());
            let by_operator = !self.paused_sources.is_empty() && self.paused_sources.contains(&state.id);
            let want = all_paused
                || state.revoking
                || by_operator
                || state.gate.is_paused()
                || state.window_gate.is_paused();
            if state.fetch_paused != Some(want) {
                state.fetch_paused = Some(want);
                if want {
                    pause.push(state.id.clone());
                } else {
                    resume.push(state.id.clone());
                }
            }
        }
        if !pause.is_empty() {
            self.stats.intake.pauses.fetch_add(pause.len() as u64, Relaxed);
            tracing::debug!(sources = ?pause, held = self.held_total, held_bytes = self.held_bytes, "back-pressure: pausing fetch");
            if let Err(e) = self.control.pause(&pause) {
                tracing::warn!(error = %e, "pausing fetch failed; messages keep arriving and are kept");
            }
        }
        if !resume.is_empty() {
            tracing::debug!(sources = ?resume, held = self.held_total, "back-pressure: resuming fetch");
            if let Err(e) = self.control.resume(&resume) {
                tracing::warn!(error = %e, "resuming fetch failed");
            }
        }
        let paused = self
            .sources
            .iter()
            .flatten()
            .filter(|s| s.fetch_paused == Some(true))
            .count();
        self.stats.intake.paused_sources.store(paused, Relaxed);
        self.metrics.paused_sources.set(paused as f64);
    }
}
