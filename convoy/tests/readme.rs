//! The README's handler, verbatim between the markers, run on the embedded broker and — the
//! one-line change — on Kafka and on RabbitMQ (when `CONVOY_KAFKA_BOOTSTRAP` and
//! `CONVOY_AMQP_URI` are set; scripts/test sets them).

#![allow(clippy::unwrap_used)]

mod snippet;

// README:BEGIN
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy::{typed, Delivery, Engine, HandlerError, OutgoingMessage};

#[derive(serde::Deserialize)]
struct Entry {
    cents: i64,
}

async fn ledger(url: &str, topic: &str) -> Result<HashMap<String, i64>, Box<dyn std::error::Error>> {
    let connection = convoy::connect(url).await?.with_topics(&[topic]); // memory://, kafka://…: same code
    connection.create_topics().await?;
    let balances = Arc::new(Mutex::new(HashMap::<String, i64>::new()));
    let b = balances.clone();
    let handler = typed(move |entry: Entry, d: Delivery| {
        // JSON-decoded; an undecodable payload is dead-lettered
        let b = b.clone();
        async move {
            let mut balances = b.lock().unwrap();
            let balance = balances.entry(d.key_display().into_owned()).or_default();
            if *balance + entry.cents < 0 {
                return Err(HandlerError::terminal("overdraft")); // dead letter; the account's lane goes on
            }
            *balance += entry.cents;
            Ok(())
        }
    });
    let engine = Engine::builder(handler)
        .dead_letter_sink(connection.dead_letter_sink()?)
        .build()?;
    let running = engine.start(&connection).await?; // joins the group; prefetch follows the engine's bounds
    let publisher = connection.publisher(topic)?;
    for (account, cents) in (0..100).flat_map(|a| [(a, 500), (a, -300), (a, -200)]) {
        let entry = OutgoingMessage::new(format!("acct-{account}"), format!(r#"{{"cents":{cents}}}"#));
        publisher.publish(entry).await?;
    }
    while running.stats().finished() < 300 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    running.stop().await?; // drains, commits the watermark, leaves the group
    let balances = balances.lock().unwrap().clone();
    Ok(balances)
}
// README:END

#[tokio::test]
async fn the_readme_ledger_on_memory() {
    let balances = ledger("memory://readme", "ledger").await.unwrap();
    assert_eq!(balances.len(), 100);
    assert!(
        balances.values().all(|b| *b == 0),
        "no debit ran before its credit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_ledger_on_kafka() {
    let Some(bootstrap) = convoy_testkit::support::required("CONVOY_KAFKA_BOOTSTRAP") else {
        return;
    };
    let unique = format!(
        "{}-{:x}",
        std::process::id(),
        std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos()
    );
    let url = format!("kafka://{bootstrap}?group=billing-{unique}");
    let balances = ledger(&url, &format!("ledger-{unique}")).await.unwrap();
    assert_eq!(balances.len(), 100);
    assert!(
        balances.values().all(|b| *b == 0),
        "no debit ran before its credit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_ledger_on_rabbitmq() {
    let Some(uri) = convoy_testkit::support::required("CONVOY_AMQP_URI") else {
        return;
    };
    let unique = format!(
        "{}-{:x}",
        std::process::id(),
        std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos()
    );
    let url = format!("{uri}?group=billing-{unique}");
    let topic = format!("ledger-{unique}");
    let balances = ledger(&url, &topic).await;
    // The broker is shared: delete what the run declared, whatever it returned.
    let connection = convoy::connect(&url).await.unwrap().with_topics(&[&topic]);
    connection.delete_topic(&topic).await.unwrap();
    let balances = balances.unwrap();
    assert_eq!(balances.len(), 100);
    assert!(
        balances.values().all(|b| *b == 0),
        "no debit ran before its credit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_ledger_on_nats() {
    let Some(server) = convoy_testkit::support::required("CONVOY_NATS_URL") else {
        return;
    };
    let unique = format!(
        "{}-{:x}",
        std::process::id(),
        std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos()
    );
    let url = format!("{server}?group=billing-{unique}");
    let topic = format!("ledger-{unique}");
    let balances = ledger(&url, &topic).await;
    // The server is shared: delete what the run created, whatever it returned.
    let connection = convoy::connect(&url).await.unwrap().with_topics(&[&topic]);
    connection.delete_topic(&topic).await.unwrap();
    let balances = balances.unwrap();
    assert_eq!(balances.len(), 100);
    assert!(
        balances.values().all(|b| *b == 0),
        "no debit ran before its credit"
    );
}

#[test]
fn the_readme_shows_this_code() {
    snippet::assert_readme_shows("readme.rs", include_str!("readme.rs"));
}
