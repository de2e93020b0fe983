//! Protobuf messages through prost, unframed: the payload is the message's encoding alone.
//! For the schema registry's wire format, see `ConfluentProtobuf` (feature `registry`).

use std::future::{ready, Future};
use std::marker::PhantomData;

use bytes::Bytes;
use convoy_core::codec::{CodecError, Decoder, Encoder};

/// A prost message type `T` as the payload.
pub struct Protobuf<T> {
    _message: PhantomData<fn() -> T>,
}

impl<T> Protobuf<T> {
    /// The codec for `T`.
    pub fn new() -> Self {
        Protobuf {
            _message: PhantomData,
        }
    }
}

impl<T> Default for Protobuf<T> {
    fn default() -> Self {
        Protobuf::new()
    }
}

impl<T> Clone for Protobuf<T> {
    fn clone(&self) -> Self {
        Protobuf::new()
    }
}

impl<T> std::fmt::Debug for Protobuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Protobuf<{}>", std::any::type_name::<T>())
    }
}

/// Decodes `T` from `payload` without copying it (prost reads `Bytes` fields as slices of it).
pub(crate) fn decode_message<T: prost::Message + Default>(payload: Bytes) -> Result<T, CodecError> {
    T::decode(payload).map_err(|e| {
        CodecError::malformed(format!(
            "payload is not a valid {} message: {e}",
            std::any::type_name::<T>()
        ))
    })
}

impl<T: prost::Message + Default + 'static> Decoder<T> for Protobuf<T> {
    fn decode(&self, payload: &Bytes) -> impl Future<Output = Result<T, CodecError>> + Send {
        ready(decode_message(payload.clone()))
    }
}

impl<T: prost::Message + 'static> Encoder<T> for Protobuf<T> {
    fn encode(&self, value: &T) -> impl Future<Output = Result<Bytes, CodecError>> + Send {
        // prost cannot fail to encode into a buffer it sized itself.
        ready(Ok(Bytes::from(value.encode_to_vec())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Entry {
        #[prost(string, tag = "1")]
        account: String,
        #[prost(int64, tag = "2")]
        amount: i64,
    }

    #[tokio::test]
    async fn round_trip_and_garbage_is_malformed() {
        let codec = Protobuf::<Entry>::new();
        let entry = Entry {
            account: "acc-1".into(),
            amount: -250,
        };
        let bytes = codec.encode(&entry).await.unwrap();
        assert_eq!(codec.decode(&bytes).await.unwrap(), entry);
        // Field 1 as a length-delimited string claiming 100 bytes, with 1 present.
        let err = codec
            .decode(&Bytes::from_static(&[0x0a, 100, b'x']))
            .await
            .unwrap_err();
        assert!(
            matches!(err, CodecError::Malformed(ref r) if r.contains("not a valid")),
            "{err:?}"
        );
    }
}
