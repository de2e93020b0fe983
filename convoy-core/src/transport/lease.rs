//! Leases: how long a transport may still act for a source it holds by lease rather than by the
//! broker's assignment (NATS: a key-value entry the member renews before the bucket expires it).
//!
//! The engine starts no handler attempt of a source whose lease has run out, whatever else is
//! queued or retrying: a member frozen past its lease (a long pause, SIGSTOP, a cut network)
//! never handles another message of a partition another member may own by now, even if its
//! tasks wake up in any order. Expiry is final — a lease that ran out is never extended again;
//! the transport reports the source lost and assigns it anew, with a new lease, if it wins it
//! back. Validity is counted on a [`Mark`]: time the host spent suspended counts as well.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::clock::Mark;

/// A source's lease; clones share it. The transport extends it on every renewal.
#[derive(Clone, Debug)]
pub struct Lease(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// When the lease was made, on both clocks (`valid_until` is on the runtime's).
    mark: Mark,
    base: Instant,
    /// Valid until `base` plus this many nanoseconds.
    until: AtomicU64,
}

impl Lease {
    /// A lease valid until `until`.
    pub fn new(until: Instant) -> Self {
        let (mark, base) = (Mark::now(), Instant::now());
        Lease(Arc::new(Inner {
            mark,
            base,
            until: AtomicU64::new(nanos(until.saturating_duration_since(base))),
        }))
    }

    /// Extends the lease to `until` (never shortens it). Returns false, changing nothing, when
    /// it has already run out: expiry is final.
    pub fn extend(&self, until: Instant) -> bool {
        let wanted = nanos(until.saturating_duration_since(self.0.base));
        self.0
            .until
            .fetch_update(SeqCst, SeqCst, |current| {
                (self.elapsed() < current).then_some(current.max(wanted))
            })
            .is_ok()
    }

    /// Ends the lease now (the source was handed over or lost).
    pub fn expire(&self) {
        self.0.until.store(0, SeqCst);
    }

    /// True until the lease runs out.
    pub fn is_valid(&self) -> bool {
        self.elapsed() < self.0.until.load(SeqCst)
    }

    /// When the lease runs out, unless extended.
    pub fn valid_until(&self) -> Instant {
        self.0.base + Duration::from_nanos(self.0.until.load(SeqCst))
    }

    fn elapsed(&self) -> u64 {
        nanos(self.0.mark.elapsed())
    }
}

impl PartialEq for Lease {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Lease {}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_lease_runs_out_and_is_never_extended_after() {
        let lease = Lease::new(Instant::now() + Duration::from_secs(2));
        assert!(lease.is_valid());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(lease.extend(Instant::now() + Duration::from_secs(2)));
        let until = lease.valid_until();
        assert!(lease.extend(Instant::now()));
        assert_eq!(lease.valid_until(), until, "never shortened");
        tokio::time::advance(Duration::from_millis(1999)).await;
        assert!(lease.is_valid());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!lease.is_valid());
        assert!(
            !lease.extend(Instant::now() + Duration::from_secs(60)),
            "expiry is final"
        );
        assert!(!lease.is_valid());
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_lease_stays_expired() {
        let lease = Lease::new(Instant::now() + Duration::from_secs(60));
        let clone = lease.clone();
        lease.expire();
        assert!(!clone.is_valid());
        assert!(!clone.extend(Instant::now() + Duration::from_secs(60)));
        assert_eq!(lease, clone);
    }
}
