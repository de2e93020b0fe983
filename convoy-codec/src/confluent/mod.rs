//! Codecs of the Confluent Schema Registry wire format: every payload names its writer's schema
//! by id, and a producer registers its schema under a subject before its first message.
//! - [`ConfluentJson`]: JSON with a JSON Schema (serde);
//! - [`ConfluentAvro`] (feature `avro`): Avro, decoded with the writer's schema and resolved to
//!   the reader's, so a field added with a default or removed does not break consumers;
//! - [`ConfluentProtobuf`] (feature `protobuf`): Protobuf (prost) with its message indexes.
//!
//! Decoding a payload of a schema id seen before costs no request; the first payload of a new
//! id waits for the registry, and a registry that does not answer makes the attempt transient.

#[cfg(feature = "avro")]
mod avro;
mod json;
#[cfg(feature = "protobuf")]
mod protobuf;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use convoy_core::codec::CodecError;

#[cfg(feature = "avro")]
pub use self::avro::ConfluentAvro;
pub use self::json::ConfluentJson;
#[cfg(feature = "protobuf")]
pub use self::protobuf::ConfluentProtobuf;
use crate::registry::{RegisteredSchema, SchemaKind, SchemaRegistry};

/// The writer's schema of a payload, which must be of `kind`.
async fn writer_schema(
    registry: &SchemaRegistry,
    id: u32,
    kind: SchemaKind,
) -> Result<Arc<RegisteredSchema>, CodecError> {
    let schema = registry.schema(id).await?;
    if schema.kind != kind {
        return Err(CodecError::malformed(format!(
            "the payload's schema id {id} is a {:?} schema, not {kind:?}",
            schema.kind
        )));
    }
    Ok(schema)
}

/// One schema id remembered without a lock (the hot path of every message after the first):
/// the id a codec registered, or the last writer's id it checked. Clones share it.
#[derive(Clone, Debug)]
struct IdCell(Arc<AtomicU64>);

impl IdCell {
    const EMPTY: u64 = u64::MAX;

    fn new() -> Self {
        IdCell(Arc::new(AtomicU64::new(Self::EMPTY)))
    }

    fn get(&self) -> Option<u32> {
        u32::try_from(self.0.load(Ordering::Relaxed)).ok()
    }

    fn is(&self, id: u32) -> bool {
        self.0.load(Ordering::Relaxed) == u64::from(id)
    }

    fn set(&self, id: u32) {
        self.0.store(u64::from(id), Ordering::Relaxed);
    }

    /// The id registered under `subject`, from this cell or the registry.
    async fn registered(
        &self,
        registry: &SchemaRegistry,
        subject: &str,
        kind: SchemaKind,
        text: &str,
    ) -> Result<u32, CodecError> {
        if let Some(id) = self.get() {
            return Ok(id);
        }
        let id = registry.register(subject, kind, text).await?;
        self.set(id);
        Ok(id)
    }
}
