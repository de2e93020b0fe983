//! # convoy
//!
//! The sequential convoy pattern: messages that share a key are handled strictly in order,
//! messages of different keys in parallel, and the committed position never passes a message
//! that is not finished. This crate is the front door: the engine of `convoy-core`, re-exported,
//! plus a connection to any broker picked by URL, so the same handler runs everywhere.
//!
//! ```no_run
//! use convoy::{handler_fn, Engine, HandlerError, Transport};
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let connection = convoy::connect("memory://?topics=orders").await?; // or kafka://127.0.0.1:9092?topics=orders
//! let handler = handler_fn(|delivery: convoy::Delivery| async move {
//!     println!("{} @ {}", delivery.message().key_display(), delivery.message().offset);
//!     Ok::<(), HandlerError>(())
//! });
//! let engine = Engine::builder(handler).dead_letter_sink(connection.dead_letter_sink()?).build()?;
//! let running = engine.start(&connection).await?;
//! // Until SIGINT or SIGTERM: finish what is in flight, commit, leave (a second signal aborts).
//! convoy::run_until_signalled(running).await?;
//! # Ok(()) }
//! ```
//!
//! Handler authors need little more than `use convoy::prelude::*;` ([`prelude`]). The crate,
//! by what you came for:
//!
//! - **Connect**: [`connect`] / [`ConnectConfig`] (URL, TOML file and `CONVOY_*` settings) → a
//!   [`Connection`]: subscribe, publish, dead-letter sink, topics, baseline;
//!   [`EngineSettings`]: the engine's settings from the same file (`[engine]`) and
//!   `CONVOY_ENGINE_*`, applied by [`Connection::engine_config`].
//! - **Handle**: [`handler_fn`], [`Handler`], [`Delivery`], [`HandlerError`] and [`ErrorClass`];
//!   [`typed`](fn@typed) decodes payloads (JSON, or any [`codec`]'s [`Decoder`] through
//!   [`typed_with`]); [`TypedPublisher`] and [`OutgoingMessage::json`] encode them;
//!   [`batch_fn`] takes the heads of many keys
//!   in one call; [`transform_fn`] publishes [`Output`]s with (or before) the commit of their
//!   input.
//! - **Run**: [`Engine`] and its [`EngineConfig`] ([`RetryPolicy`], [`BackPressure`],
//!   [`KeylessPolicy`], [`Drain`]); [`EngineHandle`] while it runs: [`StatsSnapshot`] (with
//!   [`readiness`](StatsSnapshot::readiness), what a `/readyz` answers), [`Inspector`] (lanes,
//!   sources), [`Stopper`]; [`run_until_signalled`] and [`StopSignals`]: SIGINT and SIGTERM as a
//!   graceful stop (`docker stop`, Kubernetes), a second one aborting the drain.
//! - **Dead letters**: [`DeadLetter`] and its [`DeadLetterReason`]; [`dlq`] lists them and
//!   replays parked keys.
//! - **Test**: `memory://` ([`connect`]) runs the same handler with no broker; [`memory_broker`]
//!   reaches its broker (read a topic, inject faults); `convoy-testkit` adds order checkers
//!   and the conformance suite.
//! - **Implement a transport**: [`transport`] (the contract: subscription events,
//!   pause/resume, commits, leases) and [`transform`]'s outboxes; [`unique_suffix`] names
//!   fresh topics on a shared broker.
//!
//! Features: `memory` (the embedded broker, `memory://`), `amqp` (RabbitMQ, `amqp://`) and
//! `nats` (`nats://`) are the default and build no C library (only `ring`'s few C files, for
//! rustls); `kafka` (`kafka://`) builds librdkafka
//! (C, cmake) and is opt-in. `amqp-tls` adds `amqps://`, `kafka-tls` (or
//! `kafka-tls-vendored`) Kafka's TLS and SASL, `kafka-zstd` zstd, `nats-nkeys` NATS
//! credentials files and nkeys. `opentelemetry` makes the producer's span the parent of the
//! per-message span; `opentelemetry-metrics` adds `otel_metrics`: the engine's metrics as
//! OpenTelemetry instruments, for an OTLP exporter (metrics go through the `metrics` facade
//! otherwise, to whichever recorder the application installs). `store-redb` adds `store`: an
//! idempotency store in a redb file, so duplicates are still caught after a restart.
//! `codec-protobuf`, `codec-avro` and `schema-registry` add Protobuf, Avro and the Confluent
//! Schema Registry's wire format to [`codec`].

#[cfg(not(any(feature = "memory", feature = "kafka", feature = "amqp", feature = "nats")))]
compile_error!("enable at least one broker feature of `convoy`: `memory`, `kafka`, `amqp` or `nats`");

mod backend;
mod connection;
pub mod dlq;
pub mod engine_settings;
mod error;
mod names;
#[cfg(feature = "opentelemetry-metrics")]
pub mod otel_metrics;
pub mod settings;
mod signals;

pub use connection::{connect, Connection, RecordCheck, TopicInfo, TopicSpec};
pub use convoy_core::*;
pub use engine_settings::EngineSettings;
pub use error::ConnectError;
pub use names::unique_suffix;
pub use settings::{ConnectConfig, Endpoint};
pub use signals::{run_until_signalled, run_until_signalled_or, shutdown_signal, StopSignals};

#[cfg(feature = "memory")]
pub use backend::memory::broker as memory_broker;
/// Codecs: JSON, and with features `codec-protobuf`, `codec-avro` and `schema-registry`,
/// Protobuf, Avro and the Confluent Schema Registry's wire format (`convoy-codec`).
#[cfg(any(
    feature = "codec-protobuf",
    feature = "codec-avro",
    feature = "schema-registry"
))]
pub use convoy_codec as codec;
/// Idempotency stores that survive a restart (feature `store-redb`): [`store::RedbIdempotencyStore`].
#[cfg(feature = "store-redb")]
pub use convoy_store as store;

/// What a handler author needs, in one import: `use convoy::prelude::*;`.
pub mod prelude {
    pub use crate::{
        connect, handler_fn, run_until_signalled, transform_fn, typed, typed_with, Connection, Delivery,
        Engine, EngineConfig, ErrorClass, HandlerError, Json, Message, OutgoingMessage, Output, Publisher,
        ResultExt, RetryPolicy, Transport, TypedPublisher,
    };
}
