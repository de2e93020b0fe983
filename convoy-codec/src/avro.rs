//! Avro datums (apache-avro, serde), unframed: the payload is the value's binary encoding
//! under a schema the application gives. For the schema registry's wire format, where each
//! payload names its writer's schema, see `ConfluentAvro` (feature `registry`).

use std::future::{ready, Future};
use std::marker::PhantomData;
use std::sync::Arc;

use apache_avro::Schema;
use bytes::Bytes;
use convoy_core::codec::{CodecError, Decoder, Encoder};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::SchemaError;

/// Values of `T` as Avro datums of one schema.
pub struct Avro<T> {
    schema: Arc<Schema>,
    _value: PhantomData<fn() -> T>,
}

impl<T> Avro<T> {
    /// The codec for `schema`, Avro's JSON schema text. Rejects a schema that does not parse.
    pub fn new(schema: &str) -> Result<Self, SchemaError> {
        Ok(Avro {
            schema: Arc::new(parse(schema)?),
            _value: PhantomData,
        })
    }

    /// The schema.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }
}

impl<T> Clone for Avro<T> {
    fn clone(&self) -> Self {
        Avro {
            schema: self.schema.clone(),
            _value: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for Avro<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Avro<{}>({})",
            std::any::type_name::<T>(),
            self.schema.canonical_form()
        )
    }
}

/// Parses Avro's JSON schema text.
pub(crate) fn parse(schema: &str) -> Result<Schema, SchemaError> {
    Schema::parse_str(schema).map_err(|e| SchemaError::Avro(e.to_string()))
}

/// Decodes a datum written under `writer`, resolved to `reader` when the two differ (a field
/// added with a default, a field removed), and checks that nothing follows it.
pub(crate) fn decode_datum<T: DeserializeOwned>(
    writer: &Schema,
    reader: Option<&Schema>,
    body: &[u8],
) -> Result<T, CodecError> {
    let mut rest = body;
    let value = apache_avro::from_avro_datum(writer, &mut rest, reader).map_err(|e| {
        CodecError::malformed(format!("payload is not a valid Avro datum of its schema: {e}"))
    })?;
    if !rest.is_empty() {
        return Err(CodecError::malformed(format!(
            "{} bytes follow the Avro datum: it was written under another schema",
            rest.len()
        )));
    }
    apache_avro::from_value(&value).map_err(|e| {
        CodecError::malformed(format!(
            "the Avro datum does not fit {}: {e}",
            std::any::type_name::<T>()
        ))
    })
}

/// Encodes `value` under `schema`, straight from serde (no intermediate value).
pub(crate) fn encode_datum<T: Serialize>(
    schema: &Schema,
    value: &T,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    apache_avro::write_avro_datum_ref(schema, value, out)
        .map(|_| ())
        .map_err(|e| CodecError::unencodable(format!("the value does not fit its Avro schema: {e}")))
}

impl<T: DeserializeOwned + Send + 'static> Decoder<T> for Avro<T> {
    fn decode(&self, payload: &Bytes) -> impl Future<Output = Result<T, CodecError>> + Send {
        ready(decode_datum(&self.schema, None, payload))
    }
}

impl<T: Serialize + 'static> Encoder<T> for Avro<T> {
    fn encode(&self, value: &T) -> impl Future<Output = Result<Bytes, CodecError>> + Send {
        let mut out = Vec::new();
        ready(encode_datum(&self.schema, value, &mut out).map(|()| Bytes::from(out)))
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    const ENTRY: &str = r#"{"type":"record","name":"Entry","fields":[
        {"name":"account","type":"string"},{"name":"amount","type":"long"}]}"#;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Entry {
        account: String,
        amount: i64,
    }

    #[tokio::test]
    async fn round_trip_with_the_bytes_avro_specifies() {
        let codec = Avro::<Entry>::new(ENTRY).unwrap();
        let entry = Entry {
            account: "ab".into(),
            amount: -2,
        };
        let bytes = codec.encode(&entry).await.unwrap();
        // A string is its zig-zag length (2 → 4) and bytes; a long -2 is zig-zag 3.
        assert_eq!(&bytes[..], &[4, b'a', b'b', 3]);
        assert_eq!(codec.decode(&bytes).await.unwrap(), entry);
    }

    #[tokio::test]
    async fn bad_schema_bad_payload_and_trailing_bytes_are_named() {
        let err = Avro::<Entry>::new(r#"{"type":"record"}"#).unwrap_err();
        assert!(err.to_string().contains("Avro schema"), "{err}");

        let codec = Avro::<Entry>::new(ENTRY).unwrap();
        let err = codec.decode(&Bytes::from_static(&[40, b'a'])).await.unwrap_err();
        assert!(matches!(err, CodecError::Malformed(_)), "{err:?}");
        let err = codec
            .decode(&Bytes::from_static(&[2, b'a', 3, 9, 9]))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("2 bytes follow"), "{err}");
    }
}
