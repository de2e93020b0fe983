//! Ownership on NATS: partitions spread over the live members within ±1 of their fair share; a
//! partition left by a member reaches the next owner from the committed watermark + 1, in
//! order, before anything newer; a member whose lease was taken reports the partition lost and
//! can no longer commit it.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::time::Duration;

use convoy_core::transport::{Commit, SourceEvent};
use convoy_core::{SourceId, Transport, TransportError};
use convoy_nats::{topology, NatsTransport};
use convoy_testkit::conformance::TestBed;
use convoy_testkit::ownership::partitions_spread_within_one_of_their_share;
use convoy_testkit::probe::{decode_seq, probe_key, publish_load};
use convoy_testkit::OrderChecker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_spread_over_the_members_within_one_of_their_share() {
    let Some(server) = common::server() else {
        return;
    };
    let bed = common::NatsBed::new(&server, 8).await;
    let transport = NatsTransport::new(bed.config.clone()).unwrap();
    partitions_spread_within_one_of_their_share(&bed, &transport).await;
    let used: std::collections::BTreeSet<u32> = (0..40)
        .map(|k| convoy_core::partitioner::partition_for_key(&probe_key("k", k), 8))
        .collect();
    assert_eq!(
        bed.committed().await.unwrap().len(),
        used.len(),
        "every partition that got messages committed"
    );
}

/// Reads `n` messages of a raw subscription: (source, offset, probe sequence).
async fn read(
    subscription: &mut convoy_core::transport::Subscription,
    n: usize,
) -> Vec<(SourceId, u64, u64)> {
    let mut seen = Vec::new();
    while seen.len() < n {
        match tokio::time::timeout(Duration::from_secs(30), subscription.events.recv())
            .await
            .expect("messages within 30 s")
        {
            Some(SourceEvent::Messages { messages, .. }) => seen.extend(
                messages
                    .iter()
                    .map(|m| (m.source.clone(), m.offset, decode_seq(&m.payload).unwrap())),
            ),
            Some(_) => {}
            None => panic!("the subscription ended"),
        }
    }
    seen
}

/// A member read 100 messages of a partition, committed through the 10th and went away: the
/// next owner reads 11…100 first, in order, then the 20 published meanwhile — nothing older than
/// the watermark, nothing newer first, nothing lost because it was fetched before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_owner_starts_after_the_watermark_and_in_order() {
    let Some(server) = common::server() else { return };
    let bed = common::NatsBed::new(&server, 1).await;
    let checker = OrderChecker::new();
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 100)
        .await
        .unwrap();
    let mut first = NatsTransport::new(bed.config.clone())
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let seen = read(&mut first, 100).await;
    assert_eq!(
        seen.iter().map(|s| s.2).collect::<Vec<_>>(),
        (0..100).collect::<Vec<u64>>()
    );
    let (source, tenth, _) = seen[9].clone();
    first
        .control
        .commit(&[Commit {
            token: 0,
            source: source.clone(),
            next: tenth + 1,
            finished_above: Vec::new(),
        }])
        .await
        .unwrap();
    first.control.close().await.unwrap();
    assert_eq!(bed.committed().await.unwrap().get(&source), Some(&tenth));
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 20)
        .await
        .unwrap();
    let mut second = NatsTransport::new(bed.config.clone())
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let got: Vec<u64> = read(&mut second, 110).await.into_iter().map(|s| s.2).collect();
    assert_eq!(
        got,
        (10..120).collect::<Vec<u64>>(),
        "from the watermark, in order, then newer"
    );
    second.control.close().await.unwrap();
}

/// Another member took the partition's lease (here: forced, as after this member's lease
/// expired while it was cut off): the member reports the partition lost and cannot commit it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_lease_was_taken_reports_the_partition_lost() {
    let Some(server) = common::server() else { return };
    let bed = common::NatsBed::new(&server, 1).await;
    let checker = OrderChecker::new();
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 5)
        .await
        .unwrap();
    let mut member = NatsTransport::new(bed.config.clone())
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let seen = read(&mut member, 5).await;
    let source = seen[0].0.clone();
    // The intruder writes over the lease, as the next owner does once it expired.
    let connected = convoy_nats::connect::connect(&bed.config, "intruder")
        .await
        .unwrap();
    let leases = connected
        .js
        .get_key_value(topology::leases_bucket(&bed.config.group))
        .await
        .unwrap();
    let key = topology::partition_key(&bed.topic, 0);
    leases.purge(&key).await.unwrap();
    leases.create(&key, "intruder".into()).await.unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match member.events.recv().await {
                Some(SourceEvent::Lost(sources)) => return sources,
                Some(_) => {}
                None => panic!("the subscription ended"),
            }
        }
    })
    .await
    .expect("the loss is noticed within a renewal or two");
    assert_eq!(lost, vec![source.clone()]);
    let refused = member
        .control
        .commit(&[Commit {
            token: 0,
            source: source.clone(),
            next: seen[4].1 + 1,
            finished_above: Vec::new(),
        }])
        .await;
    assert!(matches!(refused, Err(TransportError::NotOwner(_))), "{refused:?}");
    assert!(bed.committed().await.unwrap().is_empty(), "nothing was committed");
    member.control.close().await.unwrap();
}
