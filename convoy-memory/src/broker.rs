//! An in-memory partitioned broker with consumer groups, for tests and benchmarks.
//!
//! Topics have partitions holding an append-only log. A consumer group assigns partitions to
//! its members round-robin and rebalances when members join or leave; moving a partition
//! revokes it from its owner first and hands it on only after the owner acknowledged (or
//! crashed, or missed the rebalance timeout). Committed positions belong to the group and
//! survive any member. Faults can be injected: fetch delays, small batches, offset gaps (like
//! Kafka's transaction markers), failing dead-letter publishes and commits, dropped
//! connections (the member's partitions are lost, then reassigned from their commits), and
//! log truncation (a partition rewritten from an offset, as after Kafka's unclean leader
//! election).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use convoy_core::partitioner::partition_for_key;
use convoy_core::transform::{StagingOutbox, Transaction};
use convoy_core::transport::{event_channel, EventReceiver, EventSender};
use convoy_core::transport::{Assignment, Commit, RevokeAck, SourceEvent};
use convoy_core::{Headers, Message, Offset, OutgoingMessage, Receipt, SourceId, TransportError};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Faults and limits applied by the broker; change them at any time with [`MemoryBroker::set_faults`].
#[derive(Clone, Debug)]
pub struct Faults {
    /// Sleep this long before handing each fetched round to a member.
    pub fetch_delay: Option<Duration>,
    /// At most this many messages per partition per fetch.
    pub max_batch: usize,
    /// Skip one offset after every this many published messages (offsets with holes).
    pub offset_gap_every: Option<u64>,
    /// Fail this many upcoming dead-letter publishes.
    pub fail_dead_letters: u32,
    /// Fail this many upcoming commits.
    pub fail_commits: u32,
    /// How long a member may take to acknowledge a revoke before the partitions are handed on
    /// anyway (the revoke's deadline) and the member is expelled.
    pub rebalance_timeout: Duration,
    /// How long after a member's connection dropped its partitions are handed on (Kafka's
    /// session timeout): the member is told at once that it lost them.
    pub session_timeout: Duration,
    /// Commits wait until then before they are answered (a coordinator that does not answer).
    pub hang_commits_until: Option<Instant>,
    /// Sources not fetched before the instant given (a slow partition leader).
    pub delayed_sources: BTreeMap<SourceId, Instant>,
    /// A transaction carrying more bytes of outputs than this is aborted, as Kafka aborts one
    /// that outlives `transaction.timeout.ms`.
    pub max_transaction_bytes: Option<usize>,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            fetch_delay: None,
            max_batch: 512,
            offset_gap_every: None,
            fail_dead_letters: 0,
            fail_commits: 0,
            rebalance_timeout: Duration::from_secs(60),
            session_timeout: Duration::ZERO,
            hang_commits_until: None,
            delayed_sources: BTreeMap::new(),
            max_transaction_bytes: None,
        }
    }
}

/// One stored message, kept compact (a benchmark holds a million of them): the usually
/// empty headers cost one pointer.
struct Record {
    offset: Offset,
    key: Option<Bytes>,
    payload: Bytes,
    headers: Option<Box<Headers>>,
}

impl Record {
    fn new(offset: Offset, message: OutgoingMessage) -> Self {
        Record {
            offset,
            key: message.key,
            payload: message.payload,
            headers: (!message.headers.is_empty()).then(|| Box::new(message.headers)),
        }
    }

    fn weight(&self) -> usize {
        self.key.as_ref().map_or(0, Bytes::len)
            + self.payload.len()
            + self
                .headers
                .as_deref()
                .map_or(0, |h| h.iter().map(|(n, v)| n.len() + v.len()).sum())
    }

    fn to_message(&self, source: &SourceId) -> Message {
        Message {
            key: self.key.clone(),
            payload: self.payload.clone(),
            headers: self.headers.as_deref().cloned().unwrap_or_default(),
            source: source.clone(),
            offset: self.offset,
        }
    }
}

/// A partition's append-only log in fixed-size segments: no reallocation while it grows and
/// no doubled capacity, so a million stored messages cost what they weigh.
#[derive(Default)]
struct Log {
    segments: Vec<Vec<Record>>,
}

const SEGMENT: usize = 4096;

impl Log {
    fn push(&mut self, record: Record) {
        match self.segments.last_mut() {
            Some(segment) if segment.len() < SEGMENT => segment.push(record),
            _ => {
                let mut segment = Vec::with_capacity(SEGMENT);
                segment.push(record);
                self.segments.push(segment);
            }
        }
    }

    fn last(&self) -> Option<&Record> {
        self.segments.last().and_then(|s| s.last())
    }

    /// Drops every record with an offset ≥ `offset`.
    fn truncate(&mut self, offset: Offset) {
        for segment in &mut self.segments {
            segment.retain(|r| r.offset < offset);
        }
        self.segments.retain(|s| !s.is_empty());
    }

    fn iter(&self) -> impl Iterator<Item = &Record> {
        self.segments.iter().flatten()
    }

    /// Up to `max` records with offsets ≥ `from`, in order.
    fn read_from(&self, from: Offset, max: usize) -> impl Iterator<Item = &Record> {
        let segment = self
            .segments
            .partition_point(|s| s.last().is_some_and(|r| r.offset < from));
        let start = self
            .segments
            .get(segment)
            .map_or(0, |s| s.partition_point(|r| r.offset < from));
        self.segments
            .get(segment..)
            .unwrap_or_default()
            .iter()
            .enumerate()
            .flat_map(move |(i, s)| s[if i == 0 { start } else { 0 }..].iter())
            .take(max)
    }
}

#[derive(Default)]
struct Partition {
    log: Log,
    next_offset: Offset,
    published: u64,
}

struct Topic {
    partitions: Vec<Partition>,
    round_robin: u32,
}

type TopicPartition = (String, u32);

/// Message batches buffered between a member and its engine. Small, so a pause takes effect
/// quickly (control events never wait for room).
pub const EVENT_CAPACITY: usize = 4;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Ownership {
    Owned(u64),
    Revoking(u64),
    /// Its owner's connection dropped: handed on once the session timeout passed.
    Lost(u64),
}

#[derive(Default)]
struct Group {
    topics: BTreeSet<String>,
    members: BTreeSet<u64>,
    /// Bumped by every rebalance that moves a partition (Kafka's group generation).
    generation: u64,
    owners: HashMap<TopicPartition, Ownership>,
    /// Per partition: the committed position (every offset below it finished) and the finished
    /// offsets above it.
    committed: HashMap<TopicPartition, (Offset, Vec<Offset>)>,
    /// Per partition: the token of its latest assignment. A commit carries the token of the
    /// assignment it was computed for; one of an earlier assignment is refused (Kafka fences
    /// a commit of an older generation), so a commit sent before a member lost a partition
    /// and got it back never lands on the new assignment.
    tokens: HashMap<TopicPartition, u64>,
    last_token: u64,
}

struct Cursor {
    next: Offset,
    paused: bool,
}

struct Member {
    group: String,
    assigned: BTreeMap<TopicPartition, Cursor>,
    pending: VecDeque<SourceEvent>,
    wake: Arc<Notify>,
    /// Its exactly-once outbox, if it commits in transactions: staged outputs go with the
    /// partitions it gives back or loses.
    outbox: Option<Arc<StagingOutbox>>,
    /// Its assignments' offsets count deliveries, not log positions (as an AMQP channel's).
    delivery_offsets: bool,
    /// The group generation it joined, and the revokes it has not acknowledged yet: a member
    /// still giving partitions back when another rebalance happens cannot rejoin it (Kafka's
    /// member is inside its revoke callback), so its generation goes stale until it has.
    generation: u64,
    revoking: usize,
    /// How often its connection dropped: a loss releases what it was giving back, so a revoke
    /// from before a loss no longer has anything to release.
    losses: u64,
}

/// How a member joins.
pub(crate) struct Joining {
    /// What a batch weighs at most (beyond its first message).
    pub batch_bytes: usize,
    pub outbox: Option<Arc<StagingOutbox>>,
    pub delivery_offsets: bool,
}

#[derive(Default)]
struct State {
    topics: HashMap<String, Topic>,
    /// Checkpoints of parked keys, by dead-letter topic and group.
    checkpoints: HashMap<(String, String, u32), Bytes>,
    groups: HashMap<String, Group>,
    members: HashMap<u64, Member>,
    next_member: u64,
}

struct Inner {
    state: Mutex<State>,
    data: Notify,
    faults: Mutex<Faults>,
    dead_letter_failures: AtomicU64,
    /// Revokes a live member did not acknowledge by their deadline.
    missed_revokes: AtomicU64,
}

/// The in-memory broker. Cheap to clone (shared state).
#[derive(Clone)]
pub struct MemoryBroker {
    inner: Arc<Inner>,
}

impl Default for MemoryBroker {
    fn default() -> Self {
        MemoryBroker::new()
    }
}

/// The source id of a topic-partition: `topic/partition`.
pub fn source_id(topic: &str, partition: u32) -> SourceId {
    SourceId::partition(topic, partition)
}

fn parse_source(source: &SourceId) -> Option<TopicPartition> {
    let (topic, partition) = source.topic_partition()?;
    Some((topic.to_owned(), partition))
}

/// A revoke waiting for its acknowledgement.
struct PendingRevoke {
    group: String,
    member: u64,
    partitions: Vec<TopicPartition>,
    deadline: Instant,
    ack: tokio::sync::oneshot::Receiver<()>,
    outbox: Option<Arc<StagingOutbox>>,
    /// The member's losses when the revoke started.
    losses: u64,
}

impl MemoryBroker {
    /// An empty broker.
    pub fn new() -> Self {
        MemoryBroker {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                data: Notify::new(),
                faults: Mutex::new(Faults::default()),
                dead_letter_failures: AtomicU64::new(0),
                missed_revokes: AtomicU64::new(0),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current faults.
    pub fn faults(&self) -> Faults {
        self.inner
            .faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Changes the faults.
    pub fn set_faults(&self, change: impl FnOnce(&mut Faults)) {
        change(&mut self.inner.faults.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Creates a topic (no-op if it exists).
    pub fn create_topic(&self, topic: &str, partitions: u32) {
        let mut state = self.state();
        state.topics.entry(topic.to_owned()).or_insert_with(|| Topic {
            partitions: (0..partitions.max(1)).map(|_| Partition::default()).collect(),
            round_robin: 0,
        });
    }

    /// Every topic with its partition count, by name.
    pub fn topics(&self) -> Vec<(String, u32)> {
        let mut topics: Vec<(String, u32)> = self
            .state()
            .topics
            .iter()
            .map(|(name, t)| (name.clone(), t.partitions.len() as u32))
            .collect();
        topics.sort();
        topics
    }

    /// Number of partitions of a topic, if it exists.
    pub fn partitions(&self, topic: &str) -> Option<u32> {
        self.state().topics.get(topic).map(|t| t.partitions.len() as u32)
    }

    /// Appends a message; keyed messages go to `murmur2(key) % partitions`, keyless ones (and
    /// those with the empty key) round robin.
    pub fn publish(&self, topic: &str, message: OutgoingMessage) -> Result<Receipt, TransportError> {
        let gap_every = self.faults().offset_gap_every;
        let receipt = append(&mut self.state(), topic, message, gap_every)?;
        self.inner.data.notify_waiters();
        Ok(receipt)
    }

    /// Every message of a topic, partition by partition, in offset order.
    pub fn read_all(&self, topic: &str) -> Vec<Message> {
        let state = self.state();
        let Some(t) = state.topics.get(topic) else {
            return Vec::new();
        };
        t.partitions
            .iter()
            .enumerate()
            .flat_map(|(i, p)| {
                let source = source_id(topic, i as u32);
                p.log.iter().map(move |r| r.to_message(&source))
            })
            .collect()
    }

    /// The records of `topic` from the offsets given per partition on (0 for a partition not
    /// named), and the offset after each partition's last record.
    pub fn read_from(
        &self,
        topic: &str,
        from: &BTreeMap<u32, Offset>,
    ) -> (Vec<Message>, BTreeMap<u32, Offset>) {
        let state = self.state();
        let Some(t) = state.topics.get(topic) else {
            return (Vec::new(), from.clone());
        };
        let mut records = Vec::new();
        let mut next = BTreeMap::new();
        for (i, p) in t.partitions.iter().enumerate() {
            let partition = i as u32;
            let start = from.get(&partition).copied().unwrap_or(0);
            let source = source_id(topic, partition);
            records.extend(
                p.log
                    .iter()
                    .filter(|r| r.offset >= start)
                    .map(|r| r.to_message(&source)),
            );
            next.insert(
                partition,
                p.log.last().map_or(start, |r| (r.offset + 1).max(start)),
            );
        }
        (records, next)
    }

    /// Keeps `checkpoint` as part `part` of `group`'s latest for dead-letter topic `topic`.
    pub fn save_checkpoint(&self, topic: &str, group: &str, part: u32, checkpoint: Bytes) {
        self.state()
            .checkpoints
            .insert((topic.to_owned(), group.to_owned(), part), checkpoint);
    }

    /// Part `part` of `group`'s latest checkpoint for dead-letter topic `topic`.
    pub fn load_checkpoint(&self, topic: &str, group: &str, part: u32) -> Option<Bytes> {
        self.state()
            .checkpoints
            .get(&(topic.to_owned(), group.to_owned(), part))
            .cloned()
    }

    /// The newest offset of each source, if the source exists and is not empty.
    pub fn last_offsets(&self, sources: &[SourceId]) -> Vec<Option<Offset>> {
        let state = self.state();
        sources
            .iter()
            .map(|s| {
                let (topic, partition) = parse_source(s)?;
                let p = state.topics.get(&topic)?.partitions.get(partition as usize)?;
                p.log.last().map(|r| r.offset)
            })
            .collect()
    }

    /// The group's committed watermark per source (sources committed at their very first
    /// offset, with nothing finished below it, have none).
    pub fn committed(&self, group: &str) -> BTreeMap<SourceId, Offset> {
        let state = self.state();
        state
            .groups
            .get(group)
            .map(|g| {
                g.committed
                    .iter()
                    .filter_map(|((t, p), (next, _))| Some((source_id(t, *p), next.checked_sub(1)?)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The group's commit of one source: the position and the finished offsets above it.
    pub fn committed_position(&self, group: &str, source: &SourceId) -> Option<(Offset, Vec<Offset>)> {
        let tp = parse_source(source)?;
        self.state().groups.get(group)?.committed.get(&tp).cloned()
    }

    /// Fault: the partition's log is truncated at `offset` (everything from it on is gone, as
    /// after an unclean leader election); the next message published there gets `offset` again.
    /// Members reading past the cut read on from it.
    pub fn truncate(&self, source: &SourceId, offset: Offset) {
        let Some((topic, partition)) = parse_source(source) else {
            return;
        };
        let mut state = self.state();
        let State { topics, members, .. } = &mut *state;
        let Some(p) = topics
            .get_mut(&topic)
            .and_then(|t| t.partitions.get_mut(partition as usize))
        else {
            return;
        };
        p.log.truncate(offset);
        p.next_offset = p.next_offset.min(offset);
        for m in members.values_mut() {
            if let Some(cursor) = m.assigned.get_mut(&(topic.clone(), partition)) {
                cursor.next = cursor.next.min(offset);
            }
        }
    }

    /// The members of a group now.
    pub fn members(&self, group: &str) -> Vec<u64> {
        self.state()
            .groups
            .get(group)
            .map(|g| g.members.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Which member owns which source in a group now (sources being revoked included).
    pub fn owners(&self, group: &str) -> BTreeMap<SourceId, u64> {
        self.state()
            .groups
            .get(group)
            .map(|g| {
                g.owners
                    .iter()
                    .map(|((t, p), o)| {
                        let m = match o {
                            Ownership::Owned(m) | Ownership::Revoking(m) | Ownership::Lost(m) => *m,
                        };
                        (source_id(t, *p), m)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Joins `group` on `topics` as a new member whose batches weigh at most `batch_bytes`
    /// (beyond their first message); returns its id and event stream.
    pub(crate) fn join(
        &self,
        group: &str,
        topics: &[String],
        joining: Joining,
    ) -> Result<(u64, EventReceiver), TransportError> {
        let Joining {
            batch_bytes,
            outbox,
            delivery_offsets,
        } = joining;
        let (tx, rx) = event_channel(EVENT_CAPACITY);
        let wake = Arc::new(Notify::new());
        let (id, revokes) = {
            let mut state = self.state();
            for topic in topics {
                if !state.topics.contains_key(topic) {
                    return Err(TransportError::broker(
                        format!("subscribe to `{topic}`"),
                        "unknown topic; create it first with MemoryBroker::create_topic",
                    ));
                }
            }
            let id = state.next_member;
            state.next_member += 1;
            state.members.insert(
                id,
                Member {
                    group: group.to_owned(),
                    assigned: BTreeMap::new(),
                    pending: VecDeque::new(),
                    wake: wake.clone(),
                    outbox,
                    delivery_offsets,
                    generation: 0,
                    revoking: 0,
                    losses: 0,
                },
            );
            let g = state.groups.entry(group.to_owned()).or_default();
            g.members.insert(id);
            g.topics.extend(topics.iter().cloned());
            let revokes = rebalance(&mut state, group, self.faults().rebalance_timeout);
            (id, revokes)
        };
        self.await_revokes(revokes);
        tokio::spawn(self.clone().member_loop(id, tx, wake, batch_bytes));
        Ok((id, rx))
    }

    /// Removes a member (graceful leave or crash: the broker cannot tell, like Kafka after a
    /// session timeout). Its sources are reassigned from the group's committed positions.
    pub(crate) fn leave(&self, member: u64) {
        let timeout = self.faults().rebalance_timeout;
        let revokes = {
            let mut state = self.state();
            let Some(m) = state.members.remove(&member) else {
                return;
            };
            m.wake.notify_one();
            let Some(g) = state.groups.get_mut(&m.group) else {
                return;
            };
            g.members.remove(&member);
            // A lost partition stays with the session until it expires.
            g.owners
                .retain(|_, o| !matches!(o, Ownership::Owned(x) | Ownership::Revoking(x) if *x == member));
            rebalance(&mut state, &m.group, timeout)
        };
        self.await_revokes(revokes);
    }

    /// Fault: the member's connection drops. Its sources are lost (no commit possible; the
    /// member is told at once), handed on once the session timeout passed, and the member
    /// rejoins and gets sources again from their committed positions.
    pub fn drop_connection(&self, member: u64) {
        let faults = self.faults();
        let group = {
            let mut state = self.state();
            let Some(m) = state.members.get_mut(&member) else {
                return;
            };
            std::mem::take(&mut m.assigned);
            m.losses += 1;
            let group = m.group.clone();
            // Everything it owns is lost, the partitions it is being asked to give back too.
            let mut lost = Vec::new();
            if let Some(g) = state.groups.get_mut(&group) {
                for (tp, owner) in g.owners.iter_mut() {
                    if matches!(owner, Ownership::Owned(x) | Ownership::Revoking(x) if *x == member) {
                        *owner = Ownership::Lost(member);
                        lost.push(source_id(&tp.0, tp.1));
                    }
                }
            }
            lost.sort();
            if let Some(m) = state.members.get_mut(&member) {
                if !lost.is_empty() {
                    m.pending.push_back(SourceEvent::Lost(lost));
                }
                m.wake.notify_one();
            }
            group
        };
        let broker = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(faults.session_timeout).await;
            let revokes = {
                let mut state = broker.state();
                if let Some(g) = state.groups.get_mut(&group) {
                    g.owners
                        .retain(|_, o| !matches!(o, Ownership::Lost(x) if *x == member));
                }
                rebalance(&mut state, &group, faults.rebalance_timeout)
            };
            broker.await_revokes(revokes);
        });
    }

    /// Revokes that a member still in the group did not acknowledge by their deadline.
    pub fn missed_revokes(&self) -> u64 {
        self.inner.missed_revokes.load(Relaxed)
    }

    /// Waits (in the background) for revoke acknowledgements, then hands the sources on.
    fn await_revokes(&self, revokes: Vec<PendingRevoke>) {
        for revoke in revokes {
            let broker = self.clone();
            tokio::spawn(async move {
                let answer = tokio::time::timeout_at(revoke.deadline, revoke.ack).await;
                let acked = matches!(answer, Ok(Ok(())));
                {
                    // Done with this revoke: once none is left the member rejoins the group's
                    // current generation.
                    let mut state = broker.state();
                    let State { groups, members, .. } = &mut *state;
                    if let Some(m) = members.get_mut(&revoke.member) {
                        m.revoking = m.revoking.saturating_sub(1);
                        if m.revoking == 0 {
                            m.generation = groups.get(&m.group).map_or(m.generation, |g| g.generation);
                        }
                    }
                    // The staged outputs of what it gave back go — unless its connection
                    // dropped meanwhile: the loss released them (in order with the member's
                    // events), and the partitions may be assigned to it again by now, so
                    // releasing them here would drop the new assignment's outputs while its
                    // offsets commit. Under the state lock, as assignments take ownership.
                    if let Some(outbox) = &revoke.outbox {
                        let lost = members
                            .get(&revoke.member)
                            .is_none_or(|m| m.losses != revoke.losses);
                        let still: Vec<SourceId> = if lost {
                            Vec::new()
                        } else {
                            revoke.partitions.iter().map(|(t, p)| source_id(t, *p)).collect()
                        };
                        tracing::trace!(member = revoke.member, sources = ?still, acked, "revoke over: staging released");
                        outbox.released(&still);
                    }
                }
                if answer.is_err() && broker.state().members.contains_key(&revoke.member) {
                    broker.inner.missed_revokes.fetch_add(1, Relaxed);
                }
                if !acked {
                    // Dropped ack (crash) or too slow: like Kafka, expel the member.
                    tracing::warn!(
                        member = revoke.member,
                        "member did not acknowledge a revoke; expelling it"
                    );
                    broker.leave(revoke.member);
                    return;
                }
                let timeout = broker.faults().rebalance_timeout;
                let more = {
                    let mut state = broker.state();
                    if let Some(g) = state.groups.get_mut(&revoke.group) {
                        for tp in &revoke.partitions {
                            if g.owners.get(tp) == Some(&Ownership::Revoking(revoke.member)) {
                                g.owners.remove(tp);
                            }
                        }
                    }
                    rebalance(&mut state, &revoke.group, timeout)
                };
                broker.await_revokes(more);
            });
        }
    }

    pub(crate) fn set_paused(
        &self,
        member: u64,
        sources: &[SourceId],
        paused: bool,
    ) -> Result<(), TransportError> {
        let mut state = self.state();
        let m = state.members.get_mut(&member).ok_or(TransportError::Closed)?;
        for s in sources {
            if let Some(tp) = parse_source(s) {
                if let Some(c) = m.assigned.get_mut(&tp) {
                    c.paused = paused;
                }
            }
        }
        if !paused {
            m.wake.notify_one();
        }
        Ok(())
    }

    /// Waits while commits hang (a fault), then commits.
    pub(crate) async fn commit_when_answered(
        &self,
        member: u64,
        commits: &[Commit],
    ) -> Result<(), TransportError> {
        while let Some(until) = self.faults().hang_commits_until.filter(|&u| Instant::now() < u) {
            tokio::time::sleep_until(until).await;
        }
        self.commit(member, commits)
    }

    /// Commits `transaction`'s positions and publishes its outputs, both or neither (a memory
    /// broker's transaction): what exactly-once transforms on `memory://` commit through.
    pub(crate) async fn commit_transaction(
        &self,
        member: u64,
        transaction: &Transaction,
    ) -> Result<(), TransportError> {
        while let Some(until) = self.faults().hang_commits_until.filter(|&u| Instant::now() < u) {
            tokio::time::sleep_until(until).await;
        }
        {
            let mut faults = self.inner.faults.lock().unwrap_or_else(|p| p.into_inner());
            if faults.fail_commits > 0 {
                faults.fail_commits -= 1;
                return Err(TransportError::Unavailable(
                    "injected transaction abort: its outputs and offsets go again with the next commit"
                        .into(),
                ));
            }
        }
        let faults = self.faults();
        if faults
            .max_transaction_bytes
            .is_some_and(|max| transaction.bytes > max)
        {
            return Err(TransportError::Unavailable(format!(
                "a transaction of {} bytes outlived its timeout and was aborted",
                transaction.bytes
            )));
        }
        let gap_every = faults.offset_gap_every;
        {
            let mut state = self.state();
            self.check_owner(&state, member, &transaction.commits)?;
            for output in transaction.outputs.iter().flat_map(|o| o.iter()) {
                append(&mut state, &output.topic, output.message.clone(), gap_every)?;
            }
            self.record_commits(&mut state, member, &transaction.commits);
            tracing::trace!(member, commits = ?transaction.commits, outputs = transaction.outputs.len(), "transaction committed");
        }
        self.inner.data.notify_waiters();
        Ok(())
    }

    /// Refuses commits of partitions `member` does not own (or is not giving back), and of
    /// partitions it owns while its generation is stale: as Kafka, a commit inside a revoke
    /// (of the partitions being revoked) is taken; another waits until the member rejoined.
    fn check_owner(&self, state: &State, member: u64, commits: &[Commit]) -> Result<(), TransportError> {
        let m = state.members.get(&member).ok_or(TransportError::Closed)?;
        let g = state.groups.get(&m.group).ok_or(TransportError::Closed)?;
        for c in commits {
            let tp = parse_source(&c.source).ok_or_else(|| TransportError::NotOwner(c.source.clone()))?;
            match g.owners.get(&tp) {
                Some(Ownership::Revoking(owner)) if *owner == member => {}
                Some(Ownership::Owned(owner)) if *owner == member && m.generation == g.generation => {}
                Some(Ownership::Owned(owner)) if *owner == member => {
                    return Err(TransportError::Unavailable(format!(
                        "illegal generation: member {member} is at generation {} while the group is at {} (it rejoins once it acknowledged its revoke)",
                        m.generation, g.generation
                    )))
                }
                _ => return Err(TransportError::NotOwner(c.source.clone())),
            }
            if g.tokens.get(&tp) != Some(&c.token) {
                return Err(TransportError::Unavailable(format!(
                    "a commit of an earlier assignment of {}: the member lost it and was given it again since; not applied",
                    c.source
                )));
            }
        }
        Ok(())
    }

    fn record_commits(&self, state: &mut State, member: u64, commits: &[Commit]) {
        let Some(group) = state.members.get(&member).map(|m| m.group.clone()) else {
            return;
        };
        if let Some(g) = state.groups.get_mut(&group) {
            for c in commits {
                if let Some(tp) = parse_source(&c.source) {
                    g.committed.insert(tp, (c.next, c.finished_above.clone()));
                }
            }
        }
    }

    pub(crate) fn commit(&self, member: u64, commits: &[Commit]) -> Result<(), TransportError> {
        {
            let mut faults = self.inner.faults.lock().unwrap_or_else(|p| p.into_inner());
            if faults.fail_commits > 0 {
                faults.fail_commits -= 1;
                return Err(TransportError::Unavailable("injected commit failure".into()));
            }
        }
        let mut state = self.state();
        self.check_owner(&state, member, commits)?;
        self.record_commits(&mut state, member, commits);
        Ok(())
    }

    pub(crate) fn take_dead_letter_failure(&self) -> bool {
        let mut faults = self.inner.faults.lock().unwrap_or_else(|p| p.into_inner());
        if faults.fail_dead_letters > 0 {
            faults.fail_dead_letters -= 1;
            self.inner.dead_letter_failures.fetch_add(1, Relaxed);
            true
        } else {
            false
        }
    }

    /// How many dead-letter publishes were failed by injection so far.
    pub fn injected_dead_letter_failures(&self) -> u64 {
        self.inner.dead_letter_failures.load(Relaxed)
    }

    /// A member's fetch loop: control events first, then one batch from the next unpaused
    /// source with data, taken under one lock so events reach the engine in a consistent
    /// order. One batch per round keeps what arrives after a pause to at most the
    /// `EVENT_CAPACITY` queued batches plus the one held while waiting to send.
    async fn member_loop(self, id: u64, tx: EventSender, wake: Arc<Notify>, batch_bytes: usize) {
        let mut next_partition = 0usize;
        loop {
            let data = self.inner.data.notified();
            tokio::pin!(data);
            data.as_mut().enable();
            let faults = self.faults();
            let mut delayed_until: Option<Instant> = None;
            let out = {
                let mut state = self.state();
                let State { topics, members, .. } = &mut *state;
                let Some(member) = members.get_mut(&id) else {
                    return; // left or expelled
                };
                let mut out: Vec<SourceEvent> = member.pending.drain(..).collect();
                if let Some(outbox) = &member.outbox {
                    for event in &out {
                        match event {
                            SourceEvent::Assigned(list) => {
                                for a in list {
                                    tracing::trace!(member = id, source = %a.source, "staging owns");
                                    outbox.assigned(&a.source, a.committed.map(|c| c + 1));
                                }
                            }
                            SourceEvent::Lost(sources) => {
                                tracing::trace!(member = id, ?sources, "lost: staging released");
                                outbox.released(sources)
                            }
                            _ => {}
                        }
                    }
                }
                let count = member.assigned.len();
                let now = Instant::now();
                for i in 0..count {
                    let index = (next_partition + i) % count;
                    let Some(((topic, partition), cursor)) = member.assigned.iter_mut().nth(index) else {
                        break;
                    };
                    if cursor.paused {
                        continue;
                    }
                    let source = source_id(topic, *partition);
                    if let Some(&until) = faults.delayed_sources.get(&source).filter(|&&u| now < u) {
                        delayed_until = Some(delayed_until.map_or(until, |d: Instant| d.min(until)));
                        continue;
                    }
                    let Some(p) = topics
                        .get(topic)
                        .and_then(|t| t.partitions.get(*partition as usize))
                    else {
                        continue;
                    };
                    let mut weight = 0usize;
                    let mut messages = tx.batch_buffer();
                    messages.extend(
                        p.log
                            .read_from(cursor.next, faults.max_batch.max(1))
                            .take_while(|r| {
                                let fits = weight < batch_bytes;
                                weight += r.weight();
                                fits
                            })
                            .map(|r| r.to_message(&source)),
                    );
                    let Some(last) = messages.last() else {
                        continue;
                    };
                    cursor.next = last.offset + 1;
                    out.push(SourceEvent::Messages { source, messages });
                    next_partition = index + 1;
                    break;
                }
                out
            };
            if out.is_empty() {
                // Biased: the order of the branches, not a random draw, decides (simulations
                // replay a run exactly).
                tokio::select! {
                    biased;
                    _ = tx.closed() => { self.leave(id); return; }
                    _ = wake.notified() => {}
                    _ = data => {}
                    _ = tokio::time::sleep_until(delayed_until.unwrap_or_else(Instant::now)), if delayed_until.is_some() => {}
                }
                continue;
            }
            if let Some(delay) = faults.fetch_delay {
                tokio::time::sleep(delay).await;
            }
            for event in out {
                let sent = match event {
                    SourceEvent::Messages { source, messages } => tx.messages(source, messages).await.is_ok(),
                    control => tx.control(control).is_ok(),
                };
                if !sent {
                    self.leave(id); // the consumer went away without closing: a crash
                    return;
                }
            }
        }
    }
}

/// Appends `message` to `topic` (keyed: `murmur2(key) % partitions`; keyless or the empty key:
/// round robin), skipping an offset every `gap_every` messages.
fn append(
    state: &mut State,
    topic: &str,
    message: OutgoingMessage,
    gap_every: Option<u64>,
) -> Result<Receipt, TransportError> {
    let t = state.topics.get_mut(topic).ok_or_else(|| {
        TransportError::broker(
            format!("publish to `{topic}`"),
            "unknown topic; create it first with MemoryBroker::create_topic",
        )
    })?;
    let n = t.partitions.len() as u32;
    // The empty key is no key (as convoy's NATS and RabbitMQ publishers take it).
    let partition = match message.key.as_ref().filter(|k| !k.is_empty()) {
        Some(key) => partition_for_key(key, n),
        None => {
            t.round_robin = t.round_robin.wrapping_add(1);
            t.round_robin % n
        }
    };
    let p = &mut t.partitions[partition as usize];
    p.published += 1;
    if gap_every.is_some_and(|every| every > 0 && p.published % every == 0) {
        p.next_offset += 1; // a hole, like a Kafka transaction marker
    }
    let offset = p.next_offset;
    p.next_offset += 1;
    p.log.push(Record::new(offset, message));
    Ok(Receipt {
        source: source_id(topic, partition),
        offset,
    })
}

/// Moves the group toward a round-robin assignment of its partitions over its members.
/// Unowned partitions are assigned at once; owned ones that must move are revoked first.
fn rebalance(state: &mut State, group: &str, rebalance_timeout: Duration) -> Vec<PendingRevoke> {
    let State {
        topics,
        groups,
        members,
        ..
    } = state;
    let Some(g) = groups.get_mut(group) else {
        return Vec::new();
    };
    let live: Vec<u64> = g.members.iter().copied().collect();
    if live.is_empty() {
        return Vec::new();
    }
    let partitions: Vec<TopicPartition> = g
        .topics
        .iter()
        .flat_map(|t| {
            let n = topics.get(t).map_or(0, |t| t.partitions.len() as u32);
            (0..n).map(move |p| (t.clone(), p))
        })
        .collect();
    let mut assigned: BTreeMap<u64, Vec<Assignment>> = BTreeMap::new();
    let mut revoked: BTreeMap<u64, Vec<TopicPartition>> = BTreeMap::new();
    for (i, tp) in partitions.iter().enumerate() {
        let target = live[i % live.len()];
        match g.owners.get(tp).copied() {
            None => {
                let (next, finished_above) = match g.committed.get(tp) {
                    Some((next, above)) => (*next, above.clone()),
                    None => (0, Vec::new()),
                };
                if let Some(m) = members.get_mut(&target) {
                    m.assigned.insert(tp.clone(), Cursor { next, paused: false });
                    g.owners.insert(tp.clone(), Ownership::Owned(target));
                    g.last_token += 1;
                    g.tokens.insert(tp.clone(), g.last_token);
                    let mut assignment = Assignment {
                        finished_above,
                        ..Assignment::new(source_id(&tp.0, tp.1), next.checked_sub(1))
                    }
                    .with_token(g.last_token);
                    if m.delivery_offsets {
                        assignment = assignment.with_delivery_offsets();
                    }
                    assigned.entry(target).or_default().push(assignment);
                }
            }
            Some(Ownership::Owned(owner)) if owner != target => {
                if let Some(m) = members.get_mut(&owner) {
                    m.assigned.remove(tp);
                }
                g.owners.insert(tp.clone(), Ownership::Revoking(owner));
                revoked.entry(owner).or_default().push(tp.clone());
            }
            Some(_) => {}
        }
    }
    if !assigned.is_empty() || !revoked.is_empty() {
        g.generation += 1;
    }
    // Members still inside an earlier revoke cannot rejoin: their generation goes stale.
    for id in &live {
        if let Some(m) = members.get_mut(id).filter(|m| m.revoking == 0) {
            m.generation = g.generation;
        }
    }
    let mut pending = Vec::new();
    let deadline = Instant::now() + rebalance_timeout;
    for (member, partitions) in revoked {
        let (ack, rx) = RevokeAck::new();
        let outbox = members.get(&member).and_then(|m| m.outbox.clone());
        let losses = members.get(&member).map_or(0, |m| m.losses);
        if let Some(m) = members.get_mut(&member) {
            m.revoking += 1;
            m.pending.push_back(SourceEvent::Revoked {
                sources: partitions.iter().map(|(t, p)| source_id(t, *p)).collect(),
                deadline,
                ack,
            });
            m.wake.notify_one();
        }
        pending.push(PendingRevoke {
            group: group.to_owned(),
            member,
            partitions,
            deadline,
            ack: rx,
            outbox,
            losses,
        });
    }
    for (member, list) in assigned {
        if let Some(m) = members.get_mut(&member) {
            m.pending.push_back(SourceEvent::Assigned(list));
            m.wake.notify_one();
        }
    }
    pending
}
