//! A store shared by a consumer group: finished event ids in a PostgreSQL table, so that a
//! duplicate is caught whichever member receives it — after a rebalance moved its partition, a
//! crash restarted its member elsewhere, or a producer re-sent it to another partition.
//!
//! One table (`convoy_idempotency`: group, id, finish time) holds every group's ids, each group
//! seeing only its own. A lookup asks the table (lookups waiting together go as one query); a
//! finished id is visible to this member at once and to the others once written: a writer task
//! writes what arrived in one statement at most every 100 ms ([`WRITE_EVERY`]), and on
//! [`flush`](PostgresIdempotencyStore::flush). A member killed in that window loses those ids
//! (the messages may run once more, as without a store).
//!
//! The database unreachable never loses a message: a lookup answers "not seen" (the message
//! runs; counted in [`failures`](PostgresIdempotencyStore::failures) and logged), ids wait to be
//! written (up to [`MAX_UNWRITTEN`], the oldest dropped past it), and the connection is made
//! again with backoff. Ids derived from positions stay in memory, as in the redb store.

mod writer;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::{EventId, IdempotencyStore, MemoryIdempotencyStore};
use tokio::sync::{mpsc, oneshot};

use crate::key::encode;
use crate::retention::Retention;

pub use writer::MAX_UNWRITTEN;

/// The longest a finished id waits to be written while messages keep finishing.
pub const WRITE_EVERY: Duration = Duration::from_millis(100);
/// Position ids kept in memory.
const POSITIONS: usize = 100_000;

/// The table and its index, created if missing. Members starting together would race on
/// `CREATE TABLE IF NOT EXISTS` (PostgreSQL answers one of them with a unique violation): a
/// transaction-scoped advisory lock makes them take turns.
const SCHEMA: &str = "
    BEGIN;
    SELECT pg_advisory_xact_lock(hashtext('convoy_idempotency'));
    CREATE TABLE IF NOT EXISTS convoy_idempotency (
        grp text NOT NULL,
        id bytea NOT NULL,
        finished_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (grp, id)
    );
    CREATE INDEX IF NOT EXISTS convoy_idempotency_age ON convoy_idempotency (grp, finished_at);
    COMMIT;
";

/// The store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SharedStoreError {
    /// The database did not take the connection, or refused the table.
    #[error("cannot open the shared idempotency store at {url}: {source} (check the URL, the credentials, and that the role may create a table)")]
    Connect {
        /// The address, without its password.
        url: String,
        /// What the client said.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The group is empty.
    #[error("the shared idempotency store needs the consumer group's name (ids are kept per group)")]
    NoGroup,
}

/// What a lookup or the writer is asked.
enum Request {
    Lookup(Box<[u8]>, oneshot::Sender<bool>),
    Record(Box<[u8]>),
    /// Write everything recorded so far, then answer whether it went through.
    Flush(oneshot::Sender<bool>),
    /// Apply the retention now; answers how many ids it forgot (`None`: it failed).
    Trim(oneshot::Sender<Option<u64>>),
}

/// What the store and its writer task share.
pub(crate) struct Shared {
    /// Recorded and not yet written: this member sees them at once.
    pub unwritten: Mutex<HashSet<Box<[u8]>>>,
    /// Lookups answered "not seen" and writes that failed because the database did not answer.
    pub failures: AtomicU64,
}

/// Finished event ids of one consumer group in PostgreSQL (see the [module](self)
/// documentation).
///
/// ```no_run
/// # async fn demo() -> Result<(), convoy_store::SharedStoreError> {
/// use convoy_store::{PostgresIdempotencyStore, Retention};
/// let store = PostgresIdempotencyStore::connect(
///     "postgres://convoy:secret@db.internal/billing",
///     "billing",
///     Retention::default(),
/// )
/// .await?;
/// // Engine::builder(handler).idempotency_store(store) … on every member of the group.
/// # Ok(()) }
/// ```
pub struct PostgresIdempotencyStore {
    shared: Arc<Shared>,
    requests: mpsc::UnboundedSender<Request>,
    positions: MemoryIdempotencyStore,
}

impl PostgresIdempotencyStore {
    /// Connects to the database at `url` (`postgres://user:password@host:port/db`, or a
    /// `key=value` string), creates the table if it is missing, and keeps the ids of consumer
    /// group `group` for as long as `retention` says. Fails at once on a URL, credentials or
    /// permissions that do not work; later outages are waited out.
    pub async fn connect(url: &str, group: &str, retention: Retention) -> Result<Self, SharedStoreError> {
        if group.is_empty() {
            return Err(SharedStoreError::NoGroup);
        }
        let shown = writer::without_password(url);
        let connect_error = |source| SharedStoreError::Connect {
            url: shown.clone(),
            source,
        };
        let mut config: tokio_postgres::Config = url.parse().map_err(connect_error)?;
        // What an administrator sees in pg_stat_activity, unless the URL names it.
        if config.get_application_name().is_none() {
            config.application_name(format!("convoy-idempotency/{group}"));
        }
        let client = writer::connect(&config).await.map_err(connect_error)?;
        client.batch_execute(SCHEMA).await.map_err(connect_error)?;
        let shared = Arc::new(Shared {
            unwritten: Mutex::new(HashSet::new()),
            failures: AtomicU64::new(0),
        });
        let (requests, inbox) = mpsc::unbounded_channel();
        let task = writer::Writer::new(config, client, group.to_owned(), retention, shared.clone(), inbox);
        tokio::spawn(task.run());
        Ok(PostgresIdempotencyStore {
            shared,
            requests,
            positions: MemoryIdempotencyStore::new(POSITIONS),
        })
    }

    /// Writes every id recorded so far; true once they are in the table (false: the database
    /// did not answer, they stay to be written).
    pub async fn flush(&self) -> bool {
        let (reply, answer) = oneshot::channel();
        self.requests.send(Request::Flush(reply)).is_ok() && answer.await.unwrap_or(false)
    }

    /// Forgets now what the retention no longer keeps (the writer does so every minute by
    /// itself); how many ids, `None` if the database did not answer.
    pub async fn apply_retention(&self) -> Option<u64> {
        let (reply, answer) = oneshot::channel();
        self.requests.send(Request::Trim(reply)).ok()?;
        answer.await.ok().flatten()
    }

    /// Lookups answered "not seen" and writes that failed, because the database did not answer.
    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    fn unwritten(&self, key: &[u8]) -> bool {
        writer::lock(&self.shared.unwritten).contains(key)
    }
}

#[async_trait]
impl IdempotencyStore for PostgresIdempotencyStore {
    async fn contains(&self, id: &EventId) -> bool {
        if let EventId::Position(..) = id {
            return self.positions.contains(id).await;
        }
        let key = encode(id);
        if self.unwritten(&key) {
            return true;
        }
        let (reply, answer) = oneshot::channel();
        if self.requests.send(Request::Lookup(key, reply)).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }

    async fn insert(&self, id: EventId) {
        let _ = self.insert_now(id);
    }

    fn contains_now(&self, id: &EventId) -> Option<bool> {
        match id {
            EventId::Position(..) => self.positions.contains_now(id),
            // Known at once only if this member finished it lately; else the table decides.
            EventId::Header(_) => self.unwritten(&encode(id)).then_some(true),
        }
    }

    fn insert_now(&self, id: EventId) -> Result<(), EventId> {
        if let EventId::Position(..) = id {
            return self.positions.insert_now(id);
        }
        let key = encode(&id);
        writer::lock(&self.shared.unwritten).insert(key.clone());
        let _ = self.requests.send(Request::Record(key));
        Ok(())
    }
}
