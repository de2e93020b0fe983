//! Duplicate detection by stable event id.
//!
//! Delivery is at least once. The engine asks the store before handling a message and records
//! its id once it is finished (handled or dead-lettered), so a redelivered or re-published
//! event is skipped. The in-memory store forgets the oldest ids past its capacity and does not
//! survive a restart; external side effects still need idempotent downstream services.

use std::any::Any;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use hashbrown::HashTable;

use crate::message::{EventId, IdRef};

mod positions;

use positions::Sources;

/// Remembers which events were finished.
///
/// A store that answers from memory can also answer without waiting (`contains_now`,
/// `insert_now`): the engine then skips the asynchronous calls, which box a future each.
#[async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    /// True when `id` was finished before.
    async fn contains(&self, id: &EventId) -> bool;
    /// Records `id` as finished.
    async fn insert(&self, id: EventId);

    /// `Some(answer)` if the store can tell at once whether `id` was finished; `None` (the
    /// default) makes the engine await [`contains`](IdempotencyStore::contains).
    fn contains_now(&self, _id: &EventId) -> Option<bool> {
        None
    }

    /// Records `id` at once if the store can (`Ok`); `Err(id)` (the default) makes the engine
    /// await [`insert`](IdempotencyStore::insert) with it.
    fn insert_now(&self, id: EventId) -> Result<(), EventId> {
        Err(id)
    }
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

    fn contains_now(&self, id: &EventId) -> Option<bool> {
        (**self).contains_now(id)
    }

    fn insert_now(&self, id: EventId) -> Result<(), EventId> {
        (**self).insert_now(id)
    }
}

/// A bounded in-memory store of the newest ids, split over independently locked stripes (so
/// parallel shards rarely contend). Each id is hashed once per call: the hash picks the stripe
/// and is the stripe table's hash too.
///
/// - Ids of their own (the `convoy-event-id` header): the newest `capacity`, each stripe
///   keeping its share in a ring in insertion order indexed by hash with four-byte slots, so
///   the random probes of a lookup, an insert and the eviction of the oldest id touch a small
///   table that stays in cache. (With the ids inside the table, 100,000 of 48 bytes, the
///   eviction's probe missed the cache for every id recorded.)
/// - Ids derived from a position (source, offset), what a message has that its producer did not
///   stamp (a producer other than convoy's, `without_stamps`, the memory broker): per source,
///   every finished offset among its newest 16,384 and up to 1,024 runs of finished offsets
///   below them (a gapless stretch of any length is one run), for up to 1,024 sources, the one
///   recorded into longest ago forgotten first. Recording one sets a bit in a word the
///   source's previous messages just set bits in; kept in the ring instead, it cost three
///   random probes into memory out of cache — measured as 30 % of the in-memory scenario's
///   throughput.
pub struct MemoryIdempotencyStore {
    stripes: Box<[Mutex<Stripe>]>,
    positions: Box<[Mutex<Sources>]>,
    hasher: foldhash::fast::FixedState,
}

/// Sources whose position ids a store keeps.
const SOURCES: usize = 1024;

/// An id as the store keeps it: its own bytes, never a slice of the received record the id came
/// from (which it would keep alive as long as it remembers the id), and inline when short — a
/// generated event id (32 hex digits) or a UUID costs no allocation.
enum Stored {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<[u8]>),
}

const INLINE: usize = 38;

impl Stored {
    fn of(id: &[u8]) -> Self {
        if id.len() <= INLINE {
            let mut bytes = [0; INLINE];
            bytes[..id.len()].copy_from_slice(id);
            Stored::Inline {
                len: id.len() as u8,
                bytes,
            }
        } else {
            Stored::Heap(id.into())
        }
    }

    fn matches(&self, id: &[u8]) -> bool {
        match self {
            Stored::Inline { len, bytes } => &bytes[..usize::from(*len)] == id,
            Stored::Heap(own) => own.as_ref() == id,
        }
    }
}

struct Stripe {
    /// Where in `ring` each id held is, by the id's hash: four bytes a slot, so the probes of
    /// every lookup stay in cache; the ring is read only for a slot whose tag matches. An id
    /// overwritten in the ring leaves its entry behind, pointing at a slot that now holds
    /// another id: lookups compare the slot's hash and id, so it matches nothing. (Removing it
    /// at once cost a probe for the oldest id's bucket, long out of cache: 12 % of the worker
    /// threads' samples in a Kafka drain's profile.)
    index: HashTable<u32>,
    /// The ids held (with their hashes) in insertion order: a ring of `share` slots, the
    /// oldest overwritten first.
    ring: Vec<(u64, Stored)>,
    /// The oldest slot once the ring is full: where the next id goes.
    next: usize,
    share: usize,
    /// Entries of `index` left behind by overwritten ids: at `share` of them the index is built
    /// again from the ring, so it never holds more than twice the share.
    stale: usize,
}

impl Stripe {
    /// Room for the whole share is reserved at once: a store that grows while it fills rehashes
    /// its index and moves its ring under the stripe's lock, stalling every lane that waits on
    /// it — on each of the first `capacity` messages' way to the steady state. (The ring's pages
    /// become resident only as ids are written to them.)
    fn new(share: usize) -> Self {
        let share = share.clamp(1, (u32::MAX / 2) as usize);
        Stripe {
            // Live and stale entries together stay below twice the share: the index never
            // grows, and never moves an entry (a move would rehash a stale one by its slot's
            // new id — harmless, but a rehash under the lock all the same).
            index: HashTable::with_capacity(2 * share),
            ring: Vec::with_capacity(share),
            next: 0,
            share,
            stale: 0,
        }
    }

    fn contains(&self, hash: u64, id: &[u8]) -> bool {
        let ring = &self.ring;
        self.index
            .find(hash, |&at| {
                let (h, held) = &ring[at as usize];
                *h == hash && held.matches(id)
            })
            .is_some()
    }

    fn insert(&mut self, hash: u64, id: &[u8]) {
        if !self.contains(hash, id) {
            self.insert_absent(hash, id);
        }
    }

    /// Records an id its caller just found absent. Should another caller have recorded the same
    /// id in between, the ring holds it twice until the older copy is overwritten; lookups and
    /// evictions (by ring slot) answer the same.
    fn insert_absent(&mut self, hash: u64, id: &[u8]) {
        let entry = (hash, Stored::of(id));
        let at = if self.ring.len() < self.share {
            self.ring.push(entry);
            self.ring.len() - 1
        } else {
            // Forget the oldest id: overwritten in the ring, which is walked in order; its
            // index entry is left behind, stale.
            let at = self.next;
            self.next = (at + 1) % self.share;
            self.ring[at] = entry;
            self.stale += 1;
            if self.stale >= self.share {
                self.rebuild();
                return;
            }
            at
        };
        let ring = &self.ring;
        self.index.insert_unique(hash, at as u32, |&q| ring[q as usize].0);
    }

    /// Builds the index again from the ring: one entry per id held, none stale. Every `share`
    /// ids, in order through a table that stays in cache while it is built.
    fn rebuild(&mut self) {
        self.index.clear();
        let ring = &self.ring;
        for (at, (hash, _)) in ring.iter().enumerate() {
            self.index
                .insert_unique(*hash, at as u32, |&q| ring[q as usize].0);
        }
        self.stale = 0;
    }
}

const STRIPES: usize = 16;

impl MemoryIdempotencyStore {
    /// A store remembering about the newest `capacity` ids (spread over its stripes by hash,
    /// at least one per stripe).
    pub fn new(capacity: usize) -> Self {
        let per_stripe = capacity.div_ceil(STRIPES).max(1);
        MemoryIdempotencyStore {
            stripes: (0..STRIPES)
                .map(|_| Mutex::new(Stripe::new(per_stripe)))
                .collect(),
            positions: (0..STRIPES)
                .map(|_| Mutex::new(Sources::new(SOURCES / STRIPES)))
                .collect(),
            hasher: foldhash::fast::FixedState::with_seed(0x1de),
        }
    }
}

/// The stripe of `hash` in `stripes`, locked.
fn locked<T>(stripes: &[Mutex<T>], hash: u64) -> MutexGuard<'_, T> {
    // Middle bits pick the stripe: the table inside uses the low bits (bucket) and the top
    // seven (tag), which must stay spread within a stripe.
    let i = (hash >> 32) as usize % stripes.len();
    // A poisoned stripe only means another thread panicked mid-insert; the set is still usable.
    stripes[i].lock().unwrap_or_else(|p| p.into_inner())
}

impl Default for MemoryIdempotencyStore {
    fn default() -> Self {
        MemoryIdempotencyStore::new(100_000)
    }
}

#[async_trait]
impl IdempotencyStore for MemoryIdempotencyStore {
    async fn contains(&self, id: &EventId) -> bool {
        self.contains_id(id.into())
    }

    async fn insert(&self, id: EventId) {
        self.insert_id((&id).into());
    }

    fn contains_now(&self, id: &EventId) -> Option<bool> {
        Some(self.contains_id(id.into()))
    }

    fn insert_now(&self, id: EventId) -> Result<(), EventId> {
        self.insert_id((&id).into());
        Ok(())
    }
}

/// The engine's fast path: an id borrowed from its message, hashed once for the check and the
/// record — no clone of the id (whose reference count lives in the received record's buffer,
/// last written by the thread that read it) and one hash instead of two.
impl MemoryIdempotencyStore {
    /// The hash of a header id, or of a position id's source (which finds the source's set).
    pub(crate) fn hash(&self, id: IdRef<'_>) -> u64 {
        match id {
            IdRef::Header(id) => self.hasher.hash_one(&id[..]),
            IdRef::Position(source, _) => self.hasher.hash_one(source.as_str()),
        }
    }

    pub(crate) fn contains_hashed(&self, hash: u64, id: IdRef<'_>) -> bool {
        match id {
            IdRef::Header(id) => locked(&self.stripes, hash).contains(hash, id),
            IdRef::Position(source, offset) => locked(&self.positions, hash).contains(hash, source, offset),
        }
    }

    pub(crate) fn insert_hashed(&self, hash: u64, id: IdRef<'_>) {
        match id {
            IdRef::Header(id) => locked(&self.stripes, hash).insert(hash, id),
            IdRef::Position(source, offset) => locked(&self.positions, hash).insert(hash, source, offset),
        }
    }

    /// [`insert_hashed`](Self::insert_hashed) for an id [`contains_hashed`](Self::contains_hashed)
    /// just answered `false` for (a lane records what it checked before handling): a header id
    /// is not looked up a second time.
    pub(crate) fn insert_checked(&self, hash: u64, id: IdRef<'_>) {
        match id {
            IdRef::Header(id) => locked(&self.stripes, hash).insert_absent(hash, id),
            IdRef::Position(source, offset) => locked(&self.positions, hash).insert(hash, source, offset),
        }
    }

    fn contains_id(&self, id: IdRef<'_>) -> bool {
        self.contains_hashed(self.hash(id), id)
    }

    fn insert_id(&self, id: IdRef<'_>) {
        self.insert_hashed(self.hash(id), id);
    }
}

/// The store an engine records ids in: its own in-memory kind is called directly, any other
/// through the trait.
#[derive(Clone)]
pub(crate) enum Idempotency {
    Memory(Arc<MemoryIdempotencyStore>),
    Custom(Arc<dyn IdempotencyStore>),
}

impl Idempotency {
    /// `store`, recognised when it is (a shared) [`MemoryIdempotencyStore`].
    pub(crate) fn of<S: IdempotencyStore>(store: S) -> Self {
        let store = Arc::new(store);
        let any: Arc<dyn Any + Send + Sync> = store.clone();
        if let Ok(memory) = any.clone().downcast::<MemoryIdempotencyStore>() {
            return Idempotency::Memory(memory);
        }
        if let Ok(shared) = any.downcast::<Arc<MemoryIdempotencyStore>>() {
            return Idempotency::Memory(Arc::clone(&shared));
        }
        Idempotency::Custom(store)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::SourceId;
    use crate::message::{Message, EVENT_ID_HEADER};
    use bytes::Bytes;

    /// The header id numbered `i`.
    fn evt(i: usize) -> Bytes {
        Bytes::from(format!("evt-{i}"))
    }

    #[tokio::test]
    async fn remembers_and_forgets_the_oldest_past_capacity() {
        let store = MemoryIdempotencyStore::new(STRIPES * 2);
        let a = EventId::Header(Bytes::from_static(b"a"));
        assert!(!store.contains(&a).await);
        store.insert(a.clone()).await;
        store.insert(a.clone()).await;
        assert!(store.contains(&a).await);
        let id = |i: usize| EventId::Header(evt(i));
        for i in 0..10_000 {
            store.insert(id(i)).await;
        }
        assert!(!store.contains(&a).await, "bounded: the oldest id was evicted");
        assert!(store.contains(&id(9_999)).await);
        let held: usize = store.stripes.iter().map(|s| s.lock().unwrap().ring.len()).sum();
        assert!(held <= STRIPES * 2, "bounded: {held} ids held");
    }

    #[test]
    fn a_stripe_remembers_exactly_its_newest_share() {
        let store = MemoryIdempotencyStore::new(STRIPES);
        let mut stripe = Stripe::new(16);
        let (id, hash) = (evt, |i: usize| store.hash(IdRef::Header(&evt(i))));
        for i in 0..1_000 {
            stripe.insert(hash(i), &id(i));
            stripe.insert(hash(i), &id(i)); // a repeat is not a new id
            assert_eq!(stripe.ring.len(), (i + 1).min(16));
            assert!(
                stripe.index.len() < 2 * 16,
                "the index holds {}",
                stripe.index.len()
            );
            for newer in i.saturating_sub(15)..=i {
                assert!(
                    stripe.contains(hash(newer), &id(newer)),
                    "{newer} forgotten at {i}"
                );
            }
        }
        for older in 0..984 {
            assert!(!stripe.contains(hash(older), &id(older)));
        }
    }

    #[test]
    fn an_id_recorded_twice_unchecked_answers_until_its_newer_copy_is_overwritten() {
        let store = MemoryIdempotencyStore::new(STRIPES);
        let mut stripe = Stripe::new(4);
        let (id, hash) = (evt, |i: usize| store.hash(IdRef::Header(&evt(i))));
        // Two lanes checked id 0, found it absent, and both recorded it.
        stripe.insert_absent(hash(0), &id(0));
        stripe.insert_absent(hash(0), &id(0));
        for i in 1..=3 {
            stripe.insert(hash(i), &id(i));
        }
        assert_eq!(stripe.ring.len(), 4, "bounded by the ring");
        assert!(stripe.contains(hash(0), &id(0)), "the newer copy is held");
        stripe.insert(hash(4), &id(4));
        assert!(!stripe.contains(hash(0), &id(0)), "both copies overwritten");
        assert!((1..=4).all(|i| stripe.contains(hash(i), &id(i))));
    }

    #[tokio::test]
    async fn position_ids_are_held_per_source_past_the_capacity_of_header_ids() {
        let store = MemoryIdempotencyStore::new(STRIPES);
        let (s0, s1) = (SourceId::new("t/0"), SourceId::new("t/1"));
        // Finished out of order, with a gap (offset 500 of t/0 never finished here).
        for offset in (0..100_000u64).rev().filter(|&o| o != 500) {
            store.insert(EventId::Position(s0.clone(), offset)).await;
        }
        store.insert(EventId::Position(s1.clone(), 7)).await;
        for offset in [0, 499, 501, 99_999] {
            assert!(
                store.contains(&EventId::Position(s0.clone(), offset)).await,
                "{offset}"
            );
        }
        for offset in [500, 100_000] {
            assert!(
                !store.contains(&EventId::Position(s0.clone(), offset)).await,
                "{offset}"
            );
        }
        assert!(store.contains(&EventId::Position(s1.clone(), 7)).await);
        assert!(!store.contains(&EventId::Position(s1, 8)).await);
        assert!(
            !store
                .contains(&EventId::Header(Bytes::from_static(b"t/0@7")))
                .await,
            "a header id is never a position"
        );
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

    #[tokio::test]
    async fn the_engines_borrowed_ids_and_owned_ids_find_each_other() {
        let store = MemoryIdempotencyStore::new(1_000);
        let mut headers = crate::message::Headers::new();
        headers.append(EVENT_ID_HEADER, "0123456789abcdef0123456789abcdef");
        let stamped = Message {
            key: None,
            payload: Bytes::new(),
            headers,
            source: SourceId::new("t/0"),
            offset: 3,
        };
        let plain = Message {
            headers: crate::message::Headers::new(),
            offset: 4,
            ..stamped.clone()
        };
        let id = IdRef::of(&stamped);
        assert!(matches!(id, IdRef::Header(_)));
        store.insert_hashed(store.hash(id), id);
        assert!(store.contains(&stamped.event_id()).await);
        assert!(!store.contains(&plain.event_id()).await);
        store.insert(plain.event_id()).await;
        let id = IdRef::of(&plain);
        assert!(matches!(id, IdRef::Position(_, 4)));
        assert!(store.contains_hashed(store.hash(id), id));
        assert_eq!(id.to_string(), plain.event_id().to_string());
    }

    #[test]
    fn an_engine_recognises_its_own_store_shared_or_not() {
        struct Elsewhere;
        #[async_trait]
        impl IdempotencyStore for Elsewhere {
            async fn contains(&self, _id: &EventId) -> bool {
                false
            }
            async fn insert(&self, _id: EventId) {}
        }
        assert!(matches!(
            Idempotency::of(MemoryIdempotencyStore::new(10)),
            Idempotency::Memory(_)
        ));
        let shared = Arc::new(MemoryIdempotencyStore::new(10));
        assert!(
            matches!(Idempotency::of(shared.clone()), Idempotency::Memory(s) if Arc::ptr_eq(&s, &shared)),
            "a shared store stays the one store"
        );
        assert!(matches!(Idempotency::of(Elsewhere), Idempotency::Custom(_)));
    }

    #[tokio::test]
    async fn short_long_and_positional_ids_answer_the_same_at_once_and_awaited() {
        let store = MemoryIdempotencyStore::new(1_000);
        let short = EventId::Header(Bytes::from_static(b"0123456789abcdef0123456789abcdef"));
        let long = EventId::Header(Bytes::from(vec![b'x'; 200]));
        let longer = EventId::Header(Bytes::from(vec![b'x'; 201]));
        let at = EventId::Position(SourceId::new("t/0"), 7);
        for id in [&short, &long, &at] {
            assert_eq!(store.contains_now(id), Some(false));
            assert!(store.insert_now(id.clone()).is_ok());
            assert_eq!(store.contains_now(id), Some(true));
            assert!(store.contains(id).await);
        }
        assert!(
            !store.contains(&longer).await,
            "a longer id sharing a prefix is another id"
        );
        assert!(!store.contains(&EventId::Position(SourceId::new("t/1"), 7)).await);
        assert!(
            !store
                .contains(&EventId::Header(Bytes::from_static(b"t/0@7")))
                .await
        );
    }
}
