//! Two members on a real Kafka-protocol broker, with handlers that never finish on their own
//! (slower than any revoke deadline): when a partition moves, the old owner cancels its handler
//! before the revoke is released, so no key is ever in flight on both members at once.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::partitioner::partition_for_key;
use convoy_core::{Delivery, Engine, EngineHandle, Handler, HandlerError};
use convoy_kafka::KafkaTransport;
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::probe::{probe_key, publish_load, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;

const PARTITIONS: u32 = 4;

/// One key per partition, so whichever partitions move, a hung handler moves with each.
fn one_key_per_partition() -> Vec<Bytes> {
    let mut keys = Vec::new();
    for p in 0..PARTITIONS {
        let key = (0..)
            .map(|i| probe_key("k", i))
            .find(|k| partition_for_key(k, PARTITIONS) == p)
            .unwrap();
        keys.push(key);
    }
    keys
}

/// Hangs forever (inside the order checker, so an overlap would show) on the `hung` keys;
/// handles the others as a probe handler does.
struct Hanging {
    probe: ProbeHandler,
    checker: Arc<OrderChecker>,
    hung: HashSet<Bytes>,
}

#[async_trait]
impl Handler for Hanging {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        match delivery.key() {
            Some(key) if self.hung.contains(key) => {
                let _inside = self.checker.enter(key);
                std::future::pending::<()>().await;
                Ok(())
            }
            _ => self.probe.handle(delivery).await,
        }
    }
}

async fn member(bed: &common::KafkaBed, checker: &Arc<OrderChecker>, hung: HashSet<Bytes>) -> EngineHandle {
    let mut config = test_config(bed.group());
    // Below the transport's revoke timeout (15 s in these tests), far below the handler's hang.
    config.drain_timeout = Duration::from_secs(3);
    let handler = Hanging {
        probe: ProbeHandler::new(checker.clone()),
        checker: checker.clone(),
        hung,
    };
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
        .build()
        .unwrap();
    let transport = KafkaTransport::new(bed.config.clone()).unwrap();
    engine.start(&transport).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_slower_than_the_revoke_deadline_never_overlaps_the_next_owner() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    let bed = common::KafkaBed::new(&bootstrap, PARTITIONS, common::Protocol::Cooperative).await;
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 40, 5)
        .await
        .unwrap();
    // A's handler hangs on one key of every partition; B's never hangs.
    let a = member(&bed, &checker, one_key_per_partition().into_iter().collect()).await;
    let hung = 4 * 5; // the hung keys' messages wait behind their first one
    assert!(
        checker
            .wait_for(Duration::from_secs(60), |c| c.finished() >= 200 - hung)
            .await,
        "A handled the free keys: {:?}",
        checker.report()
    );
    // B joins: the partitions moving to it are revoked from A, whose hung handlers are
    // cancelled before the revoke is released; B handles those keys.
    let b = member(&bed, &checker, HashSet::new()).await;
    let moved = tokio::time::timeout(Duration::from_secs(60), async {
        while b.stats().sources == 0 || checker.finished() < 200 - hung + 5 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        moved.is_ok(),
        "B never handled a moved key: {:?}",
        checker.report()
    );
    // A leaves: its last hung handlers are cancelled by the drain, B takes the rest.
    a.stop().await.unwrap();
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "{:?}",
        checker.report()
    );
    b.stop().await.unwrap();
    let report = checker.report();
    assert_eq!(
        report.overlaps, 0,
        "a key was in flight on both members: {report:#?}"
    );
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, report.published);
}

/// The engine refuses a drain timeout that is not below the transport's revoke timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_timeout_above_the_revoke_timeout_is_refused_at_start() {
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    let bed = common::KafkaBed::new(&bootstrap, 1, common::Protocol::Cooperative).await;
    let checker = Arc::new(OrderChecker::new());
    let mut config = test_config(bed.group());
    config.drain_timeout = Duration::from_secs(90);
    let mut kafka = bed.config.clone();
    kafka.revoke_timeout_ms = 60_000;
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(config)
        .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker))
        .build()
        .unwrap();
    let err = match engine.start(&KafkaTransport::new(kafka).unwrap()).await {
        Ok(_) => panic!("started with drain_timeout 90 s under a 60 s revoke timeout"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("drain_timeout") && err.contains("revoke timeout"),
        "{err}"
    );
}
