//! # convoy-nats
//!
//! The NATS JetStream transport for convoy, over async-nats (nats-server 2.9 and later):
//! - [`config`]: [`NatsConfig`], validated, secrets redacted;
//! - [`topology`]: what a topic is on JetStream (a stream with one subject per partition) and
//!   the group's key-value buckets (watermarks, leases), declared idempotently;
//! - [`consumer`]: [`NatsTransport`] — a group member that leases its fair share of partitions
//!   and reads each from its committed watermark through a consumer of its own;
//! - [`publisher`]: [`NatsPublisher`] (Kafka-compatible key partitioning, acknowledged,
//!   deduplicated by event id) and [`NatsDeadLetterSink`];
//! - [`admin`]: reading a stream without consuming it, committed watermarks, deleting a topic;
//! - [`baseline`]: bare async-nats pull consumers, the benchmarks' baseline;
//! - [`convert`]: stream messages ↔ messages, headers (binary-safe) ↔ NATS headers;
//! - [`connect`](mod@connect) and [`error`]: connections and error classification.

pub mod admin;
pub mod baseline;
pub mod config;
pub mod connect;
pub mod consumer;
pub mod convert;
pub mod error;
pub mod publisher;
pub mod topology;

pub use config::NatsConfig;
pub use consumer::NatsTransport;
pub use publisher::{NatsDeadLetterSink, NatsPublisher};
