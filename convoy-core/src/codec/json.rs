//! JSON through serde, the default codec.

use std::future::{ready, Future};

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{CodecError, Decoder, Encoder};
use crate::message::OutgoingMessage;

/// JSON via `serde_json`, the default codec.
#[derive(Clone, Copy, Debug, Default)]
pub struct Json;

impl<T: DeserializeOwned + Send> Decoder<T> for Json {
    fn decode(&self, payload: &Bytes) -> impl Future<Output = Result<T, CodecError>> + Send {
        ready(decode(payload))
    }
}

impl<T: Serialize> Encoder<T> for Json {
    fn encode(&self, value: &T) -> impl Future<Output = Result<Bytes, CodecError>> + Send {
        ready(encode(value))
    }
}

fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, CodecError> {
    serde_json::from_slice(payload)
        .map_err(|e| CodecError::malformed(format!("payload is not valid JSON for the expected type: {e}")))
}

fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Bytes, CodecError> {
    serde_json::to_vec(value)
        .map(Bytes::from)
        .map_err(|e| CodecError::unencodable(format!("not representable as JSON: {e}")))
}

impl OutgoingMessage {
    /// A keyed message whose payload is `value` as JSON.
    ///
    /// Fails only for values JSON cannot represent (a map with non-string keys, a failing
    /// `Serialize` impl).
    pub fn json<V: Serialize + ?Sized>(
        key: impl Into<Bytes>,
        value: &V,
    ) -> Result<OutgoingMessage, CodecError> {
        Ok(OutgoingMessage::new(key, encode(value)?))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Order {
        qty: u32,
    }

    #[tokio::test]
    async fn round_trip_and_both_kinds_of_failure() {
        let bytes = Json.encode(&Order { qty: 3 }).await.unwrap();
        assert_eq!(&bytes[..], br#"{"qty":3}"#);
        let back: Order = Json.decode(&bytes).await.unwrap();
        assert_eq!(back, Order { qty: 3 });

        let bad: Result<Order, _> = Json.decode(&Bytes::from_static(b"{\"qty\":-1}")).await;
        assert!(
            matches!(bad, Err(CodecError::Malformed(ref r)) if r.contains("not valid JSON")),
            "{bad:?}"
        );

        // JSON object keys must be strings; a map keyed by a tuple cannot be written.
        let mut map = BTreeMap::new();
        map.insert((1, 2), "x");
        let err = Json.encode(&map).await.unwrap_err();
        assert!(matches!(err, CodecError::Unencodable(_)), "{err:?}");
        assert!(!err.is_transient());
    }

    #[test]
    fn outgoing_json_sets_key_and_payload() {
        let m = OutgoingMessage::json("order-7", &Order { qty: 1 }).unwrap();
        assert_eq!(m.key.as_deref(), Some(&b"order-7"[..]));
        assert_eq!(&m.payload[..], br#"{"qty":1}"#);
        assert!(m.headers.is_empty());
    }
}
