//! The dead-letter stream deleted while the engine runs is declared again by the sink, and the
//! next poison message is dead-lettered there (issue 25, item 10). Before, the sink remembered
//! "declared" for good: every later dead letter failed "no stream answered", and its lane
//! retried it forever.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use convoy_nats::topology;
use convoy_testkit::dead_letters::{
    a_checkpoint_of_a_deleted_destination_is_void, a_deleted_dead_letter_destination_is_declared_again,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_dead_letter_stream_is_declared_again() {
    let Some(server) = common::server() else {
        return;
    };
    let bed = common::NatsBed::new(&server, 1).await;
    let stream = topology::stream_name(&bed.config.dlq_topic());
    a_deleted_dead_letter_destination_is_declared_again(&bed, || async {
        let client = async_nats::connect(&server).await.unwrap();
        let js = async_nats::jetstream::new(client);
        js.delete_stream(&stream).await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_a_deleted_dead_letter_stream_is_void() {
    let Some(server) = common::server() else {
        return;
    };
    let bed = common::NatsBed::new(&server, 1).await;
    let stream = topology::stream_name(&bed.config.dlq_topic());
    a_checkpoint_of_a_deleted_destination_is_void(&bed, || async {
        let client = async_nats::connect(&server).await.unwrap();
        let js = async_nats::jetstream::new(client);
        js.delete_stream(&stream).await.unwrap();
    })
    .await;
}
