//! The conformance suite on a real Kafka-protocol broker.

mod common;

convoy_testkit::conformance_tests!(common::KafkaTarget::from_env());
