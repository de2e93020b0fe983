//! One owned partition, read through a pull consumer of this member's own: from the committed
//! watermark + 1, in order, handed to the engine in batches, paused while the engine says so,
//! until the member stops it or the lease runs out.
//!
//! The consumer acknowledges nothing (`AckPolicy::None`): the server never redelivers behind
//! the engine's back, however long a message is held — the watermark in the group's bucket is
//! the only position. The price is that a message lost between server and client is not resent
//! by itself, so every delivery's consumer sequence is checked, and after a gap, a deleted
//! consumer, a silent server or a reconnect of the client (whatever was in the cut connection
//! is gone), the consumer is created again from the last sequence handed over + 1 (a
//! consumer's start can never be moved, so each is new). A consumer of a member that died is
//! removed by the server after `INACTIVE` without pulls.
//!
//! The reader makes its pull requests itself, one at a time, each for at most `batch` messages
//! and `max_bytes` bytes and expiring after `EXPIRES` (async-nats's pull stream pulls again on
//! a timer and on every reconnect even while nobody reads it, and waits for a lost pull's
//! expiry before pulling again). So: nothing is requested while the source is paused — what it
//! may still receive is the rest of one pull — and after a reconnect reading resumes at once.
//! Each pull has a reply subject of its own under one inbox subscription, where the server sends
//! its statuses, so a late status of an earlier pull is never taken for the current one's.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::{self, BatchConfig};
use async_nats::jetstream::consumer::{AckPolicy, Consumer, DeliverPolicy};
use async_nats::jetstream::stream::Stream;
use async_nats::jetstream::Context;
use async_nats::{StatusCode, Subscriber};
use async_trait::async_trait;
use convoy_core::transport::Lease;
use convoy_core::transport::{EventSender, PartitionReader};
use convoy_core::{Message, SourceId, TransportError};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::MAX_BATCH;
use crate::convert::to_message;
use crate::error::nats_error;
use crate::topology;

/// A consumer nobody pulls from is deleted by the server after this long.
const INACTIVE: Duration = Duration::from_secs(60);
/// How long the server keeps a pull request waiting for messages.
const EXPIRES: Duration = Duration::from_secs(5);
/// The server's heartbeat while a pull waits.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// No word at all (message, heartbeat, status) for this long while a pull is outstanding: the
/// pull or the connection is gone.
const SILENCE: Duration = Duration::from_secs(3);
/// Longest wait between attempts to create a consumer again.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What the reader needs.
pub(super) struct ReaderParts {
    pub source: SourceId,
    pub js: Context,
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
    /// Most bytes per pull (at least one message of the server's largest size).
    pub max_bytes: usize,
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
}

#[async_trait]
impl PartitionReader for PartitionTask {
    type Stopped = ();

    /// Stops reading (a batch waiting for room is dropped: the next owner reads it again from
    /// the watermark) and deletes the consumer.
    async fn stop(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.handle.await {
            tracing::error!(error = %e, "a NATS partition reader failed");
        }
    }
}

/// The pull request outstanding: its reply subject and what it may still deliver.
struct Pull {
    subject: String,
    remaining: usize,
}

struct Reader {
    parts: ReaderParts,
    consumer: Option<(String, Consumer<pull::Config>)>,
    /// The inbox prefix of this consumer's pulls and the subscription on `<inbox>.*`.
    inbox: Option<(String, Subscriber)>,
    pull: Option<Pull>,
    pulls: u64,
    /// The last stream sequence handed over, and the consumer sequence it came with.
    last: Option<u64>,
    last_consumer_seq: u64,
    /// The client's connection count when the consumer was created: a reconnect since means
    /// deliveries may have been lost in the cut connection.
    connects: u64,
    last_word: Instant,
    backoff: Duration,
}

/// How one step of reading went.
enum Step {
    Batch(Vec<Message>),
    /// The pull is over with nothing to hand over: pull again.
    Pulled,
    /// The consumer must be created again.
    Recreate,
    Stop,
}

/// What one delivery on the inbox means.
// Returned and matched at once for every delivery: boxing the message would cost an allocation
// per message for nothing.
#[allow(clippy::large_enum_variant)]
enum Delivery {
    Data(Message),
    /// Liveness only, or a late word about an earlier pull.
    Nothing,
    /// The current pull is over.
    PullOver,
    Recreate,
}

impl Reader {
    fn new(parts: ReaderParts) -> Self {
        let last = parts.start.and_then(|s| s.checked_sub(1));
        Reader {
            parts,
            consumer: None,
            inbox: None,
            pull: None,
            pulls: 0,
            last,
            last_consumer_seq: 0,
            connects: 0,
            last_word: Instant::now(),
            backoff: Duration::from_millis(100),
        }
    }

    fn connects(&self) -> u64 {
        self.parts.js.client().statistics().connects.load(Relaxed)
    }

    async fn run(mut self, mut stopped: watch::Receiver<bool>) {
        let mut paused = self.parts.paused.clone();
        loop {
            if *stopped.borrow() || !self.parts.lease.is_valid() {
                break;
            }
            if *paused.borrow() {
                // Nothing more is asked for; what the outstanding pull still brings waits in
                // the inbox (at most one pull's messages and bytes).
                let open = tokio::select! {
                    changed = stopped.changed() => changed.is_ok(),
                    changed = paused.changed() => changed.is_ok(),
                };
                if !open {
                    break;
                }
                continue;
            }
            if self.consumer.is_some() && self.connects() != self.connects {
                tracing::info!(source = %self.parts.source, "the connection was re-established; reading again from the last message handed over");
                self.drop_consumer().await;
            }
            if self.consumer.is_some() && self.inbox.is_none() {
                self.drop_consumer().await; // ended by the last step, after its batch
            }
            if self.consumer.is_none() || self.pull.is_none() {
                let ready = match self.consumer {
                    None => self.create().await,
                    Some(_) => self.request().await,
                };
                if let Err(e) = ready {
                    tracing::warn!(source = %self.parts.source, error = %e, retry_in = ?self.backoff, "cannot read the partition yet");
                    self.drop_consumer().await;
                    let wait = self.backoff;
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => continue,
                        _ = stopped.changed() => break,
                    }
                }
                if self.pull.is_none() {
                    continue;
                }
            }
            let step = tokio::select! {
                biased;
                _ = stopped.changed() => Step::Stop,
                _ = paused.changed() => continue,
                step = self.next_batch() => step,
            };
            match step {
                Step::Stop => break,
                Step::Pulled => {}
                Step::Recreate => {
                    // Backing off until a pull delivers again: a consumer that fails at once
                    // must not be recreated in a tight loop.
                    self.drop_consumer().await;
                    let wait = self.backoff;
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stopped.changed() => break,
                    }
                }
                Step::Batch(batch) => {
                    // Checked last before the hand-over: a member frozen past its lease must not
                    // hand on what it read before.
                    if !self.parts.lease.is_valid() {
                        break;
                    }
                    self.backoff = Duration::from_millis(100);
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
        self.drop_consumer().await;
    }

    /// Creates a consumer starting after the last sequence handed over, subscribes its inbox
    /// and makes its first pull.
    async fn create(&mut self) -> Result<(), TransportError> {
        self.drop_consumer().await;
        self.connects = self.connects();
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
        self.consumer = Some((name, consumer));
        let client = self.parts.js.client();
        let inbox = client.new_inbox();
        let subscription = client
            .subscribe(format!("{inbox}.*"))
            .await
            .map_err(|e| nats_error(&format!("subscribing to the pulls of {}", self.parts.subject), e))?;
        self.inbox = Some((inbox, subscription));
        self.last_consumer_seq = 0;
        self.request().await
    }

    /// Asks the consumer for the next messages, on a reply subject of this pull's own.
    async fn request(&mut self) -> Result<(), TransportError> {
        let (Some((_, consumer)), Some((inbox, _))) = (&self.consumer, &self.inbox) else {
            return Err(TransportError::Unavailable("no consumer to pull from".into()));
        };
        self.pulls += 1;
        let subject = format!("{inbox}.{}", self.pulls);
        let batch = BatchConfig {
            batch: self.parts.batch,
            max_bytes: self.parts.max_bytes,
            expires: Some(EXPIRES),
            idle_heartbeat: HEARTBEAT,
            ..BatchConfig::default()
        };
        consumer
            .request_batch(batch, subject.clone().into())
            .await
            .map_err(|e| nats_error(&format!("pulling from {}", self.parts.subject), e))?;
        self.pull = Some(Pull {
            subject,
            remaining: self.parts.batch,
        });
        self.last_word = Instant::now();
        Ok(())
    }

    /// Drops the consumer's inbox subscription (the server forgets its pulls) and deletes it.
    async fn drop_consumer(&mut self) {
        self.pull = None;
        self.inbox = None;
        if let Some((name, _)) = self.consumer.take() {
            let delete = self.parts.stream.delete_consumer(&name);
            match tokio::time::timeout(Duration::from_secs(2), delete).await {
                Ok(Ok(_)) => {}
                // Gone already, or the server is away: it expires after `INACTIVE`.
                Ok(Err(e)) => tracing::debug!(consumer = %name, error = %e, "deleting a consumer"),
                Err(_) => tracing::debug!(consumer = %name, "deleting a consumer timed out"),
            }
        }
    }

    /// What a delivery on the inbox means for the current pull.
    fn classify(&mut self, message: async_nats::Message) -> Delivery {
        self.last_word = Instant::now();
        let Some(pull) = self.pull.as_mut() else {
            return Delivery::Nothing;
        };
        if let Some(status) = message.status {
            // A status comes on the reply subject of the pull it is about; data messages carry
            // their own subject (and only the one outstanding pull delivers them).
            if message.subject.as_str() != pull.subject {
                return Delivery::Nothing; // about an earlier pull
            }
            return match status {
                StatusCode::IDLE_HEARTBEAT => Delivery::Nothing,
                // Expired, or nothing there: this pull is over.
                StatusCode::TIMEOUT | StatusCode::NOT_FOUND => Delivery::PullOver,
                StatusCode::REQUEST_TERMINATED => {
                    let why = message
                        .description
                        .as_deref()
                        .unwrap_or_default()
                        .to_ascii_lowercase();
                    if why.contains("batch completed") || why.contains("exceeds maxbytes") {
                        Delivery::PullOver
                    } else {
                        tracing::info!(source = %self.parts.source, reason = why, "the pull was ended by the server; reading again");
                        Delivery::Recreate
                    }
                }
                other => {
                    tracing::info!(source = %self.parts.source, status = %other, "the pull failed; reading again");
                    Delivery::Recreate
                }
            };
        }
        pull.remaining = pull.remaining.saturating_sub(1);
        let message = async_nats::jetstream::Message {
            message,
            context: self.parts.js.clone(),
        };
        let Ok(info) = message.info() else {
            tracing::warn!(source = %self.parts.source, "a delivery without JetStream metadata; reading again");
            return Delivery::Recreate;
        };
        if info.consumer_sequence != self.last_consumer_seq + 1 {
            // Lost between server and client (a reconnect, a slow consumer).
            tracing::info!(source = %self.parts.source, expected = self.last_consumer_seq + 1, got = info.consumer_sequence, "gap in deliveries; reading again from the last message handed over");
            return Delivery::Recreate;
        }
        self.last_consumer_seq = info.consumer_sequence;
        let sequence = info.stream_sequence;
        self.last = Some(sequence);
        Delivery::Data(to_message(
            message.headers.as_ref(),
            message.payload.clone(),
            &self.parts.source,
            sequence,
        ))
    }

    /// Waits for the next message of the pull, then takes what else is already there, in order.
    async fn next_batch(&mut self) -> Step {
        let mut batch = self.parts.events.batch_buffer();
        loop {
            let waited = match self.inbox.as_mut() {
                None => return Step::Recreate,
                Some((_, inbox)) if batch.is_empty() => tokio::time::timeout(HEARTBEAT, inbox.next()).await,
                Some((_, inbox)) => match inbox.next().now_or_never() {
                    Some(next) => Ok(next),
                    None => return Step::Batch(batch),
                },
            };
            let delivery = match waited {
                // Whatever was in the cut connection is gone: the next message may be a
                // heartbeat of a pull that outlived the reconnect, past messages never received.
                Ok(Some(_)) if self.connects() != self.connects => {
                    tracing::info!(source = %self.parts.source, "the connection was re-established; reading again from the last message handed over");
                    Delivery::Recreate
                }
                Ok(Some(message)) => self.classify(message),
                Ok(None) => Delivery::Recreate, // the subscription ended
                Err(_) => {
                    // A second without word: a reconnect, or a server gone silent, ends this
                    // consumer; otherwise keep waiting.
                    if self.connects() != self.connects {
                        tracing::info!(source = %self.parts.source, "the connection was re-established; reading again from the last message handed over");
                        Delivery::Recreate
                    } else if self.last_word.elapsed() >= SILENCE {
                        tracing::info!(source = %self.parts.source, "no word from the server about the pull; reading again from the last message handed over");
                        Delivery::Recreate
                    } else {
                        Delivery::Nothing
                    }
                }
            };
            match delivery {
                Delivery::Data(message) => {
                    batch.push(message);
                    if self.pull.as_ref().is_some_and(|p| p.remaining == 0) {
                        self.pull = None; // all it asked for came: the next one can go out
                        return Step::Batch(batch);
                    }
                    if batch.len() >= MAX_BATCH {
                        return Step::Batch(batch);
                    }
                }
                Delivery::Nothing => {}
                Delivery::PullOver => {
                    self.pull = None;
                    return if batch.is_empty() {
                        Step::Pulled
                    } else {
                        Step::Batch(batch)
                    };
                }
                Delivery::Recreate => {
                    // The inbox goes now; the consumer is replaced once the batch is handed over.
                    self.pull = None;
                    self.inbox = None;
                    return if batch.is_empty() {
                        Step::Recreate
                    } else {
                        Step::Batch(batch)
                    };
                }
            }
        }
    }
}
