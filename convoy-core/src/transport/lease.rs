//! Leases: how long a transport may still act for a source it holds by lease rather than by the
//! broker's assignment (NATS: a key-value entry the member renews before the bucket expires it).
//!
//! The engine starts no handler attempt of a source whose lease has run out, whatever else is
//! queued or retrying: a member frozen past its lease (a long pause, SIGSTOP, a cut network)
//! never handles another message of a partition another member may own by now, even if its
//! tasks wake up in any order. Expiry is final — a lease that ran out is never extended again;
//! the transport reports the source lost and assigns it anew, with a new lease, if it wins it
//! back. Validity is counted on a [`Mark`]: time the host spent suspended counts as well.
//!
//! [`LeaseTerms`] is how every lease keeper (a NATS key, a RabbitMQ connection) renews: every
//! fifth of the broker's lifetime `L`, a round trip the broker answers only once it heard it
//! proves it alive at the round trip's *send* time, and the lease is extended to that time
//! `+ L · 2/3` — the broker expires it `L` after it last heard, later still, so the member
//! always stops first. A renewal not answered before the lease's end fails; a renewal tick
//! more than `L / 3` late (a frozen process, a suspended host) ends every lease the keeper
//! holds ([`Renewals`]).

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::clock::{Mark, Renewals};

/// How leases over a broker-side lifetime are kept (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTerms {
    lifetime: Duration,
}

/// The outcome of one renewal round trip.
#[derive(Debug)]
pub enum Renewal<T, E> {
    /// The broker answered in time: the lease was extended.
    Renewed(T),
    /// The broker refused (or the round trip failed): the lease was not extended.
    Refused(E),
    /// No answer before the lease ran out, or it had run out already: it is over.
    Expired,
}

impl LeaseTerms {
    /// Terms for a broker that expires a lease `lifetime` after it last heard from its holder.
    pub fn new(lifetime: Duration) -> Self {
        LeaseTerms { lifetime }
    }

    /// How often the keeper renews.
    pub fn renew_every(&self) -> Duration {
        self.lifetime / 5
    }

    /// How long after a proof's send time the lease counts as held.
    pub fn valid_for(&self) -> Duration {
        self.lifetime * 2 / 3
    }

    /// The keeper's ticks: every [`renew_every`](Self::renew_every), late when a third of the
    /// lifetime overdue.
    pub fn renewals(&self) -> Renewals {
        Renewals::new(self.renew_every(), self.lifetime / 3)
    }

    /// A lease proved by a round trip sent at `sent`.
    pub fn lease(&self, sent: Instant) -> Lease {
        Lease::new(sent + self.valid_for())
    }

    /// Runs one renewal round trip of `lease`, bounded by the lease's end; extends it from the
    /// round trip's send time when the broker answered.
    pub async fn renew<T, E>(
        &self,
        lease: &Lease,
        round_trip: impl std::future::Future<Output = Result<T, E>>,
    ) -> Renewal<T, E> {
        let sent = Instant::now();
        let left = lease.valid_until().saturating_duration_since(sent);
        match tokio::time::timeout(left, round_trip).await {
            Ok(Ok(answer)) if lease.extend(sent + self.valid_for()) => Renewal::Renewed(answer),
            Ok(Ok(_)) | Err(_) => Renewal::Expired,
            Ok(Err(e)) => Renewal::Refused(e),
        }
    }
}

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
    async fn a_renewal_extends_from_its_send_time_and_an_unanswered_one_expires_the_lease() {
        let terms = LeaseTerms::new(Duration::from_secs(9));
        assert_eq!(terms.renew_every(), Duration::from_millis(1800));
        let lease = terms.lease(Instant::now());
        assert_eq!(lease.valid_until(), Instant::now() + Duration::from_secs(6));
        tokio::time::advance(Duration::from_secs(2)).await;
        let sent = Instant::now();
        // The answer takes a second: validity counts from the send time, not the answer's.
        let answered = terms
            .renew(&lease, async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, ()>(7)
            })
            .await;
        assert!(matches!(answered, Renewal::Renewed(7)));
        assert_eq!(lease.valid_until(), sent + Duration::from_secs(6));
        let refused = terms
            .renew(&lease, async { Err::<(), _>("wrong revision") })
            .await;
        assert!(matches!(refused, Renewal::Refused("wrong revision")));
        assert!(lease.is_valid(), "a refusal alone does not end the lease");
        // A broker that never answers: the round trip is given up when the lease runs out.
        let silent = terms
            .renew(&lease, std::future::pending::<Result<(), ()>>())
            .await;
        assert!(matches!(silent, Renewal::Expired));
        assert!(!lease.is_valid());
        assert_eq!(Instant::now(), sent + Duration::from_secs(6));
        let late = terms.renew(&lease, async { Ok::<_, ()>(()) }).await;
        assert!(matches!(late, Renewal::Expired), "expiry is final");
    }

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
