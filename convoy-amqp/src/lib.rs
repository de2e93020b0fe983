//! # convoy-amqp
//!
//! The RabbitMQ transport for convoy, over lapin:
//! - [`config`]: [`AmqpConfig`], validated, the password redacted;
//! - `names`: the names of a topic's queues, locks and markers;
//! - [`topology`]: what a topic is on RabbitMQ (an exchange, quorum partition queues per group
//!   with single active consumer, a dead-letter stream, lock queues for ownership) and declaring it;
//! - [`consumer`]: [`AmqpTransport`] — a group member balancing partitions over the live
//!   members, with handovers that drain and commit (`basic.ack(W, multiple)`) first;
//! - [`publisher`]: [`AmqpPublisher`] (Kafka-compatible key partitioning, persistent, mandatory,
//!   confirmed) and [`AmqpDeadLetterSink`];
//! - [`admin`]: declaring and listing topics, reading a dead-letter stream without consuming
//!   it, queue depths, deleting a topic;
//! - [`registry`]: the topics and groups convoy declared (AMQP cannot list them), in a stream;
//! - `stream`: reading a stream without consuming it (dead letters, the registry, read-backs);
//! - [`baseline`]: a bare lapin consumer, the benchmarks' baseline;
//! - [`convert`]: deliveries ↔ messages, headers ↔ field tables;
//! - [`connect`](mod@connect) and [`error`]: connections and error classification.

pub mod admin;
pub mod baseline;
mod checkpoint;
pub mod config;
pub mod connect;
pub mod consumer;
pub mod convert;
pub mod error;
mod names;
pub mod publisher;
pub mod registry;
mod stream;
pub mod topology;

pub use config::AmqpConfig;
pub use consumer::AmqpTransport;
pub use publisher::{AmqpDeadLetterSink, AmqpPublisher};
