//! Publishing: keyed (partition = Kafka's Java-compatible murmur2 of the key, mod N — one key,
//! one partition number on every broker), persistent, `mandatory` (an unroutable message is an
//! error, not a silent loss), confirmed; every message gets a stable event id and a
//! `traceparent` unless it carries them already. The dead-letter sink publishes to the
//! dead-letter stream the same way.
//!
//! Foreign producers place keys identically with the same function (pika):
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
//! channel.confirm_delivery()
//! channel.basic_publish(exchange=topic, routing_key=str(partition), body=payload, mandatory=True,
//!     properties=pika.BasicProperties(delivery_mode=2, message_id=event_id,
//!                                     headers={"convoy-key": key}))
//! ```
//!
//! `message_id` is the message's event id for convoy's consumers when it carries no
//! `convoy-event-id` header: give a message the same id every time it is sent, and a re-send is
//! skipped as a duplicate. Without either, a message has no event id — a delivery tag restarts
//! on every channel and identifies nothing — so it is never skipped: after a crash or a lost
//! connection its redelivery is handled again (at least once).
//!
//! lapin may attach a returned (unroutable) message to another publish's confirmation when
//! several are in flight, so returns are matched by their unique `message_id`, never by which
//! confirmation carried them.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::dead_letter::DL_CAUSE;
use convoy_core::dead_letter::{ReadBack, ReadMark};
use convoy_core::parking::CAUSE_END;
use convoy_core::partitioner::partition_for_key;
use convoy_core::transport::BatchSender;
use convoy_core::{
    DeadLetter, DeadLetterSink, Headers, Message, OutgoingMessage, Receipt, SourceId, TransportError,
};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use crate::config::AmqpConfig;
use crate::connect::connect;
use crate::convert::{to_field_table, KEY_HEADER};
use crate::error::broker;
use crate::stream::Start;

use crate::topology;

/// Longest wait for a batch's publisher confirmations (connection and channel set-up included).
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(60);

/// Where a publisher sends.
#[derive(Clone, Debug)]
enum Route {
    /// A topic's exchange, routing key = the key's partition.
    Topic { partitions: u32 },
    /// One queue (a dead-letter stream), through the default exchange.
    Queue,
}

/// A confirmed, keyed RabbitMQ publisher for one topic.
#[derive(Clone)]
pub struct AmqpPublisher {
    config: AmqpConfig,
    target: String,
    route: Route,
    stamp: bool,
    open: Arc<Mutex<Option<(Connection, Channel)>>>,
    next_id: Arc<AtomicU64>,
    round_robin: Arc<AtomicU64>,
    id_prefix: String,
}

impl AmqpPublisher {
    /// A publisher to topic `topic` (the exchange), keys hashed over `config.partitions`.
    pub fn new(config: &AmqpConfig, topic: impl Into<String>) -> Self {
        Self::with_route(
            config,
            topic.into(),
            Route::Topic {
                partitions: config.partitions,
            },
        )
    }

    fn with_route(config: &AmqpConfig, target: String, route: Route) -> Self {
        AmqpPublisher {
            config: config.clone(),
            target,
            route,
            stamp: true,
            open: Arc::default(),
            next_id: Arc::default(),
            round_robin: Arc::default(),
            id_prefix: format!("{:x}-{:x}", std::process::id(), fastrand::u64(..)),
        }
    }

    /// Publishes messages exactly as given: no event id or `traceparent` is added.
    pub fn without_stamps(mut self) -> Self {
        self.stamp = false;
        self
    }

    /// The topic (or stream) published to.
    pub fn topic(&self) -> &str {
        &self.target
    }

    /// The open confirm channel, opened (and the stream, or the topic's exchange with its
    /// partition count, declared: a topic declared with another count is refused here) on first
    /// use or after a connection loss.
    async fn channel(&self, open: &mut Option<(Connection, Channel)>) -> Result<Channel, TransportError> {
        if let Some((connection, channel)) = open.as_ref() {
            if connection.status().connected() && channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        let connection = connect(&self.config, "publish").await?;
        if matches!(self.route, Route::Queue) {
            topology::declare_stream(&connection, &self.target).await?;
        }
        if let Route::Topic { partitions } = self.route {
            // On a channel of its own: a refusal closes it.
            let check = connection
                .create_channel()
                .await
                .map_err(|e| broker("opening a channel", e))?;
            topology::declare_exchange(&check, &self.target, partitions).await?;
            let _ = check.close(200, "declared".into()).await;
        }
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| broker("opening a publish channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| broker("enabling publisher confirms", e))?;
        *open = Some((connection, channel.clone()));
        Ok(channel)
    }

    /// A publish failure as the caller should see it: the broker's own reason when it closed
    /// the channel (a missing exchange is a 404 on the confirmation, then a closing channel).
    fn failure(&self, e: lapin::Error) -> TransportError {
        let context = format!("publishing to {}", self.target);
        match crate::error::amqp_error(&e) {
            Some((404, text)) => TransportError::broker(
                context,
                format!("{text}: declare the topic first (create_topics, or `convoy produce`, declare it)"),
            ),
            _ => broker(&context, e),
        }
    }

    /// The partition of a message: its key's, or round-robin for keyless messages.
    fn partition(&self, message: &OutgoingMessage, partitions: u32) -> u32 {
        match message.key.as_ref().filter(|k| !k.is_empty()) {
            Some(key) => partition_for_key(key, partitions),
            None => (self.round_robin.fetch_add(1, Relaxed) % u64::from(partitions)) as u32,
        }
    }

    async fn send_on(
        &self,
        open: &mut Option<(Connection, Channel)>,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<Receipt>, TransportError> {
        let channel = self.channel(open).await?;
        let mut writes = Vec::with_capacity(messages.len());
        let mut receipts = Vec::with_capacity(messages.len());
        for message in messages {
            let (routing_key, source) = match self.route {
                Route::Topic { partitions } => {
                    let p = self.partition(message, partitions);
                    (topology::routing_key(p), SourceId::partition(&self.target, p))
                }
                Route::Queue => (self.target.clone(), SourceId::partition(&self.target, 0)),
            };
            let id = format!("{}-{}", self.id_prefix, self.next_id.fetch_add(1, Relaxed));
            let mut headers = message.headers.clone();
            if let Some(key) = &message.key {
                headers.insert(KEY_HEADER, key.clone());
            }
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(id.as_str().into())
                .with_headers(to_field_table(&headers));
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            let exchange = match self.route {
                Route::Topic { .. } => self.target.as_str(),
                Route::Queue => "",
            };
            writes.push(Box::pin(channel.basic_publish(
                exchange.into(),
                routing_key.as_str().into(),
                options,
                &message.payload,
                properties,
            )));
            receipts.push(Receipt { source, offset: 0 });
        }
        // A publish queues its frames on its first poll, before it waits for them to be written:
        // polling every one once, in order, sends them all in order and lets the connection
        // write them in bulk instead of one round trip to its I/O thread per message.
        let mut first = Vec::with_capacity(writes.len());
        for write in &mut writes {
            first.push(futures_util::poll!(write.as_mut()));
        }
        let mut pending = Vec::with_capacity(writes.len());
        for (write, polled) in writes.into_iter().zip(first) {
            let written = match polled {
                std::task::Poll::Ready(written) => written,
                std::task::Poll::Pending => write.await,
            };
            match written {
                Ok(confirm) => pending.push(confirm),
                Err(e) => {
                    *open = None;
                    return Err(self.failure(e));
                }
            }
        }
        let mut returned = HashSet::new();
        let mut nacked = 0usize;
        for confirm in pending {
            match confirm.await {
                Ok(Confirmation::Ack(None)) | Ok(Confirmation::NotRequested) => {}
                Ok(Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret))) => {
                    returned.insert(ret.properties.message_id().as_ref().map(|id| id.to_string()));
                }
                Ok(Confirmation::Nack(None)) => nacked += 1,
                Err(e) => {
                    *open = None;
                    return Err(self.failure(e));
                }
            }
        }
        if !returned.is_empty() {
            return Err(TransportError::broker(
                format!("publishing to {}", self.target),
                format!(
                    "{} message(s) reached no consumer group: no group's queues receive {} yet (or not \
                     with this partition count), and RabbitMQ keeps a message only for the groups that \
                     exist when it is published — declare the group first (`convoy topic create {} \
                     --for-group GROUP`, create_topics, or start its consumers), with the same number of \
                     partitions",
                    returned.len(),
                    self.target,
                    self.target
                ),
            ));
        }
        if nacked > 0 {
            return Err(TransportError::Unavailable(format!(
                "RabbitMQ refused {nacked} message(s) to {} (nack); publish them again",
                self.target
            )));
        }
        Ok(receipts)
    }
}

#[async_trait]
impl BatchSender for AmqpPublisher {
    fn stamps(&self) -> bool {
        self.stamp
    }

    /// Publishes in order, pipelined: every message is written before any confirmation is
    /// awaited (one channel keeps their order). Bounded by [`CONFIRM_TIMEOUT`]: lapin was seen
    /// to leave a publish waiting forever once its connection was gone (no socket left, no
    /// error), so a batch that is not confirmed in time fails, and the next one reconnects.
    async fn send_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Receipt>, TransportError> {
        let mut open = self.open.lock().await;
        match tokio::time::timeout(CONFIRM_TIMEOUT, self.send_on(&mut open, messages)).await {
            Ok(sent) => sent,
            Err(_) => {
                *open = None;
                Err(TransportError::broker(
                    format!("publishing to {}", self.target),
                    format!(
                        "RabbitMQ confirmed nothing within {CONFIRM_TIMEOUT:?}; the connection is \
                         reopened on the next publish (is the broker alive, or blocked by a \
                         memory or disk alarm?)"
                    ),
                ))
            }
        }
    }
}

/// Dead letters to the dead-letter stream: original key, payload and headers plus the reason
/// headers, confirmed.
#[derive(Clone)]
pub struct AmqpDeadLetterSink {
    publisher: AmqpPublisher,
}

impl AmqpDeadLetterSink {
    /// A sink writing to `config`'s dead-letter stream (declared on first use).
    pub fn new(config: &AmqpConfig) -> Self {
        AmqpDeadLetterSink {
            publisher: AmqpPublisher::with_route(config, config.dlq_topic(), Route::Queue),
        }
    }
}

#[async_trait]
impl DeadLetterSink for AmqpDeadLetterSink {
    /// Publishes, confirmed. On a failure (a stream deleted since it was declared returns the
    /// message unroutable) the connection is dropped, so the engine's retry connects again and
    /// declares the stream again — instead of failing every dead letter for good.
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        let result = self.publisher.send_one(&dead_letter.to_outgoing()).await;
        if result.is_err() {
            if let Some((connection, _)) = self.publisher.open.lock().await.take() {
                crate::connect::close(&connection, "declaring the dead-letter stream again").await;
            }
        }
        result.map(|_| ())
    }

    fn can_read_back(&self) -> bool {
        true
    }

    /// A stream has no end to read to: an end marker (cause [`CAUSE_END`]) is published first,
    /// confirmed, and the stream read until it — everything confirmed before is in front of it.
    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        Ok(self.read_to_end_marker(None).await?.0)
    }

    /// From the stream offset of the mark on (`0:N`), to an end marker written now: the next
    /// mark is the offset after it.
    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        let start = mark
            .and_then(ReadMark::next_offsets)
            .and_then(|next| next.get(&0).copied())
            .unwrap_or(0);
        let (records, end, restarted) = self.read_to_end_marker(Some(start)).await?;
        Ok(ReadBack {
            records,
            mark: end.map(|end| ReadMark::of_next_offsets(&BTreeMap::from([(0, end + 1)]))),
            restarted,
        })
    }

    async fn load_checkpoint(&self, group: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
        crate::checkpoint::load(&self.publisher.config, &self.checkpoint_queue(group, part)).await
    }

    async fn save_checkpoint(&self, group: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
        crate::checkpoint::save(
            &self.publisher.config,
            &self.checkpoint_queue(group, part),
            &checkpoint,
        )
        .await
    }
}

impl AmqpDeadLetterSink {
    /// The records from stream offset `start` (its first without one) to an end marker
    /// published now (markers of other reads left out), the end marker's offset, and whether
    /// `start` lay past it — the stream deleted and declared again since `start` was taken
    /// (shorter; one refilled past it is not told apart): then it is read from its first.
    async fn read_to_end_marker(
        &self,
        start: Option<u64>,
    ) -> Result<(Vec<Message>, Option<u64>, bool), TransportError> {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let end = format!("{}-{nanos}-{}", std::process::id(), SERIAL.fetch_add(1, Relaxed));
        let mut headers = Headers::new();
        headers.insert(DL_CAUSE, CAUSE_END);
        let marker = OutgoingMessage {
            key: Some(Bytes::from(end.clone())),
            payload: Bytes::new(),
            headers,
        };
        self.publisher.send_one(&marker).await?;
        let is_end = |m: &Message| m.key.as_deref() == Some(end.as_bytes());
        let (config, stream) = (&self.publisher.config, &self.publisher.target);
        let fence = || crate::stream::End::Fence(&is_end, READ_BACK_LIMIT);
        let mut restarted = false;
        let from = match start {
            None | Some(0) => Start::First,
            Some(start) => {
                // A stream read from past its end waits for that offset: learn the end first.
                let (_, at) = crate::stream::read_stream_to(config, stream, Start::Last, fence()).await?;
                restarted = at.is_some_and(|at| at < start);
                match restarted {
                    true => Start::First,
                    false => Start::Offset(start),
                }
            }
        };
        let (records, end) = crate::stream::read_stream_to(config, stream, from, fence()).await?;
        let records = records
            .into_iter()
            .filter(|m| m.headers.get_str(DL_CAUSE) != Some(CAUSE_END))
            .collect();
        Ok((records, end, restarted))
    }

    /// The queue keeping part `part` of `group`'s checkpoint of this dead-letter stream.
    fn checkpoint_queue(&self, group: &str, part: u32) -> String {
        crate::checkpoint::queue(&self.publisher.target, group, part)
    }
}

/// Longest wait for a read-back's end marker.
const READ_BACK_LIMIT: Duration = Duration::from_secs(30);
