//! Codecs: typed values to and from payload bytes, on both sides of the broker.
//!
//! A [`Decoder`] turns a payload into a value for a [`typed`](crate::typed::typed) handler; an
//! [`Encoder`] turns a value into a payload for a [`TypedPublisher`] or an output. Both are
//! async, so a codec may fetch what it needs on first use (a schema from a registry), and both
//! fail with a [`CodecError`] that says whether retrying can help:
//! - [`CodecError::Malformed`]: the payload is not what was expected; the handler's message is
//!   dead-lettered with the reason, retrying cannot help;
//! - [`CodecError::Unavailable`]: something the codec needs did not answer; the message is
//!   retried in its lane with backoff, like any transient error;
//! - [`CodecError::Unencodable`]: the value cannot be written; the caller's bug or bad input.
//!
//! [`Json`] (serde) is built in. Protobuf, Avro and the Confluent Schema Registry wire format are
//! in the `convoy-codec` crate. A codec for a type without serde implements [`Decoder`] and
//! [`Encoder`] itself; nothing here asks for serde unless [`Json`] is used.

mod json;
mod publisher;

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;

pub use json::Json;
pub use publisher::{PublishError, TypedPublisher};

/// Why a value could not be decoded or encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The payload is not a valid encoding of the expected type (or names a schema that does
    /// not exist). Retrying cannot help: a handler's message is dead-lettered as `malformed`.
    #[error("malformed payload: {0}")]
    Malformed(String),
    /// Something the codec needs (a schema registry) did not answer. Retrying may help: a
    /// handler's message is retried in its lane with backoff.
    #[error("codec unavailable: {0} (retried with backoff)")]
    Unavailable(String),
    /// The value cannot be encoded (e.g. a JSON map with non-string keys, or a value its schema
    /// does not admit). Fix the value or the schema.
    #[error("cannot encode the value: {0}")]
    Unencodable(String),
}

impl CodecError {
    /// A malformed payload, with why.
    pub fn malformed(reason: impl std::fmt::Display) -> Self {
        CodecError::Malformed(reason.to_string())
    }

    /// A transient failure of something the codec needs, with what.
    pub fn unavailable(reason: impl std::fmt::Display) -> Self {
        CodecError::Unavailable(reason.to_string())
    }

    /// A value that cannot be encoded, with why.
    pub fn unencodable(reason: impl std::fmt::Display) -> Self {
        CodecError::Unencodable(reason.to_string())
    }

    /// Whether retrying the same call may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, CodecError::Unavailable(_))
    }
}

/// Decodes payload bytes into a `T`.
///
/// A codec with nothing to wait for returns a ready future:
/// `std::future::ready(decode_now(payload))`.
pub trait Decoder<T>: Send + Sync + 'static {
    /// Decodes `payload`, or says why it cannot be.
    fn decode(&self, payload: &Bytes) -> impl Future<Output = Result<T, CodecError>> + Send;
}

/// Encodes a `T` into payload bytes.
pub trait Encoder<T>: Send + Sync + 'static {
    /// Encodes `value`, or says why it cannot be.
    fn encode(&self, value: &T) -> impl Future<Output = Result<Bytes, CodecError>> + Send;
}

/// Both sides: what a service that consumes and produces one type needs. Implemented for every
/// type that is a [`Decoder`] and an [`Encoder`] of `T`.
pub trait Codec<T>: Decoder<T> + Encoder<T> {}

impl<T, C: Decoder<T> + Encoder<T>> Codec<T> for C {}

// A codec shared between a handler and a publisher (one registry cache for both).
impl<T, C: Decoder<T>> Decoder<T> for Arc<C> {
    fn decode(&self, payload: &Bytes) -> impl Future<Output = Result<T, CodecError>> + Send {
        (**self).decode(payload)
    }
}

impl<T, C: Encoder<T>> Encoder<T> for Arc<C> {
    fn encode(&self, value: &T) -> impl Future<Output = Result<Bytes, CodecError>> + Send {
        (**self).encode(value)
    }
}
