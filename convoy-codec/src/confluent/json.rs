//! JSON values framed with the id of their JSON Schema.

use std::marker::PhantomData;

use bytes::Bytes;
use convoy_core::codec::{CodecError, Decoder, Encoder};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{writer_schema, IdCell};
use crate::registry::{SchemaKind, SchemaRegistry};
use crate::wire;

/// Values of `T` as JSON in the schema registry's wire format, under a JSON Schema.
///
/// The payload is checked against the registry (its schema id must exist and be a JSON
/// Schema), not validated against the schema's rules: `T`'s serde shape is the contract.
pub struct ConfluentJson<T> {
    registry: SchemaRegistry,
    subject: String,
    schema: String,
    registered: IdCell,
    checked: IdCell,
    _value: PhantomData<fn() -> T>,
}

impl<T> ConfluentJson<T> {
    /// Values of `T` under `subject`, described by the JSON Schema text `schema` (registered
    /// on the first encode).
    pub fn new(registry: SchemaRegistry, subject: impl Into<String>, schema: impl Into<String>) -> Self {
        ConfluentJson {
            registry,
            subject: subject.into(),
            schema: schema.into(),
            registered: IdCell::new(),
            checked: IdCell::new(),
            _value: PhantomData,
        }
    }
}

impl<T> Clone for ConfluentJson<T> {
    fn clone(&self) -> Self {
        ConfluentJson {
            registry: self.registry.clone(),
            subject: self.subject.clone(),
            schema: self.schema.clone(),
            registered: self.registered.clone(),
            checked: self.checked.clone(),
            _value: PhantomData,
        }
    }
}

impl<T: DeserializeOwned + Send + 'static> Decoder<T> for ConfluentJson<T> {
    async fn decode(&self, payload: &Bytes) -> Result<T, CodecError> {
        let framed = wire::unframe(payload)?;
        if !self.checked.is(framed.schema_id) {
            writer_schema(&self.registry, framed.schema_id, SchemaKind::Json).await?;
            self.checked.set(framed.schema_id);
        }
        serde_json::from_slice(&framed.body).map_err(|e| {
            CodecError::malformed(format!("payload is not valid JSON for the expected type: {e}"))
        })
    }
}

impl<T: Serialize + Sync + 'static> Encoder<T> for ConfluentJson<T> {
    async fn encode(&self, value: &T) -> Result<Bytes, CodecError> {
        let mut out = vec![0; wire::HEADER_LEN];
        serde_json::to_writer(&mut out, value)
            .map_err(|e| CodecError::unencodable(format!("not representable as JSON: {e}")))?;
        let id = self
            .registered
            .registered(&self.registry, &self.subject, SchemaKind::Json, &self.schema)
            .await?;
        out[..wire::HEADER_LEN].copy_from_slice(&wire::header(id));
        Ok(Bytes::from(out))
    }
}
