//! Avro datums framed with the id of their writer's schema.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

use apache_avro::Schema;
use bytes::Bytes;
use convoy_core::codec::{CodecError, Decoder, Encoder};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{writer_schema, IdCell};
use crate::avro::{decode_datum, encode_datum, parse};
use crate::registry::{SchemaKind, SchemaRegistry};
use crate::{wire, SchemaError};

/// Values of `T` as Avro in the schema registry's wire format.
///
/// Encoding writes under the reader's schema (given here, registered under the subject on the
/// first encode). Decoding reads each payload with its writer's schema, fetched once per id,
/// and resolves it to the reader's schema: consumers keep working while producers evolve the
/// schema within the subject's compatibility rules.
pub struct ConfluentAvro<T> {
    registry: SchemaRegistry,
    subject: String,
    text: String,
    reader: Arc<Schema>,
    // The parsed writer's schema per id; `None` when it is the reader's (no resolution).
    writers: Arc<Mutex<HashMap<u32, Option<Arc<Schema>>>>>,
    // The last writer's id whose schema is the reader's: no lock for it.
    same: IdCell,
    registered: IdCell,
    _value: PhantomData<fn() -> T>,
}

impl<T> ConfluentAvro<T> {
    /// Values of `T` under `subject`, with the Avro schema text `schema` as the reader's and
    /// writer's schema. Rejects a schema that does not parse.
    pub fn new(
        registry: SchemaRegistry,
        subject: impl Into<String>,
        schema: &str,
    ) -> Result<Self, SchemaError> {
        Ok(ConfluentAvro {
            registry,
            subject: subject.into(),
            text: schema.to_string(),
            reader: Arc::new(parse(schema)?),
            writers: Arc::default(),
            same: IdCell::new(),
            registered: IdCell::new(),
            _value: PhantomData,
        })
    }

    /// The reader's schema.
    pub fn schema(&self) -> &Schema {
        &self.reader
    }

    async fn writer(&self, id: u32) -> Result<Option<Arc<Schema>>, CodecError> {
        if self.same.is(id) {
            return Ok(None);
        }
        if let Some(known) = self
            .writers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
        {
            return Ok(known.clone());
        }
        let registered = writer_schema(&self.registry, id, SchemaKind::Avro).await?;
        let writer = parse(&registered.text).map_err(|e| {
            CodecError::malformed(format!("the payload's schema id {id} does not parse: {e}"))
        })?;
        let writer = (writer.canonical_form() != self.reader.canonical_form()).then(|| Arc::new(writer));
        self.writers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, writer.clone());
        if writer.is_none() {
            self.same.set(id);
        }
        Ok(writer)
    }
}

impl<T> Clone for ConfluentAvro<T> {
    fn clone(&self) -> Self {
        ConfluentAvro {
            registry: self.registry.clone(),
            subject: self.subject.clone(),
            text: self.text.clone(),
            reader: self.reader.clone(),
            writers: self.writers.clone(),
            same: self.same.clone(),
            registered: self.registered.clone(),
            _value: PhantomData,
        }
    }
}

impl<T: DeserializeOwned + Send + 'static> Decoder<T> for ConfluentAvro<T> {
    async fn decode(&self, payload: &Bytes) -> Result<T, CodecError> {
        let framed = wire::unframe(payload)?;
        match self.writer(framed.schema_id).await? {
            None => decode_datum(&self.reader, None, &framed.body),
            Some(writer) => decode_datum(&writer, Some(&self.reader), &framed.body),
        }
    }
}

impl<T: Serialize + Sync + 'static> Encoder<T> for ConfluentAvro<T> {
    async fn encode(&self, value: &T) -> Result<Bytes, CodecError> {
        // The value after a placeholder header: one buffer, no copy.
        let mut out = vec![0; wire::HEADER_LEN];
        encode_datum(&self.reader, value, &mut out)?;
        let id = self
            .registered
            .registered(&self.registry, &self.subject, SchemaKind::Avro, &self.text)
            .await?;
        out[..wire::HEADER_LEN].copy_from_slice(&wire::header(id));
        Ok(Bytes::from(out))
    }
}
