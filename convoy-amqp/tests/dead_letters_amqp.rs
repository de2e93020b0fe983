//! The dead-letter stream deleted while the engine runs is declared again, and the next poison
//! message is dead-lettered there (issue 25, item 10). Before, the sink kept its channel after
//! the broker returned the dead letter unroutable: every later one failed, and its lane retried
//! it forever.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use convoy_testkit::dead_letters::{
    a_checkpoint_of_a_deleted_destination_is_void, a_deleted_dead_letter_destination_is_declared_again,
};
use lapin::options::QueueDeleteOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_dead_letter_stream_is_declared_again() {
    let Some(uri) = common::uri() else {
        return;
    };
    let bed = common::AmqpBed::new(&uri, 1).await;
    let (config, stream) = (bed.config.clone(), bed.config.dlq_topic());
    a_deleted_dead_letter_destination_is_declared_again(&bed, || async move {
        let connection = convoy_amqp::connect::connect(&config, "test").await.unwrap();
        let channel = connection.create_channel().await.unwrap();
        channel
            .queue_delete(stream.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        convoy_amqp::connect::close(&connection, "deleted").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_a_deleted_dead_letter_stream_is_void() {
    let Some(uri) = common::uri() else {
        return;
    };
    let bed = common::AmqpBed::new(&uri, 1).await;
    let (config, stream) = (bed.config.clone(), bed.config.dlq_topic());
    a_checkpoint_of_a_deleted_destination_is_void(&bed, || async move {
        convoy_amqp::admin::delete_dead_letter_stream(&config, &stream)
            .await
            .unwrap();
    })
    .await;
}

/// Members reading back at once (a rebalance) each find their group's checkpoint: one holds it
/// between its get and its hand-back, and the others ask again instead of reading the
/// dead-letter stream from its start (17 of the 60 read-backs of the soak's RabbitMQ run did,
/// up to 28,799 records each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_of_one_checkpoint_at_once_each_find_it() {
    use convoy_core::DeadLetterSink;
    let Some(uri) = common::uri() else {
        return;
    };
    let bed = common::AmqpBed::new(&uri, 1).await;
    let sink = convoy_amqp::AmqpDeadLetterSink::new(&bed.config);
    let checkpoint = bytes::Bytes::from_static(b"a checkpoint");
    sink.save_checkpoint("g", 0, checkpoint.clone()).await.unwrap();
    for round in 0..5 {
        let loads = (0..8).map(|_| sink.load_checkpoint("g", 0));
        for found in futures_util::future::join_all(loads).await {
            assert_eq!(found.unwrap().as_ref(), Some(&checkpoint), "round {round}");
        }
    }
}

/// Deleting a group's checkpoint (`topic delete` of a dead-letter stream) deletes every part of
/// it: the head and both slots' parts (odd and even numbers, each run without a gap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_checkpoint_deletes_all_its_parts() {
    use convoy_core::DeadLetterSink;
    let Some(uri) = common::uri() else {
        return;
    };
    let bed = common::AmqpBed::new(&uri, 1).await;
    let sink = convoy_amqp::AmqpDeadLetterSink::new(&bed.config);
    // Slot 0 holds three parts (1, 3, 5), slot 1 one (2): 4 is missing, 5 is not.
    let parts = [0, 1, 2, 3, 5];
    for part in parts {
        let bytes = bytes::Bytes::from(format!("part {part}"));
        sink.save_checkpoint("g", part, bytes).await.unwrap();
    }
    convoy_amqp::admin::delete_checkpoint(&bed.config, &bed.config.dlq_topic(), "g")
        .await
        .unwrap();
    for part in parts {
        assert_eq!(
            sink.load_checkpoint("g", part).await.unwrap(),
            None,
            "part {part}"
        );
    }
}
