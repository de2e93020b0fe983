//! The NATS subscription: a member of a consumer group whose leased partitions are convoy
//! sources.
//!
//! By job: `member` joins the group and is what a lock is for convoy-core's balancing loop
//! (`GroupMember`: fair shares, handovers with the engine's drain and commit in between); `leases` keeps this
//! member's leases (partitions, presence, extra token) renewed and reports the ones it lost;
//! `partition` reads one owned partition from its committed watermark on, through a pull
//! consumer of its own; `control` says what a commit (the watermark, by compare-and-set in the
//! group's bucket) and the lag are, for convoy-core's `MemberControl`, which pauses, resumes and
//! closes.
//!
//! A source's offset is the stream sequence. Where delivery resumes is convoy's, not the
//! server's: every ownership epoch reads through a consumer created at the committed
//! watermark + 1 with no server-side acknowledgements, so nothing is redelivered behind the
//! engine's back (however long a message is held) and nothing newer reaches a new owner before
//! the unfinished messages of the old one.

mod control;
mod leases;
mod member;
mod partition;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

use async_nats::jetstream::kv::Store;
use async_nats::jetstream::stream::Stream;
use async_trait::async_trait;
use convoy_core::transport::{event_channel, Departure, EventSender, MemberControl};
use convoy_core::transport::{Lease, PrefetchLimit, Subscription};
use convoy_core::{SourceId, Transport, TransportError};
use tokio::sync::watch;

use crate::config::NatsConfig;

/// Message batches buffered between the partition tasks and the engine.
pub const EVENT_CAPACITY: usize = 16;
/// Most messages per batch handed to the engine.
pub const MAX_BATCH: usize = 500;
/// Messages requested per pull unless configured: one pull is outstanding per partition at a
/// time, so at most this many wait in a partition's inbox (none is requested while paused).
pub const DEFAULT_FETCH_BATCH: usize = 500;

/// An owned partition as pause, resume, commit and lag see it.
struct Owned {
    lease: Lease,
    /// The partition's key in the watermarks bucket, and the revision this member last wrote
    /// (a commit with an older one means someone else wrote since: not the owner).
    watermark_key: String,
    watermark_revision: u64,
    /// When the partition's stream was created (Unix ns), written with every watermark.
    stream_created: i128,
    /// The highest stream sequence handed to the engine.
    delivered: Arc<AtomicU64>,
    /// Since when this source's commits fail (none: the last one went through).
    commits_failing_since: Option<tokio::time::Instant>,
    paused: watch::Sender<bool>,
    stream: Stream,
    subject: String,
}

/// State shared by the member task and the control.
struct Shared {
    config: NatsConfig,
    events: EventSender,
    owned: Mutex<HashMap<SourceId, Owned>>,
    watermarks: Store,
    /// Messages per pull.
    batch: usize,
    /// Bytes per pull, before the server's largest message is allowed for.
    pull_bytes: usize,
    /// The engine closing the subscription asks the member to leave the group.
    departure: Departure,
    /// This member (its id is in the watermarks it writes) and its leases.
    member: u64,
    leases: Arc<leases::Leases>,
}

impl Shared {
    fn owned(&self) -> MutexGuard<'_, HashMap<SourceId, Owned>> {
        self.owned.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Opens NATS subscriptions: each `subscribe` joins the group as a new member.
#[derive(Clone, Debug)]
pub struct NatsTransport {
    config: NatsConfig,
}

impl NatsTransport {
    /// A transport for `config` (validated here: the error names the bad field).
    pub fn new(config: NatsConfig) -> Result<Self, convoy_core::ConfigError> {
        config.validate(true)?;
        Ok(NatsTransport { config })
    }

    /// The configuration.
    pub fn config(&self) -> &NatsConfig {
        &self.config
    }

    /// Messages per pull: configured, or the engine's message limit divided over every partition
    /// this member could own (two thirds of it: the engine's gate closes on what it holds, and
    /// one pull may still be arriving), at most
    /// [`DEFAULT_FETCH_BATCH`].
    pub fn fetch_batch(&self, limit: PrefetchLimit) -> usize {
        self.config
            .fetch_batch
            .unwrap_or_else(|| (limit.messages * 2 / (3 * self.sources())).clamp(1, DEFAULT_FETCH_BATCH))
    }

    /// Bytes per pull: the engine's byte limit divided over every partition this member could
    /// own, like [`NatsTransport::fetch_batch`] (the reader raises it to the server's largest
    /// message, which must always fit in one pull).
    pub fn fetch_bytes(&self, limit: PrefetchLimit) -> usize {
        (limit.bytes * 2 / (3 * self.sources())).max(1)
    }

    fn sources(&self) -> usize {
        self.config.topics.len().max(1) * self.config.partitions as usize
    }
}

#[async_trait]
impl Transport for NatsTransport {
    fn group(&self) -> Option<String> {
        Some(self.config.group.clone())
    }

    async fn subscribe(&self) -> Result<Subscription, TransportError> {
        self.subscribe_with(PrefetchLimit::default()).await
    }

    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        let (events, rx) = event_channel(EVENT_CAPACITY);
        // Connect and declare before returning, so a bad address or a mismatching stream is an
        // error of `subscribe` (an outage is waited out first, logged at each retry).
        let joined = member::join(&self.config, events.clone()).await?;
        let shared = Arc::new(Shared {
            config: self.config.clone(),
            events,
            owned: Mutex::default(),
            watermarks: joined.watermarks.clone(),
            batch: self.fetch_batch(limit),
            pull_bytes: self.fetch_bytes(limit),
            departure: Departure::new(),
            member: joined.me,
            leases: joined.leases.clone(),
        });
        let member = joined.into_member(shared.clone());
        tokio::spawn(member::run(shared.clone(), member));
        Ok(Subscription::new(rx, Box::new(MemberControl::new(shared))))
    }
}
