//! Payments charged once across a restart: a payment service handles its payments, stops (a
//! deploy), and starts again on the same idempotency store, reopened from its file — and then
//! the producer, whose acknowledgements were lost, sends every payment again. With the
//! in-memory store the restarted service would charge each payment a second time; with the
//! redb store (`convoy::store`, feature `store-redb`) it skips them all.
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

use convoy::store::{RedbIdempotencyStore, Retention};
use convoy::{typed, Delivery, Engine, HandlerError, OutgoingMessage};
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

async fn run() -> Result<ExitCode, Error> {
    let example = Example::setup("payments").await?;
    let file = std::env::temp_dir().join(format!("convoy-payments-{}.redb", convoy::unique_suffix()));
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
    let store = Arc::new(RedbIdempotencyStore::open(&file, Retention::default())?);
    let first = example
        .start_with(
            Engine::builder(handler()).idempotency_store(store.clone()),
            |_| {},
        )
        .await?;
    let total = (ACCOUNTS * PER_ACCOUNT) as u64;
    first
        .wait_for("every payment handled", |s| s.handled >= total)
        .await?;
    first.stop().await?;
    drop(store); // the process ends: what it recorded is on disk

    // The restarted service, on the reopened store; the producer sends everything again.
    let store = Arc::new(RedbIdempotencyStore::open(&file, Retention::default())?);
    let second = example
        .start_with(
            Engine::builder(handler()).idempotency_store(store.clone()),
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
    drop(store);
    let _ = std::fs::remove_file(&file);
    let dead = example.dead_letters().await?;
    example.clean_up().await?;

    let charged = charged.lock().map_err(|_| "lock poisoned")?;
    let closed = *closed.lock().map_err(|_| "lock poisoned")?;
    println!(
        "payments: {} payments charged, restarted service skipped {} copies, {} accounts closed",
        charged.len(),
        last.duplicates,
        closed
    );
    Ok(verdict(
        "payments",
        &[
            (
                "every payment charged exactly once",
                charged.len() == ACCOUNTS * PER_ACCOUNT && charged.values().all(|n| *n == 1),
            ),
            (
                "the restarted service ran nothing but the closing messages",
                last.handled == ACCOUNTS as u64 && closed == ACCOUNTS,
            ),
            ("nothing was dead-lettered", dead.is_empty()),
        ],
    ))
}

fn main() -> ExitCode {
    main_of("payments", run())
}
