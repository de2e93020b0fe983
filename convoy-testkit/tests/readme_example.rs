//! The example shown in README.md, kept compiling and passing here (rustfmt would spread it
//! over twice the lines, so it is left as written).
#![allow(clippy::unwrap_used)]
#![cfg_attr(rustfmt, rustfmt_skip)]

use std::{collections::HashMap, sync::{Arc, Mutex}, time::Duration};
use convoy_core::{typed, Engine, HandlerError, OutgoingMessage, Publisher, Transport};
use convoy_testkit::{MemoryBroker, MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};

#[derive(serde::Deserialize)]
struct Entry { cents: i64 }

#[tokio::test]
async fn a_debit_never_applies_before_its_credit() {
    let broker = MemoryBroker::new();
    broker.create_topic("ledger", 4);
    let balances = Arc::new(Mutex::new(HashMap::<String, i64>::new()));
    let b = balances.clone();
    let handler = typed(move |e: Entry, d| {           // JSON-decoded; a bad payload is dead-lettered
        let b = b.clone();
        async move {
            let mut balances = b.lock().unwrap();
            let balance = balances.entry(String::from_utf8_lossy(d.key().unwrap()).into()).or_default();
            if *balance + e.cents < 0 { return Err(HandlerError::terminal("overdraft")) }
            *balance += e.cents;
            Ok(())
        }
    });
    let engine = Engine::builder(handler).dead_letter_sink(MemoryDeadLetterSink::new(&broker, "ledger.dlq")).build().unwrap();
    let consumer = engine.spawn(MemoryTransport::new(&broker, "bank", &["ledger"]).subscribe().await.unwrap());
    let publisher = MemoryPublisher::new(&broker, "ledger");
    for (account, cents) in (0..100).flat_map(|a| [(a, 500), (a, -300), (a, -200)]) {
        publisher.publish(OutgoingMessage::new(format!("acct-{account}"), format!(r#"{{"cents":{cents}}}"#))).await.unwrap();
    }
    while consumer.stats().handled < 300 { tokio::time::sleep(Duration::from_millis(5)).await }
    consumer.stop().await.unwrap();
    assert!(balances.lock().unwrap().values().all(|b| *b == 0));
    assert!(broker.read_all("ledger.dlq").is_empty(), "no debit ran before its credit");
}
