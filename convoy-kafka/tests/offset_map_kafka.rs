//! The offset map survives a round trip through the broker: what one member commits (the
//! watermark plus finished offsets above it, in commit metadata) is what the next member of the
//! group is assigned, so it skips work already done.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::time::Duration;

use convoy_core::transport::{Commit, SourceEvent};
use convoy_core::{OutgoingMessage, Publisher, Transport};
use convoy_kafka::convert::source_id;
use convoy_kafka::{KafkaPublisher, KafkaTransport};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_offsets_above_the_watermark_reach_the_next_owner() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    let topic = common::unique("convoy-map");
    common::create_topic(&bootstrap, &topic, 1).await;
    let config = common::test_config(&bootstrap, &common::unique("convoy-map-group"), &topic);
    let source = source_id(&topic, 0);
    // Offsets 0..39 exist, so the position committed below is inside the partition (one past
    // its end would be taken for a truncated log and dropped: tests/topic_changes_kafka.rs).
    let publisher = KafkaPublisher::new(&config, &topic).unwrap();
    let messages = (0..40)
        .map(|i| OutgoingMessage::new("k", i.to_string()))
        .collect();
    publisher.publish_all(messages).await.unwrap();

    let mut first = KafkaTransport::new(config.clone())
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let assigned = tokio::time::timeout(Duration::from_secs(30), first.events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(assigned, SourceEvent::Assigned(ref a) if a[0].committed.is_none()),
        "{assigned:?}"
    );
    let finished_above = vec![12, 13, 14, 20, 31];
    first
        .control
        .commit(&[Commit {
            token: 0,
            source: source.clone(),
            next: 10,
            finished_above: finished_above.clone(),
        }])
        .await
        .unwrap();
    first.control.close().await.unwrap();
    let mut second = KafkaTransport::new(config).unwrap().subscribe().await.unwrap();
    let assigned = tokio::time::timeout(Duration::from_secs(30), second.events.recv())
        .await
        .unwrap()
        .unwrap();
    let SourceEvent::Assigned(assignments) = assigned else {
        panic!("expected an assignment, got {assigned:?}")
    };
    assert_eq!(assignments[0].source, source);
    assert_eq!(assignments[0].committed, Some(9));
    assert_eq!(
        assignments[0].finished_above, finished_above,
        "the offset map came back from the broker's commit metadata"
    );
    second.control.close().await.unwrap();
}
