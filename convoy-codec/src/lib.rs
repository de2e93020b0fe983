//! # convoy-codec
//!
//! Codecs for convoy's typed handlers and publishers, beyond the JSON built into
//! [`convoy_core::codec`] (re-exported here, so `convoy_codec::{Decoder, Encoder, Json}` work
//! too). Each is behind a feature:
//! - [`wire`]: the Confluent Schema Registry wire format (magic byte, schema id, message
//!   indexes), always built;
//! - [`protobuf`](mod@protobuf) (`protobuf`): [`Protobuf`], prost messages;
//! - [`avro`](mod@avro) (`avro`): [`Avro`], Avro datums under a schema the application gives;
//! - [`registry`] (`registry`): [`SchemaRegistry`], a client of the registry's REST API, and
//!   [`confluent`]'s codecs: [`ConfluentJson`], [`ConfluentAvro`] (with `avro`) and
//!   [`ConfluentProtobuf`] (with `protobuf`).
//!
//! A decode failure dead-letters the message as `malformed` with the reason; a registry that
//! does not answer retries it in its lane instead.

pub use convoy_core::codec::*;

#[cfg(feature = "avro")]
pub mod avro;
#[cfg(feature = "registry")]
pub mod confluent;
#[cfg(feature = "protobuf")]
pub mod protobuf;
#[cfg(feature = "registry")]
pub mod registry;
pub mod wire;

#[cfg(feature = "avro")]
pub use self::avro::Avro;
#[cfg(all(feature = "registry", feature = "avro"))]
pub use self::confluent::ConfluentAvro;
#[cfg(all(feature = "registry", feature = "protobuf"))]
pub use self::confluent::ConfluentProtobuf;
#[cfg(feature = "protobuf")]
pub use self::protobuf::Protobuf;
#[cfg(feature = "registry")]
pub use self::{
    confluent::ConfluentJson,
    registry::{value_subject, RegisteredSchema, SchemaKind, SchemaRegistry},
};

/// A schema or registry setting that cannot be used, found at startup.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaError {
    /// The Avro schema text does not parse.
    #[error("the Avro schema does not parse: {0}")]
    Avro(String),
    /// The registry's address or settings cannot be used.
    #[error("schema registry: {0}")]
    Registry(String),
}
