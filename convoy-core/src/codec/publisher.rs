//! A publisher of typed values: encode, then publish.

use std::marker::PhantomData;
use std::sync::Arc;

use bytes::Bytes;

use super::{CodecError, Encoder, Json};
use crate::message::OutgoingMessage;
use crate::transport::{Publisher, Receipt, TransportError};

/// Why a typed publish failed: the value could not be encoded (nothing was sent), or the
/// broker did not confirm it.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The value could not be encoded; nothing was sent.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The broker did not confirm the message.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// Publishes values of `T`, encoded by `E` (JSON unless said otherwise), keyed like every
/// convoy message: all values of one key land in one source, in the order published.
///
/// ```no_run
/// # async fn f(publisher: std::sync::Arc<dyn convoy_core::Publisher>) -> Result<(), convoy_core::codec::PublishError> {
/// use convoy_core::codec::TypedPublisher;
/// #[derive(serde::Serialize)]
/// struct Order { qty: u32 }
/// let orders = TypedPublisher::json(publisher);
/// orders.publish("order-7", &Order { qty: 2 }).await?;
/// # Ok(()) }
/// ```
pub struct TypedPublisher<T, E = Json> {
    publisher: Arc<dyn Publisher>,
    encoder: E,
    _value: PhantomData<fn(&T)>,
}

impl<T> TypedPublisher<T, Json> {
    /// Values of `T` as JSON.
    pub fn json(publisher: Arc<dyn Publisher>) -> Self {
        TypedPublisher {
            publisher,
            encoder: Json,
            _value: PhantomData,
        }
    }
}

impl<T, E: Encoder<T>> TypedPublisher<T, E> {
    /// Values of `T`, encoded by `encoder`.
    pub fn new(publisher: Arc<dyn Publisher>, encoder: E) -> Self {
        TypedPublisher {
            publisher,
            encoder,
            _value: PhantomData,
        }
    }

    /// The message `publish` would send: add headers or an event id, then publish it with
    /// [`publisher`](Self::publisher), or return it as a transform's output.
    pub async fn message(&self, key: impl Into<Bytes>, value: &T) -> Result<OutgoingMessage, CodecError> {
        let key = key.into();
        Ok(OutgoingMessage::new(key, self.encoder.encode(value).await?))
    }

    /// Encodes `value` and publishes it under `key`, confirmed.
    pub async fn publish(&self, key: impl Into<Bytes>, value: &T) -> Result<Receipt, PublishError> {
        let message = self.message(key, value).await?;
        Ok(self.publisher.publish(message).await?)
    }

    /// Encodes every value, then publishes them in order (pipelined where the broker allows).
    /// Nothing is sent if any value cannot be encoded.
    pub async fn publish_all<'v, K: Into<Bytes>>(
        &self,
        values: impl IntoIterator<Item = (K, &'v T)>,
    ) -> Result<Vec<Receipt>, PublishError>
    where
        T: 'v,
    {
        let mut messages = Vec::new();
        for (key, value) in values {
            messages.push(self.message(key, value).await?);
        }
        Ok(self.publisher.publish_all(messages).await?)
    }

    /// The untyped publisher underneath.
    pub fn publisher(&self) -> &Arc<dyn Publisher> {
        &self.publisher
    }

    /// The encoder.
    pub fn encoder(&self) -> &E {
        &self.encoder
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use async_trait::async_trait;
    use serde::Serialize;

    use super::*;
    use crate::message::SourceId;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<OutgoingMessage>>);

    #[async_trait]
    impl Publisher for Recorder {
        async fn publish(&self, message: OutgoingMessage) -> Result<Receipt, TransportError> {
            let mut sent = self.0.lock().unwrap();
            sent.push(message);
            Ok(Receipt {
                source: SourceId::new("t/0"),
                offset: sent.len() as u64 - 1,
            })
        }
    }

    #[derive(Serialize)]
    struct Order {
        qty: u32,
    }

    #[tokio::test]
    async fn publishes_encoded_values_in_order_and_sends_nothing_if_one_cannot_be_encoded() {
        let recorder = Arc::new(Recorder::default());
        let orders = TypedPublisher::json(recorder.clone());
        let receipt = orders.publish("a", &Order { qty: 1 }).await.unwrap();
        assert_eq!(receipt.offset, 0);
        let receipts = orders
            .publish_all([("a", &Order { qty: 2 }), ("b", &Order { qty: 3 })])
            .await
            .unwrap();
        assert_eq!(receipts.iter().map(|r| r.offset).collect::<Vec<_>>(), [1, 2]);
        let sent: Vec<(Bytes, Bytes)> = recorder
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|m| (m.key.clone().unwrap(), m.payload.clone()))
            .collect();
        assert_eq!(
            sent,
            [
                (Bytes::from("a"), Bytes::from(r#"{"qty":1}"#)),
                (Bytes::from("a"), Bytes::from(r#"{"qty":2}"#)),
                (Bytes::from("b"), Bytes::from(r#"{"qty":3}"#)),
            ]
        );

        let maps = TypedPublisher::json(recorder.clone());
        let bad = std::collections::BTreeMap::from([((1, 2), 3)]);
        let good = std::collections::BTreeMap::new();
        let err = maps.publish_all([("c", &good), ("c", &bad)]).await.unwrap_err();
        assert!(
            matches!(err, PublishError::Codec(CodecError::Unencodable(_))),
            "{err:?}"
        );
        assert_eq!(
            recorder.0.lock().unwrap().len(),
            3,
            "nothing of the failed batch was sent"
        );
    }
}
