//! The task that talks to PostgreSQL for a store: lookups (those waiting together as one
//! query), writes of finished ids (batched, at most [`WRITE_EVERY`](super::WRITE_EVERY) late),
//! the retention, and connecting again after an outage, with backoff.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_postgres::{Client, Config, NoTls};

use super::{Request, Shared, WRITE_EVERY};
use crate::retention::Retention;

/// Most ids waiting to be written while the database does not answer; past it the oldest are
/// dropped (their messages may run once more if they come again), with a warning.
pub const MAX_UNWRITTEN: usize = 1_000_000;
/// Most ids one statement writes.
const BATCH: usize = 4096;
/// Most requests taken before answering the lookups among them.
const TAKE_AT_ONCE: usize = 4096;
/// How often the retention runs while the store is used.
const RETENTION_EVERY: Duration = Duration::from_secs(60);
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MOST: Duration = Duration::from_secs(5);

const LOOKUP: &str = "SELECT id FROM convoy_idempotency WHERE grp = $1 AND id = ANY($2)";
const WRITE: &str =
    "INSERT INTO convoy_idempotency (grp, id) SELECT $1, unnest($2::bytea[]) ON CONFLICT DO NOTHING";
const TRIM_AGE: &str =
    "DELETE FROM convoy_idempotency WHERE grp = $1 AND finished_at < now() - make_interval(secs => $2)";
const TRIM_COUNT: &str = "DELETE FROM convoy_idempotency WHERE grp = $1 AND (finished_at, id) <= (
    SELECT finished_at, id FROM convoy_idempotency WHERE grp = $1
    ORDER BY finished_at DESC, id DESC OFFSET $2 LIMIT 1)";

/// Connects, driving the connection on a task of its own.
pub(super) async fn connect(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "the shared idempotency store's connection ended: connecting again on the next request");
        }
    });
    Ok(client)
}

/// A URL as it may be logged: its password replaced.
pub(super) fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url
            .split_whitespace()
            .filter(|kv| !kv.starts_with("password="))
            .collect::<Vec<_>>()
            .join(" ");
    };
    match rest.split_once('@') {
        Some((credentials, host)) => match credentials.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// The shared sets hold plain data; a panic elsewhere cannot leave one half-written.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(super) struct Writer {
    config: Config,
    client: Option<Client>,
    group: String,
    retention: Retention,
    shared: Arc<Shared>,
    inbox: mpsc::UnboundedReceiver<Request>,
    /// Ids to write, oldest first.
    pending: VecDeque<Box<[u8]>>,
    /// When connecting may be tried again, and the wait after the next failure.
    retry_at: Instant,
    backoff: Duration,
    last_trim: Instant,
    dropped_warned: bool,
}

impl Writer {
    pub(super) fn new(
        config: Config,
        client: Client,
        group: String,
        retention: Retention,
        shared: Arc<Shared>,
        inbox: mpsc::UnboundedReceiver<Request>,
    ) -> Writer {
        Writer {
            config,
            client: Some(client),
            group,
            retention,
            shared,
            inbox,
            pending: VecDeque::new(),
            retry_at: Instant::now(),
            backoff: RECONNECT_FIRST,
            // The first retention runs with the first requests.
            last_trim: Instant::now() - RETENTION_EVERY,
            dropped_warned: false,
        }
    }

    /// Runs until the store is dropped, then writes what is left (once).
    pub(super) async fn run(mut self) {
        let mut write_at: Option<Instant> = None;
        loop {
            let first = match write_at {
                Some(at) => tokio::select! {
                    request = self.inbox.recv() => request,
                    () = tokio::time::sleep_until(at) => {
                        write_at = None;
                        self.write().await;
                        continue;
                    }
                },
                None => self.inbox.recv().await,
            };
            let Some(first) = first else {
                self.write().await;
                return;
            };
            let (mut lookups, mut flushes, mut trims) = (Vec::new(), Vec::new(), Vec::new());
            let mut next = Some(first);
            let mut taken = 0;
            while let Some(request) = next {
                match request {
                    Request::Lookup(key, reply) => lookups.push((key, reply)),
                    Request::Record(key) => self.queue(key),
                    Request::Flush(reply) => flushes.push(reply),
                    Request::Trim(reply) => trims.push(reply),
                }
                taken += 1;
                next = match taken < TAKE_AT_ONCE {
                    true => self.inbox.try_recv().ok(),
                    false => None,
                };
            }
            if !lookups.is_empty() {
                self.lookup(lookups).await;
            }
            if !flushes.is_empty() || self.pending.len() >= BATCH {
                write_at = None;
                let written = self.write().await;
                for reply in flushes {
                    let _ = reply.send(written);
                }
            } else if !self.pending.is_empty() && write_at.is_none() {
                write_at = Some(Instant::now() + WRITE_EVERY);
            }
            if !trims.is_empty() || self.last_trim.elapsed() >= RETENTION_EVERY {
                let forgot = self.trim().await;
                for reply in trims {
                    let _ = reply.send(forgot);
                }
            }
        }
    }

    fn queue(&mut self, key: Box<[u8]>) {
        if self.pending.len() >= MAX_UNWRITTEN {
            if let Some(oldest) = self.pending.pop_front() {
                lock(&self.shared.unwritten).remove(&oldest);
            }
            if !self.dropped_warned {
                self.dropped_warned = true;
                tracing::warn!(
                    held = MAX_UNWRITTEN,
                    "the shared idempotency store's database has not answered for long: dropping the oldest ids not written (their messages may run again if they come again)"
                );
            }
        }
        self.pending.push_back(key);
    }

    /// Connects again if the last connection is gone and the backoff allows; true when
    /// connected.
    async fn connected(&mut self) -> bool {
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
        }
        if self.client.is_none() && Instant::now() >= self.retry_at {
            match connect(&self.config).await {
                Ok(client) => {
                    tracing::info!("the shared idempotency store is connected again");
                    self.client = Some(client);
                    self.backoff = RECONNECT_FIRST;
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?self.backoff, "the shared idempotency store cannot reach its database");
                    self.retry_at = Instant::now() + self.backoff;
                    self.backoff = (self.backoff * 2).min(RECONNECT_MOST);
                }
            }
        }
        self.client.is_some()
    }

    /// A failed statement: counted and logged; a connection that broke is made again later.
    fn failed(&mut self, what: &str, error: &tokio_postgres::Error, count: u64) {
        self.shared.failures.fetch_add(count, Ordering::Relaxed);
        tracing::warn!(error = %error, what, "the shared idempotency store's database did not answer");
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
        }
    }

    async fn lookup(&mut self, lookups: Vec<(Box<[u8]>, oneshot::Sender<bool>)>) {
        let group = self.group.clone();
        let keys: Vec<&[u8]> = lookups.iter().map(|(k, _)| &**k).collect();
        let answer = match (self.connected().await, &self.client) {
            (true, Some(client)) => Some(client.query(LOOKUP, &[&group, &keys]).await),
            _ => None,
        };
        let found: HashSet<Vec<u8>> = match answer {
            Some(Ok(rows)) => rows
                .iter()
                .filter_map(|row| row.try_get::<_, Vec<u8>>(0).ok())
                .collect(),
            Some(Err(e)) => {
                self.failed("lookup", &e, lookups.len() as u64);
                HashSet::new()
            }
            None => {
                // Not connected: every lookup answers "not seen" (the message runs).
                self.shared
                    .failures
                    .fetch_add(lookups.len() as u64, Ordering::Relaxed);
                HashSet::new()
            }
        };
        for (key, reply) in lookups {
            // Written by this member since it asked, or in the table.
            let seen = found.contains(&*key) || lock(&self.shared.unwritten).contains(&key);
            let _ = reply.send(seen);
        }
    }

    /// Writes everything pending, in batches; true once all of it is in the table.
    async fn write(&mut self) -> bool {
        while !self.pending.is_empty() {
            if !self.connected().await {
                return false;
            }
            let Some(client) = &self.client else { return false };
            let n = self.pending.len().min(BATCH);
            let batch: Vec<&[u8]> = self.pending.iter().take(n).map(|k| &**k).collect();
            let result = client.execute(WRITE, &[&self.group, &batch]).await;
            if let Err(e) = result {
                self.failed("write", &e, 1);
                return false;
            }
            let mut unwritten = lock(&self.shared.unwritten);
            for key in self.pending.drain(..n) {
                unwritten.remove(&key);
            }
        }
        true
    }

    /// Forgets what the retention no longer keeps; how many ids.
    async fn trim(&mut self) -> Option<u64> {
        self.last_trim = Instant::now();
        let group = self.group.clone();
        let (max_age, max_ids) = (self.retention.max_age, self.retention.max_ids);
        if !self.connected().await {
            return None;
        }
        let client = self.client.as_ref()?;
        let mut forgot = 0;
        let mut result = Ok(());
        if let Some(age) = max_age {
            match client.execute(TRIM_AGE, &[&group, &age.as_secs_f64()]).await {
                Ok(n) => forgot += n,
                Err(e) => result = Err(e),
            }
        }
        if let (Some(max), Ok(())) = (max_ids, &result) {
            let max = i64::try_from(max).unwrap_or(i64::MAX);
            match client.execute(TRIM_COUNT, &[&group, &max]).await {
                Ok(n) => forgot += n,
                Err(e) => result = Err(e),
            }
        }
        match result {
            Ok(()) => Some(forgot),
            Err(e) => {
                self.failed("retention", &e, 0);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(
            without_password("postgres://convoy:s3cret@db:5432/billing"),
            "postgres://convoy:***@db:5432/billing"
        );
        assert_eq!(
            without_password("postgres://convoy@db/billing"),
            "postgres://convoy@db/billing"
        );
        assert_eq!(
            without_password("host=db user=convoy password=s3cret dbname=billing"),
            "host=db user=convoy dbname=billing"
        );
    }
}
