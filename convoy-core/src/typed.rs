//! A typed handler layer: decode the payload with a [`Decoder`] (JSON by default), hand the
//! value to the user's function, and turn a decode failure into a terminal `malformed` error, so
//! a poison message is dead-lettered with its reason instead of blocking its lane. A decoder
//! that could not reach what it needs (a schema registry) makes the attempt transient instead:
//! the message is retried in its lane, never dead-lettered for an outage.

use std::future::Future;
use std::marker::PhantomData;

use async_trait::async_trait;

use crate::codec::{CodecError, Decoder, Json};
use crate::handler::{Delivery, ErrorClass, Handler, HandlerError};

/// A handler that decodes its payload first; see [`typed`].
pub struct Typed<T, F, C = Json> {
    f: F,
    codec: C,
    _value: PhantomData<fn() -> T>,
}

/// A typed handler, JSON unless [`with_codec`](Typed::with_codec) says otherwise:
/// `typed(|order: Order, delivery| async move { ... })`. Serde is needed only for JSON.
pub fn typed<T, F, Fut>(f: F) -> Typed<T, F, Json>
where
    F: Fn(T, Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    Typed {
        f,
        codec: Json,
        _value: PhantomData,
    }
}

/// A typed handler whose payloads `codec` decodes (protobuf, Avro, a schema registry's wire
/// format, or a codec of the user's own).
pub fn typed_with<T, C, F, Fut>(codec: C, f: F) -> Typed<T, F, C>
where
    C: Decoder<T>,
    F: Fn(T, Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    Typed {
        f,
        codec,
        _value: PhantomData,
    }
}

impl<T, F, C> Typed<T, F, C> {
    /// Uses another codec.
    pub fn with_codec<D: Decoder<T>>(self, codec: D) -> Typed<T, F, D> {
        Typed {
            f: self.f,
            codec,
            _value: PhantomData,
        }
    }
}

/// How a decode failure fails the attempt.
fn handler_error(error: CodecError) -> HandlerError {
    let class = match error {
        CodecError::Unavailable(_) => ErrorClass::Transient,
        _ => ErrorClass::Malformed,
    };
    HandlerError::caused_by(class, error)
}

#[async_trait]
impl<T, F, Fut, C> Handler for Typed<T, F, C>
where
    T: Send + 'static,
    F: Fn(T, Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    C: Decoder<T>,
{
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let value = self
            .codec
            .decode(delivery.payload())
            .await
            .map_err(handler_error)?;
        (self.f)(value, delivery).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use serde::Deserialize;

    use super::*;
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

    /// A codec of the user's own, for a type without serde, that sometimes cannot reach what
    /// it needs.
    struct Digits {
        reachable: bool,
    }

    struct Count(u32);

    impl Decoder<Count> for Digits {
        fn decode(&self, payload: &Bytes) -> impl Future<Output = Result<Count, CodecError>> + Send {
            let result = if !self.reachable {
                Err(CodecError::unavailable("the digit registry did not answer"))
            } else {
                std::str::from_utf8(payload)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .map(Count)
                    .ok_or_else(|| CodecError::malformed("not a decimal count"))
            };
            std::future::ready(result)
        }
    }

    #[tokio::test]
    async fn a_codec_without_serde_decodes_and_an_unreachable_codec_is_transient() {
        let seen = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let sum = seen.clone();
        let h = typed_with(Digits { reachable: true }, move |c: Count, _d| {
            let sum = sum.clone();
            async move {
                sum.fetch_add(c.0, std::sync::atomic::Ordering::SeqCst);
                Ok(())
            }
        });
        h.handle(delivery(b"41")).await.unwrap();
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 41);
        let err = h.handle(delivery(b"x")).await.unwrap_err();
        assert_eq!(err.class(), ErrorClass::Malformed);
        assert!(err.message().contains("not a decimal count"), "{}", err.message());

        let h = h.with_codec(Digits { reachable: false });
        let err = h.handle(delivery(b"1")).await.unwrap_err();
        assert_eq!(
            err.class(),
            ErrorClass::Transient,
            "an outage is retried, not dead-lettered"
        );
        assert_eq!(
            seen.load(std::sync::atomic::Ordering::SeqCst),
            41,
            "the function was not called"
        );
    }
}
