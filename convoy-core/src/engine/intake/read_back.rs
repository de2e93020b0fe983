//! Parked keys are read back from the dead-letter destination before a newly assigned source
//! flows: its previous owner may have parked keys there. The read runs in a task of its own and
//! its end comes back as an event; only the sources waiting for it wait (their messages held,
//! unrouted, so back-pressure pauses them), every other source flows, and every revoke, loss
//! and stop is handled meanwhile — also when the destination does not answer at all.
//!
//! A source needs a read that *started* after it was assigned (one already running may have
//! read the destination before the previous owner's last records): each read has a number,
//! and a source waits for the first one numbered after its assignment.

use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Intake;
use crate::dead_letter::DeadLetterSink;
use crate::engine::parking::Parking;

/// A source waiting for its read-back.
pub(super) struct Waiting {
    /// The read-back that must finish first.
    pub read_back: u64,
    /// Since when it waits (what arrives meanwhile is held unrouted).
    pub since: Instant,
}

/// The read-backs of one engine: at most one running.
#[derive(Default)]
pub(super) struct ReadBacks {
    running: Option<(u64, JoinHandle<()>)>,
    /// The number of the last read started.
    started: u64,
}

impl ReadBacks {
    pub fn busy(&self) -> bool {
        self.running.is_some()
    }

    /// Waits for the running read-back and returns its number (pending forever when none
    /// runs). Cancel-safe.
    pub async fn done(&mut self) -> u64 {
        let Some((number, handle)) = self.running.as_mut() else {
            return std::future::pending().await;
        };
        // A read-back task only ends by finishing (it retries failures itself) or when
        // aborted, which happens only as the engine stops.
        let _ = handle.await;
        let number = *number;
        self.running = None;
        number
    }

    /// Stops the running read-back (the engine stops).
    pub fn abort(&mut self) {
        if let Some((_, handle)) = self.running.take() {
            handle.abort();
        }
    }

    fn start(&mut self, parking: Arc<Parking>, sink: Arc<dyn DeadLetterSink>) {
        self.started += 1;
        let handle = tokio::spawn(async move { parking.read_back(&*sink).await });
        self.running = Some((self.started, handle));
    }
}

impl Intake {
    /// The number of the read-back that the sources of one assignment event must wait for
    /// (`None`: the engine parks no keys): one started now, or — when one is running, which may
    /// have read before the assignment — the next, started once it ends.
    pub(super) fn read_back_for_assignment(&mut self) -> Option<u64> {
        let (parking, sink) = self.parking.clone()?;
        if self.read_backs.busy() {
            return Some(self.read_backs.started + 1);
        }
        self.read_backs.start(parking, sink);
        Some(self.read_backs.started)
    }

    /// Read-back `number` finished: the sources waiting for it (or an earlier one) flow, with
    /// what they held first; another read starts if a source waits for a later one.
    pub(super) fn on_read_back(&mut self, number: u64) {
        let ready: Vec<u32> = self
            .sources
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| {
                let waiting = s.as_ref()?.waiting.as_ref()?;
                (waiting.read_back <= number).then_some(slot as u32)
            })
            .collect();
        for slot in ready {
            let Some(state) = self.state(slot) else {
                continue;
            };
            let Some(waiting) = state.waiting.take() else {
                continue;
            };
            tracing::debug!(source = %state.id, waited = ?waiting.since.elapsed(), "parked keys read back; the source flows");
            self.release_unrouted(slot);
        }
        let still_waiting = self
            .sources
            .iter()
            .flatten()
            .any(|s| s.waiting.as_ref().is_some_and(|w| w.read_back > number));
        if still_waiting && !self.read_backs.busy() {
            if let Some((parking, sink)) = self.parking.clone() {
                self.read_backs.start(parking, sink);
            }
        }
        self.apply_flow();
    }

    /// Starts a read-back when this engine wrote enough records since its last one (it then
    /// saves a checkpoint): called on ticks, so that an assignment after a long quiet stretch
    /// still reads little. No source waits for it.
    pub(super) fn read_back_if_checkpoint_due(&mut self) {
        let Some((parking, sink)) = self.parking.clone() else {
            return;
        };
        if parking.checkpoint_due() && !self.read_backs.busy() {
            self.read_backs.start(parking, sink);
        }
    }

    /// Since when the longest-waiting source waits for its read-back.
    pub(super) fn read_back_waiting_since(&self) -> Option<Instant> {
        self.sources
            .iter()
            .flatten()
            .filter_map(|s| s.waiting.as_ref().map(|w| w.since))
            .min()
    }
}
