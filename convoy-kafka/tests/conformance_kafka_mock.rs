//! The ownership-changing conformance cases with an eager assignor (range) on librdkafka's
//! in-process mock cluster. The crash case is unreliable with Tansu's eager group handling (see
//! `conformance_kafka_eager.rs`); here the eager protocol's crash path runs against a broker
//! implementation that handles it, beside the rebalance and restart cases.

mod common;

convoy_testkit::conformance_tests!(@cases common::KafkaTarget::on_mock(convoy_kafka::Assignor::Range);
    crash_without_commit_redelivers_from_watermark,
    rebalance_two_consumers_mid_stream,
    restart_redelivers_nothing_committed,
);
