//! The partition count is part of a topic's identity on RabbitMQ too: a publisher or a member
//! configured with another count than the topic was declared with is refused, naming both
//! counts. Before, a producer configured with 8 partitions against a group declared with 6
//! created queues p6 and p7 itself, reported success and stranded the messages hashed there
//! where no consumer ever reads them (issue 25, item 3).

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use convoy_amqp::{AmqpPublisher, AmqpTransport};
use convoy_core::{OutgoingMessage, Publisher, Transport};
use convoy_testkit::conformance::TestBed;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_partition_count_than_the_topics_is_refused_naming_both() {
    let Some(uri) = common::uri() else { return };
    let bed = common::AmqpBed::new(&uri, 6).await;
    let mut eight = bed.config.clone();
    eight.partitions = 8;

    let refused = AmqpPublisher::new(&eight, &bed.topic)
        .publish(OutgoingMessage::new("k", "0"))
        .await
        .unwrap_err();
    let text = refused.to_string();
    assert!(refused.is_fatal(), "{text}");
    eprintln!("{text}");
    assert!(text.contains("8 configured") && text.contains('6'), "{text}");

    let refused = AmqpTransport::new(eight).unwrap().subscribe().await.unwrap_err();
    let text = refused.to_string();
    assert!(text.contains("8 configured") && text.contains('6'), "{text}");

    // The topic's own count is fine, and nothing was declared for the other one.
    bed.publisher()
        .publish(OutgoingMessage::new("k", "0"))
        .await
        .unwrap();
    assert_eq!(bed.ready().await.unwrap(), 1);
}
