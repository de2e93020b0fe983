//! Topics changed under a consuming group, on Apache Kafka:
//! - messages deleted (delete-records, as retention does) before the group consumed them are a
//!   hole said loudly and counted, reading resuming at the first offset kept;
//! - a topic deleted and created again under the group is read from its beginning (Apache Kafka
//!   deletes the group's offsets with the topic); a committed position past a partition's end (a
//!   truncated log, or a broker that kept them) is said and counted, and the partition read from
//!   its beginning — none of its messages passed over as if finished;
//! - a topic grown (more partitions) is said and counted, and read whole: drained first, as the
//!   README says to, no key's order is broken.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use convoy_core::metrics::{PARTITIONS_ADDED, SOURCE_HOLES};
use convoy_core::{Engine, EngineHandle, Publisher};
use convoy_kafka::{KafkaConfig, KafkaDeadLetterSink, KafkaPublisher, KafkaTransport};
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{publish_load, ProbeHandler, RecordingSink};
use convoy_testkit::support::unique;
use convoy_testkit::{recorded, OrderChecker};
use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{ClientConfig, Offset as KafkaOffset, TopicPartitionList};

/// `convoy_source_holes_total` of `group` with `reason`.
fn holes(group: &str, reason: &str) -> u64 {
    recorded::counter(SOURCE_HOLES, &[("group", group), ("reason", reason)])
}

async fn start(config: &KafkaConfig, checker: &Arc<OrderChecker>) -> EngineHandle {
    Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(&config.group_id))
        .dead_letter_sink(RecordingSink::new(
            Arc::new(KafkaDeadLetterSink::new(config).unwrap()),
            checker.clone(),
        ))
        .build()
        .unwrap()
        .start(&KafkaTransport::new(config.clone()).unwrap())
        .await
        .unwrap()
}

/// Publishes `count` probes over `keys` keys with `checker`.
async fn publish(config: &KafkaConfig, topic: &str, checker: &OrderChecker, keys: usize, count: usize) {
    let publisher = KafkaPublisher::new(config, topic).unwrap();
    publish_load(&publisher as &dyn Publisher, checker, "k", keys, count / keys)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_again_under_the_group_is_read_from_its_beginning() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    recorded::record();
    let topic = unique("convoy-again");
    let config = common::test_config(&bootstrap, &unique("g"), &topic);
    common::create_topic(&bootstrap, &topic, 1).await;
    let before = Arc::new(OrderChecker::new());
    publish(&config, &topic, &before, 2, 10).await;
    let engine = start(&config, &before).await;
    assert!(
        before.wait_complete(Duration::from_secs(60)).await,
        "{:?}",
        before.report()
    );
    engine.stop().await.unwrap();
    assert_eq!(
        common::committed(&config, &topic, 1)
            .into_values()
            .collect::<Vec<_>>(),
        [9],
        "the first topic's messages committed"
    );

    convoy_kafka::admin::delete_topics(&config, &[&topic])
        .await
        .unwrap();
    // Deleting is asynchronous: creating the topic again is refused until it is gone.
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(e) = convoy_kafka::admin::create_topics(&config, &[(&topic, 1)]).await {
        assert!(
            Instant::now() < deadline,
            "the topic was never created again: {e}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = Arc::new(OrderChecker::new());
    publish(&config, &topic, &after, 2, 4).await;
    let engine = start(&config, &after).await;
    assert!(
        after.wait_complete(Duration::from_secs(60)).await,
        "the new topic's messages (offsets 0..3, below the old position 10) were passed over: {:?}",
        after.report()
    );
    engine.stop().await.unwrap();
    // Apache Kafka deletes a deleted topic's committed offsets (measured: none were left once
    // it could be created again); a position it still held would be past the new end, below.
    assert!(after.report().is_clean(), "{:?}", after.report());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_position_past_the_end_is_said_and_the_partition_read_from_its_beginning() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    recorded::record();
    let topic = unique("convoy-past-end");
    let config = common::test_config(&bootstrap, &unique("g"), &topic);
    common::create_topic(&bootstrap, &topic, 1).await;
    let checker = Arc::new(OrderChecker::new());
    publish(&config, &topic, &checker, 2, 4).await;
    // A position far past the partition's end (4), as a truncated log or a broker that kept a
    // deleted topic's offsets leaves it.
    commit(&bootstrap, &config.group_id, &topic, 5000);
    let engine = start(&config, &checker).await;
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "the partition's messages (offsets 0..3, below the position 5000) were passed over: {:?}",
        checker.report()
    );
    engine.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.handled, 4, "{report:#?}");
    assert_eq!(holes(&config.group_id, "past_end"), 1);
}

/// Commits `next` for partition 0 of `topic` in `group`, with a plain client.
fn commit(bootstrap: &str, group: &str, topic: &str, next: i64) {
    let committer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .create()
        .unwrap();
    let mut position = TopicPartitionList::new();
    position
        .add_partition_offset(topic, 0, KafkaOffset::Offset(next))
        .unwrap();
    committer.commit(&position, CommitMode::Sync).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_deleted_before_the_group_consumed_them_are_a_counted_hole() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    recorded::record();
    let topic = unique("convoy-hole");
    let config = common::test_config(&bootstrap, &unique("g"), &topic);
    common::create_topic(&bootstrap, &topic, 1).await;
    let checker = Arc::new(OrderChecker::new());
    publish(&config, &topic, &checker, 2, 10).await;
    // The group's position: 3 (offsets 0..2 consumed), committed by a plain client.
    commit(&bootstrap, &config.group_id, &topic, 3);
    // Offsets 3..6 deleted before the group read them, as retention would.
    let admin: AdminClient<_> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let mut before = TopicPartitionList::new();
    before
        .add_partition_offset(&topic, 0, KafkaOffset::Offset(7))
        .unwrap();
    let deleted = admin.delete_records(&before, &AdminOptions::new()).await.unwrap();
    assert_eq!(deleted.elements()[0].offset(), KafkaOffset::Offset(7));

    let engine = start(&config, &checker).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while common::committed(&config, &topic, 1).into_values().next() != Some(9) {
        assert!(Instant::now() < deadline, "offsets 7..9 were never committed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    engine.stop().await.unwrap();
    let report = checker.report();
    // Offsets 7, 8 and 9 were handled (3 of the 10 published), the 7 others are gone or were
    // consumed before.
    assert_eq!(report.handled, 3, "{report:#?}");
    assert_eq!(holes(&config.group_id, "deleted"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_grown_under_the_group_is_said_and_read_whole() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    recorded::record();
    let topic = unique("convoy-grown");
    let mut config = common::test_config(&bootstrap, &unique("g"), &topic);
    // librdkafka sees new partitions at its next metadata refresh (5 minutes by default).
    config
        .properties
        .insert("topic.metadata.refresh.interval.ms".into(), "1000".into());
    common::create_topic(&bootstrap, &topic, 2).await;
    let checker = Arc::new(OrderChecker::new());
    publish(&config, &topic, &checker, 10, 40).await;
    let engine = start(&config, &checker).await;
    // Drained before the growth, as the README says to grow a topic.
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "{:?}",
        checker.report()
    );
    let admin: AdminClient<_> = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let grown = admin
        .create_partitions(&[NewPartitions::new(&topic, 4)], &AdminOptions::new())
        .await
        .unwrap();
    assert!(grown.iter().all(Result::is_ok), "{grown:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while recorded::counter(
        PARTITIONS_ADDED,
        &[("group", &config.group_id), ("topic", &topic)],
    ) != 2
    {
        assert!(Instant::now() < deadline, "the growth was never said");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The same keys again: most now map to the new partitions, all are read.
    publish(&config, &topic, &checker, 10, 40).await;
    assert!(
        checker.wait_complete(Duration::from_secs(60)).await,
        "messages on the new partitions were not all handled: {:?}",
        checker.report()
    );
    engine.stop().await.unwrap();
    let report = checker.report();
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, 80);
}
