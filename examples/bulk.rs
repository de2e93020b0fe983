//! Bulk postings: a batch handler writes the postings of many accounts to the ledger table in
//! one insert per call, each account's postings in a run, in order, instead of one round trip
//! per posting. The insert is all-or-nothing and times out now and then (every message of the
//! call is retried in its lane); a posting whose amount cannot be read is refused (malformed)
//! and dead-lettered, and its account goes on — the handler writes nothing of an account after
//! the account's first failure in a call, as a batch handler must.
//!
//! Invariant: every account's rows are its postings in order, each once (the refused one
//! missing); exactly that posting was dead-lettered; far fewer inserts than postings.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy::{
    batch_fn, Backoff, BatchConfig, Delivery, ErrorClass, HandlerError, Jitter, OutgoingMessage, RetryPolicy,
};
use convoy_examples::{main_of, verdict, Error, Example};

const ACCOUNTS: usize = 200;
const POSTINGS: u64 = 20;
/// The posting whose amount cannot be read.
const REFUSED: (&str, u64) = ("acct-7", 5);

#[derive(serde::Deserialize)]
struct Posting {
    seq: u64,
    #[allow(dead_code)] // read to refuse a posting without one; the table keeps sequence numbers
    amount: i64,
}

/// The ledger table: each account's posting sequence numbers in insert order.
#[derive(Default)]
struct Table {
    rows: HashMap<String, Vec<u64>>,
    inserts: usize,
}

async fn run() -> Result<ExitCode, Error> {
    let example = Example::setup("bulk").await?;
    let mut postings = Vec::new();
    for seq in 0..POSTINGS {
        for a in 0..ACCOUNTS {
            let account = format!("acct-{a}");
            let amount = match (account.as_str(), seq) == REFUSED {
                true => r#""oops""#.to_owned(),
                false => ((a as u64 * 7 + seq) % 100).to_string(),
            };
            postings.push(OutgoingMessage::new(
                account,
                format!(r#"{{"seq":{seq},"amount":{amount}}}"#),
            ));
        }
    }
    let total = postings.len() as u64;
    example.publish(postings).await?;

    let table = Arc::new(Mutex::new(Table::default()));
    let t = table.clone();
    let handler = batch_fn(move |batch: Vec<Delivery>| {
        let table = t.clone();
        async move {
            // The round trip of one insert, and one insert in ten times out: nothing is written.
            tokio::time::sleep(Duration::from_millis(1)).await;
            if fastrand::u8(..10) == 0 {
                return Err(HandlerError::transient("insert timed out"));
            }
            let mut results = Vec::with_capacity(batch.len());
            let mut rows = Vec::with_capacity(batch.len());
            // An account's postings are together and in order: its run.
            for run in batch.chunk_by(|a, b| a.key() == b.key()) {
                let mut failed = false;
                for d in run {
                    if failed {
                        results.push(Err(HandlerError::transient(
                            "an earlier posting of the account failed",
                        )));
                        continue;
                    }
                    match serde_json::from_slice::<Posting>(d.payload()) {
                        Ok(p) => {
                            rows.push((d.message().key_display().into_owned(), p.seq));
                            results.push(Ok(()));
                        }
                        Err(e) => {
                            failed = true;
                            results.push(Err(HandlerError::caused_by(ErrorClass::Malformed, e)));
                        }
                    }
                }
            }
            let mut table = table
                .lock()
                .map_err(|_| HandlerError::terminal("lock poisoned"))?;
            table.inserts += 1;
            for (account, seq) in rows {
                table.rows.entry(account).or_default().push(seq);
            }
            Ok(results)
        }
    });
    let retry = RetryPolicy::with_backoff(Backoff::new(
        Duration::from_millis(1),
        2.0,
        Duration::from_millis(20),
        Jitter::Full,
    ));
    let batch = BatchConfig::new(200, Duration::from_millis(5)).per_key(10);
    let stats = example.run_batches(handler, batch, retry, total).await?;
    let dead = example.dead_letters().await?;
    example.clean_up().await?;
    let table = table.lock().map_err(|_| "lock poisoned")?;
    println!(
        "bulk: {} postings handled in {} inserts, {} retried, {} dead-lettered",
        stats.handled, table.inserts, stats.retries, stats.dead_lettered
    );
    let in_order = (0..ACCOUNTS).all(|a| {
        let account = format!("acct-{a}");
        let expected: Vec<u64> = (0..POSTINGS)
            .filter(|&seq| (account.as_str(), seq) != REFUSED)
            .collect();
        table.rows.get(&account) == Some(&expected)
    });
    let refused = dead.len() == 1
        && dead[0].message.key.as_deref() == Some(REFUSED.0.as_bytes())
        && dead[0].error_class == "malformed";
    Ok(verdict(
        "bulk",
        &[
            (
                "every account's rows are its postings in order, each once",
                in_order,
            ),
            ("exactly the unreadable posting was dead-lettered", refused),
            (
                "far fewer inserts than postings",
                table.inserts * 5 < total as usize,
            ),
        ],
    ))
}

fn main() -> ExitCode {
    main_of("bulk", run())
}
