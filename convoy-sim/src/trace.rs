//! The trace of a run: one line per event, stamped with virtual time, and a hash of all of them.
//! Two runs of one seed must give the same hash (determinism is checked, not assumed); a failing
//! run prints the trace's end, ending at the violated invariant.

use std::fmt::Write;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

/// The kept lines of a trace: its events and, between them, the engine's own log lines.
pub type Lines = Arc<Mutex<Vec<String>>>;

/// Events of one run, in order.
pub struct Trace {
    start: Instant,
    lines: Lines,
    hash: u64,
    /// Keep the lines (printing a failing seed) or only hash them (hunting).
    keep: bool,
}

/// FNV-1a, 64 bits: fixed, so a hash means the same in every process.
fn fnv(hash: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(hash, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

impl Trace {
    pub fn new(keep: bool) -> Trace {
        Trace {
            start: Instant::now(),
            lines: Lines::default(),
            hash: FNV_OFFSET,
            keep,
        }
    }

    /// Where the engine's log lines go, between the events (they are not hashed).
    pub fn lines_handle(&self) -> Lines {
        self.lines.clone()
    }

    /// The virtual time since the run started, as the trace shows it.
    pub fn stamp(start: Instant) -> String {
        let at = start.elapsed();
        format!("{:>5}.{:03}s", at.as_secs(), at.subsec_millis())
    }

    pub fn start(&self) -> Instant {
        self.start
    }

    /// Records `what`, stamped with the virtual time since the run started.
    pub fn event(&mut self, what: impl std::fmt::Display) {
        let mut line = Trace::stamp(self.start);
        let _ = write!(line, " {what}");
        self.hash = fnv(self.hash, line.as_bytes());
        if self.keep {
            self.lines.lock().unwrap_or_else(|p| p.into_inner()).push(line);
        }
    }

    /// The hash of every event so far.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// The kept lines (events and log lines).
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_hash_follows_the_events_and_their_times() {
        let mut a = Trace::new(true);
        let mut b = Trace::new(false);
        a.event("x");
        b.event("x");
        assert_eq!(a.hash(), b.hash());
        tokio::time::advance(std::time::Duration::from_millis(5)).await;
        a.event("y");
        b.event("y");
        assert_eq!(a.hash(), b.hash());
        assert_eq!(a.lines().len(), 2);
        assert!(b.lines().is_empty(), "a hunting trace keeps no lines");
        let mut c = Trace::new(false);
        c.event("x");
        c.event("y");
        assert_ne!(a.hash(), c.hash(), "same events, other times");
    }
}
