//! Messages from a foreign producer (no convoy stamps: only the key header, as the pika snippet
//! publishes) across a cut connection. A delivery tag restarts at 1 on every channel, so an id
//! derived from (source, tag) would name a different message after the reconnect: the second
//! five were taken for duplicates of the first five and acknowledged unhandled (issue 25, item
//! 1). Now no id is derived from a tag, and AMQP's own `message_id` is the event id when a
//! producer sets one.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_amqp::{AmqpDeadLetterSink, AmqpTransport};
use convoy_core::Engine;
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};

const LIMIT: Duration = Duration::from_secs(60);

/// Publishes probe `seq` of `key` the way a foreign producer does: the key header and nothing
/// else of convoy's — and a `message_id` only when given.
async fn publish_foreign(uri: &str, topic: &str, key: &str, seq: u64, message_id: Option<&str>) {
    let connection = Connection::connect(uri, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut headers = FieldTable::default();
    headers.insert(ShortString::from("convoy-key"), AMQPValue::LongString(key.into()));
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(id) = message_id {
        properties = properties.with_message_id(id.into());
    }
    channel
        .basic_publish(
            topic.into(),
            "0".into(), // the one partition
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            seq.to_string().as_bytes(),
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let _ = connection.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_messages_after_a_reconnect_are_handled_and_message_ids_deduplicate() {
    let Some(uri) = common::uri() else {
        return;
    };
    let bed = common::AmqpBed::new(&uri, 1).await;
    let (proxy, through_proxy) = common::behind_proxy(&uri, &bed.config).await;
    let checker = Arc::new(OrderChecker::new());
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(&bed.config.group))
        .dead_letter_sink(RecordingSink::new(
            Arc::new(AmqpDeadLetterSink::new(&bed.config)),
            checker.clone(),
        ))
        .build()
        .unwrap()
        .start(&AmqpTransport::new(through_proxy).unwrap())
        .await
        .unwrap();

    for _ in 0..5 {
        let seq = checker.expect(&bytes::Bytes::from_static(b"k"));
        publish_foreign(&uri, &bed.topic, "k", seq, None).await;
    }
    assert!(
        checker.wait_complete(LIMIT).await,
        "the first five: {:?}",
        checker.report()
    );
    let connections = proxy.accepted();
    proxy.cut();
    // Delivered on the member's next channel with tags 1…5 again.
    for _ in 0..5 {
        let seq = checker.expect(&bytes::Bytes::from_static(b"k"));
        publish_foreign(&uri, &bed.topic, "k", seq, None).await;
    }
    assert!(
        checker.wait_complete(LIMIT).await,
        "the five published after the cut were not all handled: {:?}; engine {:?}",
        checker.report(),
        engine.stats()
    );
    assert!(
        proxy.accepted() > connections,
        "the member reconnected through the proxy"
    );
    assert_eq!(engine.stats().duplicates, 0, "nothing was skipped as a duplicate");

    // A foreign producer's re-send carries the same message_id: it is skipped. (Before it, the
    // messages unacknowledged at the cut came again on the new channel and, having no id, were
    // handled again: at least once.)
    let handled_before = checker.report().handled;
    let seq = checker.expect(&bytes::Bytes::from_static(b"k"));
    publish_foreign(&uri, &bed.topic, "k", seq, Some("order-11")).await;
    publish_foreign(&uri, &bed.topic, "k", seq, Some("order-11")).await;
    assert!(checker.wait_complete(LIMIT).await, "{:?}", checker.report());
    let deadline = tokio::time::Instant::now() + LIMIT;
    while engine.stats().duplicates < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the re-send was never skipped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    engine.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 11);
    assert_eq!(
        report.handled - handled_before,
        1,
        "the re-sent message_id was handled once"
    );
}

/// A commit computed for a partition's earlier channel (the engine may send it just before it
/// hears the channel was lost) names tags of that channel; acknowledged on the next channel it
/// would remove messages nobody handled. The control refuses it by the assignment's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_of_an_earlier_channel_is_never_acknowledged_on_the_next() {
    use convoy_core::transport::{Commit, SourceEvent};
    use convoy_core::Transport;
    let Some(uri) = common::uri() else { return };
    let bed = common::AmqpBed::new(&uri, 1).await;
    let (proxy, through_proxy) = common::behind_proxy(&uri, &bed.config).await;
    let checker = OrderChecker::new();
    for _ in 0..5 {
        let seq = checker.expect(&bytes::Bytes::from_static(b"k"));
        publish_foreign(&uri, &bed.topic, "k", seq, None).await;
    }
    let mut subscription = AmqpTransport::new(through_proxy)
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    // (token, highest tag received) of each channel, in order.
    let mut channels: Vec<(u64, u64)> = Vec::new();
    let mut cut = false;
    while channels.len() < 2 || channels[1].1 < 5 {
        let event = tokio::time::timeout(LIMIT, subscription.events.recv())
            .await
            .expect("events within the limit")
            .expect("the subscription goes on");
        match event {
            SourceEvent::Assigned(assignments) => {
                assert!(
                    !assignments[0].offsets_are_positions,
                    "delivery tags are no positions"
                );
                channels.push((assignments[0].token, 0));
            }
            SourceEvent::Messages { messages, .. } => {
                let last = channels.last_mut().expect("assigned before messages");
                last.1 = last.1.max(messages.iter().map(|m| m.offset).max().unwrap_or(0));
                if last.1 == 5 && !cut {
                    cut = true;
                    proxy.cut(); // the five come again on the next channel, tags 1…5
                }
            }
            _ => {}
        }
    }
    let (old, new) = (channels[0].0, channels[1].0);
    assert_ne!(old, new, "each channel has a token of its own");
    let source = convoy_core::SourceId::partition(&bed.topic, 0);
    subscription
        .control
        .commit(&[Commit {
            token: old,
            source: source.clone(),
            next: 6,
            finished_above: Vec::new(),
        }])
        .await
        .unwrap();
    subscription.control.close().await.unwrap();
    assert_eq!(
        bed.ready().await.unwrap(),
        5,
        "the stale commit acknowledged nothing: all five are back in the queue"
    );
}
