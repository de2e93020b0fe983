//! A member of a consumer group on NATS: the locks of convoy-core's balancing loop
//! ([`GroupMember`]) are leases in a JetStream key-value bucket (nats-server 2.9 has no pinned
//! consumers), kept by `leases`.
//!
//! - **Who owns a partition**: whoever holds its lease, the key `p.<stream>.<partition>` in the
//!   group's leases bucket: taken with `create`, renewed with compare-and-set, expired by the
//!   server `lease_ttl` after the last write. A member stops handling a partition (the engine
//!   starts nothing more of it, and it is reported `Lost`) before the lease can expire on the
//!   server, so two members never handle one partition at once.
//! - **How many members**: each holds a presence key `m.<id>` the same way; the live keys are
//!   the members. Extra tokens are keys `x.<j>`, leased too.
//! - **Where reading starts**: the committed watermark in the group's watermarks bucket. Taking
//!   a partition first rewrites its watermark entry (same value, new revision), so a former
//!   owner that was cut off can no longer commit there; then a consumer is created at the
//!   watermark + 1.
//! - **Handover** (the loop's): after the engine's revoke, the lease — renewed meanwhile — is
//!   released, so the next owner starts at the final watermark.
//! - **Failure modes**: a member that dies is replaced once its leases expire (`lease_ttl`). A
//!   member cut off from the server (or frozen) stops before its leases expire, reports its
//!   partitions lost, and takes partitions again once it can write; a handler that was already
//!   running when the lease ran out may still finish — as with Kafka's session expiry, the
//!   engine cannot take back a call in progress — but nothing new starts.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::{CreateErrorKind, Operation, Store, UpdateErrorKind};
use async_trait::async_trait;
use convoy_core::metrics::{source_hole, HoleReason};
use convoy_core::transport::{wait_out_outage, JOIN_WITHIN};
use convoy_core::transport::{Assignment, Lease, SourceEvent};
use convoy_core::transport::{Ended, EventSender, GroupLocks, GroupMember, LockLoss, MemberTiming};
use convoy_core::{Offset, SourceId, TransportError};
use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};

use super::leases::{self, Leases, LostKey};
use super::partition::{PartitionTask, ReaderParts};
use super::{Owned, Shared};
use crate::config::NatsConfig;
use crate::connect::{connect, Connected};
use crate::error::nats_error;
use crate::topology::{self, WatermarkEntry};

/// Longest wait for the member count.
const MEMBERS_TIMEOUT: Duration = Duration::from_secs(5);

/// A member that joined: announced, its leases kept, not balancing yet.
pub(super) struct Joined {
    connected: Connected,
    /// This member's leases (kept renewed from now on).
    pub leases: Arc<Leases>,
    lost: mpsc::UnboundedReceiver<LostKey>,
    /// This member's id.
    pub me: u64,
    /// The group's watermarks bucket.
    pub watermarks: Store,
}

/// Connects, declares the streams and buckets, and announces the member. An outage while
/// joining is waited out with backoff, for up to [`JOIN_WITHIN`] each: a server not answering
/// the connection (a member started while its server restarts), and streams and buckets just
/// created on a cluster answering "no responders" until their replicas elected a leader.
pub(super) async fn join(config: &NatsConfig, events: EventSender) -> Result<Joined, TransportError> {
    let connected = wait_out_outage(JOIN_WITHIN, "connecting to the group's server", || {
        connect(config, "consume")
    })
    .await?;
    let joined = wait_out_outage(JOIN_WITHIN, "joining the group", || {
        join_once(connected.clone(), config, events.clone())
    })
    .await?;
    tokio::spawn(leases::keep(joined.leases.clone()));
    tracing::info!(group = %config.group, topics = ?config.topics, member = %format!("{:016x}", joined.me), "joined the group");
    Ok(joined)
}

/// One attempt at joining: declares, then announces a new member.
async fn join_once(
    connected: Connected,
    config: &NatsConfig,
    events: EventSender,
) -> Result<Joined, TransportError> {
    for topic in &config.topics {
        topology::declare_topic(&connected.js, config, topic, config.partitions).await?;
    }
    let buckets = topology::declare_buckets(&connected.js, config).await?;
    let (lost_tx, lost) = mpsc::unbounded_channel();
    let me = fastrand::u64(..);
    let leases = Arc::new(Leases::new(
        buckets.leases,
        me,
        config.lease_ttl(),
        lost_tx,
        events,
    ));
    announce(&leases, me).await?;
    Ok(Joined {
        connected,
        leases,
        lost,
        me,
        watermarks: buckets.watermarks,
    })
}

/// Holds member `me`'s presence key (again, after it was lost).
async fn announce(leases: &Leases, me: u64) -> Result<(), TransportError> {
    let key = topology::member_key(me);
    if !leases.holds(&key) {
        leases.acquire(&key, None).await?;
    }
    Ok(())
}

impl Joined {
    /// The member's balancing loop over the partitions of `shared`'s topics.
    pub fn into_member(self, shared: Arc<Shared>) -> GroupMember<Locks> {
        let config = &shared.config;
        let partitions = config
            .topics
            .iter()
            .flat_map(|t| (0..config.partitions).map(move |p| SourceId::partition(t, p)))
            .collect();
        let timing = MemberTiming {
            balance_every: Duration::from_millis(config.balance_interval_ms),
            revoke_timeout: config.revoke_timeout(),
        };
        let events = shared.events.clone();
        let locks = Locks {
            shared,
            connected: self.connected,
            leases: self.leases,
            lost: self.lost,
            me: self.me,
            serial: Arc::default(),
        };
        GroupMember::new(locks, events, partitions, timing, self.me)
    }
}

/// A member's leases as the balancing loop's locks.
pub(super) struct Locks {
    shared: Arc<Shared>,
    connected: Connected,
    leases: Arc<Leases>,
    lost: mpsc::UnboundedReceiver<LostKey>,
    me: u64,
    /// Consumer names are numbered per member.
    serial: Arc<AtomicU64>,
}

/// The topic and partition number of a source this member made.
fn topic_partition(source: &SourceId) -> (&str, u32) {
    source.topic_partition().unwrap_or((source.as_str(), 0))
}

impl Locks {
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

    /// Reads a won partition's committed watermark, checks it against the stream, claims its
    /// entry (rewriting it under a new revision with this member's id, so a former owner's late
    /// commit is refused), and opens its stream.
    async fn prepare(&self, topic: &str, p: u32) -> Result<Start, TransportError> {
        let key = topology::partition_key(topic, p);
        let store = &self.shared.watermarks;
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
        let (committed, finished_above, revision) = loop {
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
            let last_sequence = info.state.last_sequence;
            let (committed, hole) = checked_against_stream(&stored, stream_created, &info.state);
            // What was finished above a watermark that fits is skipped; the claim keeps it.
            let finished_above: Vec<Offset> = match committed {
                Some(_) => stored
                    .finished_above
                    .into_iter()
                    .filter(|&o| o <= last_sequence)
                    .collect(),
                None => Vec::new(),
            };
            let value = WatermarkEntry {
                watermark: committed,
                writer: Some(self.me),
                stream_created: Some(stream_created),
                finished_above: finished_above.clone(),
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
                Ok(revision) => {
                    if let Some(hole) = hole {
                        report(&self.shared.config.group, topic, p, stored.watermark, hole);
                    }
                    break (committed, finished_above, revision);
                }
                // A former owner committed in between: read again.
                Err((true, _)) if attempts < 5 => continue,
                Err((_, e)) => return Err(e),
            }
        };
        Ok(Start {
            committed,
            finished_above,
            watermark_key: key,
            watermark_revision: revision,
            stream_created,
            stream,
        })
    }
}

#[async_trait]
impl GroupLocks for Locks {
    type Won = Lease;
    type Opened = Start;
    type Reader = PartitionTask;

    async fn members(&mut self) -> Result<usize, TransportError> {
        announce(&self.leases, self.me).await?;
        self.member_count().await
    }

    async fn take_token(&mut self, j: u32) -> Result<bool, TransportError> {
        let key = topology::token_key(j);
        Ok(self.leases.acquire(&key, None).await?.is_some())
    }

    async fn release_token(&mut self, j: u32) -> Result<(), TransportError> {
        self.leases.release(&topology::token_key(j)).await;
        Ok(())
    }

    async fn take(&mut self, source: &SourceId) -> Result<Option<Lease>, TransportError> {
        let (topic, p) = topic_partition(source);
        let key = topology::partition_key(topic, p);
        self.leases.acquire(&key, Some(source.clone())).await
    }

    async fn open(&self, source: &SourceId, _: &Lease) -> Result<Start, TransportError> {
        let (topic, p) = topic_partition(source);
        self.prepare(topic, p).await
    }

    /// A lease that ran out while its partition was prepared was reported lost already.
    fn still_held(&self, lease: &Lease) -> bool {
        lease.is_valid()
    }

    /// Serves a partition this member leased and prepared.
    fn start(&mut self, source: &SourceId, lease: Lease, start: Start) -> PartitionTask {
        let (topic, p) = topic_partition(source);
        let subject = topology::partition_subject(topic, p);
        let (paused_tx, paused_rx) = watch::channel(false);
        let delivered = Arc::new(AtomicU64::new(start.committed.unwrap_or(0)));
        self.shared.owned().insert(
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
        let mut assignment = Assignment::new(source.clone(), start.committed).with_lease(lease.clone());
        assignment.finished_above = start.finished_above;
        let _ = self
            .shared
            .events
            .control(SourceEvent::Assigned(vec![assignment]));
        tracing::info!(%source, committed = ?start.committed, "partition taken");
        // One pull must be able to carry the largest message the server accepts (its headers and
        // subjects included), or that message could never be read.
        let largest = self.connected.client.server_info().max_payload + 4096;
        PartitionTask::spawn(ReaderParts {
            source: source.clone(),
            js: self.connected.js.clone(),
            stream: start.stream,
            subject,
            start: start.committed.map(|w| w + 1),
            lease,
            member: self.me,
            partition: p,
            serial: self.serial.clone(),
            batch: self.shared.batch,
            max_bytes: self.shared.pull_bytes.max(largest),
            paused: paused_rx,
            delivered,
            events: self.shared.events.clone(),
        })
    }

    /// Forgets the partition (it is never committed again) and releases its lease — renewed
    /// until now — so the next owner may take it at once.
    async fn release(&mut self, source: &SourceId, _: Option<()>) {
        self.shared.owned().remove(source);
        let (topic, p) = topic_partition(source);
        self.leases.release(&topology::partition_key(topic, p)).await;
    }

    /// A lease ran out or was taken: the keeper told the engine of a partition's already; a
    /// lost token or presence is taken again by the next balance.
    async fn lost(&mut self) -> LockLoss {
        loop {
            let Some((key, source)) = self.lost.recv().await else {
                return std::future::pending().await;
            };
            if let Some(source) = source {
                return LockLoss::Partition {
                    source,
                    reported: true,
                };
            }
            if topology::is_token_key(&key) {
                return LockLoss::Token;
            }
        }
    }

    async fn leave(&mut self) {
        for key in self.leases.keys() {
            self.leases.release(&key).await;
        }
        tracing::info!(group = %self.shared.config.group, "left the group");
    }
}

/// Where a partition's reading starts.
pub(super) struct Start {
    committed: Option<Offset>,
    finished_above: Vec<Offset>,
    watermark_key: String,
    watermark_revision: u64,
    stream_created: i128,
    stream: async_nats::jetstream::stream::Stream,
}

/// Why a stored watermark was not taken as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hole {
    /// It does not fit the stream: reading starts at the stream's first message again.
    Reset(&'static str),
    /// Messages after it were deleted before the group read them: reading resumes at `first`,
    /// the first kept.
    Deleted { first: u64 },
}

/// The stored watermark where it still fits the stream, and what is wrong with it if anything.
/// A stream created since it was written (deleted and created again, restored from a backup)
/// or a watermark beyond the stream's last message (a purge, a lost unsynced tail) would make
/// reading start past messages never handled: such a watermark is reset and the partition read
/// from the stream's first message — a duplicate beats a silent loss. A watermark below the
/// stream's first kept message (its limits or a purge deleted messages the group never read)
/// is kept: reading resumes at the first kept message, and the loss is said.
fn checked_against_stream(
    stored: &WatermarkEntry,
    stream_created: i128,
    state: &async_nats::jetstream::stream::State,
) -> (Option<Offset>, Option<Hole>) {
    let Some(watermark) = stored.watermark else {
        return (None, None);
    };
    if stored.stream_created.is_some_and(|c| c != stream_created) {
        (
            None,
            Some(Hole::Reset("the stream was created again since it was written")),
        )
    } else if watermark > state.last_sequence {
        (None, Some(Hole::Reset("it is beyond the stream's last message")))
    } else if watermark + 1 < state.first_sequence {
        let first = state.first_sequence;
        (Some(watermark), Some(Hole::Deleted { first }))
    } else {
        (Some(watermark), None)
    }
}

/// Says a hole of `group` loudly (once, when the partition is claimed) and counts it
/// (`convoy_source_holes_total`).
fn report(group: &str, topic: &str, p: u32, watermark: Option<Offset>, hole: Hole) {
    let source = SourceId::partition(topic, p);
    match hole {
        Hole::Reset(why) => {
            tracing::error!(%source, group, watermark, "the committed watermark does not fit the stream ({why}): reading the partition from its first message again (what was handled before is handled again)");
            source_hole(group, &source, HoleReason::PastEnd);
        }
        Hole::Deleted { first } => {
            let gone = first - watermark.map_or(1, |w| w + 1);
            tracing::error!(%source, group, watermark, first_kept = first, "messages after the committed watermark were deleted before this group read them (the stream's limits, or a purge): up to {gone} of the stream's messages are lost, some of them possibly this partition's; reading on from the first kept");
            source_hole(group, &source, HoleReason::Deleted);
        }
    }
}

/// The member's life: serve until the subscription is closed, then say so. (Leases are per key,
/// so no session on NATS ends by losing every lock at once.)
pub(super) async fn run(shared: Arc<Shared>, mut member: GroupMember<Locks>) {
    while let Ended::Lost(why) = member.serve(&shared.departure).await {
        tracing::warn!(%why, "every partition lost; balancing again");
    }
    // Dropping the member ends the lease keeper (its lost-key receiver is gone).
    drop(member);
    shared.departure.left();
}
