//! Transforms: handlers whose effect is messages to publish (consume → produce).
//!
//! A [`Transform`] returns the [`Output`]s of one input instead of publishing them itself. The
//! engine gives each output an event id derived from the input's ([`output_id`]: the same on
//! every retry, restart and redelivery) and hands them to the subscription's [`Outbox`] before
//! the input counts as finished. What the outbox promises depends on the broker:
//!
//! - **A transport with transactions** (Kafka with a transactional id; the memory broker when
//!   asked): a [`StagingOutbox`] holds outputs until the watermark covers their input, then
//!   they are published in one broker transaction with the commit of that watermark (see
//!   [`staging`](StagingOutbox)). A `read_committed` reader sees every output exactly once; a
//!   commit that fails aborts the transaction and sends the same outputs again with the next.
//! - **Every other transport** ([`PublishingOutbox`]): outputs are published, confirmed, before
//!   the input is finished — at least once. A redelivered input publishes outputs with the same
//!   ids: NATS drops them within the stream's duplicate window (`Nats-Msg-Id`), and any convoy
//!   consumer skips them by event id (RabbitMQ's `message_id`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

mod staging;

pub use staging::{Staging, StagingOutbox, Transaction, DEFAULT_MAX_TRANSACTION_BYTES};

use crate::handler::{Delivery, ErrorClass, Handler, HandlerError};
use crate::message::{EventId, Message, EVENT_ID_HEADER};
use crate::transport::{Publisher, TransportError};

pub use crate::transport::{Outbox, Output, OutputGuarantee};

/// The event id of output number `index` (from 0) of the input whose event id is `input`:
/// `<input id>/out/<index>`. Stable as long as the transform returns its outputs in the same
/// order for the same input.
pub fn output_id(input: &EventId, index: usize) -> String {
    format!("{input}/out/{index}")
}

/// Consumes one message and returns what to publish for it. Like a [`Handler`], it runs once at
/// a time per key; an error is retried (transient) or dead-letters the input (terminal), and
/// nothing of a failed attempt is published.
#[async_trait]
pub trait Transform: Send + Sync + 'static {
    /// The outputs of one attempt at `delivery` (none is fine: the input is simply finished).
    async fn transform(&self, delivery: Delivery) -> Result<Vec<Output>, HandlerError>;
}

#[async_trait]
impl<T: Transform + ?Sized> Transform for Arc<T> {
    async fn transform(&self, delivery: Delivery) -> Result<Vec<Output>, HandlerError> {
        (**self).transform(delivery).await
    }
}

/// A transform made from an async closure; see [`transform_fn`].
#[derive(Clone)]
pub struct TransformFn<F>(F);

/// Makes a transform from `Fn(Delivery) -> impl Future<Output = Result<Vec<Output>, HandlerError>>`.
pub fn transform_fn<F, Fut>(f: F) -> TransformFn<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Vec<Output>, HandlerError>> + Send + 'static,
{
    TransformFn(f)
}

#[async_trait]
impl<F, Fut> Transform for TransformFn<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Vec<Output>, HandlerError>> + Send + 'static,
{
    async fn transform(&self, delivery: Delivery) -> Result<Vec<Output>, HandlerError> {
        (self.0)(delivery).await
    }
}

/// Makes the publisher for a topic (a connection's `publisher`).
pub type PublisherMaker = dyn Fn(&str) -> Result<Arc<dyn Publisher>, TransportError> + Send + Sync;

/// The outbox of transports without transactions: publishes outputs, confirmed, topic by topic
/// in the order given, before the input is finished.
pub struct PublishingOutbox {
    make: Box<PublisherMaker>,
    publishers: Mutex<HashMap<String, Arc<dyn Publisher>>>,
}

impl PublishingOutbox {
    /// An outbox publishing through the publishers `make` returns (one per topic, kept).
    pub fn new(
        make: impl Fn(&str) -> Result<Arc<dyn Publisher>, TransportError> + Send + Sync + 'static,
    ) -> Self {
        PublishingOutbox {
            make: Box::new(make),
            publishers: Mutex::new(HashMap::new()),
        }
    }

    fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, TransportError> {
        let mut publishers = self.publishers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = publishers.get(topic) {
            return Ok(p.clone());
        }
        let made = (self.make)(topic)?;
        publishers.insert(topic.to_owned(), made.clone());
        Ok(made)
    }
}

impl std::fmt::Debug for PublishingOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishingOutbox").finish_non_exhaustive()
    }
}

#[async_trait]
impl Outbox for PublishingOutbox {
    async fn put(&self, _input: &Message, outputs: Vec<Output>) -> Result<(), TransportError> {
        // Runs of one topic in the order given: messages of one key to one topic keep it.
        let mut outputs = outputs.into_iter().peekable();
        while let Some(first) = outputs.next() {
            let publisher = self.publisher(&first.topic)?;
            let mut run = vec![first.message];
            while let Some(next) = outputs.next_if(|o| o.topic == first.topic) {
                run.push(next.message);
            }
            publisher.publish_all(run).await?;
        }
        Ok(())
    }

    fn guarantee(&self) -> OutputGuarantee {
        OutputGuarantee::Deduplicated
    }
}

/// The outbox of a transform not yet bound to a subscription (never called: every run binds
/// its own, or does not start).
pub(crate) struct Unbound;

#[async_trait]
impl Outbox for Unbound {
    async fn put(&self, _: &Message, _: Vec<Output>) -> Result<(), TransportError> {
        Err(TransportError::Fatal(
            "the transform is not bound to a subscription's outbox".into(),
        ))
    }

    fn guarantee(&self) -> OutputGuarantee {
        OutputGuarantee::Deduplicated
    }
}

/// A transform bound to one subscription's outbox: the handler the engine runs.
pub(crate) struct Transformer {
    pub transform: Arc<dyn Transform>,
    pub outbox: Arc<dyn Outbox>,
}

#[async_trait]
impl Handler for Transformer {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        // A delivery shares its message: keeping one costs a reference count, not a copy.
        let kept = delivery.clone();
        let mut outputs = (*self.transform).transform(delivery).await?;
        if outputs.is_empty() {
            return Ok(());
        }
        let input = kept.event_id();
        for (index, output) in outputs.iter_mut().enumerate() {
            if output.message.headers.get(EVENT_ID_HEADER).is_none() {
                output
                    .message
                    .headers
                    .insert(EVENT_ID_HEADER, output_id(&input, index));
            }
        }
        (*self.outbox).put(kept.message(), outputs).await.map_err(|e| {
            let class = match e.is_fatal() {
                true => ErrorClass::Terminal,
                false => ErrorClass::Transient,
            };
            HandlerError::caused_by(class, e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{OutgoingMessage, SourceId};
    use crate::transport::Receipt;
    use bytes::Bytes;

    #[derive(Default)]
    struct Recorded(Mutex<Vec<(String, OutgoingMessage)>>);

    struct To(String, Arc<Recorded>);

    #[async_trait]
    impl Publisher for To {
        async fn publish(&self, message: OutgoingMessage) -> Result<Receipt, TransportError> {
            let mut all = self.1 .0.lock().unwrap();
            all.push((self.0.clone(), message));
            Ok(Receipt {
                source: SourceId::partition(&self.0, 0),
                offset: all.len() as u64,
            })
        }
    }

    fn input(id: Option<&str>) -> Arc<Message> {
        let mut m = Message {
            key: Some(Bytes::from_static(b"k")),
            payload: Bytes::from_static(b"p"),
            headers: Default::default(),
            source: SourceId::partition("in", 2),
            offset: 9,
        };
        if let Some(id) = id {
            m.headers.insert(EVENT_ID_HEADER, id.to_owned());
        }
        Arc::new(m)
    }

    fn transformer(recorded: &Arc<Recorded>) -> Transformer {
        let for_topics = recorded.clone();
        Transformer {
            transform: Arc::new(transform_fn(|d: Delivery| async move {
                Ok(vec![
                    Output::keyed("a", d.key().unwrap().clone(), "1"),
                    Output::keyed("b", "other", "2"),
                    Output::new("a", OutgoingMessage::new("k", "3").event_id("mine")),
                ])
            })),
            outbox: Arc::new(PublishingOutbox::new(move |topic| {
                Ok(Arc::new(To(topic.to_owned(), for_topics.clone())) as Arc<dyn Publisher>)
            })),
        }
    }

    #[tokio::test]
    async fn outputs_get_ids_derived_from_the_input_and_go_out_in_order() {
        let recorded = Arc::new(Recorded::default());
        let t = transformer(&recorded);
        t.handle(Delivery::new(input(Some("evt-1")), 1)).await.unwrap();
        t.handle(Delivery::new(input(None), 2)).await.unwrap();
        let seen: Vec<(String, String)> = recorded
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|(topic, m)| {
                (
                    topic.clone(),
                    m.headers.get_str(EVENT_ID_HEADER).unwrap().to_owned(),
                )
            })
            .collect();
        let expect = |t: &str, id: &str| (t.to_owned(), id.to_owned());
        assert_eq!(
            seen,
            vec![
                expect("a", "evt-1/out/0"),
                expect("b", "evt-1/out/1"),
                expect("a", "mine"),
                // Without an id of its own the input is named by its position.
                expect("a", "in/2@9/out/0"),
                expect("b", "in/2@9/out/1"),
                expect("a", "mine"),
            ]
        );
    }

    #[tokio::test]
    async fn a_fatal_outbox_error_dead_letters_others_retry() {
        struct Failing(bool);
        #[async_trait]
        impl Outbox for Failing {
            async fn put(&self, _: &Message, _: Vec<Output>) -> Result<(), TransportError> {
                Err(match self.0 {
                    true => TransportError::Fatal("not authorized on topic a".into()),
                    false => TransportError::Unavailable("no leader".into()),
                })
            }
            fn guarantee(&self) -> OutputGuarantee {
                OutputGuarantee::Deduplicated
            }
        }
        for (fatal, class) in [(true, ErrorClass::Terminal), (false, ErrorClass::Transient)] {
            let t = Transformer {
                transform: Arc::new(transform_fn(|_| async { Ok(vec![Output::keyed("a", "k", "v")]) })),
                outbox: Arc::new(Failing(fatal)),
            };
            let error = t.handle(Delivery::new(input(Some("e")), 1)).await.unwrap_err();
            assert_eq!(error.class(), class);
            assert!(error.chain().contains("topic a") || error.chain().contains("no leader"));
        }
    }
}
