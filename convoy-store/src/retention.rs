//! How long and how many finished ids a store keeps. An id is needed as long as its message can
//! come again: redelivered (until its source's commit passed it), re-published by its producer,
//! or replayed from the dead-letter destination. Past that it only costs space.

use std::time::Duration;

/// The ids a store keeps: the newest `max_ids`, none older than `max_age`. The oldest go first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retention {
    /// Ids finished longer ago than this are forgotten; `None`: no limit by age.
    pub max_age: Option<Duration>,
    /// At most this many ids are kept; `None`: no limit by count.
    pub max_ids: Option<u64>,
}

impl Default for Retention {
    /// Seven days and ten million ids: longer than a dead-letter destination's usual retention,
    /// a few hundred megabytes of disk.
    fn default() -> Self {
        Retention {
            max_age: Some(Duration::from_secs(7 * 24 * 3600)),
            max_ids: Some(10_000_000),
        }
    }
}

impl Retention {
    /// Keeps ids no older than `max_age`.
    pub fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = Some(max_age);
        self
    }

    /// Keeps at most `max_ids` ids.
    pub fn max_ids(mut self, max_ids: u64) -> Self {
        self.max_ids = Some(max_ids);
        self
    }

    /// Keeps every id (the file grows with every message).
    pub fn unlimited() -> Self {
        Retention {
            max_age: None,
            max_ids: None,
        }
    }
}
