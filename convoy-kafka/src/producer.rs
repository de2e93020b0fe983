//! Publishing: keyed, idempotent, Java-compatible partitioning (`murmur2_random`), confirmed;
//! every message gets a stable event id and a `traceparent` unless it carries them already.
//! The dead-letter sink publishes to the DLQ topic the same way.

use std::time::Duration;

use async_trait::async_trait;
use convoy_core::{
    DeadLetter, DeadLetterSink, OutgoingMessage, Publisher, Receipt, TraceContext, TransportError,
    EVENT_ID_HEADER,
};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::config::KafkaConfig;
use crate::convert::{source_id, to_kafka_headers};

/// How long a send may wait for room in librdkafka's queue before failing.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// A confirmed, keyed Kafka producer for one topic.
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
    topic: String,
}

impl KafkaPublisher {
    /// A publisher to `topic` with the producer settings of `config`.
    pub fn new(config: &KafkaConfig, topic: impl Into<String>) -> Result<Self, TransportError> {
        let producer = config
            .producer_config()
            .create()
            .map_err(|e| TransportError::broker("creating the Kafka producer", e))?;
        Ok(KafkaPublisher {
            producer,
            topic: topic.into(),
        })
    }

    /// The topic published to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    async fn send(&self, message: &OutgoingMessage) -> Result<Receipt, TransportError> {
        let headers = to_kafka_headers(&message.headers);
        let mut record = FutureRecord::<[u8], [u8]>::to(&self.topic)
            .payload(message.payload.as_ref())
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_ref());
        }
        match self.producer.send(record, QUEUE_TIMEOUT).await {
            Ok(delivery) => Ok(Receipt {
                source: source_id(&self.topic, delivery.partition),
                offset: delivery.offset.max(0) as u64,
            }),
            Err((e, _)) => Err(TransportError::broker(format!("publishing to {}", self.topic), e)),
        }
    }
}

/// A fresh event id: 128 random bits as hex.
fn new_event_id() -> String {
    let mut rng = fastrand::Rng::new();
    format!("{:016x}{:016x}", rng.u64(..), rng.u64(..))
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish(&self, mut message: OutgoingMessage) -> Result<Receipt, TransportError> {
        if message.headers.get(EVENT_ID_HEADER).is_none() {
            message.headers.insert(EVENT_ID_HEADER, new_event_id());
        }
        if TraceContext::extract(&message.headers).is_none() {
            TraceContext::new_root().inject(&mut message.headers);
        }
        self.send(&message).await
    }
}

/// Dead letters to a Kafka topic: original key, payload and headers plus the reason headers.
#[derive(Clone)]
pub struct KafkaDeadLetterSink {
    publisher: KafkaPublisher,
}

impl KafkaDeadLetterSink {
    /// A sink writing to `config`'s dead-letter topic.
    pub fn new(config: &KafkaConfig) -> Result<Self, TransportError> {
        Ok(KafkaDeadLetterSink {
            publisher: KafkaPublisher::new(config, config.dlq_topic())?,
        })
    }
}

#[async_trait]
impl DeadLetterSink for KafkaDeadLetterSink {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        self.publisher.send(&dead_letter.to_outgoing()).await.map(|_| ())
    }
}
