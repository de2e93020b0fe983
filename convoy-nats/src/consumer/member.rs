//! A member of a consumer group: announces itself, balances the group's partitions over the
//! live members by leases, hands partitions over, and gives up what it cannot renew.
//!
//! Ownership, with nothing but JetStream key-value buckets (nats-server 2.9 has no pinned
//! consumers):
//! - **Who owns a partition**: whoever holds its lease, the key `p.<stream>.<partition>` in the
//!   group's leases bucket (see `leases`): taken with `create`, renewed with compare-and-set,
//!   expired by the server `lease_ttl` after the last write. A member stops handling a
//!   partition (the engine starts nothing more of it, and it is reported `Lost`) before the
//!   lease can expire on the server, so two members never handle one partition at once.
//! - **How many members**: each holds a presence key `m.<id>` the same way; the live keys are
//!   the members.
//! - **Fair shares** ([`convoy_core::balance`]): ⌊S/M⌋ each, one more for the holders of the
//!   extra tokens `x.<j>`, `j < S mod M` (leased keys too).
//! - **Where reading starts**: the committed watermark in the group's watermarks bucket. Taking
//!   a partition first rewrites its watermark entry (same value, new revision), so a former
//!   owner that was cut off can no longer commit there; then a consumer is created at the
//!   watermark + 1.
//! - **Handover**: a member over its share stops reading the partition, sends `Revoked` with its
//!   deadline, waits for the engine (drained, committed), then releases the lease — renewed
//!   meanwhile — so the next owner starts at the final watermark.
//! - **Failure modes**: a member that dies is replaced once its leases expire (`lease_ttl`). A
//!   member cut off from the server (or frozen) stops before its leases expire, reports its
//!   partitions lost, and takes partitions again once it can write; a handler that was already
//!   running when the lease ran out may still finish — as with Kafka's session expiry, the
//!   engine cannot take back a call in progress — but nothing new starts.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::{CreateErrorKind, Operation, Store, UpdateErrorKind};
use bytes::Bytes;
use convoy_core::balance::{rotation, surplus, Cooling, FairShare};
use convoy_core::transport::EventSender;
use convoy_core::{Assignment, Lease, Offset, RevokeAck, SourceEvent, SourceId, TransportError};
use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::leases::{self, Leases};
use super::partition::{PartitionTask, ReaderParts};
use super::{Owned, Shared};
use crate::config::NatsConfig;
use crate::connect::{connect, Connected};

/// How long joining the group waits out an outage before `subscribe` fails with it.
const JOIN_WITHIN: Duration = Duration::from_secs(30);
use crate::error::nats_error;
use crate::topology::{self, WatermarkEntry};

/// Longest wait for the member count.
const MEMBERS_TIMEOUT: Duration = Duration::from_secs(5);

/// A partition this member holds.
struct Held {
    topic: String,
    partition: u32,
    task: PartitionTask,
    /// When it was taken (the newest are handed over first).
    taken: u64,
}

/// One member's life.
pub(super) struct Session {
    connected: Connected,
    leases: Arc<Leases>,
    lost: mpsc::UnboundedReceiver<String>,
    me: u64,
    token: Option<u32>,
    held: HashMap<SourceId, Held>,
    taken: u64,
    serial: Arc<AtomicU64>,
    /// Partitions that could not be started, skipped for a while.
    cooling: Cooling,
}

/// Every partition of the subscribed topics, in a stable order.
fn all_partitions(config: &NatsConfig) -> Vec<(String, u32)> {
    config
        .topics
        .iter()
        .flat_map(|t| (0..config.partitions).map(move |p| (t.clone(), p)))
        .collect()
}

impl Session {
    /// Connects, declares the streams and buckets, and announces the member. Returns the
    /// watermarks bucket for commits too. An outage while joining (streams and buckets just
    /// created on a cluster answer "no responders" until their replicas elected a leader; a
    /// restarting server does too) is waited out with backoff for up to [`JOIN_WITHIN`].
    pub async fn open(config: &NatsConfig, events: EventSender) -> Result<(Session, Store), TransportError> {
        let connected = connect(config, "consume").await?;
        let mut backoff = Duration::from_millis(100);
        let joining = Instant::now();
        let (session, watermarks) = loop {
            match Self::join(connected.clone(), config, events.clone()).await {
                Ok(joined) => break joined,
                Err(TransportError::Unavailable(e)) if joining.elapsed() < JOIN_WITHIN => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "joining the group: the server is not ready; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(e),
            }
        };
        tokio::spawn(leases::keep(session.leases.clone()));
        tracing::info!(group = %config.group, topics = ?config.topics, member = %format!("{:016x}", session.me), "joined the group");
        Ok((session, watermarks))
    }

    /// One attempt at joining: declares, then announces a new member.
    async fn join(
        connected: Connected,
        config: &NatsConfig,
        events: EventSender,
    ) -> Result<(Session, Store), TransportError> {
        for topic in &config.topics {
            topology::declare_topic(&connected.js, config, topic, config.partitions).await?;
        }
        let buckets = topology::declare_buckets(&connected.js, config).await?;
        let (lost_tx, lost) = mpsc::unbounded_channel();
        let leases = Arc::new(Leases::new(buckets.leases, config.lease_ttl(), lost_tx, events));
        let session = Session {
            connected,
            leases,
            lost,
            me: fastrand::u64(..),
            token: None,
            held: HashMap::new(),
            taken: 0,
            serial: Arc::default(),
            cooling: Cooling::default(),
        };
        session.announce().await?;
        Ok((session, buckets.watermarks))
    }

    /// This member's id.
    pub fn me(&self) -> u64 {
        self.me
    }

    /// This member's leases.
    pub fn leases(&self) -> Arc<Leases> {
        self.leases.clone()
    }

    /// Holds this member's presence key (again, after it was lost).
    async fn announce(&self) -> Result<(), TransportError> {
        let key = topology::member_key(self.me);
        if self.leases.holds(&key) {
            return Ok(());
        }
        match self
            .leases
            .acquire(&key, Bytes::from_static(b"member"), None)
            .await?
        {
            Some(_) => Ok(()),
            // Our own key from before it was lost locally: it expires soon.
            None => Ok(()),
        }
    }

    /// Serves the group until the subscription closes.
    async fn serve(&mut self, shared: &Arc<Shared>) {
        let interval = Duration::from_millis(shared.config.balance_interval_ms);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if shared.departure.is_asked() {
                self.leave(shared).await;
                return;
            }
            tokio::select! {
                _ = shared.departure.asked() => {}
                Some(key) = self.lost.recv() => self.lost_lease(shared, &key).await,
                _ = tick.tick() => {
                    if let Err(e) = self.balance(shared).await {
                        tracing::warn!(error = %e, "rebalancing failed; trying again");
                    }
                }
            }
        }
    }

    /// The number of live members (this one included): presence keys whose last entry is a
    /// value, not the tombstone a member that left wrote. (The bucket's subjects are listed by
    /// the stream: the library's `keys()` creates a consumer per call and was seen to hang.)
    async fn member_count(&self) -> Result<usize, TransportError> {
        let store = self.leases.store();
        let filter = format!("{}{}", store.prefix, topology::member_key_filter());
        let count = async {
            let mut subjects = store
                .stream
                .info_with_subjects(&filter)
                .await
                .map_err(|e| nats_error("listing the members", e))?;
            let mut members = 0usize;
            while let Some(subject) = subjects.next().await {
                let (subject, _) = subject.map_err(|e| nats_error("listing the members", e))?;
                let Some(key) = subject.strip_prefix(store.prefix.as_str()) else {
                    continue;
                };
                let entry = store
                    .entry(key)
                    .await
                    .map_err(|e| nats_error("reading a member", e))?;
                members += usize::from(entry.is_some_and(|e| e.operation == Operation::Put));
            }
            Ok::<usize, TransportError>(members)
        };
        let members = tokio::time::timeout(MEMBERS_TIMEOUT, count)
            .await
            .map_err(|_| TransportError::Unavailable("counting the members timed out".into()))??;
        Ok(members.max(1))
    }

    /// Moves this member's holdings toward its fair share.
    async fn balance(&mut self, shared: &Arc<Shared>) -> Result<(), TransportError> {
        self.announce().await?;
        let members = self.member_count().await?;
        let partitions = all_partitions(&shared.config);
        let share = FairShare::new(partitions.len(), members);
        if let Some(j) = self.token.filter(|j| !share.token_counts(*j)) {
            self.leases.release(&topology::token_key(j)).await;
            self.token = None;
        }
        if self.token.is_none() {
            for j in 0..share.extra_tokens() as u32 {
                if self
                    .leases
                    .acquire(&topology::token_key(j), Bytes::from_static(b"token"), None)
                    .await?
                    .is_some()
                {
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
            self.hand_over(shared, release).await;
            return Ok(());
        }
        let mut won = Vec::new();
        for i in rotation(partitions.len(), self.me) {
            if self.held.len() + won.len() >= quota {
                break;
            }
            let (topic, p) = &partitions[i];
            let source = SourceId::partition(topic, *p);
            if self.held.contains_key(&source) || self.cooling.is_cooling(&source) {
                continue;
            }
            let key = topology::partition_key(topic, *p);
            if let Some(lease) = self
                .leases
                .acquire(
                    &key,
                    Bytes::from(format!("{:016x}", self.me)),
                    Some(source.clone()),
                )
                .await?
            {
                won.push((topic.clone(), *p, lease));
            }
        }
        // Started together: each start is a few round trips.
        let starts = won.iter().map(|(topic, p, _)| self.prepare(shared, topic, *p));
        let prepared = futures_util::future::join_all(starts).await;
        for ((topic, p, lease), prepared) in won.into_iter().zip(prepared) {
            let source = SourceId::partition(&topic, p);
            match prepared {
                Ok(start) => {
                    self.cooling.started(&source);
                    self.start(shared, &topic, p, lease, start);
                }
                Err(e) => {
                    let wait = self.cooling.failed(source.clone());
                    tracing::warn!(%source, error = %e, retry_in = ?wait, "could not take the partition; serving the others meanwhile");
                    self.leases.release(&topology::partition_key(&topic, p)).await;
                }
            }
        }
        Ok(())
    }

    /// Reads a won partition's committed watermark, checks it against the stream, claims its
    /// entry (rewriting it under a new revision with this member's id, so a former owner's late
    /// commit is refused), and opens its stream.
    async fn prepare(&self, shared: &Arc<Shared>, topic: &str, p: u32) -> Result<Start, TransportError> {
        let key = topology::partition_key(topic, p);
        let store = &shared.watermarks;
        // The stream first: a stored watermark is only a position in the stream it was counted in.
        let mut stream = self
            .connected
            .js
            .get_stream(topology::stream_name(topic))
            .await
            .map_err(|e| nats_error(&format!("opening the stream of {topic}"), e))?;
        let info = stream
            .info()
            .await
            .map_err(|e| nats_error(&format!("reading the stream of {topic}"), e))?
            .clone();
        let stream_created = info.created.unix_timestamp_nanos();
        let mut attempts = 0;
        let (committed, revision) = loop {
            attempts += 1;
            let entry = store
                .entry(key.as_str())
                .await
                .map_err(|e| nats_error("reading a watermark", e))?;
            let (stored, revision) = match entry {
                Some(e) if e.operation == Operation::Put => {
                    (WatermarkEntry::decode(&e.value), Some(e.revision))
                }
                Some(e) => (WatermarkEntry::default(), Some(e.revision)), // a tombstone: compare against it
                None => (WatermarkEntry::default(), None),
            };
            let committed =
                checked_against_stream(topic, p, stored, stream_created, info.state.last_sequence);
            let value = WatermarkEntry {
                watermark: committed,
                writer: Some(self.me),
                stream_created: Some(stream_created),
            }
            .encode();
            let claimed = match revision {
                Some(revision) => store.update(key.as_str(), value, revision).await.map_err(|e| {
                    (
                        e.kind() == UpdateErrorKind::WrongLastRevision,
                        nats_error("claiming a watermark", e),
                    )
                }),
                None => store.create(key.as_str(), value).await.map_err(|e| {
                    (
                        e.kind() == CreateErrorKind::AlreadyExists,
                        nats_error("claiming a watermark", e),
                    )
                }),
            };
            match claimed {
                Ok(revision) => break (committed, revision),
                // A former owner committed in between: read again.
                Err((true, _)) if attempts < 5 => continue,
                Err((_, e)) => return Err(e),
            }
        };
        Ok(Start {
            committed,
            watermark_key: key,
            watermark_revision: revision,
            stream_created,
            stream,
        })
    }

    /// Serves a partition this member leased and prepared.
    fn start(&mut self, shared: &Arc<Shared>, topic: &str, p: u32, lease: Lease, start: Start) {
        let source = SourceId::partition(topic, p);
        let subject = topology::partition_subject(topic, p);
        let (paused_tx, paused_rx) = watch::channel(false);
        let delivered = Arc::new(AtomicU64::new(start.committed.unwrap_or(0)));
        shared.owned().insert(
            source.clone(),
            Owned {
                lease: lease.clone(),
                watermark_key: start.watermark_key,
                watermark_revision: start.watermark_revision,
                stream_created: start.stream_created,
                delivered: delivered.clone(),
                commits_failing_since: None,
                paused: paused_tx,
                stream: start.stream.clone(),
                subject: subject.clone(),
            },
        );
        let assignment = Assignment::new(source.clone(), start.committed).with_lease(lease.clone());
        let _ = shared.events.control(SourceEvent::Assigned(vec![assignment]));
        // One pull must be able to carry the largest message the server accepts (its headers and
        // subjects included), or that message could never be read.
        let largest = self.connected.client.server_info().max_payload + 4096;
        let task = PartitionTask::spawn(ReaderParts {
            source: source.clone(),
            js: self.connected.js.clone(),
            stream: start.stream,
            subject,
            start: start.committed.map(|w| w + 1),
            lease,
            member: self.me,
            partition: p,
            serial: self.serial.clone(),
            batch: shared.batch,
            max_bytes: shared.pull_bytes.max(largest),
            paused: paused_rx,
            delivered,
            events: shared.events.clone(),
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
        tracing::info!(%source, committed = ?start.committed, "partition taken");
    }

    /// Hands partitions over: stop reading, revoke (the engine drains and commits, bounded by
    /// the deadline), then release their leases.
    async fn hand_over(&mut self, shared: &Arc<Shared>, sources: Vec<SourceId>) {
        let mut stopped = Vec::new();
        for source in &sources {
            if let Some(held) = self.held.remove(source) {
                held.task.stop().await;
                stopped.push((source.clone(), held.topic, held.partition));
            }
        }
        let deadline = Instant::now() + shared.config.revoke_timeout();
        let (ack, done) = RevokeAck::new();
        let revoked = SourceEvent::Revoked {
            sources: sources.clone(),
            deadline,
            ack,
        };
        if shared.events.control(revoked).is_ok() && tokio::time::timeout_at(deadline, done).await.is_err() {
            tracing::error!(?sources, "the engine did not acknowledge the revoke by its deadline; handing over anyway (it cancelled their work by then)");
        }
        for (source, topic, partition) in stopped {
            shared.owned().remove(&source);
            self.leases
                .release(&topology::partition_key(&topic, partition))
                .await;
        }
    }

    /// A lease ran out or was taken: a partition is lost (the keeper told the engine; its
    /// reader stops here, and it is never committed again), the token or the presence is taken
    /// again by the next balance.
    async fn lost_lease(&mut self, shared: &Arc<Shared>, key: &str) {
        if self.token.is_some_and(|j| topology::token_key(j) == key) {
            self.token = None;
            return;
        }
        let lost = self
            .held
            .iter()
            .find(|(_, h)| topology::partition_key(&h.topic, h.partition) == key)
            .map(|(s, _)| s.clone());
        let Some(source) = lost else {
            return;
        };
        if let Some(held) = self.held.remove(&source) {
            held.task.stop().await;
        }
        shared.owned().remove(&source);
    }

    /// Leaves the group after the engine's final commit: readers stopped, every lease released.
    async fn leave(&mut self, shared: &Arc<Shared>) {
        for (_, held) in self.held.drain() {
            held.task.stop().await;
        }
        shared.owned().clear();
        for key in self.leases.keys() {
            self.leases.release(&key).await;
        }
        tracing::info!(group = %shared.config.group, "left the group");
    }
}

/// Where a partition's reading starts.
struct Start {
    committed: Option<Offset>,
    watermark_key: String,
    watermark_revision: u64,
    stream_created: i128,
    stream: async_nats::jetstream::stream::Stream,
}

/// The stored watermark of partition `p` of `topic` where it still fits the stream: a stream
/// created since it was written (deleted and created again, restored from a backup) or a
/// watermark beyond the stream's last message (a lost unsynced tail) would make reading start
/// past messages never handled. Such a watermark is reset loudly and the partition read from
/// the stream's first message: a duplicate beats a silent loss.
fn checked_against_stream(
    topic: &str,
    p: u32,
    stored: WatermarkEntry,
    stream_created: i128,
    last_sequence: u64,
) -> Option<Offset> {
    let watermark = stored.watermark?;
    let why = if stored.stream_created.is_some_and(|c| c != stream_created) {
        "the stream was created again since it was written"
    } else if watermark > last_sequence {
        "it is beyond the stream's last message"
    } else {
        return Some(watermark);
    };
    tracing::warn!(topic, partition = p, watermark, last_sequence, "the committed watermark does not fit the stream ({why}): reading the partition from its first message again");
    metrics::counter!(WATERMARK_RESETS, "topic" => topic.to_owned()).increment(1);
    None
}

/// Watermarks reset because they did not fit their stream.
pub const WATERMARK_RESETS: &str = "convoy_nats_watermark_resets_total";

/// The member's life: serve until the subscription is closed, then say so.
pub(super) async fn run(shared: Arc<Shared>, mut session: Session) {
    session.serve(&shared).await;
    // Dropping the session ends the lease keeper (its lost-key receiver is gone).
    drop(session);
    shared.departure.left();
}
