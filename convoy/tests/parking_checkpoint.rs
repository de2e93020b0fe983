//! Parked keys' checkpoints on `memory://`: an engine that wrote `park_checkpoint_after`
//! records reads the dead-letter destination back and saves its group's checkpoint without a
//! rebalance, and the next engine of the group, starting from it, keeps the key parked.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use convoy::prelude::*;

async fn run_until(running: &convoy::EngineHandle, finished: u64) {
    while running.stats().finished() < finished {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn an_engine_that_wrote_enough_records_saves_a_checkpoint_the_next_one_reads() {
    let connection = convoy::connect("memory://parking-checkpoint?topics=ledger&partitions=1&group=billing")
        .await
        .unwrap();
    let broker = connection.memory_broker().unwrap().clone();
    let dlq = connection.dlq_topic().unwrap();
    let handled = Arc::new(AtomicU64::new(0));
    let engine = |handled: Arc<AtomicU64>| {
        let mut config = connection.engine_config().unwrap();
        config.park_keys = true;
        config.park_checkpoint_after = 5;
        Engine::builder(handler_fn(move |d: Delivery| {
            let handled = handled.clone();
            async move {
                if d.payload_str()? == "poison" {
                    return Err(HandlerError::terminal("cannot apply"));
                }
                handled.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        }))
        .config(config)
        .dead_letter_sink(connection.dead_letter_sink().unwrap())
        .build()
        .unwrap()
    };
    let publisher = connection.publisher("ledger").unwrap();
    let first = engine(handled.clone()).start(&connection).await.unwrap();
    assert_eq!(
        broker.load_checkpoint(&dlq, "billing", 0),
        None,
        "nothing written yet"
    );
    publisher
        .publish(OutgoingMessage::new("acct-1", "poison"))
        .await
        .unwrap();
    for i in 0..8 {
        publisher
            .publish(OutgoingMessage::new("acct-1", format!("entry {i}")))
            .await
            .unwrap();
    }
    // The dead letter and eight set aside: nine records, past five.
    run_until(&first, 9).await;
    assert_eq!(first.stats().parked, 8);
    // Saved on one of the engine's next ticks (virtual time: a minute is plenty).
    let mut checkpoint = None;
    for _ in 0..1200 {
        checkpoint = broker.load_checkpoint(&dlq, "billing", 0);
        if checkpoint.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    checkpoint.expect("a checkpoint saved without a rebalance");
    let sink = connection.dead_letter_sink().unwrap();
    let read = convoy::parking::ParkedKeys::catch_up("billing", &*sink, usize::MAX)
        .await
        .unwrap();
    assert!(read.from_checkpoint, "the group's checkpoint, whole");
    assert_eq!(read.keys.get(b"acct-1").map(|p| p.pending()), Some(9));
    first.stop().await.unwrap();

    // The next engine of the group reads the checkpoint (and nothing after it): acct-1 is
    // still parked, other keys flow.
    let second = engine(handled.clone()).start(&connection).await.unwrap();
    publisher
        .publish(OutgoingMessage::new("acct-1", "entry 8"))
        .await
        .unwrap();
    publisher
        .publish(OutgoingMessage::new("acct-2", "entry 0"))
        .await
        .unwrap();
    run_until(&second, 2).await;
    let stats = second.stop().await.unwrap().stats;
    assert_eq!((stats.parked, stats.handled), (1, 1), "{stats:?}");
    assert_eq!(handled.load(Ordering::Relaxed), 1, "only acct-2's entry ran");
}
