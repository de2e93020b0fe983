//! A shard: one task owning many lanes (one FIFO per active key).
//!
//! At most one message of a lane is in flight; lanes of a shard run concurrently (the shard
//! polls their futures itself: [`LaneTasks`]), shards run in parallel on the runtime's threads.
//! A lane exists only while its key has work: it is removed as soon as its queue empties,
//! so memory follows the active keys, never every key ever seen.
//!
//! Cancelling drops a lane future at once (the shard owns it), before anyone hears back: a
//! cancelled handler is gone, not merely asleep, when its source is handed to another member.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::inspect::{top_by, LaneView};
use super::job::{Job, Task};
use super::lane::{Outcome, PositionId, ShardContext};
use super::run::{RunItem, RunTask};
use super::tasks::{Ended, LaneTasks};
use crate::message::Message;
use crate::spares::Spares;
use crate::transport::{Lease, TransportError};
use crate::watermark::Seq;

/// Identifies a lane inside a shard.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LaneKey {
    /// A keyed message's lane.
    Key(Bytes),
    /// The lane of a source's keyless messages (by the source's assignment epoch).
    Source(u64),
    /// A lane of its own for one unordered keyless message.
    Solo(u64),
    /// A lane of its own for a stuck message taken out of its key's queue to be dead-lettered.
    Detached(u64),
}

/// Which lane a routed message joins. A keyed message's lane key is the message's own key:
/// it is copied once when its lane is created, not for every message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum LaneOf {
    /// The lane of the message's key.
    Key,
    /// The lane of a source's keyless messages (by the source's assignment epoch).
    Source(u64),
    /// A lane of its own for one unordered keyless message.
    Solo(u64),
}

/// The shard of a lane whose key hashed to `hash`. The middle bits choose it: a shard's lane
/// table uses the low bits (bucket) and the top seven (tag) of the same hash, which must stay
/// spread among the lanes of one shard.
pub(crate) fn shard_of(hash: u64, shards: usize) -> usize {
    (hash >> 32) as usize % shards
}

/// A message routed to a shard.
pub(crate) struct Work {
    pub message: Message,
    pub lane: LaneOf,
    /// The lane key's hash (the intake's; the shard's table uses it as is).
    pub hash: u64,
    pub slot: u32,
    pub epoch: u64,
    pub seq: Seq,
    /// What the message weighs for back-pressure (bytes).
    pub weight: usize,
    /// What may be done with an id derived from the message's position.
    pub position_id: PositionId,
    pub received: Instant,
    /// The source's lease, when it is held by one: no attempt starts once it ran out.
    pub lease: Option<Lease>,
}

impl Work {
    /// The key of the lane this work joins (made when the lane is created).
    fn lane_key(&self) -> LaneKey {
        match self.lane {
            LaneOf::Key => LaneKey::Key(self.message.ordering_key().cloned().unwrap_or_default()),
            LaneOf::Source(epoch) => LaneKey::Source(epoch),
            LaneOf::Solo(n) => LaneKey::Solo(n),
        }
    }

    /// True if this work belongs to the lane `key`.
    fn joins(&self, key: &LaneKey) -> bool {
        match (self.lane, key) {
            (LaneOf::Key, LaneKey::Key(k)) => self.message.ordering_key() == Some(k),
            (LaneOf::Source(a), LaneKey::Source(b)) | (LaneOf::Solo(a), LaneKey::Solo(b)) => a == *b,
            _ => false,
        }
    }
}

/// Emptied batch buffers of both directions, shared by the intake and the shards.
#[derive(Clone)]
pub(crate) struct BatchSpares {
    pub work: Spares<Work>,
    pub completions: Spares<Completion>,
}

impl BatchSpares {
    pub fn new(shards: usize) -> Self {
        // A few per shard: the intake may route several batches before a shard runs.
        BatchSpares {
            work: Spares::new(4 * shards),
            completions: Spares::new(4 * shards),
        }
    }
}

/// A finished message reported back to the intake for the watermark.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completion {
    pub slot: u32,
    pub weight: u32,
    pub epoch: u64,
    pub seq: Seq,
}

impl Completion {
    /// The completion of a message of `weight` bytes (saturated to `u32`).
    fn of(slot: u32, weight: usize, epoch: u64, seq: Seq) -> Self {
        Completion {
            slot,
            weight: u32::try_from(weight).unwrap_or(u32::MAX),
            epoch,
            seq,
        }
    }
}

/// What a shard tells the intake. Answers to the intake's commands come this way too, behind
/// the completions the shard sent before them, so the intake never waits for a shard.
pub(crate) enum ShardReport {
    /// Messages finished.
    Completions(Vec<Completion>),
    /// Queued messages dropped (an answer to [`ShardCommand::DropQueued`]): per assignment,
    /// how many and what they weighed.
    Dropped(Vec<(u64, Dropped)>),
    /// Every in-flight message of the assignments named by cancel request `.0` is gone (an
    /// answer to [`ShardCommand::Cancel`]): no handler of them is alive any more.
    Cancelled(u64),
    /// A lane met an error nothing can retry (e.g. the dead-letter sink's client is fenced):
    /// the engine must stop.
    Fatal(TransportError),
}

/// Queued messages dropped for one assignment: how many and what they weighed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Dropped {
    pub count: usize,
    pub weight: usize,
}

/// Which assignments a command is about.
#[derive(Clone, Debug)]
pub(crate) enum Epochs {
    All,
    Some(Vec<u64>),
}

impl Epochs {
    fn contains(&self, epoch: u64) -> bool {
        match self {
            Epochs::All => true,
            Epochs::Some(e) => e.contains(&epoch),
        }
    }
}

pub(crate) enum ShardCommand {
    Work(Vec<Work>),
    /// Drop queued (not started) messages of these assignments; answered with
    /// [`ShardReport::Dropped`].
    DropQueued {
        epochs: Epochs,
    },
    /// Drop queued and abort in-flight messages of these assignments (their completions are
    /// never reported); answered with [`ShardReport::Dropped`] (if any was queued), then
    /// [`ShardReport::Cancelled`] and the request's number.
    Cancel {
        epochs: Epochs,
        request: u64,
    },
    /// Cancel this message wherever it is and dead-letter it with reason `stuck`.
    Stuck {
        epoch: u64,
        seq: Seq,
        waited: std::time::Duration,
    },
    /// Dead-letter, as stuck, every message whose handling started at least `limit` ago and
    /// has not finished (a hung call, or retries that never end), each lane on its own.
    CheckStuck {
        limit: std::time::Duration,
    },
    /// Report the `top` lanes whose head runs longest and the `top` with the most queued.
    Inspect {
        top: usize,
        reply: oneshot::Sender<(Vec<LaneView>, Vec<LaneView>)>,
    },
    /// An operator's pause (or resume) of a key: its lane starts no message while paused
    /// (the one in flight finishes). Answered once applied.
    PauseKey {
        key: Bytes,
        hash: u64,
        pause: bool,
        reply: oneshot::Sender<()>,
    },
}

struct InFlight {
    /// Its future's number in the shard's [`LaneTasks`].
    task: u32,
    slot: u32,
    epoch: u64,
    seq: Seq,
    weight: usize,
    message: Arc<Message>,
    /// Its source's lease, if held by one (a stuck message's dead letter checks it).
    lease: Option<Lease>,
    /// What may be done with an id derived from its position (a stuck message's dead letter
    /// is known by it).
    position_id: PositionId,
    /// When its handling started; `None` for a stuck message's dead letter.
    started: Option<Instant>,
    /// The rest of its run, when it heads one (a batch handler's).
    run: Option<Box<Run>>,
}

/// The messages of a run after its head, and how many of the run are finished so far.
struct Run {
    followers: Vec<Follower>,
    finished: Arc<AtomicUsize>,
}

/// A message of a run after its head (same lane, same assignment and lease as the head).
struct Follower {
    lane: LaneOf,
    slot: u32,
    seq: Seq,
    weight: usize,
    position_id: PositionId,
    received: Instant,
    message: Arc<Message>,
}

impl InFlight {
    fn completion(&self) -> Completion {
        Completion::of(self.slot, self.weight, self.epoch, self.seq)
    }

    /// The first message of the job not finished yet: its sequence number and the message.
    fn first_unfinished(&self) -> (Seq, &Arc<Message>) {
        let finished = self.run.as_ref().map_or(0, |r| r.finished.load(Relaxed));
        match self
            .run
            .as_ref()
            .and_then(|r| r.followers.get(finished.checked_sub(1)?))
        {
            Some(f) => (f.seq, &f.message),
            None => (self.seq, &self.message),
        }
    }

    /// True if the job handles message `seq` of assignment `epoch`.
    fn holds(&self, epoch: u64, seq: Seq) -> bool {
        self.epoch == epoch
            && (self.seq == seq
                || self
                    .run
                    .as_ref()
                    .is_some_and(|r| r.followers.iter().any(|f| f.seq == seq)))
    }
}

/// Completes what `busy`'s run finished: its head, then its followers, in order.
fn complete_run(pending: &mut Vec<Completion>, busy: &InFlight) {
    let Some(run) = busy.run.as_ref() else {
        return;
    };
    let done = run.finished.load(Relaxed);
    if done == 0 {
        return;
    }
    pending.push(busy.completion());
    pending.extend(
        run.followers
            .iter()
            .take(done - 1)
            .map(|f| Completion::of(f.slot, f.weight, busy.epoch, f.seq)),
    );
}

/// A stuck message taken out of its run, to be dead-lettered.
struct Stuck {
    slot: u32,
    weight: usize,
    message: Arc<Message>,
    lease: Option<Lease>,
    position_id: PositionId,
}

/// How many messages of a key a run holds, at most, and their payload bytes.
#[derive(Clone, Copy)]
struct RunLimits {
    per_key: usize,
    max_bytes: usize,
}

struct Lane {
    key: LaneKey,
    hash: u64,
    queue: VecDeque<Work>,
    busy: Option<InFlight>,
    /// Assignments one of whose messages was taken out of the queue as stuck and is being
    /// dead-lettered on a lane of its own (once per such message): their next messages wait
    /// for it (they must not overtake it), the other sources' messages of the key do not.
    blocked: Vec<u64>,
    /// On a detached lane: the lane its message was taken from (key and hash) and the
    /// assignment it blocks there, to unblock once the dead letter is done (or cancelled).
    unblocks: Option<(LaneKey, u64, u64)>,
    /// An operator paused the key: nothing starts until it is resumed.
    paused: bool,
}

impl Lane {
    fn new(key: LaneKey, hash: u64) -> Self {
        Lane {
            key,
            hash,
            queue: VecDeque::new(),
            busy: None,
            blocked: Vec::new(),
            unblocks: None,
            paused: false,
        }
    }

    /// True when the lane may start its next queued message now.
    fn may_start(&self) -> bool {
        self.busy.is_none()
            && !self.paused
            && self
                .queue
                .front()
                .is_some_and(|w| !self.blocked.contains(&w.epoch))
    }

    /// True when nothing runs, waits or depends on the lane any more (a blocked lane stays, so
    /// that its assignment's next message, arriving later, still waits).
    fn is_idle(&self) -> bool {
        self.busy.is_none() && self.queue.is_empty() && self.blocked.is_empty()
    }
}

/// The lanes of a shard by key, each stored with its key's hash (computed once, by the intake).
#[derive(Default)]
struct Lanes(HashTable<Lane>);

impl Lanes {
    fn entry(&mut self, key: &LaneKey, hash: u64) -> Entry<'_, Lane> {
        self.0
            .entry(hash, |l| l.hash == hash && l.key == *key, |l| l.hash)
    }

    fn get_mut(&mut self, key: &LaneKey, hash: u64) -> Option<&mut Lane> {
        self.0.find_mut(hash, |l| l.hash == hash && l.key == *key)
    }
}

/// Completions are sent in batches of at most this many.
const FLUSH_AT: usize = 1024;

/// Rounds of polling a shard runs before it yields to the runtime (whose cooperative budget
/// its lane futures share: once spent, they are woken at once without progress until it does).
const ROUNDS_BEFORE_YIELD: usize = 16;

pub(crate) struct Shard<F> {
    commands: mpsc::UnboundedReceiver<ShardCommand>,
    reports: mpsc::UnboundedSender<ShardReport>,
    lanes: Lanes,
    launcher: Launcher<F>,
    pending: Vec<Completion>,
    /// Emptied buffers, shared with the intake.
    spares: BatchSpares,
    /// Lane futures that ended, to be handled (kept to reuse its allocation).
    ended: Vec<Ended<Outcome>>,
    /// Lanes made for stuck messages so far (names the next one).
    detached: u64,
    /// Keys an operator paused (their lanes are made paused; empty almost always, so the
    /// check costs nothing then).
    paused: HashSet<Bytes>,
}

/// Starts lane futures; kept apart from the lane map so both can be borrowed at once.
struct Launcher<F> {
    tasks: LaneTasks<F>,
    /// Makes a job's future (`job::run`: a function, so the future's type is known and it is
    /// kept inline in its slot, not boxed).
    make: fn(Job) -> F,
    shard: Arc<ShardContext>,
    /// Set for a batch handler whose batches may hold several messages of a key.
    runs: Option<(Arc<crate::batch::Batched>, RunLimits)>,
}

/// How a lane future is identified in the shard.
struct Launch {
    hash: u64,
    slot: u32,
    epoch: u64,
    seq: Seq,
    weight: usize,
}

impl<F: Future<Output = Outcome>> Launcher<F> {
    /// Starts `work` as the in-flight message of its lane.
    fn start(&mut self, work: Work) -> InFlight {
        let launch = Launch {
            hash: work.hash,
            slot: work.slot,
            epoch: work.epoch,
            seq: work.seq,
            weight: work.weight,
        };
        let task = Task::Handle {
            position_id: work.position_id,
            received: work.received,
            lease: work.lease,
        };
        self.launch(launch, Arc::new(work.message), task)
    }

    /// Starts the next message of `queue` as its lane's in-flight job: with runs, together with
    /// the messages of the same assignment queued behind it, within the run's bounds.
    fn start_next(&mut self, queue: &mut VecDeque<Work>) -> Option<InFlight> {
        let head = queue.pop_front()?;
        let Some((batched, limits)) = self.runs.clone() else {
            return Some(self.start(head));
        };
        let mut bytes = head.message.payload.len();
        let mut followers = Vec::new();
        while followers.len() + 1 < limits.per_key {
            let fits = queue.front().is_some_and(|next| {
                next.epoch == head.epoch && bytes + next.message.payload.len() <= limits.max_bytes
            });
            let Some(next) = queue.pop_front().filter(|_| fits) else {
                break;
            };
            bytes += next.message.payload.len();
            followers.push(Follower {
                lane: next.lane,
                slot: next.slot,
                seq: next.seq,
                weight: next.weight,
                position_id: next.position_id,
                received: next.received,
                message: Arc::new(next.message),
            });
        }
        if followers.is_empty() {
            return Some(self.start(head));
        }
        Some(self.start_run(head, followers, batched))
    }

    /// Starts `head` and `followers` as one run.
    fn start_run(
        &mut self,
        head: Work,
        followers: Vec<Follower>,
        batched: Arc<crate::batch::Batched>,
    ) -> InFlight {
        let message = Arc::new(head.message);
        let items = std::iter::once(RunItem {
            message: message.clone(),
            position_id: head.position_id,
            received: head.received,
        })
        .chain(followers.iter().map(|f| RunItem {
            message: f.message.clone(),
            position_id: f.position_id,
            received: f.received,
        }))
        .collect();
        let finished = Arc::new(AtomicUsize::new(0));
        let launch = Launch {
            hash: head.hash,
            slot: head.slot,
            epoch: head.epoch,
            seq: head.seq,
            weight: head.weight,
        };
        let task = Task::Run(Box::new(RunTask {
            items,
            batched,
            lease: head.lease,
            finished: finished.clone(),
        }));
        let mut in_flight = self.launch(launch, message, task);
        in_flight.run = Some(Box::new(Run { followers, finished }));
        in_flight
    }

    /// Starts `task` for `message` as the in-flight job of the lane of `launch.hash`.
    fn launch(&mut self, launch: Launch, message: Arc<Message>, task: Task) -> InFlight {
        let (lease, started, position_id) = match &task {
            Task::Handle {
                lease, position_id, ..
            } => (lease.clone(), Some(Instant::now()), *position_id),
            Task::Run(run) => (
                run.lease.clone(),
                Some(Instant::now()),
                run.items.first().map_or(PositionId::None, |i| i.position_id),
            ),
            Task::DeadLetter {
                lease, position_id, ..
            } => (lease.clone(), None, *position_id),
        };
        let job = Job {
            shard: self.shard.clone(),
            message: message.clone(),
            task,
        };
        let task = self.tasks.start(launch.hash, (self.make)(job));
        InFlight {
            task,
            slot: launch.slot,
            epoch: launch.epoch,
            seq: launch.seq,
            weight: launch.weight,
            message,
            lease,
            position_id,
            started,
            run: None,
        }
    }
}

impl<F: Future<Output = Outcome>> Shard<F> {
    pub fn new(
        commands: mpsc::UnboundedReceiver<ShardCommand>,
        reports: mpsc::UnboundedSender<ShardReport>,
        shard: ShardContext,
        make: fn(Job) -> F,
        spares: BatchSpares,
    ) -> Self {
        Shard {
            commands,
            reports,
            lanes: Lanes::default(),
            launcher: Launcher {
                tasks: LaneTasks::new(),
                make,
                runs: shard.ctx.runs.as_ref().map(|batched| {
                    let config = batched.config();
                    let limits = RunLimits {
                        per_key: config.per_key,
                        max_bytes: config.max_bytes,
                    };
                    (batched.clone(), limits)
                }),
                shard: Arc::new(shard),
            },
            pending: Vec::new(),
            spares,
            ended: Vec::new(),
            detached: 0,
            paused: HashSet::new(),
        }
    }

    /// Runs until the intake drops its command sender.
    pub async fn run(mut self) {
        loop {
            let next = std::future::poll_fn(|cx| {
                if self.launcher.tasks.poll_ready(cx).is_ready() {
                    return Poll::Ready(Some(None));
                }
                self.commands.poll_recv(cx).map(|c| c.map(Some))
            })
            .await;
            match next {
                None => break,
                Some(Some(command)) => self.on_command(command),
                Some(None) => {}
            }
            // Take everything already ready before reporting, so completions travel in batches.
            let mut rounds = 0;
            loop {
                let mut progressed = false;
                while let Ok(command) = self.commands.try_recv() {
                    self.on_command(command);
                    progressed = true;
                }
                let mut ended = std::mem::take(&mut self.ended);
                progressed |= self.launcher.tasks.poll_round(&mut ended);
                self.finish(ended);
                if !progressed {
                    break;
                }
                rounds += 1;
                if rounds == ROUNDS_BEFORE_YIELD {
                    self.flush();
                    tokio::task::yield_now().await;
                    rounds = 0;
                }
            }
            self.flush();
        }
        self.flush();
    }

    /// Handles the lane futures in `ended`, then polls the ones that started meanwhile (the
    /// next messages of their lanes), until none is left; keeps `ended`'s allocation for the
    /// next round (it is taken out of `self` while the shard is borrowed to handle it).
    fn finish(&mut self, mut ended: Vec<Ended<Outcome>>) {
        loop {
            for end in ended.drain(..) {
                self.on_finished(end);
            }
            if !self.launcher.tasks.poll_fresh(&mut ended) {
                break;
            }
        }
        self.ended = ended;
    }

    /// Polls the lane futures started since the last poll right away: a message whose handler
    /// does not wait is done before the next is taken, and what it allocated is freed while
    /// it is still in the allocator's per-thread cache.
    fn settle(&mut self) {
        let mut ended = std::mem::take(&mut self.ended);
        self.launcher.tasks.poll_fresh(&mut ended);
        self.finish(ended);
    }

    fn flush(&mut self) {
        self.launcher.shard.stats.lanes.store(self.lanes.0.len(), Relaxed);
        if !self.pending.is_empty() {
            // The intake is gone only when the engine is shutting down; nothing to report then.
            let batch = std::mem::replace(&mut self.pending, self.spares.completions.take());
            let _ = self.reports.send(ShardReport::Completions(batch));
        }
    }

    fn on_command(&mut self, command: ShardCommand) {
        match command {
            ShardCommand::Work(mut batch) => {
                for work in batch.drain(..) {
                    self.enqueue(work);
                    self.settle();
                }
                self.spares.work.keep(batch);
            }
            ShardCommand::DropQueued { epochs } => {
                let dropped = self.drop_queued(&epochs);
                let _ = self.reports.send(ShardReport::Dropped(dropped));
            }
            ShardCommand::Cancel { epochs, request } => {
                // What is queued of them goes too, first: cancelling a lane's head would start
                // the next message of a cancelled assignment otherwise.
                let dropped = self.drop_queued(&epochs);
                if !dropped.is_empty() {
                    let _ = self.reports.send(ShardReport::Dropped(dropped));
                }
                // Dropped here: no handler of a cancelled message is alive when the intake hears
                // back. What finished before goes first, so the intake counts it.
                self.cancel(&epochs);
                self.flush();
                let _ = self.reports.send(ShardReport::Cancelled(request));
            }
            ShardCommand::Stuck { epoch, seq, waited } => {
                self.stuck(epoch, seq, waited);
            }
            ShardCommand::Inspect { top, reply } => {
                let _ = reply.send(self.inspect(top));
            }
            ShardCommand::PauseKey {
                key,
                hash,
                pause,
                reply,
            } => {
                self.pause_key(key, hash, pause);
                let _ = reply.send(());
            }
            ShardCommand::CheckStuck { limit } => {
                let now = Instant::now();
                let stuck: Vec<(u64, Seq, std::time::Duration)> = self
                    .lanes
                    .0
                    .iter()
                    .filter_map(|l| l.busy.as_ref())
                    .filter_map(|b| {
                        let waited = now - b.started?;
                        (waited >= limit).then_some((b.epoch, b.first_unfinished().0, waited))
                    })
                    .collect();
                for (epoch, seq, waited) in stuck {
                    self.launcher.shard.ctx.metrics.stuck.increment(1);
                    self.stuck(epoch, seq, waited);
                }
            }
        }
    }

    /// The `top` lanes whose head has run longest and the `top` with the most queued.
    fn inspect(&self, top: usize) -> (Vec<LaneView>, Vec<LaneView>) {
        let now = Instant::now();
        let retrying = self
            .launcher
            .shard
            .retrying
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let views: Vec<LaneView> = self
            .lanes
            .0
            .iter()
            .filter_map(|lane| {
                let (message, busy) = match (&lane.busy, lane.queue.front()) {
                    (Some(b), _) => (&**b.first_unfinished().1, Some(b)),
                    (None, Some(w)) => (&w.message, None),
                    (None, None) => return None,
                };
                let retried =
                    busy.and_then(|b| retrying.get(&(Arc::as_ptr(b.first_unfinished().1) as usize)));
                Some(LaneView {
                    key: match &lane.key {
                        LaneKey::Key(key) => String::from_utf8_lossy(key).into_owned(),
                        _ => "(keyless)".to_owned(),
                    },
                    source: message.source.clone(),
                    offset: message.offset,
                    attempts: match (busy, retried) {
                        (_, Some((attempts, _))) => *attempts,
                        (Some(_), None) => 1,
                        (None, None) => 0,
                    },
                    running_for: busy.and_then(|b| b.started).map(|started| now - started),
                    last_error: retried.map(|(_, error)| error.clone()),
                    queued: lane.queue.len(),
                })
            })
            .collect();
        let oldest: Vec<LaneView> = views
            .iter()
            .filter(|v| v.running_for.is_some())
            .cloned()
            .collect();
        (
            top_by(oldest, top, |v| v.running_for),
            top_by(views, top, |v| v.queued),
        )
    }

    fn enqueue(&mut self, work: Work) {
        let hash = work.hash;
        match self
            .lanes
            .0
            .entry(hash, |l| l.hash == hash && work.joins(&l.key), |l| l.hash)
        {
            Entry::Occupied(mut entry) => {
                let lane = entry.get_mut();
                let blocked = lane.blocked.contains(&work.epoch);
                if lane.busy.is_none() && lane.queue.is_empty() && !blocked && !lane.paused {
                    lane.busy = Some(self.launcher.start(work));
                } else {
                    lane.queue.push_back(work);
                }
            }
            Entry::Vacant(entry) => {
                let mut lane = Lane::new(work.lane_key(), hash);
                lane.paused = !self.paused.is_empty()
                    && matches!(&lane.key, LaneKey::Key(k) if self.paused.contains(k));
                if lane.paused {
                    lane.queue.push_back(work);
                } else {
                    lane.busy = Some(self.launcher.start(work));
                }
                entry.insert(lane);
            }
        }
    }

    /// An operator's pause or resume of `key` (whose lane, if any, hashed to `hash`).
    fn pause_key(&mut self, key: Bytes, hash: u64, pause: bool) {
        let lane_key = LaneKey::Key(key.clone());
        if let Some(lane) = self.lanes.get_mut(&lane_key, hash) {
            lane.paused = pause;
        }
        if pause {
            self.paused.insert(key);
        } else {
            self.paused.remove(&key);
            self.advance(&lane_key, hash);
        }
    }

    fn on_finished(&mut self, end: Ended<Outcome>) {
        let finished_it = match end.output {
            Outcome::Fatal(error) => {
                // The lane stays blocked: the engine stops on this report.
                let _ = self.reports.send(ShardReport::Fatal(error));
                return;
            }
            // Never finished here: the transport reports the source lost, and its next owner
            // handles the message.
            Outcome::Fenced => false,
            Outcome::Handled | Outcome::Duplicate | Outcome::DeadLettered | Outcome::Parked => true,
        };
        // One lookup per finished message: complete it, then start the next or drop the lane.
        let (hash, task) = (end.tag, end.number);
        let Ok(mut entry) = self
            .lanes
            .0
            // The full hash too: a table probe also offers lanes of other hashes, and slot
            // numbers are reused, so another lane may run a future in the same slot by now.
            .find_entry(hash, |l| {
                l.hash == hash && l.busy.as_ref().is_some_and(|b| b.task == task)
            })
        else {
            return;
        };
        let lane = entry.get_mut();
        if let Some(busy) = lane.busy.take() {
            if busy.run.is_some() {
                // A run counts what it finished; the rest was fenced, as a single message is.
                complete_run(&mut self.pending, &busy);
            } else if finished_it {
                self.pending.push(busy.completion());
            }
        }
        if lane.may_start() {
            lane.busy = self.launcher.start_next(&mut lane.queue);
        }
        if lane.is_idle() {
            let gone = entry.remove().0;
            self.unblock(gone.unblocks);
        }
        if self.pending.len() >= FLUSH_AT {
            self.flush();
        }
    }

    /// A detached stuck message's lane is gone (its dead letter is done or cancelled): the lane
    /// it came from starts its next message again.
    fn unblock(&mut self, from: Option<(LaneKey, u64, u64)>) {
        let Some((key, hash, epoch)) = from else {
            return;
        };
        if let Some(lane) = self.lanes.get_mut(&key, hash) {
            if let Some(i) = lane.blocked.iter().position(|&e| e == epoch) {
                lane.blocked.swap_remove(i);
            }
        }
        self.advance(&key, hash);
    }

    /// Starts the next queued message of an idle lane, or removes the lane if it has none.
    fn advance(&mut self, key: &LaneKey, hash: u64) {
        let Entry::Occupied(mut entry) = self.lanes.entry(key, hash) else {
            return;
        };
        let lane = entry.get_mut();
        if lane.may_start() {
            lane.busy = self.launcher.start_next(&mut lane.queue);
        }
        if lane.is_idle() {
            let gone = entry.remove().0;
            self.unblock(gone.unblocks);
        }
    }

    fn drop_queued(&mut self, epochs: &Epochs) -> Vec<(u64, Dropped)> {
        let mut dropped: BTreeMap<u64, Dropped> = BTreeMap::new();
        let mut idle = Vec::new();
        for lane in self.lanes.0.iter_mut() {
            lane.queue.retain(|w| {
                let drop = epochs.contains(w.epoch);
                if drop {
                    let d = dropped.entry(w.epoch).or_default();
                    d.count += 1;
                    d.weight += w.weight;
                }
                !drop
            });
            if lane.is_idle() {
                idle.push((lane.key.clone(), lane.hash));
            }
        }
        // Lanes left empty go, as when their last message finishes (a detached one unblocks
        // the lane it came from).
        for (key, hash) in idle {
            self.advance(&key, hash);
        }
        dropped.into_iter().collect()
    }

    fn cancel(&mut self, epochs: &Epochs) {
        let victims: Vec<(LaneKey, u64)> = self
            .lanes
            .0
            .iter()
            .filter(|lane| lane.busy.as_ref().is_some_and(|b| epochs.contains(b.epoch)))
            .map(|lane| (lane.key.clone(), lane.hash))
            .collect();
        for (key, hash) in victims {
            if let Some(busy) = self.lanes.get_mut(&key, hash).and_then(|lane| lane.busy.take()) {
                self.launcher.tasks.cancel(busy.task);
            }
            self.advance(&key, hash);
        }
    }

    /// Takes apart the run of a job cancelled because message `stuck` of it is stuck:
    /// completes what the run finished, puts the messages after the stuck one back at the front
    /// of their queue, and gives back the stuck one. That is the run's first unfinished message
    /// (the stuck one is the lowest unfinished message of its source, and a run holds one
    /// assignment's messages in order); `None`, with every unfinished one put back, if the run
    /// had finished it already.
    fn split_run(&mut self, key: &LaneKey, hash: u64, busy: InFlight, stuck: Seq) -> Option<Stuck> {
        complete_run(&mut self.pending, &busy);
        let run = busy.run?;
        let done = run.finished.load(Relaxed);
        let mut followers = run.followers.into_iter().skip(done.saturating_sub(1)).peekable();
        let first = if done == 0 {
            Some(Stuck {
                slot: busy.slot,
                weight: busy.weight,
                message: busy.message,
                lease: busy.lease.clone(),
                position_id: busy.position_id,
            })
        } else {
            // Taken out only if it is the stuck one; else it goes back with the rest.
            followers.next_if(|f| f.seq == stuck).map(|f| Stuck {
                slot: f.slot,
                weight: f.weight,
                message: f.message,
                lease: busy.lease.clone(),
                position_id: f.position_id,
            })
        };
        if let Some(lane) = self.lanes.get_mut(key, hash) {
            for f in followers.rev() {
                lane.queue.push_front(Work {
                    message: Arc::unwrap_or_clone(f.message),
                    lane: f.lane,
                    hash,
                    slot: f.slot,
                    epoch: busy.epoch,
                    seq: f.seq,
                    weight: f.weight,
                    position_id: f.position_id,
                    received: f.received,
                    lease: busy.lease.clone(),
                });
            }
        }
        first
    }

    fn stuck(&mut self, epoch: u64, seq: Seq, waited: std::time::Duration) {
        let mut unblocks = None;
        let in_flight = self
            .lanes
            .0
            .iter()
            // A message already being dead-lettered (found stuck by the other check) is skipped:
            // not in flight as a handler, not queued, so left alone below.
            .find(|l| {
                l.busy
                    .as_ref()
                    .is_some_and(|b| b.holds(epoch, seq) && b.started.is_some())
            })
            .map(|l| (l.key.clone(), l.hash));
        let finishing = in_flight.as_ref().is_some_and(|(key, hash)| {
            self.lanes
                .0
                .find(*hash, |l| l.hash == *hash && l.key == *key)
                .and_then(|l| l.busy.as_ref())
                .is_some_and(|b| self.launcher.shard.is_finishing(&b.message))
        });
        if finishing {
            tracing::warn!(?waited, "a message held the watermark past the stuck timeout after it was handled: its replay's end marker waits for the dead-letter destination (not dead-lettered)");
            return;
        }
        let (key, hash, slot, weight, message, lease, position_id) = if let Some((key, hash)) = in_flight {
            let Some(busy) = self.lanes.get_mut(&key, hash).and_then(|l| l.busy.take()) else {
                return;
            };
            self.launcher.tasks.cancel(busy.task);
            if busy.run.is_none() {
                (
                    key,
                    hash,
                    busy.slot,
                    busy.weight,
                    busy.message,
                    busy.lease,
                    busy.position_id,
                )
            } else {
                let Some(first) = self.split_run(&key, hash, busy, seq) else {
                    // Finished already: the next of the lane goes on.
                    self.advance(&key, hash);
                    return;
                };
                (
                    key,
                    hash,
                    first.slot,
                    first.weight,
                    first.message,
                    first.lease,
                    first.position_id,
                )
            }
        } else {
            // Queued behind another message of its key (of another source): take it out and give
            // it a lane of its own; the messages of its source behind it wait until it is
            // dead-lettered, the other sources' go on.
            let mut found = None;
            for lane in self.lanes.0.iter_mut() {
                if let Some(i) = lane.queue.iter().position(|w| w.epoch == epoch && w.seq == seq) {
                    found = lane.queue.remove(i).map(|w| (w, lane.key.clone(), lane.hash));
                    lane.blocked.push(epoch);
                    break;
                }
            }
            let Some((work, from, from_hash)) = found else {
                return; // finished meanwhile
            };
            self.detached += 1;
            let key = LaneKey::Detached(self.detached);
            let hash = foldhash::fast::FixedState::default().hash_one(&key);
            unblocks = Some((from, from_hash, epoch));
            (
                key,
                hash,
                work.slot,
                work.weight,
                Arc::new(work.message),
                work.lease,
                work.position_id,
            )
        };
        tracing::error!(source = %message.source, offset = message.offset, ?waited, "message stuck past the stuck timeout; cancelling and dead-lettering it");
        let reason = super::lane::stuck_reason(&self.launcher.shard.ctx, waited);
        let launch = Launch {
            hash,
            slot,
            epoch,
            seq,
            weight,
        };
        let in_flight = self.launcher.launch(
            launch,
            message,
            Task::DeadLetter {
                reason: Box::new(reason),
                lease,
                position_id,
            },
        );
        match self.lanes.entry(&key, hash) {
            Entry::Occupied(mut entry) => entry.get_mut().busy = Some(in_flight),
            Entry::Vacant(entry) => {
                let mut lane = Lane::new(key, hash);
                lane.busy = Some(in_flight);
                lane.unblocks = unblocks;
                entry.insert(lane);
            }
        }
    }
}
