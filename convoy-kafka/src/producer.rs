//! Publishing: keyed, idempotent, Java-compatible partitioning (`murmur2_random`), confirmed;
//! every message gets a stable event id and a `traceparent` unless it carries them already.
//! The dead-letter sink publishes to the DLQ topic the same way.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::dead_letter::{ReadBack, ReadMark};
use convoy_core::transport::BatchSender;
use convoy_core::{DeadLetter, DeadLetterSink, Headers, Message, OutgoingMessage, Receipt, TransportError};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};

use crate::config::KafkaConfig;
use crate::convert::{source_id, to_kafka_headers};
use crate::fatal;

/// How long a send may wait for room in librdkafka's queue before failing.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(30);

/// A confirmed, keyed Kafka producer for one topic.
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
    topic: String,
    stamp: bool,
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
            stamp: true,
        })
    }

    /// Publishes messages exactly as given: no event id or `traceparent` is added (for
    /// consumers that are not convoy, or load generators reproducing another producer). Without
    /// an event id, duplicates are detected by source and offset only.
    pub fn without_stamps(mut self) -> Self {
        self.stamp = false;
        self
    }

    /// The same producer (its connections and queue), publishing to `topic` unstamped.
    fn to_topic(&self, topic: String) -> KafkaPublisher {
        KafkaPublisher {
            producer: self.producer.clone(),
            topic,
            stamp: false,
        }
    }

    /// The topic published to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    fn record<'a>(
        &'a self,
        message: &'a OutgoingMessage,
        headers: OwnedHeaders,
    ) -> FutureRecord<'a, [u8], [u8]> {
        let mut record = FutureRecord::<[u8], [u8]>::to(&self.topic)
            .payload(message.payload.as_ref())
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_ref());
        }
        record
    }

    /// A send failure as the caller should see it: fatal when the producer can never send again
    /// (e.g. its idempotence state is fenced), so the engine stops instead of retrying forever.
    fn failure(&self, e: KafkaError) -> TransportError {
        let context = format!("publishing to {}", self.topic);
        fatal::client_fatal(self.producer.client(), &context)
            .or_else(|| fatal::classify(&e, &context))
            .unwrap_or_else(|| TransportError::broker(context, e))
    }

    fn receipt(&self, partition: i32, offset: i64) -> Receipt {
        Receipt {
            source: source_id(&self.topic, partition),
            offset: offset.max(0) as u64,
        }
    }
}

#[async_trait]
impl BatchSender for KafkaPublisher {
    fn stamps(&self) -> bool {
        self.stamp
    }

    /// The idempotent producer numbers each partition's batches and the broker refuses one out
    /// of sequence, so a failed message fails the partition's later ones with it: a batch needs
    /// no rounds. The one gap left: a message that exhausts `message.timeout.ms` (5 minutes)
    /// while a later one gets through; the librdkafka property `enable.gapless.guarantee=true`
    /// makes that a fatal producer error instead.
    fn orders_on_failure(&self) -> bool {
        true
    }

    /// Enqueues every message before awaiting any confirmation: librdkafka keeps enqueue order
    /// per partition (and, being idempotent, across retries), so per-key order holds.
    async fn send_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Receipt>, TransportError> {
        let started = Instant::now();
        let mut pending = Vec::with_capacity(messages.len());
        for message in messages {
            let mut record = self.record(message, to_kafka_headers(&message.headers));
            loop {
                match self.producer.send_result(record) {
                    Ok(delivery) => break pending.push(delivery),
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                        if started.elapsed() < QUEUE_TIMEOUT =>
                    {
                        record = back;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    Err((e, _)) => return Err(self.failure(e)),
                }
            }
        }
        let mut receipts = Vec::with_capacity(pending.len());
        for delivery in pending {
            match delivery.await {
                Ok(Ok(d)) => receipts.push(self.receipt(d.partition, d.offset)),
                Ok(Err((e, _))) => return Err(self.failure(e)),
                Err(_) => return Err(TransportError::Closed),
            }
        }
        Ok(receipts)
    }
}

/// Dead letters to a Kafka topic: original key, payload and headers plus the reason headers.
#[derive(Clone)]
pub struct KafkaDeadLetterSink {
    publisher: KafkaPublisher,
    /// The checkpoints' topic, through the dead letters' producer: a save costs one record.
    checkpoints: KafkaPublisher,
    /// Whether the checkpoints' topic was created (or found): not asked again until a save fails.
    checkpoints_created: Arc<AtomicBool>,
    config: KafkaConfig,
}

impl KafkaDeadLetterSink {
    /// A sink writing to `config`'s dead-letter topic.
    pub fn new(config: &KafkaConfig) -> Result<Self, TransportError> {
        let publisher = KafkaPublisher::new(config, config.dlq_topic())?;
        Ok(KafkaDeadLetterSink {
            checkpoints: publisher.to_topic(checkpoint_topic(&config.dlq_topic())),
            publisher,
            checkpoints_created: Arc::default(),
            config: config.clone(),
        })
    }
}

#[async_trait]
impl DeadLetterSink for KafkaDeadLetterSink {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        self.publisher
            .send_one(&dead_letter.to_outgoing())
            .await
            .map(|_| ())
    }

    fn can_read_back(&self) -> bool {
        true
    }

    /// The topic up to the end each partition had when reading began.
    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        crate::admin::read_topic_to_end(&self.config, &self.config.dlq_topic(), READ_BACK_STALL).await
    }

    /// From the offsets of the mark on (per partition), to the end each partition had. A mark
    /// past a partition's end (the topic deleted and created again since, shorter) reads the
    /// topic from its start; one deleted and refilled past the mark is not told apart.
    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        let from = mark.and_then(ReadMark::next_offsets).unwrap_or_default();
        let topic = self.config.dlq_topic();
        let (read, restarted) =
            match crate::admin::read_topic_after(&self.config, &topic, from, READ_BACK_STALL).await? {
                Some(read) => (read, false),
                None => {
                    let read = crate::admin::read_topic_after(
                        &self.config,
                        &topic,
                        Default::default(),
                        READ_BACK_STALL,
                    )
                    .await?
                    .unwrap_or_default();
                    (read, true)
                }
            };
        Ok(ReadBack {
            records: read.0,
            mark: Some(ReadMark::of_next_offsets(&read.1)),
            restarted,
        })
    }

    /// The group's latest record in the compacted topic `<dead-letter topic>.parking`, read
    /// from its end: what it costs grows with the checkpoints saved since the group's last
    /// one, not with every checkpoint ever saved (compaction leaves the active segment alone).
    async fn load_checkpoint(&self, group: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
        let topic = self.checkpoints.topic();
        let key = checkpoint_key(group, part);
        let latest = crate::admin::latest_of_key(&self.config, topic, &key, READ_BACK_STALL).await?;
        Ok(latest.map(|r| r.payload))
    }

    /// A record keyed by the group (and the part) in the compacted topic
    /// `<dead-letter topic>.parking` (created on first use; each part is half the broker's
    /// default `message.max.bytes`).
    async fn save_checkpoint(&self, group: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
        if !self.checkpoints_created.load(Relaxed) {
            crate::admin::create_compacted_topic(&self.config, self.checkpoints.topic()).await?;
            self.checkpoints_created.store(true, Relaxed);
        }
        let saved = self
            .checkpoints
            .send_one(&OutgoingMessage {
                key: Some(Bytes::from(checkpoint_key(group, part))),
                payload: checkpoint,
                headers: Headers::new(),
            })
            .await;
        if saved.is_err() {
            // The topic may have been deleted under us: the next save creates it again.
            self.checkpoints_created.store(false, Relaxed);
        }
        saved.map(|_| ())
    }
}

/// The compacted topic beside `dead_letter_topic` holding its parked keys' checkpoints, one
/// record per group.
pub fn checkpoint_topic(dead_letter_topic: &str) -> String {
    format!("{dead_letter_topic}.parking")
}

/// The key of part `part` of `group`'s checkpoint: the group's name, and for the parts after
/// the first a NUL and the part's number (no group's name makes another's part).
fn checkpoint_key(group: &str, part: u32) -> Vec<u8> {
    match part {
        0 => group.as_bytes().to_vec(),
        n => format!("{group}\0{n}").into_bytes(),
    }
}

/// Reading the dead-letter topic back fails when no record arrived for this long before its end
/// (and the engine tries again).
const READ_BACK_STALL: Duration = Duration::from_secs(10);
