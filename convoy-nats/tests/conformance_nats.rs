//! The transport conformance suite on NATS JetStream (`CONVOY_NATS_URL`; scripts/test sets it).

mod common;

convoy_testkit::conformance_tests!(common::NatsTarget::from_env());
