//! Publishing: keyed (partition = Kafka's Java-compatible murmur2 of the key, mod N — one key,
//! one partition number on every broker), acknowledged by JetStream, deduplicated by the
//! stream within its duplicate window (`Nats-Msg-Id` = the event id, so a publish re-sent after
//! a lost acknowledgement is stored once); every message gets a stable event id and a
//! `traceparent` unless it carries them already. Publishes are pipelined: up to
//! [`IN_FLIGHT`] acknowledgements are awaited at a time, in order.
//!
//! Foreign producers place keys identically with the same function (nats-py):
//!
//! ```python
//! def murmur2(data: bytes) -> int:
//!     seed, m, r = 0x9747B28C, 0x5BD1E995, 24
//!     h = (seed ^ len(data)) & 0xFFFFFFFF
//!     n = len(data) // 4
//!     for i in range(n):
//!         k = int.from_bytes(data[4 * i:4 * i + 4], "little")
//!         k = (k * m) & 0xFFFFFFFF; k ^= k >> r; k = (k * m) & 0xFFFFFFFF
//!         h = (h * m) & 0xFFFFFFFF; h ^= k
//!     tail = data[4 * n:]
//!     if len(tail) >= 3: h ^= tail[2] << 16
//!     if len(tail) >= 2: h ^= tail[1] << 8
//!     if len(tail) >= 1: h ^= tail[0]; h = (h * m) & 0xFFFFFFFF
//!     h ^= h >> 13; h = (h * m) & 0xFFFFFFFF; h ^= h >> 15
//!     return h
//!
//! partition = (murmur2(key) & 0x7FFFFFFF) % partitions
//! ack = await js.publish(f"{topic}.{partition}", payload,
//!                        headers={"convoy-key": key.decode(), "Nats-Msg-Id": event_id})
//! ```
//!
//! (A key that is not one line of text without surrounding spaces goes base64-encoded, listed
//! in `convoy-b64`: see [`crate::convert`].) `Nats-Msg-Id` is also the message's event id for
//! convoy's consumers when it carries no `convoy-event-id`: give a message the same id every time
//! it is sent, and a re-send is stored once and, past the duplicate window, skipped by the
//! idempotency store. Without one, a message is identified by its stream sequence.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use async_nats::jetstream::context::PublishError;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::dead_letter::{ReadBack, ReadMark};
use convoy_core::partitioner::partition_for_key;
use convoy_core::transport::BatchSender;
use convoy_core::{
    DeadLetter, DeadLetterSink, Message, OutgoingMessage, Receipt, SourceId, TransportError, EVENT_ID_HEADER,
};
use tokio::sync::OnceCell;

use crate::config::NatsConfig;
use crate::connect::{connect, Connected};
use crate::convert::to_header_map;
use crate::error::nats_error;
use crate::topology;

/// Acknowledgements awaited at a time. async-nats blocks a publish while 5,000 are
/// outstanding on its context, so a window above that would wait on itself.
pub const IN_FLIGHT: usize = 4_096;

/// Where a publisher sends.
#[derive(Clone, Debug)]
enum Route {
    /// A topic's partition subjects.
    Topic { partitions: u32 },
    /// One subject (a dead-letter stream), declared on first use.
    Stream,
}

/// An acknowledged, keyed JetStream publisher for one topic.
#[derive(Clone)]
pub struct NatsPublisher {
    config: NatsConfig,
    target: String,
    route: Route,
    stamp: bool,
    connected: Arc<OnceCell<Connected>>,
    round_robin: Arc<AtomicU64>,
}

impl NatsPublisher {
    /// A publisher to `topic`, keys hashed over `config.partitions`. It connects on first use.
    pub fn new(config: &NatsConfig, topic: impl Into<String>) -> Self {
        Self::with_route(
            config,
            topic.into(),
            Route::Topic {
                partitions: config.partitions,
            },
        )
    }

    fn with_route(config: &NatsConfig, target: String, route: Route) -> Self {
        NatsPublisher {
            config: config.clone(),
            target,
            route,
            stamp: true,
            connected: Arc::default(),
            round_robin: Arc::default(),
        }
    }

    /// Publishes messages exactly as given: no event id or `traceparent` is added.
    pub fn without_stamps(mut self) -> Self {
        self.stamp = false;
        self
    }

    /// The topic (or dead-letter stream) published to.
    pub fn topic(&self) -> &str {
        &self.target
    }

    /// The connection, opened (and, for a dead-letter stream, the stream declared) on first use.
    /// async-nats reconnects by itself after that.
    async fn connection(&self) -> Result<&Connected, TransportError> {
        self.connected
            .get_or_try_init(|| async {
                let connected = connect(&self.config, "publish").await?;
                if matches!(self.route, Route::Stream) {
                    topology::declare_dead_letters(&connected.js, &self.config, &self.target).await?;
                }
                Ok(connected)
            })
            .await
    }

    /// The subject and source of a message.
    fn place(&self, message: &OutgoingMessage) -> (String, SourceId) {
        match self.route {
            Route::Topic { partitions } => {
                let p = match message.key.as_ref().filter(|k| !k.is_empty()) {
                    Some(key) => partition_for_key(key, partitions),
                    None => (self.round_robin.fetch_add(1, Relaxed) % u64::from(partitions)) as u32,
                };
                (
                    topology::partition_subject(&self.target, p),
                    SourceId::partition(&self.target, p),
                )
            }
            Route::Stream => (self.target.clone(), SourceId::partition(&self.target, 0)),
        }
    }

    async fn acknowledged(&self, source: SourceId, ack: PublishAckFuture) -> Result<Receipt, TransportError> {
        let ack = ack.await.map_err(|e| self.failure(e))?;
        Ok(Receipt {
            source,
            offset: ack.sequence,
        })
    }

    /// A publish failure as the caller should see it.
    fn failure(&self, e: PublishError) -> TransportError {
        let context = format!("publishing to {}", self.target);
        match e.kind() {
            // "No responders": no stream holds the subject — or, on a cluster, the stream that
            // does has no leader for a moment (one of its servers just went away). Worth
            // publishing again; a topic that does not exist fails the same way every time.
            PublishErrorKind::StreamNotFound => TransportError::Unavailable(format!(
                "{context}: no stream answered for this subject: create the topic first \
                 (create_topics, or `convoy produce`), with the same number of partitions; on a \
                 cluster, its stream may be electing a leader: publish again"
            )),
            PublishErrorKind::MaxPayloadExceeded => TransportError::broker(
                context,
                format!("{e}: the server's max_payload counts headers and payload together"),
            ),
            PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => TransportError::Unavailable(
                format!("{context}: {e}; publish again (duplicates are dropped by the stream)"),
            ),
            _ => nats_error(&context, e),
        }
    }
}

#[async_trait]
impl BatchSender for NatsPublisher {
    fn stamps(&self) -> bool {
        self.stamp
    }

    /// Publishes in order, pipelined; returns once every message is acknowledged.
    async fn send_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Receipt>, TransportError> {
        let connected = self.connection().await?;
        let mut receipts = Vec::with_capacity(messages.len());
        let mut pending: VecDeque<(SourceId, PublishAckFuture)> = VecDeque::new();
        for message in messages {
            if pending.len() >= IN_FLIGHT {
                if let Some((source, ack)) = pending.pop_front() {
                    receipts.push(self.acknowledged(source, ack).await?);
                }
            }
            let (subject, source) = self.place(message);
            let mut headers = to_header_map(message.key.as_ref(), &message.headers);
            if let Some(id) = message.headers.get_str(EVENT_ID_HEADER) {
                if let Ok(id) = id.parse::<async_nats::HeaderValue>() {
                    headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
                }
            }
            let ack = connected
                .js
                .publish_with_headers(subject, headers, message.payload.clone())
                .await
                .map_err(|e| self.failure(e))?;
            pending.push_back((source, ack));
        }
        for (source, ack) in pending {
            receipts.push(self.acknowledged(source, ack).await?);
        }
        Ok(receipts)
    }
}

/// Dead letters to the dead-letter stream: original key, payload and headers plus the reason
/// headers, acknowledged.
#[derive(Clone)]
pub struct NatsDeadLetterSink {
    publisher: NatsPublisher,
}

impl NatsDeadLetterSink {
    /// A sink writing to `config`'s dead-letter stream (declared on first use).
    pub fn new(config: &NatsConfig) -> Self {
        NatsDeadLetterSink {
            publisher: NatsPublisher::with_route(config, config.dlq_topic(), Route::Stream),
        }
    }
}

#[async_trait]
impl DeadLetterSink for NatsDeadLetterSink {
    /// Publishes, acknowledged. On a failure the stream is declared again before the error goes
    /// back (the engine retries the dead letter with backoff): one deleted since it was first
    /// declared — an operator's clean-up — would otherwise fail every dead letter for good.
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        let result = self.publisher.send_one(&dead_letter.to_outgoing()).await;
        if result.is_err() {
            if let Some(connected) = self.publisher.connected.get() {
                let (config, stream) = (&self.publisher.config, &self.publisher.target);
                if let Err(e) = topology::declare_dead_letters(&connected.js, config, stream).await {
                    tracing::warn!(stream, error = %e, "declaring the dead-letter stream again failed");
                }
            }
        }
        result.map(|_| ())
    }

    fn can_read_back(&self) -> bool {
        true
    }

    /// The stream up to the last message it held when reading began.
    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        let connected = self.publisher.connection().await?;
        crate::admin::read_with(connected, &self.publisher.target).await
    }

    /// From the stream sequence of the mark on; the mark is the stream's creation time and the
    /// next sequence (`created|0:N`). A mark of a stream deleted and created again since (another
    /// creation time) reads the new stream from its start.
    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        let start = mark
            .and_then(ReadMark::next_offsets)
            .and_then(|next| next.get(&0).copied())
            .unwrap_or(1);
        let connected = self.publisher.connection().await?;
        let target = &self.publisher.target;
        let mut read = crate::admin::read_from(connected, target, start).await?;
        let current = read.created.map(|c| c.to_string());
        let restarted = start > 1 && mark.and_then(ReadMark::epoch) != current.as_deref();
        if restarted {
            read = crate::admin::read_from(connected, target, 1).await?;
        }
        let next = BTreeMap::from([(0, read.next)]);
        let mark = match read.created {
            Some(created) => ReadMark::of_next_offsets_in(&created.to_string(), &next),
            None => ReadMark::of_next_offsets(&next),
        };
        Ok(ReadBack {
            records: read.messages,
            mark: Some(mark),
            restarted,
        })
    }

    /// From the group's watermark bucket, key `parking.<stream>` (part 0) or
    /// `parking.<stream>.<part>`.
    async fn load_checkpoint(&self, group: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
        let connected = self.publisher.connection().await?;
        let store = topology::open_watermarks(&connected.js, &self.publisher.config, group).await?;
        let entry = store
            .entry(self.checkpoint_key(part))
            .await
            .map_err(|e| nats_error("reading the parked keys' checkpoint", e))?;
        Ok(entry
            .filter(|e| e.operation == async_nats::jetstream::kv::Operation::Put)
            .map(|e| e.value))
    }

    /// Into the group's watermark bucket (a value is at most the server's max_payload, 1 MB by
    /// default: each part is half that).
    async fn save_checkpoint(&self, group: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
        let connected = self.publisher.connection().await?;
        let store = topology::open_watermarks(&connected.js, &self.publisher.config, group).await?;
        store
            .put(self.checkpoint_key(part), checkpoint)
            .await
            .map_err(|e| nats_error("saving the parked keys' checkpoint", e))?;
        Ok(())
    }
}

impl NatsDeadLetterSink {
    /// The key of the checkpoint's part `part` in a group's watermark bucket.
    fn checkpoint_key(&self, part: u32) -> String {
        let stream = topology::stream_name(&self.publisher.target);
        match part {
            0 => format!("parking.{stream}"),
            n => format!("parking.{stream}.{n}"),
        }
    }
}
