//! Payments charged once across a restart, and across the members of a group: a payment
//! service handles its payments and stops (a deploy); then another service starts — the same
//! service on its reopened redb file (`RedbIdempotencyStore`, feature `store-redb`), or another
//! member of its group on the group's PostgreSQL table (`PostgresIdempotencyStore`, feature
//! `store-postgres`, when `CONVOY_POSTGRES_URL` names a database) — and the producer, whose
//! acknowledgements were lost, sends every payment again. With the in-memory store the second
//! service would charge each payment a second time; with either store it skips them all.
//!
//! Each key then gets a closing message, after its payments in the key's order: once every
//! closing message ran, every copy before it was seen (JetStream drops the copies itself
//! within its duplicate window; the store catches them on every broker, whenever they come).
//!
//! Invariant: every payment charged exactly once; every copy the restarted service received
//! skipped as a duplicate.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use convoy::store::{PostgresIdempotencyStore, RedbIdempotencyStore, Retention};
use convoy::{typed, Delivery, Engine, HandlerError, IdempotencyStore, OutgoingMessage};
use convoy_examples::{main_of, verdict, Error, Example};

const ACCOUNTS: usize = 50;
const PER_ACCOUNT: usize = 10;

#[derive(serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Command {
    Pay { payment: usize },
    Close,
}

fn poisoned<T>(_: T) -> HandlerError {
    HandlerError::terminal("lock poisoned")
}

fn payments() -> Vec<OutgoingMessage> {
    (0..PER_ACCOUNT)
        .flat_map(|i| {
            (0..ACCOUNTS).map(move |a| {
                let payment = a * PER_ACCOUNT + i;
                OutgoingMessage::new(
                    format!("acct-{a}"),
                    format!(r#"{{"type":"pay","payment":{payment}}}"#),
                )
                .event_id(format!("payment-{payment}"))
            })
        })
        .collect()
}

/// Where the two services keep their finished ids.
enum Stores {
    /// One redb file, reopened by the restarted service.
    Redb(std::path::PathBuf),
    /// One PostgreSQL table, a connection per member.
    Postgres(String),
}

/// A service's store, as it is closed at its graceful stop.
enum Opened {
    Redb(Arc<RedbIdempotencyStore>),
    Postgres(Arc<PostgresIdempotencyStore>),
}

impl Stores {
    async fn open(&self, group: &str) -> Result<Opened, Error> {
        Ok(match self {
            Stores::Redb(file) => {
                Opened::Redb(Arc::new(RedbIdempotencyStore::open(file, Retention::default())?))
            }
            Stores::Postgres(url) => Opened::Postgres(Arc::new(
                PostgresIdempotencyStore::connect(url, group, Retention::default()).await?,
            )),
        })
    }
}

impl Opened {
    fn shared(&self) -> Arc<dyn IdempotencyStore> {
        match self {
            Opened::Redb(store) => store.clone(),
            Opened::Postgres(store) => store.clone(),
        }
    }

    /// The service stops: the redb file is synced as it is dropped; the PostgreSQL store
    /// writes what it holds (`flush`), which a graceful stop does.
    async fn close(self) -> Result<(), Error> {
        if let Opened::Postgres(store) = &self {
            if !store.flush().await {
                return Err("the PostgreSQL store could not write its ids".into());
            }
        }
        Ok(())
    }
}

/// One run: `first` handles every payment, then `second` gets them all again and the closing
/// messages; the checks.
async fn scenario(name: &'static str, stores: Stores) -> Result<Vec<(String, bool)>, Error> {
    let example = Example::setup(name).await?;
    let group = example.connection().endpoint().group.clone();
    // Per payment: how often it was charged. Per account: its closing message ran.
    let charged = Arc::new(Mutex::new(HashMap::<usize, u32>::new()));
    let closed = Arc::new(Mutex::new(0usize));
    let handler = || {
        let (charged, closed) = (charged.clone(), closed.clone());
        typed(move |command: Command, _d: Delivery| {
            let (charged, closed) = (charged.clone(), closed.clone());
            async move {
                match command {
                    Command::Pay { payment } => {
                        *charged.lock().map_err(poisoned)?.entry(payment).or_default() += 1
                    }
                    Command::Close => *closed.lock().map_err(poisoned)? += 1,
                }
                Ok(())
            }
        })
    };

    example.publish(payments()).await?;
    let store = stores.open(&group).await?;
    let first = example
        .start_with(
            Engine::builder(handler()).idempotency_store(store.shared()),
            |_| {},
        )
        .await?;
    let total = (ACCOUNTS * PER_ACCOUNT) as u64;
    first
        .wait_for("every payment handled", |s| s.handled >= total)
        .await?;
    first.stop().await?;
    store.close().await?;

    // The second service; the producer sends everything again.
    let store = stores.open(&group).await?;
    let second = example
        .start_with(
            Engine::builder(handler()).idempotency_store(store.shared()),
            |_| {},
        )
        .await?;
    example.publish(payments()).await?;
    let closing = (0..ACCOUNTS)
        .map(|a| OutgoingMessage::new(format!("acct-{a}"), r#"{"type":"close"}"#))
        .collect();
    example.publish(closing).await?;
    second
        .wait_for("every account closed", |s| s.handled >= ACCOUNTS as u64)
        .await?;
    let last = second.stop().await?;
    store.close().await?;
    if let Stores::Redb(file) = &stores {
        let _ = std::fs::remove_file(file);
    }
    let dead = example.dead_letters().await?;
    example.clean_up().await?;

    let charged = charged.lock().map_err(|_| "lock poisoned")?;
    let closed = *closed.lock().map_err(|_| "lock poisoned")?;
    println!(
        "{name}: {} payments charged, the second service skipped {} copies, {} accounts closed",
        charged.len(),
        last.duplicates,
        closed
    );
    Ok(vec![
        (
            format!("{name}: every payment charged exactly once"),
            charged.len() == ACCOUNTS * PER_ACCOUNT && charged.values().all(|n| *n == 1),
        ),
        (
            format!("{name}: the second service ran nothing but the closing messages"),
            last.handled == ACCOUNTS as u64 && closed == ACCOUNTS,
        ),
        (format!("{name}: nothing was dead-lettered"), dead.is_empty()),
    ])
}

async fn run() -> Result<ExitCode, Error> {
    let file = std::env::temp_dir().join(format!("convoy-payments-{}.redb", convoy::unique_suffix()));
    let mut checks = scenario("payments", Stores::Redb(file)).await?;
    match std::env::var("CONVOY_POSTGRES_URL") {
        Ok(url) => checks.extend(scenario("payments-group", Stores::Postgres(url)).await?),
        Err(_) => {
            println!("payments-group: skipped (set CONVOY_POSTGRES_URL to run it on a PostgreSQL store)")
        }
    }
    let checks: Vec<(&str, bool)> = checks.iter().map(|(what, held)| (what.as_str(), *held)).collect();
    Ok(verdict("payments", &checks))
}

fn main() -> ExitCode {
    main_of("payments", run())
}
