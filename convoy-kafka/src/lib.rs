//! # convoy-kafka
//!
//! The Kafka transport for convoy, over rdkafka with its bundled librdkafka:
//! - [`config`]: [`KafkaConfig`], validated, secrets redacted;
//! - [`consumer`]: [`KafkaTransport`] — a consumer-group member whose partitions are sources,
//!   each on its own split queue, with revoke drains and watermark commits (`W + 1`);
//! - [`producer`]: [`KafkaPublisher`] (idempotent, murmur2-compatible) and [`KafkaDeadLetterSink`];
//! - [`admin`]: reachability, topic creation, reading a topic without a group;
//! - [`baseline`]: the bare-consumer drain benchmarks compare against;
//! - [`convert`]: records ↔ messages;
//! - [`fatal`]: which Kafka errors end the engine instead of being retried.

pub mod admin;
pub mod baseline;
pub mod config;
pub mod consumer;
pub mod convert;
pub mod fatal;
pub mod producer;

pub use config::{Assignor, GroupProtocol, KafkaConfig, Prefetch};
pub use consumer::KafkaTransport;
pub use producer::{KafkaDeadLetterSink, KafkaPublisher};
