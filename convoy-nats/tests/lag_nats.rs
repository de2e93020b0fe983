//! Lag on NATS is exact: a topic's partitions share one stream, so a partition's stream
//! sequences skip the others' and "newest minus committed" overcounts. The backlog of a partition
//! is the number of its own messages above the committed one — 0 on an empty partition, 0 once
//! everything is committed — what alerts and autoscalers read.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use convoy_core::partitioner::partition_for_key;
use convoy_core::transport::{SourceEvent, Subscription};
use convoy_core::{OutgoingMessage, Publisher, SourceId, Transport};
use convoy_nats::NatsTransport;

const PARTITIONS: u32 = 4;

/// A key of `partition`.
fn key_of(partition: u32) -> String {
    (0..)
        .map(|i| format!("k{i}"))
        .find(|k| partition_for_key(k.as_bytes(), PARTITIONS) == partition)
        .unwrap()
}

/// Reads events until `partitions` more are assigned and `n` messages arrived: their offsets per
/// source, in order.
async fn read(subscription: &mut Subscription, partitions: usize, n: usize) -> BTreeMap<SourceId, Vec<u64>> {
    let mut assigned = 0;
    let mut seen: BTreeMap<SourceId, Vec<u64>> = BTreeMap::new();
    while assigned < partitions || seen.values().map(Vec::len).sum::<usize>() < n {
        match tokio::time::timeout(Duration::from_secs(30), subscription.events.recv())
            .await
            .expect("events within 30 s")
        {
            Some(SourceEvent::Assigned(list)) => {
                assigned += list.len();
                for a in list {
                    seen.entry(a.source).or_default();
                }
            }
            Some(SourceEvent::Messages { source, messages }) => {
                seen.entry(source)
                    .or_default()
                    .extend(messages.iter().map(|m| m.offset));
            }
            Some(_) => {}
            None => panic!("the subscription ended"),
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitions_backlog_counts_its_own_messages_above_the_committed_one() {
    let Some(server) = common::server() else {
        return;
    };
    let bed = common::NatsBed::new(&server, PARTITIONS).await;
    let mut member = NatsTransport::new(bed.config.clone())
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let sources = read(&mut member, PARTITIONS as usize, 0).await;
    let none: Vec<(SourceId, Option<u64>)> = sources.keys().map(|s| (s.clone(), None)).collect();
    assert_eq!(
        member.control.backlogs(&none).await,
        vec![Some(0); PARTITIONS as usize],
        "empty partitions have nothing to catch up"
    );

    // Partition 0's three messages interleaved with two of each other partition's.
    let publisher = convoy_nats::NatsPublisher::new(&bed.config, &bed.topic);
    for round in 0..3 {
        publisher
            .publish(OutgoingMessage::new(key_of(0), format!("p0 #{round}")))
            .await
            .unwrap();
        if round < 2 {
            for p in 1..PARTITIONS {
                publisher
                    .publish(OutgoingMessage::new(key_of(p), format!("p{p} #{round}")))
                    .await
                    .unwrap();
            }
        }
    }
    let seen = read(&mut member, 0, 3 + 2 * (PARTITIONS as usize - 1)).await;
    let (first, offsets) = seen.iter().next().unwrap();
    assert_eq!(offsets.len(), 3, "partition 0 got its three: {seen:?}");
    assert!(
        offsets[2] - offsets[0] > 2,
        "its sequences skip the others': {offsets:?}"
    );

    let backlogs = member.control.backlogs(&none).await;
    assert_eq!(
        backlogs[0],
        Some(3),
        "nothing committed: all three of partition 0"
    );
    assert!(backlogs[1..].iter().all(|b| *b == Some(2)), "{backlogs:?}");
    let after_first = member
        .control
        .backlogs(&[(first.clone(), Some(offsets[0]))])
        .await;
    assert_eq!(after_first, [Some(2)], "the first committed: the two after it");
    let all = member
        .control
        .backlogs(&[(first.clone(), Some(offsets[2]))])
        .await;
    assert_eq!(all, [Some(0)], "everything committed");
    member.control.close().await.unwrap();
}
