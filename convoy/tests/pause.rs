//! An operator's pause of a key or a source (`memory://`): a paused key starts nothing (the
//! message in flight finishes), its messages wait in order and run once resumed; other keys
//! go on. A paused source delivers nothing new until resumed, also when assigned after the
//! pause.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy::prelude::*;
use convoy::{Handler, Paused, SourceId};
use tokio::sync::Notify;

async fn wait_finished(running: &convoy::EngineHandle, finished: u64) {
    while running.stats().finished() < finished {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// `handler` through an engine on `connection`.
async fn start(connection: &convoy::Connection, handler: impl Handler) -> convoy::EngineHandle {
    Engine::builder(handler)
        .config(connection.engine_config().unwrap())
        .dead_letter_sink(connection.dead_letter_sink().unwrap())
        .build()
        .unwrap()
        .start(connection)
        .await
        .unwrap()
}

fn of(seen: &Mutex<Vec<(String, u32)>>, key: &str) -> Vec<u32> {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, n)| *n)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_key_waits_in_order_while_others_go_on() {
    let connection = convoy::connect("memory://pause-key?topics=orders&partitions=2&group=g")
        .await
        .unwrap();
    connection.create_topics().await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::<(String, u32)>::new()));
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = {
        let (seen, started, release) = (seen.clone(), started.clone(), release.clone());
        handler_fn(move |d: Delivery| {
            let (seen, started, release) = (seen.clone(), started.clone(), release.clone());
            async move {
                let key = d.key_display().into_owned();
                let n: u32 = d.payload_str()?.parse().map_err(HandlerError::malformed)?;
                if key == "a" && n == 1 {
                    // a's first message is in flight when the pause comes.
                    started.notify_one();
                    release.notified().await;
                }
                seen.lock().unwrap().push((key, n));
                Ok(())
            }
        })
    };
    let running = start(&connection, handler).await;
    let pauser = running.pauser();
    let publisher = connection.publisher("orders").unwrap();
    let batch = |key: &'static str, ns: std::ops::RangeInclusive<u32>| {
        ns.map(move |n| OutgoingMessage::new(key, n.to_string()))
            .collect::<Vec<_>>()
    };
    publisher.publish_all(batch("a", 1..=5)).await.unwrap();
    started.notified().await;

    assert!(pauser.pause_key("a").await);
    release.notify_one();
    wait_finished(&running, 1).await; // a1, in flight at the pause, finishes
    publisher.publish_all(batch("b", 1..=5)).await.unwrap();
    wait_finished(&running, 6).await;
    assert_eq!(of(&seen, "a"), [1], "nothing of a starts while it is paused");
    assert_eq!(of(&seen, "b"), [1, 2, 3, 4, 5], "other keys go on");
    assert_eq!(
        pauser.paused().await.unwrap(),
        Paused {
            keys: vec!["a".into()],
            sources: vec![]
        }
    );
    // More of a arrives while paused: it waits behind the rest.
    publisher.publish_all(batch("a", 6..=7)).await.unwrap();
    let lanes = running.inspector().inspect(10).await.unwrap();
    assert!(
        lanes.backlog.iter().any(|l| l.key == "a"),
        "a's messages wait in its lane: {lanes:?}"
    );

    assert!(pauser.resume_key("a").await);
    wait_finished(&running, 12).await;
    assert_eq!(of(&seen, "a"), [1, 2, 3, 4, 5, 6, 7], "in order once resumed");
    assert_eq!(pauser.paused().await.unwrap(), Paused::default());
    let report = running.stop().await.unwrap();
    assert_eq!(report.stats.handled, 12);
    assert!(!pauser.pause_key("a").await, "a stopped engine says so");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_source_delivers_nothing_new_until_resumed() {
    let connection = convoy::connect("memory://pause-source?topics=orders&partitions=2&group=g")
        .await
        .unwrap();
    connection.create_topics().await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::<(String, u32)>::new()));
    let handler = {
        let seen = seen.clone();
        handler_fn(move |d: Delivery| {
            let seen = seen.clone();
            async move {
                let n: u32 = d.payload_str()?.parse().map_err(HandlerError::malformed)?;
                seen.lock().unwrap().push((d.source().to_string(), n));
                Ok(())
            }
        })
    };
    let running = start(&connection, handler).await;
    let pauser = running.pauser();
    let zero = SourceId::partition("orders", 0);
    assert!(pauser.pause_source(zero.clone()).await);

    // Keys on both partitions; which key lands where is the partitioner's.
    let publisher = connection.publisher("orders").unwrap();
    let mut receipts = Vec::new();
    for n in 0..40u32 {
        receipts.push(
            publisher
                .publish(OutgoingMessage::new(format!("k{n}"), n.to_string()))
                .await
                .unwrap(),
        );
    }
    let on_zero = receipts.iter().filter(|r| r.source == zero).count() as u64;
    assert!(on_zero > 0 && on_zero < 40, "both partitions get keys");
    wait_finished(&running, 40 - on_zero).await;
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|(source, _)| source != zero.as_str()),
        "nothing of the paused source ran"
    );
    let lanes = running.inspector().inspect(10).await.unwrap();
    assert!(
        lanes.sources.iter().any(|s| s.source == zero && s.paused),
        "{lanes:?}"
    );

    assert!(pauser.resume_source(zero.clone()).await);
    wait_finished(&running, 40).await;
    assert_eq!(seen.lock().unwrap().len(), 40);
    running.stop().await.unwrap();
}
