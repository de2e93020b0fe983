//! A committed watermark that does not fit its stream any more — the stream deleted and created
//! again (or restored from an older backup, or its unsynced tail lost in a host crash) — is
//! reset loudly and the partition read from its first message. Before, reading started at the
//! stored watermark + 1 and the new stream's first messages were skipped without a word
//! (issue 25, item 5: W = 5, the stream recreated, 5 new messages, none handled). Both are
//! errors counted as `convoy_source_holes_total{reason="past_end"}`. Messages deleted before the
//! group read them (the stream's limits, a purge) are a hole said and counted too
//! (`reason="deleted"`), reading resuming at the first message kept.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_core::metrics::SOURCE_HOLES;
use convoy_core::Engine;
use convoy_nats::{admin, topology, NatsConfig, NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{publish_load, ProbeHandler, RecordingSink};
use convoy_testkit::{recorded, OrderChecker};

const LIMIT: Duration = Duration::from_secs(60);

/// `convoy_source_holes_total` of `group` with `reason`.
fn holes(group: &str, reason: &str) -> u64 {
    recorded::counter(SOURCE_HOLES, &[("group", group), ("reason", reason)])
}

/// Runs the group's engine until `checker` saw everything published, then stops it.
async fn consume_all(config: &NatsConfig, checker: &Arc<OrderChecker>) {
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(&config.group))
        .dead_letter_sink(RecordingSink::new(
            Arc::new(NatsDeadLetterSink::new(config)),
            checker.clone(),
        ))
        .build()
        .unwrap()
        .start(&NatsTransport::new(config.clone()).unwrap())
        .await
        .unwrap();
    let complete = checker.wait_complete(LIMIT).await;
    engine.stop().await.unwrap();
    assert!(complete, "not everything was handled: {:?}", checker.report());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watermark_of_a_stream_created_again_is_reset_not_trusted() {
    common::init_tracing();
    let Some(server) = common::server() else {
        return;
    };
    recorded::record(); // before any engine counts
    let topic = common::unique("convoy-recreated");
    let config = common::test_config(&server, &common::unique("g"), &topic, 1);
    admin::create_topics(&config, &[(&topic, 1)]).await.unwrap();
    let publisher = NatsPublisher::new(&config, &topic);
    let before = Arc::new(OrderChecker::new());
    publish_load(&publisher, &before, "old-k", 1, 5).await.unwrap();
    consume_all(&config, &before).await;
    assert_eq!(admin::committed(&config, &topic).await.unwrap(), [(0, 5)]);

    // The stream goes and comes back empty; the group's watermark (5) stays in its bucket.
    let js = async_nats::jetstream::new(async_nats::connect(server.as_str()).await.unwrap());
    js.delete_stream(topology::stream_name(&topic)).await.unwrap();
    admin::create_topics(&config, &[(&topic, 1)]).await.unwrap();
    let after = Arc::new(OrderChecker::new());
    publish_load(&NatsPublisher::new(&config, &topic), &after, "new-k", 1, 5)
        .await
        .unwrap();
    consume_all(&config, &after).await;
    let report = after.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 5, "sequences 1…5 of the new stream were handled");
    assert_eq!(admin::committed(&config, &topic).await.unwrap(), [(0, 5)]);
    assert_eq!(holes(&config.group, "past_end"), 1, "said and counted once");
    assert_eq!(holes(&config.group, "deleted"), 0);
    admin::delete_topic(&config, &topic, &[&config.dlq_topic()])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_deleted_before_the_group_read_them_are_a_hole_said_and_counted() {
    common::init_tracing();
    let Some(server) = common::server() else {
        return;
    };
    recorded::record();
    let topic = common::unique("convoy-purged");
    let config = common::test_config(&server, &common::unique("g"), &topic, 1);
    admin::create_topics(&config, &[(&topic, 1)]).await.unwrap();
    let publisher = NatsPublisher::new(&config, &topic);
    let first = Arc::new(OrderChecker::new());
    publish_load(&publisher, &first, "first-k", 1, 2).await.unwrap();
    consume_all(&config, &first).await;
    assert_eq!(admin::committed(&config, &topic).await.unwrap(), [(0, 2)]);

    // Sequences 3…5 arrive while the group is away, and a purge deletes them unread (as the
    // stream's limits would).
    let unread = OrderChecker::new();
    publish_load(&publisher, &unread, "unread-k", 1, 3).await.unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(server.as_str()).await.unwrap());
    let stream = js.get_stream(topology::stream_name(&topic)).await.unwrap();
    stream.purge().sequence(6).await.unwrap();
    let after = Arc::new(OrderChecker::new());
    publish_load(&publisher, &after, "after-k", 1, 3).await.unwrap();
    consume_all(&config, &after).await;
    let report = after.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 3, "sequences 6…8, after the hole, were handled");
    assert_eq!(admin::committed(&config, &topic).await.unwrap(), [(0, 8)]);
    assert_eq!(
        holes(&config.group, "deleted"),
        1,
        "the hole was said and counted once"
    );
    assert_eq!(holes(&config.group, "past_end"), 0);
    admin::delete_topic(&config, &topic, &[&config.dlq_topic()])
        .await
        .unwrap();
}
