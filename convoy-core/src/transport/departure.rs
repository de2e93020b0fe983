//! How a group member's control asks the member to leave, and learns that it has left.
//!
//! Transports whose members balance partitions themselves (RabbitMQ, NATS) run one member task
//! per subscription; `SourceControl::close` (or dropping the control) asks it to leave, and
//! `close` returns once it has released everything.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

use tokio::sync::{watch, Notify};

/// A member's leave request and its answer. Share it between the control and the member task.
#[derive(Debug)]
pub struct Departure {
    asked: AtomicBool,
    ask: Notify,
    left: watch::Sender<bool>,
}

impl Default for Departure {
    fn default() -> Self {
        Departure {
            asked: AtomicBool::new(false),
            ask: Notify::new(),
            left: watch::Sender::new(false),
        }
    }
}

impl Departure {
    /// Not asked, not left.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the member to leave (again is harmless).
    pub fn ask(&self) {
        self.asked.store(true, SeqCst);
        // A stored permit: a member not waiting right now finds it at its next wait.
        self.ask.notify_one();
    }

    /// True once the member was asked to leave.
    pub fn is_asked(&self) -> bool {
        self.asked.load(SeqCst)
    }

    /// Completes when the member is asked to leave — or earlier: check
    /// [`is_asked`](Self::is_asked) again after it.
    pub async fn asked(&self) {
        self.ask.notified().await;
    }

    /// The member has left (or ended on its own): [`wait_left`](Self::wait_left) returns.
    pub fn left(&self) {
        // `send_replace`, not `send`: the value must stick even while nobody waits yet.
        self.left.send_replace(true);
    }

    /// Waits until the member has left.
    pub async fn wait_left(&self) {
        let mut left = self.left.subscribe();
        // The sender lives in `self`, so the channel cannot close while this waits.
        let _ = left.wait_for(|l| *l).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn an_ask_reaches_a_member_that_waits_later_and_close_sees_it_left() {
        let departure = Arc::new(Departure::new());
        assert!(!departure.is_asked());
        departure.ask(); // before the member waits
        let member = tokio::spawn({
            let departure = departure.clone();
            async move {
                while !departure.is_asked() {
                    departure.asked().await;
                }
                departure.left();
            }
        });
        departure.wait_left().await;
        assert!(departure.is_asked());
        member.await.expect("the member task panicked");
    }

    #[tokio::test]
    async fn a_member_that_left_before_anyone_waited_is_still_seen_as_left() {
        let departure = Departure::new();
        departure.left(); // e.g. ended by a fatal error, nobody closing yet
        departure.wait_left().await;
    }
}
