//! The whole conformance suite on Apache Kafka with the KIP-848 group protocol
//! (`group.protocol=consumer`): the broker assigns partitions and rebalances incrementally.

mod common;

convoy_testkit::conformance_tests!(common::KafkaTarget::from_env(common::Protocol::Consumer));
