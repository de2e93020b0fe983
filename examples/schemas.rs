//! Avro through the Confluent Schema Registry, across a schema change: a ledger's producers
//! publish entries under schema v1, then under v2 (a `memo` field added, with a default), and
//! one foreign producer writes plain JSON by mistake. The consumer reads with v2: each payload
//! names its writer's schema, fetched once per id and resolved to v2, so v1 entries arrive
//! with the default memo. The foreign message is dead-lettered as malformed, with the reason.
//!
//! Needs a registry: `CONVOY_SCHEMA_REGISTRY` (default `http://127.0.0.1:8081`;
//! `scripts/brokers/registry up` starts Karapace on Kafka).
//!
//! Invariant: every entry handled once, in order per account, v1 entries with the default
//! memo and v2 entries with theirs; the foreign message, and only it, dead-lettered as
//! malformed.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use convoy::codec::{value_subject, ConfluentAvro, SchemaRegistry};
use convoy::{typed_with, Delivery, HandlerError, OutgoingMessage, RetryPolicy, TypedPublisher};
use convoy_examples::{main_of, verdict, Error, Example};
use serde::{Deserialize, Serialize};

const ACCOUNTS: i64 = 20;
const PER_VERSION: i64 = 5;

const ENTRY_V1: &str = r#"{"type":"record","name":"Entry","namespace":"convoy.examples","fields":[
    {"name":"account","type":"string"},{"name":"seq","type":"long"},{"name":"cents","type":"long"}]}"#;
const ENTRY_V2: &str = r#"{"type":"record","name":"Entry","namespace":"convoy.examples","fields":[
    {"name":"account","type":"string"},{"name":"seq","type":"long"},{"name":"cents","type":"long"},
    {"name":"memo","type":"string","default":"(none)"}]}"#;

/// What producers of the first release write.
#[derive(Serialize)]
struct EntryV1 {
    account: String,
    seq: i64,
    cents: i64,
}

/// What the second release writes, and what the consumer reads.
#[derive(Serialize, Deserialize)]
struct Entry {
    account: String,
    seq: i64,
    cents: i64,
    memo: String,
}

fn poisoned<T>(_: T) -> HandlerError {
    HandlerError::terminal("lock poisoned")
}

async fn run() -> Result<ExitCode, Error> {
    let example = Example::setup("schemas").await?;
    let topic = example.connection().endpoint().topics[0].clone();
    let url = std::env::var("CONVOY_SCHEMA_REGISTRY").unwrap_or_else(|_| "http://127.0.0.1:8081".into());
    let registry = SchemaRegistry::new(&url)?;
    let subject = value_subject(&topic);
    let publisher = example.connection().publisher(&topic)?;

    // The first release: v1, registered under the topic's subject on its first message.
    let v1 = TypedPublisher::new(
        publisher.clone(),
        ConfluentAvro::<EntryV1>::new(registry.clone(), &subject, ENTRY_V1)?,
    );
    let entries: Vec<(String, EntryV1)> = (0..PER_VERSION)
        .flat_map(|seq| {
            (0..ACCOUNTS).map(move |a| {
                let account = format!("acct-{a}");
                (
                    account.clone(),
                    EntryV1 {
                        account,
                        seq,
                        cents: 100 * seq + a,
                    },
                )
            })
        })
        .collect();
    v1.publish_all(entries.iter().map(|(k, e)| (k.clone(), e)))
        .await?;

    // The second release: v2, a compatible change the registry accepts.
    let v2 = TypedPublisher::new(
        publisher.clone(),
        ConfluentAvro::<Entry>::new(registry.clone(), &subject, ENTRY_V2)?,
    );
    let entries: Vec<(String, Entry)> = (PER_VERSION..2 * PER_VERSION)
        .flat_map(|seq| {
            (0..ACCOUNTS).map(move |a| {
                let account = format!("acct-{a}");
                let memo = format!("batch {seq}");
                (
                    account.clone(),
                    Entry {
                        account,
                        seq,
                        cents: 100 * seq + a,
                        memo,
                    },
                )
            })
        })
        .collect();
    v2.publish_all(entries.iter().map(|(k, e)| (k.clone(), e)))
        .await?;

    // A foreign producer that skipped the registry's serializer.
    example
        .publish(vec![OutgoingMessage::json(
            "stray",
            &serde_json::json!({ "account": "stray", "seq": 1 }),
        )?])
        .await?;

    // Per account: the (seq, memo) handled, in order.
    let seen = Arc::new(Mutex::new(HashMap::<String, Vec<(i64, String)>>::new()));
    let handler = {
        let seen = seen.clone();
        let reader = ConfluentAvro::<Entry>::new(registry, &subject, ENTRY_V2)?;
        typed_with(reader, move |entry: Entry, _d: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock()
                    .map_err(poisoned)?
                    .entry(entry.account)
                    .or_default()
                    .push((entry.seq, entry.memo));
                Ok(())
            }
        })
    };
    let total = (2 * PER_VERSION * ACCOUNTS) as u64;
    // A registry outage is waited out (retried in the lane), never a reason to dead-letter.
    let stats = example
        .run(
            handler,
            RetryPolicy::default().with_unlimited_attempts(),
            total + 1,
        )
        .await?;
    let dead = example.dead_letters().await?;
    example.clean_up().await?;

    let seen = seen.lock().map_err(|_| "lock poisoned")?;
    let in_order_with_memos = (0..ACCOUNTS).all(|a| {
        let expected: Vec<(i64, String)> = (0..2 * PER_VERSION)
            .map(|seq| {
                (
                    seq,
                    if seq < PER_VERSION {
                        "(none)".to_string()
                    } else {
                        format!("batch {seq}")
                    },
                )
            })
            .collect();
        seen.get(&format!("acct-{a}")) == Some(&expected)
    });
    let foreign_dead_lettered = dead.len() == 1
        && dead[0].message.key.as_deref() == Some(&b"stray"[..])
        && dead[0].cause == "malformed"
        && dead[0].error.contains("magic byte");
    println!(
        "schemas: {} entries handled over {} accounts (schema ids from {url}), {} dead-lettered{}",
        stats.handled,
        seen.len(),
        dead.len(),
        dead.first().map(|d| format!(": {}", d.error)).unwrap_or_default()
    );
    Ok(verdict(
        "schemas",
        &[
            (
                "every entry handled once, in order per account, v1 ones with the default memo",
                stats.handled == total && in_order_with_memos,
            ),
            (
                "the foreign message, and only it, dead-lettered as malformed",
                foreign_dead_lettered,
            ),
        ],
    ))
}

fn main() -> ExitCode {
    main_of("schemas", run())
}
