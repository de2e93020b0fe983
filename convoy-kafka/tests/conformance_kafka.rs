//! The whole conformance suite on Apache Kafka, classic protocol with the cooperative-sticky
//! assignor (convoy's default): a rebalance revokes only the partitions that move.

mod common;

convoy_testkit::conformance_tests!(common::KafkaTarget::from_env(common::Protocol::Cooperative));
