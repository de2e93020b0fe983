//! The intake: the engine's control task. It takes events from the transport, tracks each
//! source's watermark, routes messages to shards by key, applies back-pressure, commits, and
//! runs revokes and the shutdown.
//!
//! **The intake never waits.** Its loop awaits one thing: the next event. Everything it asks of
//! anyone else — a commit, a read-back of parked keys, a lag query, a shard dropping or
//! cancelling work, an inspection — runs beside it, and the answer comes back as an event of
//! the loop. So whatever hangs (a broker, a dead-letter destination, a shard), every other
//! source flows, and every deadline (a revoke's, a lease's, a stop's) is kept. Each method
//! below that the loop calls is synchronous; only the closing of the transport, after the loop
//! ended, awaits (bounded by what is left of the stop's deadline).
//!
//! By job:
//! - [`route`]: messages in (watermark tracking, position resets, key → shard);
//! - [`flow`]: back-pressure (held messages, held bytes, watermark windows);
//! - [`shards`]: commands to the shards answered as reports (drop, cancel);
//! - [`read_back`]: newly assigned sources waiting for their parked keys;
//! - [`unrouted`]: messages held, not routed, while a read-back or an operator's pause holds
//!   their source;
//! - [`commit`]: the commit in flight and when to start the next;
//! - [`revoke`]: revokes, lost sources and their deadlines;
//! - [`stop`]: the shutdown (drain, cancel, final commit), and stopping on a failure;
//! - [`tick`]: the stuck-gap check, gauges, how far commits cover for a lane waiting on one,
//!   and what has waited past its deadline;
//! - [`pause`]: an operator's pause of a key or a source.

mod commit;
mod flow;
mod inspect;
mod pause;
mod read_back;
mod revoke;
mod route;
mod shards;
mod source;
mod stop;
mod tick;
mod unrouted;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use self::commit::Committer;
use self::read_back::ReadBacks;
use self::revoke::PendingRevoke;
use self::shards::Cancels;
use self::source::SourceState;
use self::stop::Stopping;
use super::inspect::InspectRequest;
use super::parking::Parking;
use super::pause::PauseRequest;
use super::shard::{BatchSpares, ShardCommand, ShardReport, Work};
use super::stats::{EngineStats, StallOn};
use super::{EngineError, EngineReport};
use crate::backpressure::Gate;
use crate::config::EngineConfig;
use crate::dead_letter::DeadLetterSink;
use crate::message::SourceId;
use crate::metrics::IntakeMetrics;
use crate::transform::Outbox;
use crate::transport::{EventReceiver, SourceControl, SourceEvent, Subscription};

/// Salt for key → shard hashing. Brokers partition by a hash of the key too (Kafka: murmur2);
/// hashing the keys of one partition again with the same function would pile them onto few
/// shards, so shards use a different, seeded hash.
const SHARD_SALT: u64 = 0x636f_6e76_6f79_5348;

/// How long closing the transport may take at the end (leaving the group, joining threads).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(30);

/// `now + d`, saturating far in the future instead of overflowing for huge user durations.
fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30))
}

/// The engine's control loop (see the module documentation: it never waits).
pub(crate) struct Intake {
    config: EngineConfig,
    control: Arc<dyn SourceControl>,
    wants_above: bool,
    events: EventReceiver,
    events_open: bool,
    reports: mpsc::UnboundedReceiver<ShardReport>,
    shards: Vec<mpsc::UnboundedSender<ShardCommand>>,
    shard_tasks: JoinSet<()>,
    sources: Vec<Option<SourceState>>,
    by_id: HashMap<SourceId, u32>,
    next_epoch: u64,
    next_solo: u64,
    held_total: usize,
    held_bytes: usize,
    total_gate: Gate,
    bytes_gate: Gate,
    revokes: Vec<PendingRevoke>,
    next_revoke: u64,
    committer: Committer,
    finished_since_commit: usize,
    /// Half the transport's credit per source, when it has one ([`SourceControl::credit`]),
    /// and whether a source has finished that much since its last commit.
    credit_commit: Option<u64>,
    credit_due: bool,
    last_commit: Instant,
    /// Fires `commit_interval` after the last commit started. One timer, reset per commit: a
    /// timer created per loop turn costs more than the engine's whole per-message work.
    commit_timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    stopping: Option<Stopping>,
    /// Messages taken so far (counted only with a message limit).
    taken: u64,
    /// The lag query in flight, if any (asked of the transport off the intake's own loop).
    lag_probe: Option<tokio::task::JoinHandle<()>>,
    last_lag_probe: Instant,
    shard_hasher: foldhash::fast::FixedState,
    routes: Vec<Vec<Work>>,
    /// Emptied batch buffers, shared with the shards.
    spares: BatchSpares,
    stats: Arc<EngineStats>,
    metrics: IntakeMetrics,
    signals: watch::Receiver<u8>,
    signals_open: bool,
    /// Requests for an operator's view.
    inspects: mpsc::Receiver<InspectRequest>,
    /// An operator's pauses and resumes.
    pauses: mpsc::Receiver<PauseRequest>,
    /// Keys and sources an operator paused.
    paused_keys: HashSet<Bytes>,
    paused_sources: HashSet<SourceId>,
    /// Each source's lag as last asked of the broker (written by the lag probe).
    lags: Arc<std::sync::Mutex<HashMap<SourceId, u64>>>,
    /// Since when commits fail (none: the last one went through).
    commits_failing_since: Option<Instant>,
    /// Read back before sources are taken: their previous owner may have parked keys.
    parking: Option<(Arc<Parking>, Arc<dyn DeadLetterSink>)>,
    read_backs: ReadBacks,
    /// Cancels sent to the shards and not yet answered.
    cancels: Cancels,
    /// What the engine waits for past its deadline, as last reported.
    stalled: Option<StallOn>,
    /// A transform's outbox, whose staged outputs count against the bytes bound.
    outbox: Option<Arc<dyn Outbox>>,
}

pub(crate) struct IntakeParts {
    pub config: EngineConfig,
    pub subscription: Subscription,
    pub reports: mpsc::UnboundedReceiver<ShardReport>,
    pub shards: Vec<mpsc::UnboundedSender<ShardCommand>>,
    pub shard_tasks: JoinSet<()>,
    pub stats: Arc<EngineStats>,
    pub signals: watch::Receiver<u8>,
    pub spares: BatchSpares,
    pub inspects: mpsc::Receiver<InspectRequest>,
    pub pauses: mpsc::Receiver<PauseRequest>,
    /// The group's parked keys and the sink they are read back from, when it parks keys.
    pub parking: Option<(Arc<Parking>, Arc<dyn DeadLetterSink>)>,
    /// A transform's outbox: what it holds until a commit counts against the bytes bound.
    pub outbox: Option<Arc<dyn Outbox>>,
}

/// What one turn of the loop saw.
enum Turn {
    Continue,
    Fail(EngineError),
}

impl Intake {
    pub fn new(parts: IntakeParts) -> Self {
        let bp = parts.config.back_pressure;
        let commit_timer = Box::pin(tokio::time::sleep_until(after(parts.config.commit_interval)));
        let shard_count = parts.shards.len();
        let control: Arc<dyn SourceControl> = Arc::from(parts.subscription.control);
        let credit_commit = control.credit().map(|c| (c / 2).max(1));
        Intake {
            metrics: IntakeMetrics::new(&parts.config.group),
            config: parts.config,
            wants_above: control.wants_finished_above(),
            control,
            events: parts.subscription.events,
            events_open: true,
            reports: parts.reports,
            shards: parts.shards,
            shard_tasks: parts.shard_tasks,
            sources: Vec::new(),
            by_id: HashMap::new(),
            next_epoch: 1,
            next_solo: 0,
            held_total: 0,
            held_bytes: 0,
            total_gate: Gate::new(bp.total_high, bp.total_low),
            bytes_gate: Gate::new(bp.total_bytes_high, bp.total_bytes_low),
            revokes: Vec::new(),
            next_revoke: 0,
            committer: Committer::default(),
            finished_since_commit: 0,
            credit_commit,
            credit_due: false,
            last_commit: Instant::now(),
            commit_timer,
            stopping: None,
            taken: 0,
            lag_probe: None,
            last_lag_probe: Instant::now(),
            shard_hasher: foldhash::fast::FixedState::with_seed(SHARD_SALT),
            routes: (0..shard_count).map(|_| Vec::new()).collect(),
            spares: parts.spares,
            stats: parts.stats,
            signals: parts.signals,
            signals_open: true,
            inspects: parts.inspects,
            pauses: parts.pauses,
            paused_keys: HashSet::new(),
            paused_sources: HashSet::new(),
            lags: Arc::default(),
            commits_failing_since: None,
            parking: parts.parking,
            read_backs: ReadBacks::default(),
            cancels: Cancels::default(),
            stalled: None,
            outbox: parts.outbox,
        }
    }

    /// Runs until shutdown is signalled, the transport closes or something fails fatally;
    /// drains and commits on the way out of a shutdown.
    pub async fn run(mut self) -> Result<EngineReport, EngineError> {
        if let Some(revoke_timeout) = self.control.revoke_timeout() {
            if let Err(e) = self.config.validate_for_revoke_timeout(revoke_timeout) {
                return self.fail(e.into()).await;
            }
        }
        let period = match self.config.stuck_timeout {
            Some(stuck) => self
                .config
                .commit_interval
                .min(stuck / 2)
                .max(Duration::from_millis(1)),
            None => self.config.commit_interval,
        };
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.take_signals();
            self.stop_at_limit();
            self.progress_stop();
            if self.stopping.as_ref().is_some_and(|s| s.done()) {
                return self.finish_stop().await;
            }
            let wake = self.next_deadline();
            let turn = tokio::select! {
                biased;
                changed = self.signals.changed(), if self.signals_open => {
                    // A dropped handle means nobody can ask for shutdown any more: run on.
                    self.signals_open = changed.is_ok();
                    Turn::Continue
                }
                Some(ended) = self.shard_tasks.join_next() => Turn::Fail(EngineError::Shard(match ended {
                    Ok(()) => "a shard task ended on its own".to_owned(),
                    Err(e) => stop::panic_text(e),
                })),
                Some(report) = self.reports.recv() => match report {
                    ShardReport::Completions(batch) => {
                        self.on_completions(batch);
                        Turn::Continue
                    }
                    ShardReport::Dropped(dropped) => {
                        self.on_dropped(dropped);
                        Turn::Continue
                    }
                    ShardReport::Cancelled(request) => {
                        self.on_cancelled(request);
                        Turn::Continue
                    }
                    ShardReport::Fatal(e) => Turn::Fail(e.into()),
                },
                (commit, result) = self.committer.done(), if self.committer.busy() => {
                    self.on_committed(commit, result)
                }
                number = self.read_backs.done(), if self.read_backs.busy() => {
                    self.on_read_back(number);
                    Turn::Continue
                }
                Some(request) = self.inspects.recv() => {
                    self.answer(request);
                    Turn::Continue
                }
                Some(request) = self.pauses.recv() => {
                    self.on_pause(request);
                    Turn::Continue
                }
                event = self.events.recv(), if self.events_open => match event {
                    Some(event) => self.on_event(event),
                    None => {
                        self.events_open = false;
                        tracing::info!("transport closed the subscription; draining");
                        self.begin_stop();
                        Turn::Continue
                    }
                },
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => Turn::Continue,
                _ = &mut self.commit_timer => {
                    self.timed_commit();
                    Turn::Continue
                }
                _ = tick.tick() => {
                    self.on_tick();
                    Turn::Continue
                }
            };
            if let Turn::Fail(error) = turn {
                return self.fail(error).await;
            }
            self.progress_revokes();
            self.maybe_commit();
        }
    }

    fn signal_count(&self) -> u8 {
        *self.signals.borrow()
    }

    fn state(&mut self, slot: u32) -> Option<&mut SourceState> {
        self.sources.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// The state of `slot` if it still holds the assignment `epoch`.
    fn state_of(&self, slot: u32, epoch: u64) -> Option<&SourceState> {
        self.sources
            .get(slot as usize)
            .and_then(Option::as_ref)
            .filter(|s| s.epoch == epoch)
    }

    fn on_event(&mut self, event: SourceEvent) -> Turn {
        match event {
            SourceEvent::Messages { source, messages } => self.on_messages(source, messages),
            SourceEvent::Assigned(assignments) => {
                // Their previous owner may have parked keys: they wait, unrouted, for a read-back.
                let read_back = self.read_back_for_assignment();
                for a in assignments {
                    self.assign(a, read_back);
                }
                self.apply_flow();
            }
            SourceEvent::Revoked {
                sources,
                deadline,
                ack,
            } => self.begin_revoke(sources, deadline, ack),
            SourceEvent::Lost(sources) => self.lose(sources),
            SourceEvent::Failed(e) => return Turn::Fail(e.into()),
        }
        Turn::Continue
    }

    /// The earliest moment the loop must wake for by itself (besides the commit timer): a
    /// revoke's drain or commit deadline, or the end of the shutdown drain.
    fn next_deadline(&self) -> Option<Instant> {
        let revokes = self.revokes.iter().map(PendingRevoke::wake_at);
        let stop = self.stopping.as_ref().map(stop::Stopping::wake_at);
        revokes.chain(stop).min()
    }
}
