//! A key's order survives a refused publish (issue 25, item 10). JetStream answers each publish
//! on its own: a stream limited to small messages refuses one of a batch and stores the rest.
//! Pipelined, a key's message after the refused one was stored, and publishing the refused one
//! again would have stored it after its successor. convoy's publisher sends a batch in rounds —
//! nothing of a key before its earlier messages were confirmed — so after the refusal nothing
//! later of that key is stored; other keys' messages of the same round are.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use convoy_core::{OutgoingMessage, Publisher};
use convoy_nats::{admin, topology, NatsPublisher};

#[tokio::test]
async fn after_a_refused_message_nothing_later_of_its_key_is_stored() {
    let Some(server) = common::server() else {
        return;
    };
    let bed = common::NatsBed::new(&server, 1).await;
    // The stream refuses messages over 1 KiB from now on.
    let client = async_nats::connect(&server).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(topology::stream_name(&bed.topic)).await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.max_message_size = 1024;
    js.update_stream(config).await.unwrap();

    let big = "x".repeat(4096);
    let batch = vec![
        OutgoingMessage::new("k", "k1"),
        OutgoingMessage::new("j", "j1"),
        OutgoingMessage::new("k", big),
        OutgoingMessage::new("j", "j2"),
        OutgoingMessage::new("k", "k3"),
        OutgoingMessage::new("j", "j3"),
    ];
    let publisher = NatsPublisher::new(&bed.config, &bed.topic);
    let refused = publisher.publish_all(batch).await;
    assert!(refused.is_err(), "the large message is refused");

    let stored: Vec<String> = admin::read_stream(&bed.config, &bed.topic)
        .await
        .unwrap()
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect();
    println!("stored after the refusal: {stored:?}");
    assert!(
        !stored.contains(&"k3".to_owned()),
        "k's message after the refused one was stored: {stored:?}"
    );
    assert_eq!(
        stored,
        ["k1", "j1", "j2"],
        "the round of the refusal went out whole, nothing after it"
    );
}
