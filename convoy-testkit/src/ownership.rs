//! Ownership scenarios for transports whose members balance partitions among themselves
//! (RabbitMQ, NATS): one scenario, asserting the same outcomes on every such transport.

use std::sync::Arc;
use std::time::Duration;

use convoy_core::{EngineHandle, Transport};

use crate::checker::OrderChecker;
use crate::conformance::{test_config, TestBed};
use crate::probe::publish_load;
use crate::support::start_probe_engine;

const LIMIT: Duration = Duration::from_secs(60);

/// A member of `bed`'s group on `transport`, recording into `checker`.
async fn member(bed: &dyn TestBed, transport: &dyn Transport, checker: &Arc<OrderChecker>) -> EngineHandle {
    start_probe_engine(
        transport,
        bed.dead_letter_sink(),
        test_config(bed.group()),
        checker,
    )
    .await
}

/// Waits until the members own these many sources each (in any order).
async fn wait_for_shares(members: &[&EngineHandle], mut want: Vec<usize>) -> Vec<usize> {
    want.sort_unstable();
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let mut have: Vec<usize> = members.iter().map(|m| m.stats().sources).collect();
        have.sort_unstable();
        if have == want || tokio::time::Instant::now() >= deadline {
            return have;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes 40 keys × 10 messages and waits until every message finished.
async fn publish_and_finish(bed: &dyn TestBed, checker: &OrderChecker) {
    if let Err(e) = publish_load(bed.publisher().as_ref(), checker, "k", 40, 10).await {
        panic!("publishing the load failed: {e}");
    }
    assert!(checker.wait_complete(LIMIT).await, "{:?}", checker.report());
}

async fn stop(member: EngineHandle) {
    if let Err(e) = member.stop().await {
        panic!("a member did not stop cleanly: {e}");
    }
}

/// On a topic of 8 partitions, members joining one by one own 8, then 4 + 4, then 3 + 3 + 2;
/// messages (keys `k…`, 40 keys) flow to all of them in order, with handovers in between; once
/// one leaves, the other two own 4 + 4. Returns the checker (every message finished, in order)
/// for the transport's own checks of what is left on its broker.
pub async fn partitions_spread_within_one_of_their_share(
    bed: &dyn TestBed,
    transport: &dyn Transport,
) -> Arc<OrderChecker> {
    let checker = Arc::new(OrderChecker::new());
    let a = member(bed, transport, &checker).await;
    assert_eq!(wait_for_shares(&[&a], vec![8]).await, [8]);
    let b = member(bed, transport, &checker).await;
    assert_eq!(wait_for_shares(&[&a, &b], vec![4, 4]).await, [4, 4]);
    let c = member(bed, transport, &checker).await;
    assert_eq!(wait_for_shares(&[&a, &b, &c], vec![2, 3, 3]).await, [2, 3, 3]);
    publish_and_finish(bed, &checker).await;
    stop(b).await;
    assert_eq!(wait_for_shares(&[&a, &c], vec![4, 4]).await, [4, 4]);
    publish_and_finish(bed, &checker).await;
    stop(a).await;
    stop(c).await;
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, report.published);
    checker
}
