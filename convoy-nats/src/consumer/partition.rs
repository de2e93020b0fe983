//! One owned partition, read through a pull consumer of this member's own: from the committed
//! watermark + 1, in order, handed to the engine in batches, paused while the engine says so,
//! until the member stops it or the lease runs out.
//!
//! The consumer acknowledges nothing (`AckPolicy::None`): the server never redelivers behind
//! the engine's back, however long a message is held — the watermark in the group's bucket is
//! the only position. The price is that a message lost between server and client is not resent
//! by itself, so every delivery's consumer sequence is checked: after a gap, a deleted consumer,
//! missed heartbeats or a lost connection, the consumer is created again from the last
//! sequence handed over + 1 (a consumer's start can never be moved, so each is new). A consumer
//! of a member that died is removed by the server after `INACTIVE` without pulls.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::{self, MessagesErrorKind};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy};
use async_nats::jetstream::stream::Stream;
use convoy_core::transport::EventSender;
use convoy_core::{Lease, Message, SourceId, TransportError};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::MAX_BATCH;
use crate::convert::to_message;
use crate::error::nats_error;
use crate::topology;

/// A consumer nobody pulls from is deleted by the server after this long.
const INACTIVE: Duration = Duration::from_secs(60);
/// A pull stream reports a missing heartbeat after two of these without word from the server.
const HEARTBEAT: Duration = Duration::from_secs(5);
/// Longest wait between attempts to create a consumer again.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What the reader needs.
pub(super) struct ReaderParts {
    pub source: SourceId,
    pub stream: Stream,
    pub subject: String,
    /// The first sequence to read (`None`: the partition's first message).
    pub start: Option<u64>,
    pub lease: Lease,
    pub member: u64,
    pub partition: u32,
    /// Consumer names are numbered per member.
    pub serial: Arc<AtomicU64>,
    pub batch: usize,
    pub paused: watch::Receiver<bool>,
    pub delivered: Arc<AtomicU64>,
    pub events: EventSender,
}

/// A running reader.
pub(super) struct PartitionTask {
    stop: watch::Sender<bool>,
    handle: JoinHandle<()>,
}

impl PartitionTask {
    pub fn spawn(parts: ReaderParts) -> Self {
        let (stop, stopped) = watch::channel(false);
        PartitionTask {
            stop,
            handle: tokio::spawn(Reader::new(parts).run(stopped)),
        }
    }

    /// Stops reading (a batch waiting for room is dropped: the next owner reads it again from
    /// the watermark) and deletes the consumer.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.handle.await {
            tracing::error!(error = %e, "a NATS partition reader failed");
        }
    }
}

struct Reader {
    parts: ReaderParts,
    consumer: Option<String>,
    messages: Option<pull::Stream>,
    /// The last stream sequence handed over, and the consumer sequence it came with.
    last: Option<u64>,
    last_consumer_seq: u64,
    missed_heartbeat: bool,
    backoff: Duration,
}

/// How one step of reading went.
enum Step {
    Batch(Vec<Message>),
    /// Nothing to hand over; the consumer must be created again.
    Recreate,
    Stop,
}

impl Reader {
    fn new(parts: ReaderParts) -> Self {
        let last = parts.start.and_then(|s| s.checked_sub(1));
        Reader {
            parts,
            consumer: None,
            messages: None,
            last,
            last_consumer_seq: 0,
            missed_heartbeat: false,
            backoff: Duration::from_millis(100),
        }
    }

    async fn run(mut self, mut stopped: watch::Receiver<bool>) {
        let mut paused = self.parts.paused.clone();
        loop {
            if *stopped.borrow() || !self.parts.lease.is_valid() {
                break;
            }
            if *paused.borrow() {
                let open = tokio::select! {
                    changed = stopped.changed() => changed.is_ok(),
                    changed = paused.changed() => changed.is_ok(),
                };
                if !open {
                    break;
                }
                continue;
            }
            if self.messages.is_none() {
                if let Err(e) = self.create().await {
                    tracing::warn!(source = %self.parts.source, error = %e, retry_in = ?self.backoff, "cannot read the partition yet");
                    let wait = self.backoff;
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => continue,
                        _ = stopped.changed() => break,
                    }
                }
                self.backoff = Duration::from_millis(100);
            }
            let step = tokio::select! {
                biased;
                _ = stopped.changed() => Step::Stop,
                _ = paused.changed() => continue,
                step = self.next_batch() => step,
            };
            match step {
                Step::Stop => break,
                Step::Recreate => self.messages = None,
                Step::Batch(batch) => {
                    // Checked last before the hand-over: a member frozen past its lease must not
                    // hand on what it read before.
                    if !self.parts.lease.is_valid() {
                        break;
                    }
                    if let Some(last) = batch.last() {
                        self.parts.delivered.store(last.offset, Relaxed);
                    }
                    tokio::select! {
                        sent = self.parts.events.messages(self.parts.source.clone(), batch) => {
                            if sent.is_err() {
                                break; // the engine is gone
                            }
                        }
                        _ = stopped.changed() => break,
                    }
                }
            }
        }
        self.delete_consumer().await;
    }

    /// Creates a consumer starting after the last sequence handed over.
    async fn create(&mut self) -> Result<(), TransportError> {
        self.delete_consumer().await;
        let name = topology::consumer_name(
            self.parts.member,
            self.parts.partition,
            self.parts.serial.fetch_add(1, Relaxed),
        );
        let deliver_policy = match self.last {
            Some(last) => DeliverPolicy::ByStartSequence {
                start_sequence: last + 1,
            },
            None => DeliverPolicy::All,
        };
        let consumer = self
            .parts
            .stream
            .create_consumer(pull::Config {
                name: Some(name.clone()),
                filter_subject: self.parts.subject.clone(),
                deliver_policy,
                ack_policy: AckPolicy::None,
                inactive_threshold: INACTIVE,
                ..pull::Config::default()
            })
            .await
            .map_err(|e| nats_error(&format!("creating a consumer of {}", self.parts.subject), e))?;
        self.consumer = Some(name);
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.parts.batch)
            .heartbeat(HEARTBEAT)
            .expires(Duration::from_secs(30))
            .messages()
            .await
            .map_err(|e| nats_error(&format!("reading {}", self.parts.subject), e))?;
        self.messages = Some(messages);
        self.last_consumer_seq = 0;
        self.missed_heartbeat = false;
        Ok(())
    }

    async fn delete_consumer(&mut self) {
        self.messages = None;
        if let Some(name) = self.consumer.take() {
            let delete = self.parts.stream.delete_consumer(&name);
            match tokio::time::timeout(Duration::from_secs(2), delete).await {
                Ok(Ok(_)) => {}
                // Gone already, or the server is away: it expires after `INACTIVE`.
                Ok(Err(e)) => tracing::debug!(consumer = name, error = %e, "deleting a consumer"),
                Err(_) => tracing::debug!(consumer = name, "deleting a consumer timed out"),
            }
        }
    }

    /// Waits for the next message, then takes what else is already buffered, in order.
    async fn next_batch(&mut self) -> Step {
        let Some(messages) = self.messages.as_mut() else {
            return Step::Recreate;
        };
        let first = messages.next().await;
        let mut batch = self.parts.events.batch_buffer();
        let mut next = first;
        loop {
            match next {
                Some(Ok(message)) => {
                    let Ok(info) = message.info() else {
                        tracing::warn!(source = %self.parts.source, "a delivery without JetStream metadata; reading again");
                        return self.ended(batch);
                    };
                    if info.consumer_sequence != self.last_consumer_seq + 1 {
                        // Lost between server and client (a reconnect, a slow consumer).
                        tracing::info!(source = %self.parts.source, expected = self.last_consumer_seq + 1, got = info.consumer_sequence, "gap in deliveries; reading again from the last message handed over");
                        return self.ended(batch);
                    }
                    self.last_consumer_seq = info.consumer_sequence;
                    self.last = Some(info.stream_sequence);
                    self.missed_heartbeat = false;
                    batch.push(to_message(
                        message.headers.as_ref(),
                        message.payload.clone(),
                        &self.parts.source,
                        info.stream_sequence,
                    ));
                }
                Some(Err(e))
                    if matches!(e.kind(), MessagesErrorKind::MissingHeartbeat) && !self.missed_heartbeat =>
                {
                    // One miss is the server being busy or away for a moment; two end the stream.
                    self.missed_heartbeat = true;
                    if !batch.is_empty() {
                        return Step::Batch(batch);
                    }
                }
                Some(Err(e)) => {
                    tracing::info!(source = %self.parts.source, error = %e, "partition consumer interrupted; reading again from the last message handed over");
                    return self.ended(batch);
                }
                None => return self.ended(batch),
            }
            if batch.len() >= MAX_BATCH {
                return Step::Batch(batch);
            }
            let Some(messages) = self.messages.as_mut() else {
                return Step::Batch(batch);
            };
            match messages.next().now_or_never() {
                Some(more) => next = more,
                None if batch.is_empty() => next = messages.next().await,
                None => return Step::Batch(batch),
            }
        }
    }

    /// The consumer must be created again; what was read before that is still handed over.
    fn ended(&mut self, batch: Vec<Message>) -> Step {
        self.messages = None;
        if batch.is_empty() {
            Step::Recreate
        } else {
            Step::Batch(batch)
        }
    }
}
