//! Ownership on RabbitMQ: partitions spread over the live members within ±1 of their fair share,
//! and a partition handed over — or left by a member that stops without committing — reaches
//! the next owner from its watermark, in order, before anything newer.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::time::Duration;

use convoy_amqp::AmqpTransport;
use convoy_core::transport::{Commit, SourceEvent};
use convoy_core::Transport;
use convoy_testkit::conformance::TestBed;
use convoy_testkit::ownership::partitions_spread_within_one_of_their_share;
use convoy_testkit::probe::{decode_seq, publish_load};
use convoy_testkit::OrderChecker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_spread_over_the_members_within_one_of_their_share() {
    let Some(uri) = common::uri() else {
        return;
    };
    common::init_tracing();
    let bed = common::AmqpBed::new(&uri, 8).await;
    let transport = AmqpTransport::new(bed.config.clone()).unwrap();
    partitions_spread_within_one_of_their_share(&bed, &transport).await;
    assert_eq!(bed.remaining().await.unwrap(), 0);
}

/// Verified rather than assumed: a member that received 100 messages of one partition queue,
/// acknowledged 10 and went away (channel closed, nothing cancelled) leaves 11…100 to the next
/// owner, who receives them first, in order, then the 20 published meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_owner_gets_the_unacknowledged_first_and_in_order() {
    let Some(uri) = common::uri() else { return };
    let bed = common::AmqpBed::new(&uri, 1).await;
    let checker = OrderChecker::new();
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 100)
        .await
        .unwrap();
    let mut first = AmqpTransport::new(bed.config.clone())
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut token = None;
    while seen.len() < 100 {
        match tokio::time::timeout(Duration::from_secs(30), first.events.recv())
            .await
            .unwrap()
        {
            Some(SourceEvent::Assigned(assignments)) => token = assignments.first().map(|a| a.token),
            Some(SourceEvent::Messages { messages, .. }) => {
                seen.extend(
                    messages
                        .iter()
                        .map(|m| (m.source.clone(), m.offset, decode_seq(&m.payload).unwrap())),
                );
            }
            Some(_) => {}
            None => panic!("the subscription ended"),
        }
    }
    let (source, tag10, _) = seen[9].clone();
    first
        .control
        .commit(&[Commit {
            token: token.expect("the partition was assigned before its messages came"),
            source,
            next: tag10 + 1,
            finished_above: Vec::new(),
        }])
        .await
        .unwrap();
    first.control.close().await.unwrap();
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 20)
        .await
        .unwrap();
    let mut second = AmqpTransport::new(bed.config.clone())
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < 110 {
        match tokio::time::timeout(Duration::from_secs(30), second.events.recv())
            .await
            .unwrap()
        {
            Some(SourceEvent::Messages { messages, .. }) => {
                got.extend(messages.iter().map(|m| decode_seq(&m.payload).unwrap()));
            }
            Some(_) => {}
            None => panic!("the subscription ended"),
        }
    }
    assert_eq!(
        got,
        (10..120).collect::<Vec<u64>>(),
        "from the watermark, in order, then newer"
    );
    second.control.close().await.unwrap();
    // Nothing was acknowledged by the second member: everything from 10 on is still there.
    assert_eq!(bed.remaining().await.unwrap(), 110);
}
