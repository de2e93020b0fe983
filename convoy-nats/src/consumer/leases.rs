//! This member's leases — on partitions, on its presence, on an extra token — as entries of the
//! group's leases bucket, whose entries the server expires `lease_ttl` after their last write.
//!
//! Taking one is `create` (refused while anyone holds it), renewing is `update` against the
//! revision this member wrote last (refused once anyone else wrote), releasing is a delete
//! against that revision. Renewals follow convoy-core's [`LeaseTerms`] with lifetime `ttl`, like
//! every lease convoy keeps: on their own task every `ttl / 5`, whatever the member is doing (a
//! handover may wait a minute for the engine); a lease counts as held until `ttl · 2/3` after
//! the *send* time of its last successful write — the server's expiry is `ttl` after it
//! *stored* that write, later still, so this member always stops before anyone else can take
//! the key. Past that point the lease is reported lost and never renewed again — a partition's
//! straight to the engine (`Lost`), whatever the member task is waiting for. Validity counts
//! suspended time too ([`convoy_core::transport::clock`]), and a renewal far later than due
//! gives every lease up. What remains assumed: the server's clock does not step forward by
//! more than a third of `ttl` (that would expire a lease before this member stops).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::kv::{CreateErrorKind, Operation, Store, UpdateErrorKind};
use bytes::Bytes;
use convoy_core::transport::clock::Tick;
use convoy_core::transport::{EventSender, LeaseTerms, Renewal};
use convoy_core::transport::{Lease, SourceEvent};
use convoy_core::{SourceId, TransportError};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::error::nats_error;

/// A key whose lease was lost, with the partition it was for, if it was one.
pub(super) type LostKey = (String, Option<SourceId>);

struct Held {
    revision: u64,
    lease: Lease,
    /// The partition the lease is for, if it is one.
    source: Option<SourceId>,
}

/// The leases of one member.
pub(super) struct Leases {
    store: Store,
    /// What this member writes in every key it holds: its id.
    owner: Bytes,
    terms: LeaseTerms,
    held: Mutex<HashMap<String, Held>>,
    lost: mpsc::UnboundedSender<LostKey>,
    events: EventSender,
}

impl Leases {
    /// Member `me`'s leases in `store` (expiring after `ttl`); keys lost are sent to `lost`, and the
    /// partitions among them to the engine through `events`.
    pub fn new(
        store: Store,
        me: u64,
        ttl: Duration,
        lost: mpsc::UnboundedSender<LostKey>,
        events: EventSender,
    ) -> Self {
        Leases {
            store,
            owner: Bytes::from(format!("{me:016x}")),
            terms: LeaseTerms::new(ttl),
            held: Mutex::default(),
            lost,
            events,
        }
    }

    fn held(&self) -> MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True while `key` is held.
    pub fn holds(&self, key: &str) -> bool {
        self.held().get(key).is_some_and(|h| h.lease.is_valid())
    }

    /// The bucket.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Takes `key` if nobody holds it: its lease, or `None` when it is someone else's. The lease
    /// of a partition names its `source`.
    ///
    /// A key whose entry is still this member's own — a lease it lost here (the server was
    /// away longer than the lease's validity here, shorter than its lifetime there) — is taken
    /// back by compare-and-set on that entry's revision: nobody can have written it since, and
    /// waiting for the server to expire it left partitions idle for most of a lease's lifetime
    /// after a server restart.
    pub async fn acquire(
        &self,
        key: &str,
        source: Option<SourceId>,
    ) -> Result<Option<Lease>, TransportError> {
        let sent = Instant::now();
        let written = match self.store.create(key, self.owner.clone()).await {
            Ok(revision) => Some(revision),
            Err(e) if e.kind() == CreateErrorKind::AlreadyExists => self.take_back(key).await?,
            Err(e) => return Err(nats_error(&format!("taking the lease {key}"), e)),
        };
        match written {
            Some(revision) => {
                let lease = self.terms.lease(sent);
                self.held().insert(
                    key.to_owned(),
                    Held {
                        revision,
                        lease: lease.clone(),
                        source,
                    },
                );
                Ok(Some(lease))
            }
            None => Ok(None),
        }
    }

    /// Writes `key` again if its entry is this member's own (the revision written), `None` when
    /// it is someone else's or changed meanwhile.
    async fn take_back(&self, key: &str) -> Result<Option<u64>, TransportError> {
        let entry = self
            .store
            .entry(key)
            .await
            .map_err(|e| nats_error(&format!("reading the lease {key}"), e))?;
        let Some(entry) = entry.filter(|e| e.operation == Operation::Put && e.value == self.owner) else {
            return Ok(None);
        };
        match self.store.update(key, self.owner.clone(), entry.revision).await {
            Ok(revision) => {
                tracing::info!(
                    key,
                    "took back a lease of this member's that the server still held"
                );
                Ok(Some(revision))
            }
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(nats_error(&format!("taking back the lease {key}"), e)),
        }
    }

    /// Gives `key` up: it ends here at once, and anyone may take it right away.
    pub async fn release(&self, key: &str) {
        let Some(held) = self.held().remove(key) else {
            return;
        };
        held.lease.expire();
        if let Err(e) = self.store.delete_expect_revision(key, Some(held.revision)).await {
            // Someone else's by now, or the server is away: it expires by itself.
            tracing::debug!(key, error = %e, "releasing a lease");
        }
    }

    /// Gives `key` up at once and says so: it ends here, is released for another member to
    /// take, and — a partition's — is reported lost to the engine and the member.
    pub async fn give_up(&self, key: &str) {
        let Some(held) = self.held().remove(key) else {
            return;
        };
        held.lease.expire();
        if let Err(e) = self.store.delete_expect_revision(key, Some(held.revision)).await {
            tracing::debug!(key, error = %e, "releasing a lease given up (it expires by itself)");
        }
        if let Some(source) = &held.source {
            let _ = self.events.control(SourceEvent::Lost(vec![source.clone()]));
        }
        let _ = self.lost.send((key.to_owned(), held.source));
    }

    /// Ends every lease here now; they stay listed for `give_up` or `release`.
    fn expire_all(&self) {
        for held in self.held().values() {
            held.lease.expire();
        }
    }

    /// Every key held (the member's leave releases them all).
    pub fn keys(&self) -> Vec<String> {
        self.held().keys().cloned().collect()
    }

    /// Renews every lease, all at once; reports those that ran out or that someone else took.
    pub async fn renew_all(&self) {
        let due: Vec<(String, Bytes, u64, Lease)> = self
            .held()
            .iter()
            .map(|(k, h)| (k.clone(), self.owner.clone(), h.revision, h.lease.clone()))
            .collect();
        let renewals = due.into_iter().map(|(key, value, revision, lease)| async move {
            let renewal = self
                .terms
                .renew(&lease, self.store.update(key.as_str(), value, revision))
                .await;
            (key, lease, renewal)
        });
        for (key, lease, renewal) in futures_util::future::join_all(renewals).await {
            match renewal {
                Renewal::Renewed(revision) => {
                    if let Some(h) = self.held().get_mut(&key).filter(|h| h.lease == lease) {
                        h.revision = revision;
                    }
                }
                Renewal::Refused(e) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                    tracing::warn!(key, "lease taken by another member (it expired here first)");
                    lease.expire();
                }
                Renewal::Refused(e) => tracing::warn!(key, error = %e, "renewing a lease failed; retrying"),
                Renewal::Expired => tracing::warn!(key, "renewing a lease timed out"),
            }
        }
        self.report_expired();
    }

    /// Forgets and reports every lease that ran out.
    fn report_expired(&self) {
        let expired: Vec<(String, Option<SourceId>)> = {
            let mut held = self.held();
            let keys: Vec<String> = held
                .iter()
                .filter(|(_, h)| !h.lease.is_valid())
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter()
                .filter_map(|k| held.remove(&k).map(|h| (k, h.source)))
                .collect()
        };
        let sources: Vec<SourceId> = expired.iter().filter_map(|(_, s)| s.clone()).collect();
        if !sources.is_empty() {
            tracing::warn!(
                ?sources,
                "partitions lost: this member could not renew their leases in time"
            );
            let _ = self.events.control(SourceEvent::Lost(sources));
        }
        for lost in expired {
            let _ = self.lost.send(lost);
        }
    }
}

/// Renews `leases` until the receiver of its lost keys is gone (the member ended). A renewal
/// that comes later than a third of the lifetime after it was due (the process frozen, the host
/// suspended) gives every lease up first: the server may have expired them meanwhile.
pub(super) async fn keep(leases: Arc<Leases>) {
    let mut renewals = leases.terms.renewals();
    while !leases.lost.is_closed() {
        if let Tick::Late(gap) = renewals.tick().await {
            tracing::warn!(
                ?gap,
                "lease renewals stalled (a frozen process or a suspended host): every lease is lost"
            );
            leases.expire_all(); // at once, before the deletes' round trips
            for key in leases.keys() {
                leases.give_up(&key).await;
            }
        }
        leases.renew_all().await;
    }
}
