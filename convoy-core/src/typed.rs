//! A typed handler layer: decode the payload with serde (JSON by default), hand the value to
//! the user's function, and turn a decode failure into a terminal `malformed` error, so a
//! poison message is dead-lettered with its reason instead of blocking its lane.

use std::future::Future;
use std::marker::PhantomData;

use async_trait::async_trait;
use serde::de::DeserializeOwned;

use crate::handler::{Delivery, Handler, HandlerError};

/// Decodes payload bytes into a value.
pub trait Codec<T>: Send + Sync + 'static {
    /// Decodes, or says why the payload is malformed.
    fn decode(&self, payload: &[u8]) -> Result<T, String>;
}

/// JSON via `serde_json`, the default codec.
#[derive(Clone, Copy, Debug, Default)]
pub struct Json;

impl<T: DeserializeOwned> Codec<T> for Json {
    fn decode(&self, payload: &[u8]) -> Result<T, String> {
        serde_json::from_slice(payload)
            .map_err(|e| format!("payload is not valid JSON for the expected type: {e}"))
    }
}

/// A handler that decodes its payload first; see [`typed`].
pub struct Typed<T, F, C = Json> {
    f: F,
    codec: C,
    _value: PhantomData<fn() -> T>,
}

/// A typed JSON handler: `typed(|order: Order, delivery| async move { ... })`.
pub fn typed<T, F, Fut>(f: F) -> Typed<T, F, Json>
where
    T: DeserializeOwned + Send + 'static,
    F: Fn(T, Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    Typed {
        f,
        codec: Json,
        _value: PhantomData,
    }
}

impl<T, F> Typed<T, F, Json> {
    /// Uses another codec (e.g. a protobuf or CBOR decoder).
    pub fn with_codec<C: Codec<T>>(self, codec: C) -> Typed<T, F, C> {
        Typed {
            f: self.f,
            codec,
            _value: PhantomData,
        }
    }
}

#[async_trait]
impl<T, F, Fut, C> Handler for Typed<T, F, C>
where
    T: Send + 'static,
    F: Fn(T, Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    C: Codec<T>,
{
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let value = self
            .codec
            .decode(delivery.payload())
            .map_err(HandlerError::malformed)?;
        (self.f)(value, delivery).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use serde::Deserialize;

    use super::*;
    use crate::handler::ErrorClass;
    use crate::message::{Headers, Message, SourceId};

    #[derive(Deserialize)]
    struct Order {
        qty: u32,
    }

    fn delivery(payload: &'static [u8]) -> Delivery {
        Delivery::new(
            Arc::new(Message {
                key: None,
                payload: Bytes::from_static(payload),
                headers: Headers::new(),
                source: SourceId::new("s"),
                offset: 0,
            }),
            1,
        )
    }

    #[tokio::test]
    async fn decode_failure_is_malformed_and_valid_payload_reaches_the_function() {
        let h = typed(|o: Order, _d| async move {
            if o.qty == 0 {
                Err(HandlerError::terminal("empty order"))
            } else {
                Ok(())
            }
        });
        assert!(h.handle(delivery(br#"{"qty":2}"#)).await.is_ok());
        let err = h.handle(delivery(b"not json")).await.unwrap_err();
        assert_eq!(err.class(), ErrorClass::Malformed);
        assert!(err.message().contains("not valid JSON"));
        let err = h.handle(delivery(br#"{"qty":0}"#)).await.unwrap_err();
        assert_eq!(err.class(), ErrorClass::Terminal);
    }
}
