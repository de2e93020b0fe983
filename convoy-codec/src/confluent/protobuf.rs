//! Protobuf messages framed with the id of their `.proto` schema and their message indexes.

use std::marker::PhantomData;

use bytes::Bytes;
use convoy_core::codec::{CodecError, Decoder, Encoder};

use super::{writer_schema, IdCell};
use crate::protobuf::decode_message;
use crate::registry::{SchemaKind, SchemaRegistry};
use crate::wire;

/// Prost messages of `T` in the schema registry's wire format.
///
/// The `.proto` text is registered under the subject on the first encode. Decoding checks that
/// the payload's schema id exists and is a Protobuf schema, and that its message indexes name
/// `T`'s place in the file (`[0]`, the first message, unless [`message_indexes`] says
/// otherwise): a payload of another message type is malformed, not misread.
///
/// [`message_indexes`]: ConfluentProtobuf::message_indexes
pub struct ConfluentProtobuf<T> {
    registry: SchemaRegistry,
    subject: String,
    proto: String,
    indexes: Vec<u32>,
    registered: IdCell,
    checked: IdCell,
    _message: PhantomData<fn() -> T>,
}

impl<T> ConfluentProtobuf<T> {
    /// Messages of `T` under `subject`, described by the `.proto` file text `proto`, in which
    /// `T` is the first message.
    pub fn new(registry: SchemaRegistry, subject: impl Into<String>, proto: impl Into<String>) -> Self {
        ConfluentProtobuf {
            registry,
            subject: subject.into(),
            proto: proto.into(),
            indexes: vec![0],
            registered: IdCell::new(),
            checked: IdCell::new(),
            _message: PhantomData,
        }
    }

    /// Where `T` is in the `.proto` file: `[2]` for its third top-level message, `[1, 0]` for
    /// the first message nested in the second.
    pub fn message_indexes(mut self, indexes: impl Into<Vec<u32>>) -> Self {
        self.indexes = indexes.into();
        // Another message of the file: registered and checked on its own.
        self.registered = IdCell::new();
        self.checked = IdCell::new();
        self
    }
}

impl<T> Clone for ConfluentProtobuf<T> {
    fn clone(&self) -> Self {
        ConfluentProtobuf {
            registry: self.registry.clone(),
            subject: self.subject.clone(),
            proto: self.proto.clone(),
            indexes: self.indexes.clone(),
            registered: self.registered.clone(),
            checked: self.checked.clone(),
            _message: PhantomData,
        }
    }
}

impl<T: prost::Message + Default + 'static> Decoder<T> for ConfluentProtobuf<T> {
    async fn decode(&self, payload: &Bytes) -> Result<T, CodecError> {
        let framed = wire::unframe(payload)?;
        if !self.checked.is(framed.schema_id) {
            writer_schema(&self.registry, framed.schema_id, SchemaKind::Protobuf).await?;
            self.checked.set(framed.schema_id);
        }
        // The first message, `[0]`, is one byte 0: no list to build.
        if self.indexes == [0] && framed.body.first() == Some(&0) {
            return decode_message(framed.body.slice(1..));
        }
        let (indexes, message) = wire::message_indexes(&framed.body)?;
        if indexes != self.indexes {
            return Err(CodecError::malformed(format!(
                "the payload is message {indexes:?} of schema id {}, not {:?} ({})",
                framed.schema_id,
                self.indexes,
                std::any::type_name::<T>()
            )));
        }
        decode_message(message)
    }
}

impl<T: prost::Message + Sync + 'static> Encoder<T> for ConfluentProtobuf<T> {
    async fn encode(&self, value: &T) -> Result<Bytes, CodecError> {
        let id = self
            .registered
            .registered(&self.registry, &self.subject, SchemaKind::Protobuf, &self.proto)
            .await?;
        if self.indexes == [0] {
            // The header, the one-byte index list, the message: one buffer.
            let mut out = Vec::with_capacity(wire::HEADER_LEN + 1 + value.encoded_len());
            out.extend_from_slice(&wire::header(id));
            out.push(0);
            value.encode_raw(&mut out);
            return Ok(Bytes::from(out));
        }
        Ok(wire::frame(id, Some(&self.indexes), &value.encode_to_vec()))
    }
}
