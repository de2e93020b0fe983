//! [`RedbIdempotencyStore`]: finished event ids in one redb file, kept across restarts.
//!
//! The engine asks a store before every message and records every finished one, so the store
//! keeps the disk off a lane's way as far as it can:
//! - a lookup checks the ids recorded but not yet written, then reads in a read transaction (no
//!   lock on the writer) through redb's page cache: pages read once stay in memory, a lookup on a
//!   cold page (just after a restart) reads the local disk on the calling thread;
//! - a record goes to a writer thread of its own, which writes what arrived in one transaction
//!   and makes it durable (fsync) at most every [`SYNC_EVERY`], and on [`flush`] and drop (which
//!   waits for the writer: at most one batch and a sync).
//!
//! So a process killed without a goodbye loses the ids recorded since its last sync (about
//! [`SYNC_EVERY`], more if the writer had a backlog): their messages may run once more after the
//! restart, as they would without a store (delivery is at least once). A graceful stop loses
//! none. The trait has no error to return: a write that fails is logged and retried with the
//! next batch (the ids stay known to this process meanwhile), and a lookup that fails answers
//! "not seen", so the message runs — never a message skipped unhandled.
//!
//! Only ids of their own (the `convoy-event-id` header, a broker's message id) go to the file.
//! Ids derived from a position (source and offset: a foreign producer's message on Kafka or
//! JetStream) are kept in memory, as the in-memory store keeps them: a topic deleted and created
//! again starts its offsets over, and a position remembered across that would skip a new
//! message.
//!
//! Two tables: `ids` (id → sequence number) for lookups, `order` (sequence number → finish
//! time and id) so that [`Retention`] forgets the oldest first.
//!
//! [`flush`]: RedbIdempotencyStore::flush

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ::redb::{Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use async_trait::async_trait;
use convoy_core::{EventId, IdempotencyStore, MemoryIdempotencyStore};

use crate::key::encode;
use crate::retention::Retention;

/// Id → its sequence number.
const IDS: TableDefinition<'static, &[u8], u64> = TableDefinition::new("ids");
/// Sequence number → finish time (Unix ms, 8 bytes big-endian) followed by the id.
const ORDER: TableDefinition<'static, u64, &[u8]> = TableDefinition::new("order");

/// The longest a recorded id waits to be durable while messages keep finishing.
pub const SYNC_EVERY: Duration = Duration::from_millis(100);
/// Position ids kept in memory (per source, the in-memory store's own bounds apply too).
const POSITIONS: usize = 100_000;
/// Most ids written in one transaction.
const BATCH: usize = 4096;
/// Most old ids forgotten per transaction: a retention catching up after a long pause (or a
/// smaller limit) spreads over batches instead of stalling the writer.
const TRIM_PER_BATCH: usize = 2 * BATCH;

/// A store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The file could not be opened or created as a redb database.
    #[error(
        "cannot open the idempotency store {path}: {source} (is another process using it? one \
         process at a time opens a store file)"
    )]
    Open {
        /// The file.
        path: PathBuf,
        /// What redb said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What the writer thread is told.
enum Command {
    Record(Box<[u8]>),
    /// Make everything recorded so far durable, then answer whether it is.
    Flush(Sender<bool>),
}

/// What the store and its writer share.
struct Shared {
    db: Database,
    /// Ids recorded and not yet written: lookups see them at once.
    unwritten: Mutex<HashSet<Box<[u8]>>>,
    /// Writes (and syncs) that failed.
    failures: AtomicU64,
    retention: Retention,
    clock: Clock,
}

/// The wall clock a store stamps ids with (a test's own, to try retention by age).
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// Finished event ids in a redb file, kept across restarts (see the [module](self) documentation).
///
/// ```no_run
/// # fn demo() -> Result<(), convoy_store::StoreError> {
/// use convoy_store::{RedbIdempotencyStore, Retention};
/// use std::time::Duration;
/// let store = RedbIdempotencyStore::open(
///     "/var/lib/billing/convoy-ids.redb",
///     Retention::default().max_age(Duration::from_secs(3 * 24 * 3600)),
/// )?;
/// // Engine::builder(handler).idempotency_store(store) …
/// # Ok(()) }
/// ```
pub struct RedbIdempotencyStore {
    shared: Arc<Shared>,
    /// Ids derived from positions: in memory only (see the [module](self) documentation).
    positions: MemoryIdempotencyStore,
    commands: Option<Sender<Command>>,
    writer: Option<JoinHandle<()>>,
}

impl RedbIdempotencyStore {
    /// Opens the store in `path`, creating it if there is none. One process at a time.
    pub fn open(path: impl AsRef<Path>, retention: Retention) -> Result<Self, StoreError> {
        RedbIdempotencyStore::open_with_clock(path, retention, Arc::new(SystemTime::now))
    }

    /// As [`open`](Self::open), the ids stamped by `clock` (tests of retention by age).
    pub fn open_with_clock(
        path: impl AsRef<Path>,
        retention: Retention,
        clock: Clock,
    ) -> Result<Self, StoreError> {
        let path = path.as_ref();
        let opened = |source: Box<dyn std::error::Error + Send + Sync>| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        let db = Database::create(path).map_err(|e| opened(e.into()))?;
        // Both tables exist from the start, so that a lookup never meets a missing one.
        let write = db.begin_write().map_err(|e| opened(e.into()))?;
        write.open_table(IDS).map_err(|e| opened(e.into()))?;
        write.open_table(ORDER).map_err(|e| opened(e.into()))?;
        write.commit().map_err(|e| opened(e.into()))?;
        let shared = Arc::new(Shared {
            db,
            unwritten: Mutex::new(HashSet::new()),
            failures: AtomicU64::new(0),
            retention,
            clock,
        });
        let (commands, received) = mpsc::channel();
        let writer = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("convoy-store-writer".into())
                .spawn(move || write_loop(&shared, &received))
                .map_err(|e| opened(e.into()))?
        };
        Ok(RedbIdempotencyStore {
            shared,
            positions: MemoryIdempotencyStore::new(POSITIONS),
            commands: Some(commands),
            writer: Some(writer),
        })
    }

    /// Makes every id recorded so far durable, and returns once it is: true, or false if writing
    /// or syncing failed (logged; retried with the next batch). Blocking: call it off the async
    /// runtime, e.g. after the engine stopped.
    pub fn flush(&self) -> bool {
        let (done, wait) = mpsc::channel();
        let Some(commands) = &self.commands else {
            return false;
        };
        commands.send(Command::Flush(done)).is_ok() && wait.recv().unwrap_or(false)
    }

    /// How many ids the file holds (written ones; those on their way are not counted).
    pub fn len(&self) -> u64 {
        let held =
            || -> Result<u64, ::redb::Error> { Ok(self.shared.db.begin_read()?.open_table(ORDER)?.len()?) };
        held().unwrap_or(0)
    }

    /// True when the file holds no id.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads and writes that failed so far (each is logged; a failed write's ids are written
    /// with the next batch, a failed read answered "not seen").
    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    fn contains_key(&self, key: &[u8]) -> bool {
        if unwritten(&self.shared).contains(key) {
            return true;
        }
        let found = || -> Result<bool, ::redb::Error> {
            Ok(self.shared.db.begin_read()?.open_table(IDS)?.get(key)?.is_some())
        };
        found().unwrap_or_else(|e| {
            self.shared.failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, "the idempotency store cannot be read: the message runs (a duplicate is possible)");
            false
        })
    }

    fn record_key(&self, key: Box<[u8]>) {
        unwritten(&self.shared).insert(key.clone());
        if let Some(commands) = &self.commands {
            // The writer ends only when the store is dropped, after which nothing records.
            let _ = commands.send(Command::Record(key));
        }
    }
}

impl Drop for RedbIdempotencyStore {
    /// Writes what is left and makes it durable.
    fn drop(&mut self) {
        drop(self.commands.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

fn unwritten(shared: &Shared) -> MutexGuard<'_, HashSet<Box<[u8]>>> {
    shared.unwritten.lock().unwrap_or_else(|p| p.into_inner())
}

#[async_trait]
impl IdempotencyStore for RedbIdempotencyStore {
    async fn contains(&self, id: &EventId) -> bool {
        self.contains_id(id)
    }

    async fn insert(&self, id: EventId) {
        self.record_id(id);
    }

    /// Answered at once: from the ids on their way or redb's page cache (a cold page is read
    /// from the local disk on this thread).
    fn contains_now(&self, id: &EventId) -> Option<bool> {
        Some(self.contains_id(id))
    }

    /// A record is handed to the writer: done at once.
    fn insert_now(&self, id: EventId) -> Result<(), EventId> {
        self.record_id(id);
        Ok(())
    }
}

impl RedbIdempotencyStore {
    fn contains_id(&self, id: &EventId) -> bool {
        match id {
            EventId::Header(_) => self.contains_key(&encode(id)),
            EventId::Position(..) => self.positions.contains_now(id).unwrap_or(false),
        }
    }

    fn record_id(&self, id: EventId) {
        match id {
            EventId::Header(_) => self.record_key(encode(&id)),
            EventId::Position(..) => {
                let _ = self.positions.insert_now(id);
            }
        }
    }
}

/// The writer: batches what arrives into transactions, syncs at most every [`SYNC_EVERY`], and
/// once the store is dropped, writes what is left and syncs.
fn write_loop(shared: &Shared, commands: &Receiver<Command>) {
    let mut batch: Vec<Box<[u8]>> = Vec::new();
    let mut flushes: Vec<Sender<bool>> = Vec::new();
    let mut synced = Instant::now();
    let mut dirty = false;
    loop {
        let closed = match commands.recv_timeout(SYNC_EVERY) {
            Ok(command) => {
                take(command, &mut batch, &mut flushes);
                while batch.len() < BATCH {
                    match commands.try_recv() {
                        Ok(command) => take(command, &mut batch, &mut flushes),
                        Err(_) => break,
                    }
                }
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        let mut ok = true;
        if !batch.is_empty() {
            match write(shared, &batch) {
                Ok(()) => {
                    let mut unwritten = unwritten(shared);
                    for key in batch.drain(..) {
                        unwritten.remove(&key);
                    }
                    dirty = true;
                }
                // Kept for the next round (and known to lookups meanwhile).
                Err(e) => {
                    failed(shared, "writing finished ids", &e);
                    ok = false;
                }
            }
        }
        let sync = closed || !flushes.is_empty() || synced.elapsed() >= SYNC_EVERY;
        if sync && dirty {
            match make_durable(shared) {
                Ok(()) => dirty = false,
                Err(e) => {
                    failed(shared, "making finished ids durable", &e);
                    ok = false;
                }
            }
            synced = Instant::now();
        }
        for done in flushes.drain(..) {
            let _ = done.send(ok);
        }
        if closed {
            return;
        }
    }
}

fn take(command: Command, batch: &mut Vec<Box<[u8]>>, flushes: &mut Vec<Sender<bool>>) {
    match command {
        Command::Record(key) => batch.push(key),
        Command::Flush(done) => flushes.push(done),
    }
}

fn failed(shared: &Shared, what: &str, error: &::redb::Error) {
    shared.failures.fetch_add(1, Ordering::Relaxed);
    tracing::error!(error = %error, "the idempotency store failed {what}; retrying with the next batch");
}

/// Writes `batch` (ids not held yet get the next sequence numbers), then forgets what the
/// retention no longer keeps — in one transaction, synced later.
fn write(shared: &Shared, batch: &[Box<[u8]>]) -> Result<(), ::redb::Error> {
    let now = unix_ms((shared.clock)());
    let mut write = shared.db.begin_write()?;
    write.set_durability(Durability::None)?;
    {
        let mut ids = write.open_table(IDS)?;
        let mut order = write.open_table(ORDER)?;
        let mut next = order.last()?.map_or(0, |(seq, _)| seq.value() + 1);
        let mut entry = Vec::new();
        for key in batch {
            if ids.get(&**key)?.is_some() {
                continue;
            }
            ids.insert(&**key, next)?;
            entry.clear();
            entry.extend_from_slice(&now.to_be_bytes());
            entry.extend_from_slice(key);
            order.insert(next, entry.as_slice())?;
            next += 1;
        }
        trim(&shared.retention, now, &mut ids, &mut order)?;
    }
    write.commit()?;
    Ok(())
}

/// Forgets the oldest ids while there are more than the retention keeps or they are older.
fn trim(
    retention: &Retention,
    now: u64,
    ids: &mut ::redb::Table<'_, &'static [u8], u64>,
    order: &mut ::redb::Table<'_, u64, &'static [u8]>,
) -> Result<(), ::redb::Error> {
    let oldest_kept = retention
        .max_age
        .map(|age| now.saturating_sub(u64::try_from(age.as_millis()).unwrap_or(u64::MAX)));
    let mut held = order.len()?;
    for _ in 0..TRIM_PER_BATCH {
        // Copied out, so that the table is no longer borrowed when the entry is removed.
        let Some((seq, entry)) = order
            .first()?
            .map(|(seq, entry)| (seq.value(), entry.value().to_vec()))
        else {
            return Ok(());
        };
        let (stamp, key) = entry.split_at(8.min(entry.len()));
        let finished = stamp.try_into().map_or(0, u64::from_be_bytes);
        let too_many = retention.max_ids.is_some_and(|most| held > most);
        let too_old = oldest_kept.is_some_and(|oldest| finished < oldest);
        if !(too_many || too_old) {
            return Ok(());
        }
        order.remove(seq)?;
        // The id may have been forgotten and recorded again since: only its newest entry counts.
        if ids.get(key)?.is_some_and(|at| at.value() == seq) {
            ids.remove(key)?;
        }
        held -= 1;
    }
    Ok(())
}

/// An empty durable commit: makes every earlier non-durable one durable.
fn make_durable(shared: &Shared) -> Result<(), ::redb::Error> {
    let mut write = shared.db.begin_write()?;
    write.set_durability(Durability::Immediate)?;
    write.commit()?;
    Ok(())
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
