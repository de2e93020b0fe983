//! The RabbitMQ subscription: a member of a consumer group whose owned partition queues are
//! convoy sources.
//!
//! By job: `member` is what a lock is for convoy-core's balancing loop (`GroupMember`: fair
//! shares, handovers with the engine's drain and commit in between) and rejoins after a lost
//! connection; `lease` is the connection's lease, the fence of every assignment; `partition` reads one owned
//! partition queue on its own channel and hands batches to the engine; `control` says what a
//! commit (`basic.ack(W, multiple)` on that channel, and each finished message above W on its own) and the lag are, for convoy-core's
//! `MemberControl`, which pauses, resumes and closes.
//!
//! A source's offset is the delivery tag, which restarts with every channel: each time a
//! partition is taken it is a new assignment (committed `None`). Prefetch bounds the messages
//! unacknowledged on a channel, which is exactly the watermark window; pausing stops reading
//! the channel (never a cancel: under single active consumer a cancel hands the queue over).

mod acks;
mod control;
mod lease;
mod member;
mod partition;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use convoy_core::transport::{event_channel, Departure, EventSender, MemberControl};
use convoy_core::transport::{wait_out_outage, PrefetchLimit, Subscription, JOIN_WITHIN};
use convoy_core::{SourceId, Transport, TransportError};
use lapin::Channel;
use tokio::sync::watch;

use crate::config::AmqpConfig;

/// Message batches buffered between the partition tasks and the engine.
pub const EVENT_CAPACITY: usize = 16;
/// Most messages per batch handed to the engine.
pub const MAX_BATCH: usize = 500;

/// An owned partition as pause, resume and commit see it.
struct Owned {
    channel: Channel,
    /// This channel's mark, given to the engine with the assignment and back with its commits:
    /// a commit computed for an earlier channel of the partition is never acknowledged on this
    /// one (delivery tags restart with every channel).
    token: u64,
    /// What this channel acknowledged.
    acks: acks::Acked,
    /// The highest tag delivered to the engine.
    delivered: Arc<AtomicU64>,
    paused: watch::Sender<bool>,
    /// The partition queue.
    queue: String,
}

/// State shared by the member task and the control.
struct Shared {
    config: AmqpConfig,
    events: EventSender,
    owned: Mutex<HashMap<SourceId, Owned>>,
    /// Unacknowledged messages per partition channel.
    prefetch: u16,
    /// The engine closing the subscription asks the member to leave the group.
    departure: Departure,
}

impl Shared {
    fn owned(&self) -> MutexGuard<'_, HashMap<SourceId, Owned>> {
        self.owned.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Opens RabbitMQ subscriptions: each `subscribe` joins the group as a new member.
#[derive(Clone, Debug)]
pub struct AmqpTransport {
    config: AmqpConfig,
}

impl AmqpTransport {
    /// A transport for `config` (validated here: the error names the bad field).
    pub fn new(config: AmqpConfig) -> Result<Self, convoy_core::ConfigError> {
        config.validate(true)?;
        Ok(AmqpTransport { config })
    }

    /// The configuration.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// The prefetch of each partition channel: configured, or the engine's message limit
    /// divided over every partition this member could own.
    pub fn prefetch(&self, limit: PrefetchLimit) -> u16 {
        self.config.prefetch.unwrap_or_else(|| {
            let sources = self.config.topics.len().max(1) * self.config.partitions as usize;
            u16::try_from((limit.messages / sources).clamp(1, usize::from(u16::MAX))).unwrap_or(u16::MAX)
        })
    }
}

#[async_trait]
impl Transport for AmqpTransport {
    fn group(&self) -> Option<String> {
        Some(self.config.group.clone())
    }

    async fn subscribe(&self) -> Result<Subscription, TransportError> {
        self.subscribe_with(PrefetchLimit::default()).await
    }

    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        let (events, rx) = event_channel(EVENT_CAPACITY);
        let shared = Arc::new(Shared {
            config: self.config.clone(),
            events,
            owned: Mutex::default(),
            prefetch: self.prefetch(limit),
            departure: Departure::new(),
        });
        // Connect and declare before returning, so a refused login or a mismatching queue is an
        // error of `subscribe`, not a silent retry loop; an outage (a node restarting) is
        // waited out for a while, as a running member's reconnection does.
        let member =
            wait_out_outage(JOIN_WITHIN, "joining the group", || member::join(shared.clone())).await?;
        tokio::spawn(member::run(shared.clone(), member));
        Ok(Subscription::new(rx, Box::new(MemberControl::new(shared))))
    }
}
