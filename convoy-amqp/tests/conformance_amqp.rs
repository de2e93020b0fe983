//! The transport conformance suite on RabbitMQ (`CONVOY_AMQP_URI`; scripts/test sets it).

mod common;

convoy_testkit::conformance_tests!(common::AmqpTarget::from_env());
