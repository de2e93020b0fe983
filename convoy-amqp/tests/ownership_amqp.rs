//! Ownership on RabbitMQ: partitions spread over the live members within ±1 of their fair share,
//! and a partition handed over — or left by a member that stops without committing — reaches
//! the next owner from its watermark, in order, before anything newer.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_amqp::AmqpTransport;
use convoy_core::{Commit, Engine, EngineHandle, SourceEvent, Transport};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::probe::{decode_seq, publish_load, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;

async fn member(bed: &common::AmqpBed, checker: &Arc<OrderChecker>) -> EngineHandle {
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(bed.group()))
        .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
        .build()
        .unwrap();
    engine
        .start(&AmqpTransport::new(bed.config.clone()).unwrap())
        .await
        .unwrap()
}

/// Waits until the members own these many sources each (in any order).
async fn wait_for_shares(members: &[&EngineHandle], mut want: Vec<usize>) -> Vec<usize> {
    want.sort_unstable();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut have: Vec<usize> = members.iter().map(|m| m.stats().sources).collect();
        have.sort_unstable();
        if have == want || tokio::time::Instant::now() >= deadline {
            return have;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_spread_over_the_members_within_one_of_their_share() {
    let Some(uri) = common::uri() else {
        eprintln!("skipped: {} is not set", common::URI_VAR);
        return;
    };
    let bed = common::AmqpBed::new(&uri, 8).await;
    let checker = Arc::new(OrderChecker::new());
    let a = member(&bed, &checker).await;
    assert_eq!(wait_for_shares(&[&a], vec![8]).await, [8]);
    let b = member(&bed, &checker).await;
    assert_eq!(wait_for_shares(&[&a, &b], vec![4, 4]).await, [4, 4]);
    let c = member(&bed, &checker).await;
    assert_eq!(wait_for_shares(&[&a, &b, &c], vec![2, 3, 3]).await, [2, 3, 3]);
    // Messages flow to all of them, in order, with handovers in between.
    publish_load(bed.publisher().as_ref(), &checker, "k", 40, 10)
        .await
        .unwrap();
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "{:?}",
        checker.report()
    );
    b.stop().await.unwrap();
    assert_eq!(wait_for_shares(&[&a, &c], vec![4, 4]).await, [4, 4]);
    publish_load(bed.publisher().as_ref(), &checker, "k", 40, 10)
        .await
        .unwrap();
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "{:?}",
        checker.report()
    );
    a.stop().await.unwrap();
    c.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, report.published);
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
    while seen.len() < 100 {
        match tokio::time::timeout(Duration::from_secs(30), first.events.recv())
            .await
            .unwrap()
        {
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
