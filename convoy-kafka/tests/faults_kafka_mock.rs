//! Broker faults injected on librdkafka's mock cluster: a consumer error nothing retried can
//! fix ends the engine with that error, and a broker refusing the offset map as too large gets
//! watermark-only commits instead of failing every commit. The cases share one mock cluster
//! whose injected errors apply to every client, so they run one at a time.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::sync::Arc;
use std::time::Duration;

use convoy_core::transport::{Commit, SourceEvent};
use convoy_core::{Engine, EngineError, Transport};
use convoy_kafka::convert::source_id;
use convoy_kafka::KafkaTransport;
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use tokio::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// Fails without fatal-error reporting: the authorization failure was only logged, and the
/// engine sat in the group forever without a partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_authorization_failure_ends_the_engine_with_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    common::init_tracing();
    let (bootstrap, create) = common::mock_cluster();
    let topic = common::unique("convoy-denied");
    create(&topic, 2);
    let config = common::test_config(&bootstrap, &common::unique("convoy-denied-group"), &topic);
    create(&config.dlq_topic(), 1);
    common::mock_request_errors(
        RDKafkaApiKey::JoinGroup,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_GROUP_AUTHORIZATION_FAILED],
    );
    let checker = Arc::new(OrderChecker::new());
    let sink = convoy_kafka::KafkaDeadLetterSink::new(&config).unwrap();
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(test_config(&config.group_id))
        .dead_letter_sink(RecordingSink::new(Arc::new(sink), checker))
        .build()
        .unwrap();
    let running = engine.start(&KafkaTransport::new(config).unwrap()).await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(60), running.join())
        .await
        .expect("the engine stopped")
        .unwrap_err();
    // The next case joins groups too: no injected error may outlive this one.
    common::mock_clear_errors(RDKafkaApiKey::JoinGroup);
    assert!(
        matches!(err, EngineError::Transport(ref e) if e.is_fatal()),
        "{err}"
    );
    assert!(err.to_string().to_lowercase().contains("authoriz"), "{err}");
}

/// Fails without the fallback: every commit carrying an offset map failed with
/// OFFSET_METADATA_TOO_LARGE, so not even the watermark was committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offset_map_refused_as_too_large_falls_back_to_the_watermark() {
    let _one = ONE_AT_A_TIME.lock().await;
    common::init_tracing();
    common::mock_clear_errors(RDKafkaApiKey::JoinGroup);
    let (bootstrap, create) = common::mock_cluster();
    let topic = common::unique("convoy-bigmap");
    create(&topic, 1);
    let config = common::test_config(&bootstrap, &common::unique("convoy-bigmap-group"), &topic);
    let source = source_id(&topic, 0);
    let mut sub = KafkaTransport::new(config.clone())
        .unwrap()
        .subscribe()
        .await
        .unwrap();
    let assigned = tokio::time::timeout(Duration::from_secs(30), sub.events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(assigned, SourceEvent::Assigned(_)), "{assigned:?}");
    common::mock_request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE],
    );
    sub.control
        .commit(&[Commit {
            token: 0,
            source: source.clone(),
            next: 10,
            finished_above: vec![12, 13, 20],
        }])
        .await
        .expect("the watermark is committed without the map");
    let committed = common::committed_with_map(&config, &topic, 1);
    assert_eq!(committed[&source], (Some(9), Vec::new()));
    assert!(
        !sub.control.wants_finished_above(),
        "no more maps for this broker"
    );
    sub.control.close().await.unwrap();
}
