//! Duplicate detection by stable event id.
//!
//! Delivery is at least once. The engine asks the store before handling a message and records
//! its id once it is finished (handled or dead-lettered), so a redelivered or re-published
//! event is skipped. The in-memory store forgets the oldest ids past its capacity and does not
//! survive a restart; external side effects still need idempotent downstream services.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use async_trait::async_trait;
use bytes::Bytes;

use crate::message::EventId;

/// Remembers which events were finished.
#[async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    /// True when `id` was finished before.
    async fn contains(&self, id: &EventId) -> bool;
    /// Records `id` as finished.
    async fn insert(&self, id: EventId);
}

/// A shared store (e.g. one store for engines that replace each other in one process).
#[async_trait]
impl<S: IdempotencyStore + ?Sized> IdempotencyStore for std::sync::Arc<S> {
    async fn contains(&self, id: &EventId) -> bool {
        (**self).contains(id).await
    }

    async fn insert(&self, id: EventId) {
        (**self).insert(id).await
    }
}

/// A bounded in-memory store: the newest `capacity` ids, split over independently locked
/// stripes so parallel shards rarely contend.
pub struct MemoryIdempotencyStore {
    stripes: Box<[Mutex<Stripe>]>,
    hasher: foldhash::fast::FixedState,
}

#[derive(Default)]
struct Stripe {
    ids: HashSet<EventId, foldhash::fast::RandomState>,
    order: VecDeque<EventId>,
    capacity: usize,
}

const STRIPES: usize = 16;

impl MemoryIdempotencyStore {
    /// A store remembering about `capacity` ids (at least one per stripe).
    pub fn new(capacity: usize) -> Self {
        let per_stripe = capacity.div_ceil(STRIPES).max(1);
        MemoryIdempotencyStore {
            stripes: (0..STRIPES)
                .map(|_| {
                    Mutex::new(Stripe {
                        capacity: per_stripe,
                        ..Stripe::default()
                    })
                })
                .collect(),
            hasher: foldhash::fast::FixedState::with_seed(0x1de),
        }
    }

    fn stripe(&self, id: &EventId) -> std::sync::MutexGuard<'_, Stripe> {
        use std::hash::BuildHasher;
        let i = (self.hasher.hash_one(id) as usize) % self.stripes.len();
        // A poisoned stripe only means another thread panicked mid-insert; the set is still usable.
        self.stripes[i].lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Default for MemoryIdempotencyStore {
    fn default() -> Self {
        MemoryIdempotencyStore::new(100_000)
    }
}

#[async_trait]
impl IdempotencyStore for MemoryIdempotencyStore {
    async fn contains(&self, id: &EventId) -> bool {
        self.stripe(id).ids.contains(id)
    }

    async fn insert(&self, id: EventId) {
        // Own just the id's bytes: a header value is usually a slice of the whole received
        // record, which the store would otherwise keep alive for as long as it remembers the id.
        let id = match id {
            EventId::Header(bytes) => EventId::Header(Bytes::copy_from_slice(&bytes)),
            position => position,
        };
        let mut s = self.stripe(&id);
        if s.ids.insert(id.clone()) {
            s.order.push_back(id);
            if s.order.len() > s.capacity {
                if let Some(old) = s.order.pop_front() {
                    s.ids.remove(&old);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::SourceId;

    #[tokio::test]
    async fn remembers_and_forgets_the_oldest_past_capacity() {
        let store = MemoryIdempotencyStore::new(STRIPES * 2);
        let a = EventId::Header(Bytes::from_static(b"a"));
        assert!(!store.contains(&a).await);
        store.insert(a.clone()).await;
        store.insert(a.clone()).await;
        assert!(store.contains(&a).await);
        for i in 0..10_000 {
            store.insert(EventId::Position(SourceId::new("s"), i)).await;
        }
        assert!(!store.contains(&a).await, "bounded: the oldest id was evicted");
        assert!(
            store
                .contains(&EventId::Position(SourceId::new("s"), 9_999))
                .await
        );
        let held: usize = store.stripes.iter().map(|s| s.lock().unwrap().ids.len()).sum();
        assert!(held <= STRIPES * 2);
    }

    #[tokio::test]
    async fn keeps_only_the_id_bytes_never_the_record_they_were_sliced_from() {
        let store = MemoryIdempotencyStore::new(100);
        // A received record: key, a 64 KiB payload and the event id header in one buffer.
        let mut record = vec![0u8; 64 << 10];
        record.extend_from_slice(b"evt-1");
        let record = Bytes::from(record);
        let id = record.slice(64 << 10..);
        store.insert(EventId::Header(id)).await;
        assert!(
            store
                .contains(&EventId::Header(Bytes::from_static(b"evt-1")))
                .await
        );
        // The store holds no reference into the record: the caller's handle is the only one.
        assert!(
            record.try_into_mut().is_ok(),
            "the store pins the whole 64 KiB record for a 5-byte id"
        );
    }
}
