//! A broker whose answers are lost (issue 25, item 10): the member's requests reach it, none is
//! answered, and the broker's heartbeats still arrive, so the connection looks alive to lapin
//! (the testkit proxy's `stall_answers_keep_heartbeats`; what lapin's seen hangs and a quorum
//! queue without a leader look like). Every call of a member is bounded in time, so it notices
//! its connection's lease ran out, reports its partitions lost and rejoins once answers flow
//! again. Unbounded, a balance round waited for the member count for as long as the answers
//! were held, with the connection's lease long run out, and the engine never heard that its
//! partitions were gone.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use convoy_amqp::AmqpTransport;
use convoy_core::transport::EventReceiver;
use convoy_core::transport::SourceEvent;
use convoy_core::Transport;

/// Far longer than any bounded call ([`convoy_amqp::error::CALL_TIMEOUT`]) plus a lease.
const LIMIT: Duration = Duration::from_secs(90);

/// Waits for events until `owned` (what the member holds, as the events say) satisfies `done`.
async fn until(
    events: &mut EventReceiver,
    owned: &mut BTreeSet<String>,
    what: &str,
    done: impl Fn(&BTreeSet<String>) -> bool,
) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !done(owned) {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting until {what}; holding {owned:?}"))
            .expect("the member ended");
        match event {
            SourceEvent::Assigned(list) => owned.extend(list.into_iter().map(|a| a.source.to_string())),
            SourceEvent::Lost(list) => {
                for source in list {
                    owned.remove(source.as_str());
                }
            }
            SourceEvent::Revoked { sources, ack, .. } => {
                for source in sources {
                    owned.remove(source.as_str());
                }
                ack.done();
            }
            SourceEvent::Failed(e) => panic!("the member failed: {e}"),
            SourceEvent::Messages { .. } => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_answers_are_lost_reports_its_partitions_lost_and_rejoins() {
    let Some(uri) = common::uri() else {
        return;
    };
    let mut bed = common::AmqpBed::new(&uri, 2).await;
    bed.config.heartbeat_s = 3;
    bed.config.balance_interval_ms = 200;
    let (proxy, through_proxy) = common::behind_proxy(&uri, &bed.config).await;
    let subscription = AmqpTransport::new(through_proxy)
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let mut events = subscription.events;
    let mut owned = BTreeSet::new();
    until(&mut events, &mut owned, "both partitions are taken", |o| {
        o.len() == 2
    })
    .await;

    proxy.stall_answers_keep_heartbeats();
    let stalled = Instant::now();
    until(
        &mut events,
        &mut owned,
        "both partitions are reported lost",
        BTreeSet::is_empty,
    )
    .await;
    let lost_after = stalled.elapsed();

    proxy.resume();
    let resumed = Instant::now();
    until(&mut events, &mut owned, "both partitions are taken again", |o| {
        o.len() == 2
    })
    .await;
    println!(
        "answers lost: partitions reported lost {lost_after:?} later; answers back: taken again within {:?}",
        resumed.elapsed()
    );
    tokio::time::timeout(LIMIT, subscription.control.close())
        .await
        .expect("leaving is bounded")
        .unwrap();
}
