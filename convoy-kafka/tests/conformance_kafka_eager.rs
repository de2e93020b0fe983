//! The whole conformance suite on Apache Kafka, classic protocol with an eager assignor (range):
//! every rebalance revokes all of a member's partitions before reassigning them.

mod common;

convoy_testkit::conformance_tests!(common::KafkaTarget::from_env(common::Protocol::Eager));
