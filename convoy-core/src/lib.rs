//! # convoy-core
//!
//! The engine of **convoy**, the sequential convoy pattern in Rust: messages that share a key
//! are handled strictly in order, messages of different keys in parallel, and commits never
//! pass an unfinished message. No broker code lives here; adapters implement [`transport`].
//!
//! The data path, by module:
//! - [`header_names`]: the names of the headers convoy writes, a leaf;
//! - [`message`]: keys, payloads, headers, sources, offsets, event ids;
//! - [`partitioner`]: key → partition, the same (Kafka's murmur2) for every broker;
//! - [`transport`]: the contract adapters implement (subscription events, pause/resume,
//!   commit, leases, publisher);
//! - [`balance`]: fair shares of partitions for transports whose members balance themselves;
//! - [`engine`]: intake → shards → lanes → handler, with completions feeding the watermark;
//! - [`handler`] and [`typed`](mod@typed): the handler contract and the decoding layer;
//! - [`codec`]: values to and from payloads (JSON built in), and a typed publisher;
//! - [`batch`]: batch handlers, one call for the heads of many keys;
//! - [`retry`]: backoff, jitter and limits for in-lane retry;
//! - [`dead_letter`]: sinks and the reason headers;
//! - [`transform`]: consume → produce, outputs published with (or before) the commit of
//!   their input;
//! - [`parking`]: parked keys, folded from the dead-letter destination, and their replays;
//! - [`watermark`]: the contiguous watermark per source;
//! - [`offset_map`]: the finished offsets above a watermark, as text a broker stores beside it;
//! - [`backpressure`]: the high/low water gate;
//! - [`idempotency`]: duplicate detection by event id;
//! - [`trace_context`]: W3C `traceparent` across the broker;
//! - [`metrics`]: metric names;
//! - [`config`]: engine configuration and its validation.

pub mod backpressure;
pub mod balance;
pub mod batch;
pub mod codec;
pub mod config;
pub mod dead_letter;
pub mod engine;
pub mod handler;
pub mod header_names;
pub mod idempotency;
pub mod message;
pub mod metrics;
pub mod offset_map;
pub mod parking;
pub mod partitioner;
pub mod retry;
mod spares;
mod stamp;
pub mod trace_context;
pub mod transform;
pub mod transport;
pub mod typed;
pub mod watermark;

pub use batch::{batch_fn, BatchConfig, BatchHandler, BatchResults};
pub use codec::{Codec, CodecError, Decoder, Encoder, Json, PublishError, TypedPublisher};
pub use config::{BackPressure, ConfigError, Drain, EngineConfig, KeylessPolicy};
pub use dead_letter::{DeadLetter, DeadLetterCause, DeadLetterReason, DeadLetterSink};
pub use engine::{
    Engine, EngineBuilder, EngineError, EngineHandle, EngineReport, Inspection, Inspector, LaneView,
    PauseTarget, Paused, Pauser, SourceView, Stall, StallOn, StatsReader, StatsSnapshot, Stopper,
    COMMITS_FAILING_AT_MOST,
};
pub use handler::{handler_fn, Cause, Delivery, ErrorClass, Handler, HandlerError, ResultExt};
pub use idempotency::{IdempotencyStore, MemoryIdempotencyStore};
pub use message::{EventId, Headers, Message, Offset, OutgoingMessage, SourceId, EVENT_ID_HEADER};
pub use retry::{Backoff, Jitter, OnExhausted, RetryPolicy};
pub use trace_context::TraceContext;
pub use transform::{transform_fn, Output, OutputGuarantee, Transform};
pub use transport::{Publisher, Receipt, Transport, TransportError};
pub use typed::{typed, typed_with};
