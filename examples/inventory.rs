//! Inventory: each item is restocked, then ordered one unit at a time. A decrement that ran
//! before its restock, or two that raced, would sell stock that is not there. The warehouse
//! API fails transiently now and then; retries stay inside the item's lane.
//!
//! Invariant: every item ends at exactly 0, every order was filled, nothing was dead-lettered
//! (an out-of-order decrement would have found no stock).

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy::{typed, Backoff, Delivery, HandlerError, Jitter, OutgoingMessage, RetryPolicy};
use convoy_examples::{main_of, verdict, Error, Example};

const ITEMS: usize = 100;
const ORDERS_PER_ITEM: usize = 10;

#[derive(serde::Deserialize)]
struct Change {
    delta: i64,
}

#[derive(Default)]
struct Stock {
    levels: HashMap<String, i64>,
    orders_filled: usize,
}

async fn run() -> Result<ExitCode, Error> {
    let example = Example::setup("inventory").await?;
    let mut changes = Vec::new();
    for i in 0..ITEMS {
        changes.push(OutgoingMessage::new(
            format!("sku-{i}"),
            format!(r#"{{"delta":{ORDERS_PER_ITEM}}}"#),
        ));
    }
    for _ in 0..ORDERS_PER_ITEM {
        for i in 0..ITEMS {
            changes.push(OutgoingMessage::new(format!("sku-{i}"), r#"{"delta":-1}"#));
        }
    }
    let total = changes.len() as u64;
    example.publish(changes).await?;

    let stock = Arc::new(Mutex::new(Stock::default()));
    let s = stock.clone();
    let handler = typed(move |change: Change, d: Delivery| {
        let stock = s.clone();
        async move {
            // The warehouse API: a little latency, and one call in twenty times out.
            tokio::time::sleep(Duration::from_micros(fastrand::u64(0..500))).await;
            if fastrand::u8(..20) == 0 {
                return Err(HandlerError::transient("warehouse API timed out"));
            }
            let item = d.message().key_display().into_owned();
            let mut stock = stock
                .lock()
                .map_err(|_| HandlerError::terminal("lock poisoned"))?;
            let level = stock.levels.entry(item.clone()).or_default();
            if *level + change.delta < 0 {
                return Err(HandlerError::terminal(format!("{item}: out of stock")));
            }
            *level += change.delta;
            if change.delta < 0 {
                stock.orders_filled += 1;
            }
            Ok(())
        }
    });
    let retry = RetryPolicy::with_backoff(Backoff::new(
        Duration::from_millis(1),
        2.0,
        Duration::from_millis(20),
        Jitter::Full,
    ));
    let stats = example.run(handler, retry, total).await?;
    let dead = example.dead_letters().await?;
    example.clean_up().await?;
    let stock = stock.lock().map_err(|_| "lock poisoned")?;
    println!(
        "inventory: {} changes handled, {} retried, {} dead-lettered",
        stats.handled, stats.retries, stats.dead_lettered
    );
    Ok(verdict(
        "inventory",
        &[
            (
                "every item ends at 0",
                stock.levels.len() == ITEMS && stock.levels.values().all(|l| *l == 0),
            ),
            (
                "every order was filled",
                stock.orders_filled == ITEMS * ORDERS_PER_ITEM,
            ),
            ("no change ran out of order (no dead letters)", dead.is_empty()),
        ],
    ))
}

fn main() -> ExitCode {
    main_of("inventory", run())
}
