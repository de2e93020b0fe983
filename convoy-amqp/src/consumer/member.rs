//! A member of a consumer group: joins, balances the group's partitions over the live members,
//! hands partitions over, and survives connection losses.
//!
//! Ownership, with nothing but AMQP:
//! - **Who owns a partition**: whoever holds its lock, an exclusive queue `T.G.p{i}.owner`. The
//!   broker grants an exclusive queue to one connection and deletes it when that connection
//!   closes or dies, so a crashed member's partitions free themselves. Only the holder consumes
//!   the partition queue; its single-active-consumer flag is the broker-enforced second line.
//! - **How many members**: every member consumes `convoy.G.members`; its consumer count is the
//!   number of live members M.
//! - **Fair shares** ([`convoy_core::balance`]): with S partitions, every member may hold
//!   `⌊S/M⌋`, and `S mod M` members one more — those holding an extra token
//!   (`convoy.G.extra.{j}`, `j < S mod M`, exclusive queues too).
//! - **Handover**: a member over its share stops reading the partition, sends `Revoked` with its
//!   deadline, waits for the engine (drained, committed: `basic.ack(W, multiple)`), closes the
//!   channel — its unacknowledged messages return to the head of the queue, in order — and only
//!   then drops its consumer and deletes the lock. The next owner takes the lock and receives
//!   the partition from the watermark on, before anything newer.
//! - **Fence**: every assignment carries the connection's lease (`lease`), which ends before
//!   the broker can consider the connection dead, and at once on a connection error or a stalled
//!   renewal: a member cut off without a close, or frozen, starts nothing more of its
//!   partitions before anyone else may have them.
//! - **Failure modes**: a member that dies is noticed by the broker when its connection closes,
//!   or after one to two heartbeat timeouts for a silent network loss; until then its locks
//!   hold, so nobody else reads its partitions. A member that loses its connection or its lease
//!   reports all its partitions `Lost` (its acks cannot reach the broker), reconnects with
//!   backoff, declares again and rejoins. As with Kafka's session expiry, a handler already
//!   running when the lease ended may still finish after the broker handed its partition on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use convoy_core::balance::{rotation, surplus, Cooling, FairShare};
use convoy_core::{Assignment, RevokeAck, SourceEvent, SourceId, TransportError};
use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::lease::ConnectionLease;
use super::partition::{Ended, PartitionParts, PartitionTask};
use super::{Owned, Shared};
use crate::connect::connect;
use crate::error::broker;

use crate::topology;

/// Marks for partition channels, unique in the process (see `Owned::token`).
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// Longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// How long starting to consume a partition may take. A quorum queue without a leader (after a
/// node restart, until its Raft group recovers) lets `basic.consume` hang, and the broker ends
/// the whole connection about a minute later.
const CONSUME_TIMEOUT: Duration = Duration::from_secs(5);

/// A partition this member holds.
struct Held {
    topic: String,
    partition: u32,
    task: PartitionTask,
    /// When it was taken (the newest are handed over first).
    taken: u64,
}

/// How a session ended.
enum Outcome {
    /// The subscription was closed: the member left.
    Closed,
    /// The connection was lost: rejoin.
    Lost(String),
}

/// One connection's life as a member.
pub(super) struct Session {
    shared: Arc<Shared>,
    connection: Connection,
    /// Until when this member may start work on what it holds through `connection`.
    lease: ConnectionLease,
    utility: Channel,
    /// Kept open: its consumer counts this member.
    _members: (Channel, Consumer),
    me: u64,
    token: Option<u32>,
    held: HashMap<SourceId, Held>,
    taken: u64,
    /// Partitions that could not be taken, skipped for a while.
    cooling: Cooling,
    ended_tx: mpsc::UnboundedSender<SourceId>,
    ended_rx: mpsc::UnboundedReceiver<SourceId>,
}

/// Every partition of the subscribed topics, in a stable order.
fn all_partitions(shared: &Shared) -> Vec<(String, u32)> {
    shared
        .config
        .topics
        .iter()
        .flat_map(|t| (0..shared.config.partitions).map(move |p| (t.clone(), p)))
        .collect()
}

impl Session {
    /// Connects, declares the topology and joins the group.
    pub async fn open(shared: Arc<Shared>) -> Result<Session, TransportError> {
        let config = &shared.config;
        let connection = connect(config, "consume").await?;
        let lease = ConnectionLease::hold(&connection, config.heartbeat_s).await?;
        for topic in &config.topics {
            topology::declare_topic(&connection, topic, config, config.partitions).await?;
        }
        let members = connection
            .create_channel()
            .await
            .map_err(|e| broker("opening the membership channel", e))?;
        let name = topology::members_queue(&config.group);
        members
            .queue_declare(name.as_str().into(), members_options(), FieldTable::default())
            .await
            .map_err(|e| broker("declaring the membership queue", e))?;
        members
            .basic_qos(1, BasicQosOptions::default())
            .await
            .map_err(|e| broker("joining the group", e))?;
        let consumer = members
            .basic_consume(
                name.as_str().into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| broker("joining the group", e))?;
        let utility = connection
            .create_channel()
            .await
            .map_err(|e| broker("opening a channel", e))?;
        let (ended_tx, ended_rx) = mpsc::unbounded_channel();
        tracing::info!(group = %config.group, topics = ?config.topics, "joined the group");
        Ok(Session {
            shared,
            connection,
            lease,
            utility,
            _members: (members, consumer),
            me: fastrand::u64(..),
            token: None,
            held: HashMap::new(),
            taken: 0,
            cooling: Cooling::default(),
            ended_tx,
            ended_rx,
        })
    }

    fn connected(&self) -> bool {
        self.connection.status().connected()
    }

    /// Serves the group until the subscription closes or the connection is lost.
    async fn serve(&mut self) -> Outcome {
        let interval = Duration::from_millis(self.shared.config.balance_interval_ms);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.shared.departure.is_asked() {
                self.leave().await;
                return Outcome::Closed;
            }
            tokio::select! {
                _ = self.shared.departure.asked() => {}
                why = self.lease.lost() => return Outcome::Lost(why),
                Some(source) = self.ended_rx.recv() => {
                    if !self.connected() {
                        return Outcome::Lost("the connection was lost".into());
                    }
                    self.partition_ended(source).await;
                }
                _ = tick.tick() => {
                    if !self.connected() {
                        return Outcome::Lost("the connection was lost".into());
                    }
                    if let Err(e) = self.balance().await {
                        if !self.connected() {
                            return Outcome::Lost(e.to_string());
                        }
                        tracing::warn!(error = %e, "rebalancing failed; trying again");
                        self.renew_utility().await;
                    }
                }
            }
        }
    }

    async fn renew_utility(&mut self) {
        if !self.utility.status().connected() {
            if let Ok(channel) = self.connection.create_channel().await {
                self.utility = channel;
            }
        }
    }

    /// The number of live members (this one included).
    async fn member_count(&self) -> Result<usize, TransportError> {
        let name = topology::members_queue(&self.shared.config.group);
        let queue = self
            .utility
            .queue_declare(name.as_str().into(), members_options(), FieldTable::default())
            .await
            .map_err(|e| broker("counting the members", e))?;
        Ok((queue.consumer_count() as usize).max(1))
    }

    /// Moves this member's holdings toward its fair share.
    async fn balance(&mut self) -> Result<(), TransportError> {
        let members = self.member_count().await?;
        let partitions = all_partitions(&self.shared);
        let share = FairShare::new(partitions.len(), members);
        let group = self.shared.config.group.clone();
        if let Some(j) = self.token.filter(|j| !share.token_counts(*j)) {
            topology::delete_queue(&self.utility, &topology::extra_token(&group, j)).await?;
            self.token = None;
        }
        if self.token.is_none() {
            for j in 0..share.extra_tokens() as u32 {
                if topology::try_lock(&self.connection, &topology::extra_token(&group, j)).await? {
                    self.token = Some(j);
                    break;
                }
            }
        }
        let quota = share.quota(self.token);
        let release = surplus(
            self.held.iter().map(|(s, h)| (h.taken, s.clone())).collect(),
            quota,
        );
        if !release.is_empty() {
            tracing::info!(
                members,
                quota,
                held = self.held.len(),
                ?release,
                "handing partitions over"
            );
            self.hand_over(release).await;
            return Ok(());
        }
        let mut locked = Vec::new();
        for i in rotation(partitions.len(), self.me) {
            if self.held.len() + locked.len() >= quota {
                break;
            }
            let (topic, p) = &partitions[i];
            let source = SourceId::partition(topic, *p);
            if self.held.contains_key(&source) || self.cooling.is_cooling(&source) {
                continue;
            }
            if topology::try_lock(&self.connection, &topology::owner_lock(topic, &group, *p)).await? {
                locked.push((topic.clone(), *p, source));
            }
        }
        // Started together: each start is a few round trips, which a busy broker answers slowly.
        let starts = locked.iter().map(|(topic, p, _)| {
            open_partition(
                &self.connection,
                topology::partition_queue(topic, &group, *p),
                self.shared.prefetch,
            )
        });
        let opened = futures_util::future::join_all(starts).await;
        let mut failure = None;
        for ((topic, p, source), opened) in locked.into_iter().zip(opened) {
            match opened {
                Ok((queue, channel, consumer)) => {
                    self.cooling.started(&source);
                    self.register(&topic, p, queue, channel, consumer);
                }
                Err(e) => {
                    let wait = self.cooling.failed(source.clone());
                    tracing::warn!(%source, error = %e, retry_in = ?wait, "could not take the partition; serving the others meanwhile");
                    self.renew_utility().await;
                    let _ =
                        topology::delete_queue(&self.utility, &topology::owner_lock(&topic, &group, p)).await;
                    failure = Some(e);
                }
            }
        }
        match failure {
            Some(e) if !self.connected() => Err(e),
            _ => Ok(()),
        }
    }

    /// Serves a partition this member holds the lock of and has started consuming.
    fn register(&mut self, topic: &str, p: u32, queue: String, channel: Channel, consumer: Consumer) {
        let source = SourceId::partition(topic, p);
        let (paused_tx, paused_rx) = watch::channel(false);
        let delivered = Arc::new(AtomicU64::new(0));
        let token = NEXT_TOKEN.fetch_add(1, Relaxed);
        self.shared.owned().insert(
            source.clone(),
            Owned {
                channel,
                token,
                acked: 0,
                delivered: delivered.clone(),
                paused: paused_tx,
                queue,
            },
        );
        // Delivery tags restart with the channel: a fresh assignment, nothing committed on it,
        // its offsets no positions (no event id is derived from them), its commits marked.
        let assignment = Assignment::new(source.clone(), None)
            .with_delivery_offsets()
            .with_token(token)
            .with_lease(self.lease.lease());
        let _ = self
            .shared
            .events
            .control(SourceEvent::Assigned(vec![assignment]));
        let task = PartitionTask::spawn(PartitionParts {
            source: source.clone(),
            consumer,
            paused: paused_rx,
            delivered,
            events: self.shared.events.clone(),
            ended: self.ended_tx.clone(),
            batch_bytes: 1 << 20,
        });
        self.taken += 1;
        self.held.insert(
            source.clone(),
            Held {
                topic: topic.to_owned(),
                partition: p,
                task,
                taken: self.taken,
            },
        );
        tracing::info!(%source, "partition taken");
    }

    /// Hands partitions over: stop reading, revoke (the engine drains and commits, bounded by
    /// the deadline), close their channels, then free their locks.
    async fn hand_over(&mut self, sources: Vec<SourceId>) {
        let mut stopped = Vec::new();
        for source in &sources {
            if let Some(held) = self.held.remove(source) {
                let (consumer, _) = held.task.stop().await;
                stopped.push((source.clone(), held.topic, held.partition, consumer));
            }
        }
        let deadline = Instant::now() + self.shared.config.revoke_timeout();
        let (ack, done) = RevokeAck::new();
        let revoked = SourceEvent::Revoked {
            sources: sources.clone(),
            deadline,
            ack,
        };
        if self.shared.events.control(revoked).is_ok() {
            match tokio::time::timeout_at(deadline, done).await {
                Ok(_) => {}
                Err(_) => tracing::error!(
                    ?sources,
                    "the engine did not acknowledge the revoke by its deadline; handing over anyway (it cancelled their work by then)"
                ),
            }
        }
        for (source, topic, partition, consumer) in stopped {
            self.release(&source, &topic, partition, consumer).await;
        }
    }

    /// Closes a partition's channel (its unacknowledged messages return to the queue's head),
    /// then drops its consumer and frees its lock.
    async fn release(&mut self, source: &SourceId, topic: &str, partition: u32, consumer: Option<Consumer>) {
        let owned = self.shared.owned().remove(source);
        if let Some(owned) = owned {
            if owned.channel.status().connected() {
                if let Err(e) = owned.channel.close(200, "handed over".into()).await {
                    tracing::debug!(%source, error = %e, "closing a partition channel");
                }
            }
        }
        drop(consumer);
        let lock = topology::owner_lock(topic, &self.shared.config.group, partition);
        if let Err(e) = topology::delete_queue(&self.utility, &lock).await {
            tracing::warn!(%source, error = %e, "freeing a partition lock failed; it is freed with the connection");
        }
    }

    /// A partition's channel ended without being asked (the queue was deleted, the channel
    /// was closed by the broker): its source is lost.
    async fn partition_ended(&mut self, source: SourceId) {
        let Some(held) = self.held.remove(&source) else {
            return;
        };
        let (consumer, ended) = held.task.stop().await;
        match &ended {
            Ended::Failed(e) => {
                tracing::warn!(%source, error = %e, "partition channel failed; its messages go back to the queue")
            }
            Ended::Cancelled => {
                tracing::warn!(%source, "the broker cancelled the partition's consumer (queue deleted?)")
            }
            Ended::Stopped => {}
        }
        let _ = self
            .shared
            .events
            .control(SourceEvent::Lost(vec![source.clone()]));
        self.release(&source, &held.topic, held.partition, consumer).await;
    }

    /// The connection is gone: every partition is lost (its acks cannot reach the broker; the
    /// broker returned its unacknowledged messages).
    async fn lose_everything(&mut self) {
        let mut lost = Vec::new();
        for (source, held) in self.held.drain() {
            let _ = held.task.stop().await;
            lost.push(source);
        }
        self.shared.owned().clear();
        if !lost.is_empty() {
            let _ = self.shared.events.control(SourceEvent::Lost(lost));
        }
        // A connection that outlived its lease (a stall) still holds locks: close it, so the
        // broker frees them and returns the unacknowledged messages now.
        if self.connected() {
            crate::connect::close(&self.connection, "the member's lease ran out").await;
        }
    }

    /// Leaves the group after the engine's final commit: every channel closed (unacknowledged
    /// messages go back to their queues), locks freed, the connection closed.
    async fn leave(&mut self) {
        let held: Vec<(SourceId, Held)> = self.held.drain().collect();
        for (source, held) in held {
            let (consumer, _) = held.task.stop().await;
            self.release(&source, &held.topic, held.partition, consumer).await;
        }
        if let Some(j) = self.token.take() {
            let _ = topology::delete_queue(
                &self.utility,
                &topology::extra_token(&self.shared.config.group, j),
            )
            .await;
        }
        crate::connect::close(&self.connection, "leaving").await;
        tracing::info!(group = %self.shared.config.group, "left the group");
    }
}

/// Starts consuming a partition queue on a channel of its own, with the partition prefetch.
async fn open_partition(
    connection: &Connection,
    queue: String,
    prefetch: u16,
) -> Result<(String, Channel, Consumer), TransportError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| broker("opening a partition channel", e))?;
    // Per consumer, never global: a global prefetch on a quorum queue closes the connection.
    channel
        .basic_qos(prefetch, BasicQosOptions { global: false })
        .await
        .map_err(|e| broker("setting the prefetch", e))?;
    let consume = channel.basic_consume(
        queue.as_str().into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    );
    match tokio::time::timeout(CONSUME_TIMEOUT, consume).await {
        Ok(consumer) => {
            let consumer = consumer.map_err(|e| broker(&format!("consuming {queue}"), e))?;
            Ok((queue, channel, consumer))
        }
        Err(_) => {
            let _ = channel.close(200, "consume timed out".into()).await;
            Err(TransportError::Unavailable(format!(
                "{queue} did not start delivering within {CONSUME_TIMEOUT:?} (a quorum queue without a leader yet?)"
            )))
        }
    }
}

fn members_options() -> QueueDeclareOptions {
    QueueDeclareOptions {
        auto_delete: true,
        ..QueueDeclareOptions::default()
    }
}

/// The member's life: serve, and after a connection loss report the partitions lost and rejoin
/// with backoff, until the subscription is closed.
pub(super) async fn run(shared: Arc<Shared>, mut session: Session) {
    loop {
        match session.serve().await {
            Outcome::Closed => break,
            Outcome::Lost(why) => {
                tracing::warn!(%why, "RabbitMQ connection lost; partitions lost, reconnecting");
                session.lose_everything().await;
            }
        }
        let mut backoff = Duration::from_millis(100);
        session = loop {
            if shared.departure.is_asked() {
                shared.departure.left();
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shared.departure.asked() => continue,
            }
            match Session::open(shared.clone()).await {
                Ok(session) => break session,
                Err(e) if e.is_fatal() => {
                    let _ = shared.events.control(SourceEvent::Failed(e));
                    shared.departure.left();
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?backoff, "reconnecting to RabbitMQ failed; retrying");
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        };
    }
    shared.departure.left();
}
