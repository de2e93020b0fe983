//! The PostgreSQL store (`CONVOY_POSTGRES_URL`, `scripts/brokers/postgres up`): one table for a
//! consumer group's members — what one member finished, another skips — groups kept apart, a
//! connection cut and made again, retention by count, and a refused address named without its
//! password.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use convoy_core::{
    handler_fn, Delivery, Engine, EngineConfig, EventId, IdempotencyStore, OutgoingMessage, Publisher,
};
use convoy_store::{PostgresIdempotencyStore, Retention};
use convoy_testkit::support::{required, unique};
use convoy_testkit::{MemoryBroker, MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};

fn header(n: u64) -> EventId {
    EventId::Header(Bytes::from(format!("ev-{n}")))
}

async fn store(url: &str, group: &str, retention: Retention) -> PostgresIdempotencyStore {
    PostgresIdempotencyStore::connect(url, group, retention)
        .await
        .unwrap()
}

/// Publishes `count` messages of 10 keys with event ids `ev-0 …`.
async fn publish(broker: &MemoryBroker, count: u64) {
    let publisher = MemoryPublisher::new(broker, "orders");
    for n in 0..count {
        let message =
            OutgoingMessage::new(format!("k{}", n % 10), format!("{n}")).event_id(format!("ev-{n}"));
        publisher.publish(message).await.unwrap();
    }
}

/// A member of `group` with `store` runs until `count` messages finished; how many its handler
/// ran and how many it skipped as duplicates.
async fn member(
    broker: &MemoryBroker,
    group: &str,
    store: Arc<dyn IdempotencyStore>,
    count: u64,
) -> (u64, u64) {
    let ran = Arc::new(AtomicU64::new(0));
    let handler = {
        let ran = ran.clone();
        handler_fn(move |_d: Delivery| {
            let ran = ran.clone();
            async move {
                ran.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        })
    };
    let running = Engine::builder(handler)
        .config(EngineConfig::for_group(group))
        .idempotency_store(store)
        .dead_letter_sink(MemoryDeadLetterSink::new(broker, "orders.dlq"))
        .build()
        .unwrap()
        .start(&MemoryTransport::new(broker, group, &["orders"]))
        .await
        .unwrap();
    while running.stats().finished() < count {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let report = running.stop().await.unwrap();
    (ran.load(Ordering::Relaxed), report.stats.duplicates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_member_finished_another_skips() {
    let Some(url) = required("CONVOY_POSTGRES_URL") else {
        return;
    };
    let group = unique("billing");
    let broker = MemoryBroker::new();
    broker.create_topic("orders", 4);
    publish(&broker, 200).await;

    let first = Arc::new(store(&url, &group, Retention::default()).await);
    assert_eq!(member(&broker, &group, first.clone(), 200).await, (200, 0));
    assert!(first.flush().await, "written to the table");

    // The producer sends them all again; another member (its own connection, nothing in
    // memory) receives them: every one is skipped.
    publish(&broker, 200).await;
    let second = Arc::new(store(&url, &group, Retention::default()).await);
    assert_eq!(member(&broker, &group, second.clone(), 200).await, (0, 200));
    assert_eq!(second.failures(), 0);

    // Another group handles the same events on its own.
    let other = store(&url, &unique("audit"), Retention::default()).await;
    assert!(!other.contains(&header(7)).await);
    assert!(second.contains(&header(7)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_connection_is_made_again_and_nothing_recorded_is_lost() {
    let Some(url) = required("CONVOY_POSTGRES_URL") else {
        return;
    };
    let group = unique("cut");
    let store = store(&url, &group, Retention::default()).await;
    store.insert(header(1)).await;
    assert!(store.flush().await);

    // The server ends the store's connection (an administrator, a failover); the store names
    // itself in pg_stat_activity.
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let ended = admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("convoy-idempotency/{group}")],
        )
        .await
        .unwrap();
    assert!(ended >= 1, "the store's connection was ended");

    store.insert(header(2)).await;
    // Written once the connection is made again (the first attempt may meet the dead one).
    let mut written = false;
    for _ in 0..100 {
        if store.flush().await {
            written = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(written, "the store connected again and wrote");
    let fresh = PostgresIdempotencyStore::connect(&url, &group, Retention::default())
        .await
        .unwrap();
    assert!(fresh.contains(&header(1)).await && fresh.contains(&header(2)).await);
    assert!(!fresh.contains(&header(3)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_the_newest_ids() {
    let Some(url) = required("CONVOY_POSTGRES_URL") else {
        return;
    };
    let group = unique("retention");
    let store = store(&url, &group, Retention::unlimited().max_ids(10)).await;
    for n in 0..50 {
        store.insert(header(n)).await;
        // One write each: each id its own finish time, in order.
        assert!(store.flush().await);
    }
    assert_eq!(store.apply_retention().await, Some(40));
    let fresh = PostgresIdempotencyStore::connect(&url, &group, Retention::unlimited())
        .await
        .unwrap();
    assert!(!fresh.contains(&header(0)).await && !fresh.contains(&header(39)).await);
    assert!(fresh.contains(&header(40)).await && fresh.contains(&header(49)).await);
}

#[tokio::test]
async fn a_refused_address_is_named_without_its_password() {
    let port = convoy_testkit::support::free_port().unwrap();
    let url = format!("postgres://convoy:s3cret@127.0.0.1:{port}/billing");
    let err = PostgresIdempotencyStore::connect(&url, "billing", Retention::default())
        .await
        .err()
        .unwrap();
    let text = err.to_string();
    assert!(
        text.contains(&format!("postgres://convoy:***@127.0.0.1:{port}/billing")),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
}
