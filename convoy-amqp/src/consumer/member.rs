//! A member of a consumer group on RabbitMQ: the locks of convoy-core's balancing loop
//! ([`GroupMember`]) are exclusive queues held by one connection, and the member survives the
//! loss of that connection by joining again on a new one.
//!
//! Ownership, with nothing but AMQP:
//! - **Who owns a partition**: whoever holds its lock, an exclusive queue `T.G.p{i}.owner`. The
//!   broker grants an exclusive queue to one connection and deletes it when that connection
//!   closes or dies, so a crashed member's partitions free themselves. Only the holder consumes
//!   the partition queue; its single-active-consumer flag is the broker-enforced second line.
//! - **How many members**: every member consumes `convoy.G.members`; its consumer count is the
//!   number of live members M.
//! - **Extra tokens** `convoy.G.extra.{j}` are exclusive queues too.
//! - **Handover** (the loop's): after the engine's revoke, the partition's channel is closed —
//!   its unacknowledged messages return to the head of the queue, in order — and only then its
//!   consumer dropped and its lock deleted. The next owner takes the lock and receives the
//!   partition from the watermark on, before anything newer.
//! - **Fence**: every assignment carries the connection's lease (`lease`), which ends before
//!   the broker can consider the connection dead, and at once on a connection error or a stalled
//!   renewal: a member cut off without a close, or frozen, starts nothing more of its
//!   partitions before anyone else may have them.
//! - **Failure modes**: a member that dies is noticed by the broker when its connection closes,
//!   or after one to two heartbeat timeouts for a silent network loss; until then its locks
//!   hold, so nobody else reads its partitions. A member that loses its connection or its lease
//!   reports all its partitions `Lost` (its acks cannot reach the broker), reconnects with
//!   backoff, declares again and rejoins. Every broker call is bounded in time
//!   ([`CALL_TIMEOUT`](crate::error::CALL_TIMEOUT)), so a broker whose answers are lost cannot
//!   hold the member from noticing. As with Kafka's session expiry, a handler already running
//!   when the lease ended may still finish after the broker handed its partition on.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::transport::{Assignment, SourceEvent};
use convoy_core::transport::{Ended as Session, GroupLocks, GroupMember, LockLoss, MemberTiming};
use convoy_core::{SourceId, TransportError};
use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use tokio::sync::{mpsc, watch};

use super::lease::ConnectionLease;
use super::partition::{Ended, PartitionParts, PartitionTask};
use super::{acks, Owned, Shared};
use crate::connect::connect;
use crate::error::{amqp_error, answered, broker};
use crate::topology;

/// Marks for partition channels, unique in the process (see `Owned::token`).
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// Longest wait between reconnection attempts: a broker back from a restart is found within a
/// second (at 10 s the members of a restarted node sat idle for up to 10 s after it was ready).
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// How long starting to consume a partition may take. A quorum queue without a leader (after a
/// node restart, until its Raft group recovers) lets `basic.consume` hang, and the broker ends
/// the whole connection about a minute later.
const CONSUME_TIMEOUT: Duration = Duration::from_secs(5);

/// The locks of one connection's life as a member.
pub(super) struct Locks {
    shared: Arc<Shared>,
    connection: Connection,
    /// Until when this member may start work on what it holds through `connection`.
    lease: ConnectionLease,
    utility: Channel,
    /// Kept open: its consumer counts this member.
    _members: (Channel, Consumer),
    ended_tx: mpsc::UnboundedSender<SourceId>,
    ended_rx: mpsc::UnboundedReceiver<SourceId>,
}

/// A partition queue consumed on a channel of its own, not read yet.
pub(super) struct Opened {
    queue: String,
    channel: Channel,
    consumer: Consumer,
}

/// Every partition of the subscribed topics, in a stable order.
fn all_partitions(shared: &Shared) -> Vec<SourceId> {
    let partitions = shared.config.partitions;
    shared
        .config
        .topics
        .iter()
        .flat_map(|t| (0..partitions).map(move |p| SourceId::partition(t, p)))
        .collect()
}

/// The topic and partition number of a source this member made.
fn topic_partition(source: &SourceId) -> (&str, u32) {
    source.topic_partition().unwrap_or((source.as_str(), 0))
}

/// Connects, declares the topology and joins the group: a new member session.
pub(super) async fn join(shared: Arc<Shared>) -> Result<GroupMember<Locks>, TransportError> {
    let config = &shared.config;
    let connection = connect(config, "consume").await?;
    let lease = ConnectionLease::hold(&connection, config.heartbeat_s).await?;
    for topic in &config.topics {
        let declared =
            crate::registry::declare_recorded(&connection, topic, config, config.partitions).await?;
        crate::registry::tell_if_new_group(topic, &config.group, &declared);
    }
    let (members, consumer) =
        consume_membership(&connection, &topology::members_queue(&config.group)).await?;
    let utility = answered("opening a channel", connection.create_channel())
        .await?
        .map_err(|e| broker("opening a channel", e))?;
    let (ended_tx, ended_rx) = mpsc::unbounded_channel();
    tracing::info!(group = %config.group, topics = ?config.topics, "joined the group");
    let timing = MemberTiming {
        balance_every: Duration::from_millis(config.balance_interval_ms),
        revoke_timeout: config.revoke_timeout(),
    };
    let (events, partitions) = (shared.events.clone(), all_partitions(&shared));
    let locks = Locks {
        shared,
        connection,
        lease,
        utility,
        _members: (members, consumer),
        ended_tx,
        ended_rx,
    };
    Ok(GroupMember::new(
        locks,
        events,
        partitions,
        timing,
        fastrand::u64(..),
    ))
}

impl Locks {
    fn connected(&self) -> bool {
        self.connection.status().connected()
    }

    /// The channel for counting members and deleting locks, opened again if the broker closed
    /// it (a refused call closes its channel).
    async fn utility(&mut self) -> Result<Channel, TransportError> {
        if !self.utility.status().connected() {
            self.utility = answered("opening a channel", self.connection.create_channel())
                .await?
                .map_err(|e| broker("opening a channel", e))?;
        }
        Ok(self.utility.clone())
    }

    /// Deletes a lock queue this connection holds.
    async fn unlock(&mut self, lock: &str) -> Result<(), TransportError> {
        let utility = self.utility().await?;
        Ok(topology::delete_queue(&utility, lock).await?)
    }
}

#[async_trait]
impl GroupLocks for Locks {
    type Won = ();
    type Opened = Opened;
    type Reader = PartitionTask;

    async fn members(&mut self) -> Result<usize, TransportError> {
        let name = topology::members_queue(&self.shared.config.group);
        let utility = self.utility().await?;
        let declare = utility.queue_declare(name.as_str().into(), members_options(), FieldTable::default());
        let queue = answered("counting the members", declare)
            .await?
            .map_err(|e| broker("counting the members", e))?;
        Ok((queue.consumer_count() as usize).max(1))
    }

    async fn take_token(&mut self, j: u32) -> Result<bool, TransportError> {
        let token = topology::extra_token(&self.shared.config.group, j);
        Ok(topology::try_lock(&self.connection, &token).await?)
    }

    async fn release_token(&mut self, j: u32) -> Result<(), TransportError> {
        self.unlock(&topology::extra_token(&self.shared.config.group, j))
            .await
    }

    async fn take(&mut self, source: &SourceId) -> Result<Option<()>, TransportError> {
        let (topic, p) = topic_partition(source);
        let lock = topology::owner_lock(topic, &self.shared.config.group, p);
        Ok(topology::try_lock(&self.connection, &lock).await?.then_some(()))
    }

    async fn open(&self, source: &SourceId, _: &()) -> Result<Opened, TransportError> {
        let (topic, p) = topic_partition(source);
        let queue = topology::partition_queue(topic, &self.shared.config.group, p);
        open_partition(&self.connection, queue, self.shared.prefetch).await
    }

    /// Serves a partition this member holds the lock of and has started consuming.
    fn start(&mut self, source: &SourceId, _: (), opened: Opened) -> PartitionTask {
        let (paused_tx, paused_rx) = watch::channel(false);
        let delivered = Arc::new(AtomicU64::new(0));
        let token = NEXT_TOKEN.fetch_add(1, Relaxed);
        self.shared.owned().insert(
            source.clone(),
            Owned {
                channel: opened.channel,
                token,
                acks: Default::default(),
                delivered: delivered.clone(),
                paused: paused_tx,
                queue: opened.queue,
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
        tracing::info!(%source, "partition taken");
        PartitionTask::spawn(PartitionParts {
            source: source.clone(),
            consumer: opened.consumer,
            paused: paused_rx,
            delivered,
            events: self.shared.events.clone(),
            ended: self.ended_tx.clone(),
            batch_bytes: 1 << 20,
        })
    }

    /// Closes a partition's channel (its unacknowledged messages return to the queue's head),
    /// then drops its consumer and frees its lock.
    async fn release(&mut self, source: &SourceId, stopped: Option<(Option<Consumer>, Ended)>) {
        let (consumer, ended) = stopped.unwrap_or((None, Ended::Stopped));
        match &ended {
            Ended::Failed(e) => {
                tracing::warn!(%source, error = %e, "partition channel failed; its messages go back to the queue")
            }
            Ended::Cancelled => {
                tracing::warn!(%source, "the broker cancelled the partition's consumer (queue deleted?)")
            }
            Ended::Stopped => {}
        }
        let owned = self.shared.owned().remove(source);
        if let Some(owned) = owned.filter(|o| o.channel.status().connected()) {
            acknowledge_finished_above(source, &owned).await;
            match answered(
                "closing a partition channel",
                owned.channel.close(200, "handed over".into()),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%source, error = %e, "closing a partition channel"),
                Err(e) => tracing::warn!(%source, error = %e, "closing a partition channel"),
            }
        }
        drop(consumer);
        let (topic, p) = topic_partition(source);
        let lock = topology::owner_lock(topic, &self.shared.config.group, p);
        if let Err(e) = self.unlock(&lock).await {
            tracing::warn!(%source, error = %e, "freeing a partition lock failed; it is freed with the connection");
        }
    }

    /// The connection's lease ran out (every lock with it), or a partition's channel ended by
    /// itself (the queue was deleted, the channel closed by the broker).
    async fn lost(&mut self) -> LockLoss {
        tokio::select! {
            why = self.lease.lost() => LockLoss::All(why),
            Some(source) = self.ended_rx.recv() => match self.connected() {
                true => LockLoss::Partition { source, reported: false },
                false => LockLoss::All("the connection was lost".into()),
            },
        }
    }

    fn over(&self) -> Option<String> {
        (!self.connected()).then(|| "the connection was lost".into())
    }

    /// The connection is gone: its acks cannot reach the broker, which returned the
    /// unacknowledged messages.
    async fn abandon(&mut self) {
        self.shared.owned().clear();
        // A connection that outlived its lease (a stall) still holds locks: close it, so the
        // broker frees them and returns the unacknowledged messages now.
        if self.connected() {
            crate::connect::close(&self.connection, "the member's lease ran out").await;
        }
    }

    async fn leave(&mut self) {
        let owned: Vec<(SourceId, Owned)> = self.shared.owned().drain().collect();
        for (source, owned) in &owned {
            acknowledge_finished_above(source, owned).await;
        }
        crate::connect::close(&self.connection, "leaving").await;
        tracing::info!(group = %self.shared.config.group, "left the group");
    }
}

/// Before a partition's channel closes: acknowledges the messages its last commit found
/// finished above the watermark (a bounded number: `acks.rs`), so the next owner does not get
/// them again. A failure only costs redelivery.
async fn acknowledge_finished_above(source: &SourceId, owned: &Owned) {
    let plan = owned.acks.release_plan();
    if plan.is_empty() {
        return;
    }
    if let Err(e) = acks::send(&owned.channel, &plan, source.as_str()).await {
        tracing::debug!(%source, error = %e, "acknowledging finished messages before the handover failed; they are redelivered");
    }
}

/// Starts consuming a partition queue on a channel of its own, with the partition prefetch.
async fn open_partition(
    connection: &Connection,
    queue: String,
    prefetch: u16,
) -> Result<Opened, TransportError> {
    let channel = answered("opening a partition channel", connection.create_channel())
        .await?
        .map_err(|e| broker("opening a partition channel", e))?;
    // Per consumer, never global: a global prefetch on a quorum queue closes the connection.
    answered(
        "setting the prefetch",
        channel.basic_qos(prefetch, BasicQosOptions { global: false }),
    )
    .await?
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
            Ok(Opened {
                queue,
                channel,
                consumer,
            })
        }
        Err(_) => {
            let _ = answered(
                "closing a channel",
                channel.close(200, "consume timed out".into()),
            )
            .await;
            Err(TransportError::Unavailable(format!(
                "{queue} did not start delivering within {CONSUME_TIMEOUT:?} (a quorum queue without a leader yet?)"
            )))
        }
    }
}

/// Declares the membership queue `name` and consumes it, on a channel of its own. The queue is
/// deleted when its last consumer goes (`auto_delete`): a member joining just as the last one
/// leaves may find it gone between the declare and the consume (a 404 that closes the channel),
/// and then declares it again on a new channel. (CI once caught a member exiting on that 404.)
async fn consume_membership(
    connection: &Connection,
    name: &str,
) -> Result<(Channel, Consumer), TransportError> {
    const ATTEMPTS: u32 = 5;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let members = answered("opening the membership channel", connection.create_channel())
            .await?
            .map_err(|e| broker("opening the membership channel", e))?;
        let declare = members.queue_declare(name.into(), members_options(), FieldTable::default());
        answered("declaring the membership queue", declare)
            .await?
            .map_err(|e| broker("declaring the membership queue", e))?;
        answered(
            "joining the group",
            members.basic_qos(1, BasicQosOptions::default()),
        )
        .await?
        .map_err(|e| broker("joining the group", e))?;
        let options = BasicConsumeOptions {
            no_ack: true,
            ..BasicConsumeOptions::default()
        };
        let consume = members.basic_consume(name.into(), "".into(), options, FieldTable::default());
        match answered("joining the group", consume).await? {
            Ok(consumer) => return Ok((members, consumer)),
            Err(e) if attempt < ATTEMPTS && amqp_error(&e).is_some_and(|(code, _)| code == 404) => {
                tracing::debug!(queue = name, error = %e, "the membership queue went with the last member as this one joined; declaring it again");
            }
            Err(e) => return Err(broker("joining the group", e)),
        }
    }
}

fn members_options() -> QueueDeclareOptions {
    QueueDeclareOptions {
        auto_delete: true,
        ..QueueDeclareOptions::default()
    }
}

/// The member's life: serve, and after a connection loss (its partitions reported lost) rejoin
/// with backoff, until the subscription is closed.
pub(super) async fn run(shared: Arc<Shared>, mut member: GroupMember<Locks>) {
    loop {
        match member.serve(&shared.departure).await {
            Session::Left => break,
            Session::Lost(why) => {
                tracing::warn!(%why, "RabbitMQ connection lost; partitions lost, reconnecting");
            }
        }
        let mut backoff = Duration::from_millis(100);
        let (lost_at, mut attempts) = (std::time::Instant::now(), 0u32);
        let mut last_said = String::new();
        member = loop {
            if shared.departure.is_asked() {
                shared.departure.left();
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shared.departure.asked() => continue,
            }
            attempts += 1;
            match join(shared.clone()).await {
                Ok(member) => {
                    tracing::info!(lost_for = ?lost_at.elapsed(), attempts, "reconnected to RabbitMQ");
                    break member;
                }
                Err(e) if e.is_fatal() => {
                    let _ = shared.events.control(SourceEvent::Failed(e));
                    shared.departure.left();
                    return;
                }
                // Said when the reason changes, not on every attempt of an outage.
                Err(e) => {
                    let said = e.to_string();
                    if said != last_said {
                        tracing::warn!(error = %said, "joining RabbitMQ again failed; retrying (said again when it succeeds or fails otherwise)");
                        last_said = said;
                    } else {
                        tracing::debug!(error = %e, ?backoff, "joining RabbitMQ again failed again");
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        };
    }
    shared.departure.left();
}
