//! A shard: one task owning many lanes (one FIFO per active key).
//!
//! At most one message of a lane is in flight; lanes of a shard run concurrently (their
//! futures share one `FuturesUnordered`), shards run in parallel on the runtime's threads.
//! A lane exists only while its key has work: it is removed as soon as its queue empties,
//! so memory follows the active keys, never every key ever seen.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::{AbortHandle, Abortable, Aborted};
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::lane::{self, LaneContext, Outcome};
use super::stats::ShardStats;
use crate::message::Message;
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

/// A message routed to a shard.
pub(crate) struct Work {
    pub message: Message,
    pub lane: LaneKey,
    pub slot: u32,
    pub epoch: u64,
    pub seq: Seq,
    pub received: Instant,
}

/// A finished message reported back to the intake for the watermark.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Completion {
    pub slot: u32,
    pub epoch: u64,
    pub seq: Seq,
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
    /// Drop queued (not started) messages of these assignments; reply with (epoch, dropped).
    DropQueued {
        epochs: Epochs,
        reply: oneshot::Sender<Vec<(u64, usize)>>,
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
    abort: AbortHandle,
    message: Arc<Message>,
}

#[derive(Default)]
struct Lane {
    queue: VecDeque<Work>,
    busy: Option<InFlight>,
}

struct Finished {
    lane: LaneKey,
    ticket: u64,
    outcome: Result<Outcome, Aborted>,
}

type Running = Pin<Box<dyn Future<Output = Finished> + Send>>;

/// Completions are sent in batches of at most this many.
const FLUSH_AT: usize = 1024;

pub(crate) struct Shard {
    commands: mpsc::UnboundedReceiver<ShardCommand>,
    completions: mpsc::UnboundedSender<Vec<Completion>>,
    lanes: HashMap<LaneKey, Lane, foldhash::fast::RandomState>,
    launcher: Launcher,
    pending: Vec<Completion>,
}

/// Starts lane futures; kept apart from the lane map so both can be borrowed at once.
struct Launcher {
    running: FuturesUnordered<Running>,
    ctx: Arc<LaneContext>,
    stats: Arc<ShardStats>,
    next_ticket: u64,
}

impl Launcher {
    /// Starts `work` as the in-flight message of its lane.
    fn start(&mut self, work: Work) -> InFlight {
        let message = Arc::new(work.message);
        let future = lane::process(
            self.ctx.clone(),
            self.stats.clone(),
            message.clone(),
            work.received,
        );
        self.launch(work.lane, work.slot, work.epoch, work.seq, message, future)
    }

    fn launch(
        &mut self,
        lane: LaneKey,
        slot: u32,
        epoch: u64,
        seq: Seq,
        message: Arc<Message>,
        future: impl Future<Output = Outcome> + Send + 'static,
    ) -> InFlight {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let (abort, registration) = AbortHandle::new_pair();
        self.running
            .push(Box::pin(Abortable::new(future, registration).map(
                move |outcome| Finished {
                    lane,
                    ticket,
                    outcome,
                },
            )));
        InFlight {
            ticket,
            slot,
            epoch,
            seq,
            abort,
            message,
        }
    }
}

impl Shard {
    pub fn new(
        commands: mpsc::UnboundedReceiver<ShardCommand>,
        completions: mpsc::UnboundedSender<Vec<Completion>>,
        ctx: Arc<LaneContext>,
        stats: Arc<ShardStats>,
    ) -> Self {
        Shard {
            commands,
            completions,
            lanes: HashMap::default(),
            launcher: Launcher {
                running: FuturesUnordered::new(),
                ctx,
                stats,
                next_ticket: 0,
            },
            pending: Vec::new(),
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
        self.launcher.stats.lanes.store(self.lanes.len(), Relaxed);
        if !self.pending.is_empty() {
            // The intake is gone only when the engine is shutting down; nothing to report then.
            let _ = self.completions.send(std::mem::take(&mut self.pending));
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
                // Aborted futures are dropped on their next poll: do it now, so no handler of
                // a cancelled message is still alive when the intake hears back.
                while let Some(Some(finished)) = self.launcher.running.next().now_or_never() {
                    self.on_finished(finished);
                }
                let _ = reply.send(());
            }
            ShardCommand::Stuck { epoch, seq, waited } => self.stuck(epoch, seq, waited),
        }
    }

    fn enqueue(&mut self, work: Work) {
        let lane = self.lanes.entry(work.lane.clone()).or_default();
        if lane.busy.is_none() && lane.queue.is_empty() {
            lane.busy = Some(self.launcher.start(work));
        } else {
            lane.queue.push_back(work);
        }
    }

    fn on_finished(&mut self, finished: Finished) {
        if finished.outcome.is_err() {
            return; // aborted: whoever aborted it already moved the lane on
        }
        // One lookup per finished message: complete it, then start the next or drop the lane.
        let Entry::Occupied(mut entry) = self.lanes.entry(finished.lane) else {
            return;
        };
        let lane = entry.get_mut();
        match lane.busy.take() {
            Some(busy) if busy.ticket == finished.ticket => self.pending.push(Completion {
                slot: busy.slot,
                epoch: busy.epoch,
                seq: busy.seq,
            }),
            other => {
                lane.busy = other; // a stale finish (the message was cancelled and replaced)
                return;
            }
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
    fn advance(&mut self, key: LaneKey) {
        let Entry::Occupied(mut entry) = self.lanes.entry(key) else {
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

    fn drop_queued(&mut self, epochs: &Epochs) -> Vec<(u64, usize)> {
        let mut dropped: HashMap<u64, usize> = HashMap::new();
        self.lanes.retain(|_, lane| {
            lane.queue.retain(|w| {
                let drop = epochs.contains(w.epoch);
                if drop {
                    *dropped.entry(w.epoch).or_default() += 1;
                }
                !drop
            });
            lane.busy.is_some() || !lane.queue.is_empty()
        });
        dropped.into_iter().collect()
    }

    fn cancel(&mut self, epochs: &Epochs) {
        let victims: Vec<LaneKey> = self
            .lanes
            .iter()
            .filter(|(_, lane)| lane.busy.as_ref().is_some_and(|b| epochs.contains(b.epoch)))
            .map(|(key, _)| key.clone())
            .collect();
        for key in victims {
            if let Some(busy) = self.lanes.get_mut(&key).and_then(|lane| lane.busy.take()) {
                busy.abort.abort();
            }
            self.advance(key);
        }
    }

    fn stuck(&mut self, epoch: u64, seq: Seq, waited: std::time::Duration) {
        let in_flight = self
            .lanes
            .iter()
            .find(|(_, l)| l.busy.as_ref().is_some_and(|b| b.epoch == epoch && b.seq == seq))
            .map(|(k, _)| k.clone());
        let (key, slot, message) = if let Some(key) = in_flight {
            let Some(busy) = self.lanes.get_mut(&key).and_then(|l| l.busy.take()) else {
                return;
            };
            busy.abort.abort();
            (key, busy.slot, busy.message)
        } else {
            // Queued behind another message of its key: take it out and give it a lane of its own.
            let mut found = None;
            for lane in self.lanes.values_mut() {
                if let Some(i) = lane.queue.iter().position(|w| w.epoch == epoch && w.seq == seq) {
                    found = lane.queue.remove(i);
                    break;
                }
            }
            let Some(work) = found else {
                return; // finished meanwhile
            };
            (
                LaneKey::Detached(self.launcher.next_ticket),
                work.slot,
                Arc::new(work.message),
            )
        };
        tracing::error!(source = %message.source, offset = message.offset, ?waited, "message stuck past the stuck timeout; cancelling and dead-lettering it");
        let ctx = self.launcher.ctx.clone();
        let stats = self.launcher.stats.clone();
        let reason = lane::stuck_reason(&ctx, waited);
        let dl_message = message.clone();
        let future = async move {
            lane::dead_letter(&ctx, &stats, &dl_message, reason, &mut fastrand::Rng::new()).await
        };
        let in_flight = self
            .launcher
            .launch(key.clone(), slot, epoch, seq, message, future);
        self.lanes.entry(key).or_default().busy = Some(in_flight);
    }
}
