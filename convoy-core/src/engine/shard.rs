//! A shard: one task owning many lanes (one FIFO per active key).
//!
//! At most one message of a lane is in flight; lanes of a shard run concurrently (their
//! futures share one `FuturesUnordered`), shards run in parallel on the runtime's threads.
//! A lane exists only while its key has work: it is removed as soon as its queue empties,
//! so memory follows the active keys, never every key ever seen.
//!
//! Cancelling drops a lane future at once (the shard owns it) and then polls the shard's set
//! until the emptied task left it, before anyone hears back: a cancelled handler is gone, not
//! merely asleep, when its source is handed to another member.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::lane::{self, LaneContext, Outcome};
use super::slots::CallSlots;
use super::stats::ShardStats;
use crate::message::Message;
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
    /// False for a message at an offset rewritten after a position reset: an id derived from
    /// its position would match the message the offset held before, so it is not checked.
    pub check_duplicate: bool,
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

/// A finished message reported back to the intake for the watermark.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completion {
    pub slot: u32,
    pub weight: u32,
    pub epoch: u64,
    pub seq: Seq,
}

/// What a shard tells the intake.
pub(crate) enum ShardReport {
    /// Messages finished.
    Completions(Vec<Completion>),
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
    /// Drop queued (not started) messages of these assignments; reply with what was dropped.
    DropQueued {
        epochs: Epochs,
        reply: oneshot::Sender<Vec<(u64, Dropped)>>,
    },
    /// Abort in-flight messages of these assignments; their completions are never reported.
    Cancel {
        epochs: Epochs,
        reply: oneshot::Sender<()>,
    },
    /// Cancel this message wherever it is and dead-letter it with reason `stuck`.
    Stuck {
        epoch: u64,
        seq: Seq,
        waited: std::time::Duration,
    },
}

struct InFlight {
    ticket: u64,
    slot: u32,
    epoch: u64,
    seq: Seq,
    weight: usize,
    message: Arc<Message>,
}

struct Lane {
    key: LaneKey,
    hash: u64,
    queue: VecDeque<Work>,
    busy: Option<InFlight>,
}

impl Lane {
    fn new(key: LaneKey, hash: u64) -> Self {
        Lane {
            key,
            hash,
            queue: VecDeque::new(),
            busy: None,
        }
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

/// A lane future's end; its lane is found by the hash and the ticket of its in-flight message.
struct Finished {
    hash: u64,
    ticket: u64,
    /// `None`: cancelled.
    outcome: Option<Outcome>,
}

/// A lane future in the shard's set. The shard cancels it itself — drops the lane future and
/// wakes the task, whose next poll ends it — so no abort handle (an allocation and two atomic
/// references per message) is needed.
struct Running {
    hash: u64,
    ticket: u64,
    future: Option<Pin<Box<dyn Future<Output = Outcome> + Send>>>,
    /// The waker of the last poll that returned pending, to wake the task on cancel.
    waker: Option<Waker>,
}

impl Running {
    fn cancel(&mut self) {
        self.future = None;
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
    }
}

impl Future for Running {
    type Output = Finished;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Finished> {
        let this = self.get_mut();
        let outcome = match this.future.as_mut() {
            None => None,
            Some(future) => match future.as_mut().poll(cx) {
                Poll::Ready(outcome) => Some(outcome),
                Poll::Pending => {
                    if !this.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        this.waker = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
            },
        };
        this.future = None;
        Poll::Ready(Finished {
            hash: this.hash,
            ticket: this.ticket,
            outcome,
        })
    }
}

/// Completions are sent in batches of at most this many.
const FLUSH_AT: usize = 1024;

pub(crate) struct Shard {
    commands: mpsc::UnboundedReceiver<ShardCommand>,
    reports: mpsc::UnboundedSender<ShardReport>,
    lanes: Lanes,
    launcher: Launcher,
    pending: Vec<Completion>,
    /// Aborted lane futures not yet dropped.
    aborting: usize,
}

/// Starts lane futures; kept apart from the lane map so both can be borrowed at once.
struct Launcher {
    running: FuturesUnordered<Running>,
    ctx: Arc<LaneContext>,
    stats: Arc<ShardStats>,
    /// This shard's share of `max_in_flight` handler calls, if limited.
    calls: Option<Arc<CallSlots>>,
    next_ticket: u64,
}

/// How a lane future is identified in the shard.
struct Launch {
    hash: u64,
    slot: u32,
    epoch: u64,
    seq: Seq,
    weight: usize,
}

impl Launcher {
    /// Starts `work` as the in-flight message of its lane.
    fn start(&mut self, work: Work) -> InFlight {
        let message = Arc::new(work.message);
        let (ctx, stats, calls, lane_message) = (
            self.ctx.clone(),
            self.stats.clone(),
            self.calls.clone(),
            message.clone(),
        );
        let (check_duplicate, received, lease) = (work.check_duplicate, work.received, work.lease);
        let future = move || lane::process(ctx, stats, calls, lane_message, check_duplicate, received, lease);
        let launch = Launch {
            hash: work.hash,
            slot: work.slot,
            epoch: work.epoch,
            seq: work.seq,
            weight: work.weight,
        };
        self.launch(launch, message, future)
    }

    /// Starts the future `make` returns. It is made inside the boxed task, where it runs: a
    /// lane future is about a kilobyte, and building it outside would copy it at every move
    /// into place (measured: ~6 % of the engine's instructions per message).
    fn launch<F>(
        &mut self,
        launch: Launch,
        message: Arc<Message>,
        make: impl FnOnce() -> F + Send + 'static,
    ) -> InFlight
    where
        F: Future<Output = Outcome> + Send + 'static,
    {
        let Launch {
            hash,
            slot,
            epoch,
            seq,
            weight,
        } = launch;
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.running.push(Running {
            hash,
            ticket,
            future: Some(Box::pin(async move { make().await })),
            waker: None,
        });
        InFlight {
            ticket,
            slot,
            epoch,
            seq,
            weight,
            message,
        }
    }

    /// Cancels the lane futures of `tickets` (their tasks end at their next poll).
    fn cancel(&mut self, tickets: &[u64]) {
        for running in self.running.iter_mut() {
            if tickets.contains(&running.ticket) {
                running.cancel();
            }
        }
    }
}

impl Shard {
    pub fn new(
        commands: mpsc::UnboundedReceiver<ShardCommand>,
        reports: mpsc::UnboundedSender<ShardReport>,
        ctx: Arc<LaneContext>,
        stats: Arc<ShardStats>,
        max_calls: Option<usize>,
    ) -> Self {
        Shard {
            commands,
            reports,
            lanes: Lanes::default(),
            launcher: Launcher {
                running: FuturesUnordered::new(),
                ctx,
                stats,
                calls: max_calls.map(|n| Arc::new(CallSlots::new(n))),
                next_ticket: 0,
            },
            pending: Vec::new(),
            aborting: 0,
        }
    }

    /// Runs until the intake drops its command sender.
    pub async fn run(mut self) {
        loop {
            tokio::select! {
                biased;
                Some(finished) = self.launcher.running.next(), if !self.launcher.running.is_empty() => {
                    self.on_finished(finished);
                }
                command = self.commands.recv() => match command {
                    Some(command) => self.on_command(command),
                    None => break,
                },
            }
            // Take everything already ready before reporting, so completions travel in batches.
            loop {
                let mut progressed = false;
                while let Ok(command) = self.commands.try_recv() {
                    self.on_command(command);
                    progressed = true;
                }
                while let Some(Some(finished)) = self.launcher.running.next().now_or_never() {
                    self.on_finished(finished);
                    progressed = true;
                }
                if !progressed {
                    break;
                }
            }
            self.flush();
        }
        self.flush();
    }

    fn flush(&mut self) {
        self.launcher.stats.lanes.store(self.lanes.0.len(), Relaxed);
        if !self.pending.is_empty() {
            // The intake is gone only when the engine is shutting down; nothing to report then.
            let _ = self
                .reports
                .send(ShardReport::Completions(std::mem::take(&mut self.pending)));
        }
    }

    /// Polls the shard's set until every cancelled task returned and left it (their lane
    /// futures were dropped when cancelled). A cancelled task is woken by its cancel, so each
    /// round reaches it; `FuturesUnordered` may yield before it polled everything ready (it
    /// does after two futures yield, as lanes waiting out a sub-millisecond backoff do), which
    /// is why this loops on the count, not on readiness.
    fn reap_aborted(&mut self) {
        while self.aborting > 0 {
            match self.launcher.running.next().now_or_never() {
                Some(Some(finished)) => self.on_finished(finished),
                Some(None) => {
                    tracing::error!(
                        aborting = self.aborting,
                        "aborted lane futures vanished without finishing"
                    );
                    self.aborting = 0;
                }
                None => {} // it yielded with work left: poll again
            }
        }
    }

    fn on_command(&mut self, command: ShardCommand) {
        match command {
            ShardCommand::Work(batch) => {
                for work in batch {
                    self.enqueue(work);
                }
            }
            ShardCommand::DropQueued { epochs, reply } => {
                let _ = reply.send(self.drop_queued(&epochs));
            }
            ShardCommand::Cancel { epochs, reply } => {
                self.cancel(&epochs);
                // No handler of a cancelled message may still be alive when the intake hears back.
                self.reap_aborted();
                let _ = reply.send(());
            }
            ShardCommand::Stuck { epoch, seq, waited } => {
                self.stuck(epoch, seq, waited);
                self.reap_aborted();
            }
        }
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
                if lane.busy.is_none() && lane.queue.is_empty() {
                    lane.busy = Some(self.launcher.start(work));
                } else {
                    lane.queue.push_back(work);
                }
            }
            Entry::Vacant(entry) => {
                let mut lane = Lane::new(work.lane_key(), hash);
                lane.busy = Some(self.launcher.start(work));
                entry.insert(lane);
            }
        }
    }

    fn on_finished(&mut self, finished: Finished) {
        let Some(outcome) = finished.outcome else {
            // Whoever cancelled it already moved the lane on; its task is gone now.
            self.aborting = self.aborting.saturating_sub(1);
            return;
        };
        let finished_it = match outcome {
            Outcome::Fatal(error) => {
                // The lane stays blocked: the engine stops on this report.
                let _ = self.reports.send(ShardReport::Fatal(error));
                return;
            }
            // Never finished here: the transport reports the source lost, and its next owner
            // handles the message.
            Outcome::Fenced => false,
            Outcome::Handled | Outcome::Duplicate | Outcome::DeadLettered => true,
        };
        // One lookup per finished message: complete it, then start the next or drop the lane.
        // No lane has it in flight: a stale finish (the message was cancelled and replaced).
        let (hash, ticket) = (finished.hash, finished.ticket);
        let Ok(mut entry) = self
            .lanes
            .0
            .find_entry(hash, |l| l.busy.as_ref().is_some_and(|b| b.ticket == ticket))
        else {
            return;
        };
        let lane = entry.get_mut();
        if let Some(busy) = lane.busy.take().filter(|_| finished_it) {
            self.pending.push(Completion {
                slot: busy.slot,
                weight: u32::try_from(busy.weight).unwrap_or(u32::MAX),
                epoch: busy.epoch,
                seq: busy.seq,
            });
        }
        match lane.queue.pop_front() {
            Some(next) => lane.busy = Some(self.launcher.start(next)),
            None => {
                entry.remove();
            }
        }
        if self.pending.len() >= FLUSH_AT {
            self.flush();
        }
    }

    /// Starts the next queued message of an idle lane, or removes the lane if it has none.
    fn advance(&mut self, key: &LaneKey, hash: u64) {
        let Entry::Occupied(mut entry) = self.lanes.entry(key, hash) else {
            return;
        };
        let lane = entry.get_mut();
        if lane.busy.is_some() {
            return;
        }
        match lane.queue.pop_front() {
            Some(next) => lane.busy = Some(self.launcher.start(next)),
            None => {
                entry.remove();
            }
        }
    }

    fn drop_queued(&mut self, epochs: &Epochs) -> Vec<(u64, Dropped)> {
        let mut dropped: HashMap<u64, Dropped> = HashMap::new();
        self.lanes.0.retain(|lane| {
            lane.queue.retain(|w| {
                let drop = epochs.contains(w.epoch);
                if drop {
                    let d = dropped.entry(w.epoch).or_default();
                    d.count += 1;
                    d.weight += w.weight;
                }
                !drop
            });
            lane.busy.is_some() || !lane.queue.is_empty()
        });
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
        let mut tickets = Vec::with_capacity(victims.len());
        for (key, hash) in &victims {
            if let Some(busy) = self.lanes.get_mut(key, *hash).and_then(|lane| lane.busy.take()) {
                tickets.push(busy.ticket);
                self.aborting += 1;
            }
        }
        self.launcher.cancel(&tickets);
        for (key, hash) in victims {
            self.advance(&key, hash);
        }
    }

    fn stuck(&mut self, epoch: u64, seq: Seq, waited: std::time::Duration) {
        let in_flight = self
            .lanes
            .0
            .iter()
            .find(|l| l.busy.as_ref().is_some_and(|b| b.epoch == epoch && b.seq == seq))
            .map(|l| (l.key.clone(), l.hash));
        let (key, hash, slot, weight, message) = if let Some((key, hash)) = in_flight {
            let Some(busy) = self.lanes.get_mut(&key, hash).and_then(|l| l.busy.take()) else {
                return;
            };
            self.launcher.cancel(&[busy.ticket]);
            self.aborting += 1;
            (key, hash, busy.slot, busy.weight, busy.message)
        } else {
            // Queued behind another message of its key: take it out and give it a lane of its own.
            let mut found = None;
            for lane in self.lanes.0.iter_mut() {
                if let Some(i) = lane.queue.iter().position(|w| w.epoch == epoch && w.seq == seq) {
                    found = lane.queue.remove(i);
                    break;
                }
            }
            let Some(work) = found else {
                return; // finished meanwhile
            };
            let key = LaneKey::Detached(self.launcher.next_ticket);
            let hash = foldhash::fast::FixedState::default().hash_one(&key);
            (key, hash, work.slot, work.weight, Arc::new(work.message))
        };
        tracing::error!(source = %message.source, offset = message.offset, ?waited, "message stuck past the stuck timeout; cancelling and dead-lettering it");
        let ctx = self.launcher.ctx.clone();
        let stats = self.launcher.stats.clone();
        let reason = lane::stuck_reason(&ctx, waited);
        let dl_message = message.clone();
        let future = move || async move {
            lane::dead_letter(&ctx, &stats, &dl_message, reason, &mut fastrand::Rng::new()).await
        };
        let launch = Launch {
            hash,
            slot,
            epoch,
            seq,
            weight,
        };
        let in_flight = self.launcher.launch(launch, message, future);
        match self.lanes.entry(&key, hash) {
            Entry::Occupied(mut entry) => entry.get_mut().busy = Some(in_flight),
            Entry::Vacant(entry) => {
                let mut lane = Lane::new(key, hash);
                lane.busy = Some(in_flight);
                entry.insert(lane);
            }
        }
    }
}
