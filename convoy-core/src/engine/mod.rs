//! The engine: wires a handler, a dead-letter sink and a configuration to a transport's
//! subscription, and runs the data path
//!
//! ```text
//! transport ─events─▶ intake (watermarks, back-pressure) ─key→shard─▶ shards ─▶ lanes ─▶ handler
//!                       ▲                                                  │
//!                       └──────────── completions (source, offset) ────────┘
//! ```

mod inspect;
mod intake;
mod job;
mod lane;
mod parking;
#[cfg(test)]
mod parking_properties;
mod pause;
mod run;
mod shard;
mod slots;
mod stats;
mod tasks;

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

pub use inspect::{Inspection, Inspector, LaneView, SourceView};
pub use pause::{PauseTarget, Paused, Pauser};
pub use stats::{Stall, StallOn, StatsSnapshot, COMMITS_FAILING_AT_MOST};

use self::intake::{Intake, IntakeParts};
use self::lane::{LaneContext, ShardContext};
use self::parking::Parking;
use self::shard::{BatchSpares, Shard};
use self::slots::CallSlots;
use self::stats::EngineStats;
use crate::batch::{BatchConfig, BatchHandler, Batched};
use crate::config::{ConfigError, EngineConfig};
use crate::dead_letter::DeadLetterSink;
use crate::handler::Handler;
use crate::idempotency::{Idempotency, IdempotencyStore, MemoryIdempotencyStore};
use crate::message::{Offset, SourceId};
use crate::metrics::LaneMetrics;
use crate::transform::{Transform, Transformer};
use crate::transport::{Subscription, Transport, TransportError};

/// What an engine did, returned when it stops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineReport {
    /// Final counters.
    pub stats: StatsSnapshot,
    /// The last watermark committed per source still assigned at shutdown.
    pub committed: BTreeMap<SourceId, Offset>,
    /// Messages still unfinished when the drain ended (its timeout passed or a second stop
    /// signal aborted it): cancelled, left uncommitted, redelivered to the next owner.
    pub cancelled: usize,
    /// Messages finished here whose commit never went through by the stop's deadline (the
    /// broker refused or did not answer): the next owner handles them again. Zero for a stop
    /// whose final commit was accepted.
    pub uncommitted: u64,
}

/// The engine stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine task panicked or was aborted (a crash: nothing was committed after it).
    #[error("engine task ended abnormally: {0}")]
    Crashed(String),
    /// The configuration does not fit the transport (checked when the engine starts).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The transport failed in a way nothing retried can fix (fenced member, authorization
    /// failure, a fatal client error); the engine stopped without committing.
    #[error("the transport failed: {0}")]
    Transport(#[from] TransportError),
    /// A shard task died (a dead-letter sink or idempotency store panicked, or an engine bug):
    /// its lanes could never finish, so the engine stopped instead of freezing.
    #[error("a shard of the engine failed: {0}; the engine stopped (unfinished messages stay uncommitted and are redelivered)")]
    Shard(String),
}

/// Builds an [`Engine`].
pub struct EngineBuilder {
    handler: Arc<dyn Handler>,
    /// A batch handler's gatherer (`handler` is it too), if the engine runs one.
    batched: Option<Arc<Batched>>,
    /// A transform, bound to each subscription's outbox when the engine runs on it.
    transform: Option<Arc<dyn Transform>>,
    config: EngineConfig,
    sink: Option<Arc<dyn DeadLetterSink>>,
    idempotency: Option<Idempotency>,
}

impl EngineBuilder {
    fn new(handler: Arc<dyn Handler>, batched: Option<Arc<Batched>>) -> Self {
        EngineBuilder {
            handler,
            batched,
            transform: None,
            config: EngineConfig::default(),
            sink: None,
            idempotency: Some(Idempotency::Memory(Arc::new(MemoryIdempotencyStore::default()))),
        }
    }

    /// Sets the configuration (validated by `build`).
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets where dead letters go (required; transports provide native sinks).
    pub fn dead_letter_sink(mut self, sink: impl DeadLetterSink) -> Self {
        self.sink = Some(Arc::new(sink));
        self
    }

    /// Replaces the default in-memory idempotency store (100,000 header ids; position ids per
    /// source, see [`MemoryIdempotencyStore`]).
    pub fn idempotency_store(mut self, store: impl IdempotencyStore) -> Self {
        self.idempotency = Some(Idempotency::of(store));
        self
    }

    /// Turns duplicate detection off (every delivery is handled).
    pub fn without_idempotency(mut self) -> Self {
        self.idempotency = None;
        self
    }

    /// Validates and builds.
    pub fn build(self) -> Result<Engine, ConfigError> {
        self.config.validate()?;
        let sink = self.sink.ok_or_else(|| {
            ConfigError::invalid(
                "dead_letter_sink",
                "required: give the engine a sink (e.g. the transport's dead-letter sink) so failed messages are kept, never dropped",
            )
        })?;
        if self.config.park_keys && !sink.can_read_back() {
            return Err(ConfigError::invalid(
                "park_keys",
                "needs a dead-letter sink that reads its destination back (parked keys are kept there): use the transport's own sink",
            ));
        }
        Ok(Engine {
            context: Arc::new(LaneContext {
                handler: self.handler,
                retry: self.config.retry,
                dead_letter_backoff: self.config.dead_letter_backoff,
                sink,
                idempotency: self.idempotency,
                reject_keyless: self.config.keyless == crate::config::KeylessPolicy::DeadLetter,
                max_payload_bytes: self.config.max_payload_bytes,
                metrics: LaneMetrics::new(self.config.group_or_default()),
                group: self.config.group_or_default().to_owned(),
                // Runs of one message are the lane's single path, through `handler`. A group
                // that parks keys takes one message of a key per call: a dead letter that parks
                // its key waits for the commit below it, which a run's earlier messages — not
                // counted finished before the run ends — would hold back.
                runs: self
                    .batched
                    .filter(|b| b.config().per_key > 1 && !self.config.park_keys),
                parking: self.config.park_keys.then(|| {
                    Arc::new(Parking::new(
                        self.config.group_or_default(),
                        self.config.park_checkpoint_after,
                    ))
                }),
                outbox: None,
            }),
            config: self.config,
            transform: self.transform,
        })
    }
}

/// A configured sequential-convoy consumer, ready to run on a subscription.
pub struct Engine {
    config: EngineConfig,
    context: Arc<LaneContext>,
    transform: Option<Arc<dyn Transform>>,
}

impl Engine {
    /// Starts building an engine around `handler`.
    pub fn builder(handler: impl Handler) -> EngineBuilder {
        EngineBuilder::new(Arc::new(handler), None)
    }

    /// Starts building an engine around a batch handler, whose calls each take many messages
    /// gathered as `batch` says (see [`batch`](crate::batch)). Fails if `batch` is invalid,
    /// naming the field.
    ///
    /// Batches fill only with messages in flight at once: the engine's `max_in_flight`, if set,
    /// should be at least `batch.max_messages / batch.per_key` keys.
    pub fn batch_builder(
        handler: impl BatchHandler,
        batch: BatchConfig,
    ) -> Result<EngineBuilder, ConfigError> {
        let batched = Arc::new(Batched::new(Arc::new(handler), batch)?);
        Ok(EngineBuilder::new(batched.clone(), Some(batched)))
    }

    /// Starts building an engine around a transform: what it returns for a message is published
    /// through the subscription's outbox — on Kafka with a transactional id in one transaction
    /// with the commit that covers the message (exactly once), elsewhere before the message is
    /// finished, with ids derived from its event id (see [`transform`](crate::transform)).
    pub fn transform_builder(transform: impl Transform) -> EngineBuilder {
        let transform: Arc<dyn Transform> = Arc::new(transform);
        // Every run binds the transform to its own subscription's outbox (`spawn_in`); until
        // then the handler has none.
        let unbound = Transformer {
            transform: transform.clone(),
            outbox: Arc::new(crate::transform::Unbound),
        };
        EngineBuilder {
            transform: Some(transform),
            ..EngineBuilder::new(Arc::new(unbound), None)
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Subscribes to `transport` with a prefetch limit derived from the back-pressure bounds
    /// (so the broker client buffers no more than the engine would hold), then runs on the
    /// subscription like [`Engine::spawn`]. Must be called within a Tokio runtime.
    ///
    /// An engine whose configuration names no group takes the transport's ([`Transport::group`]).
    pub async fn start<T: Transport + ?Sized>(&self, transport: &T) -> Result<EngineHandle, EngineError> {
        let group = match self.config.group.is_empty() {
            true => transport.group(),
            false => None,
        };
        let subscription = transport
            .subscribe_with(self.config.back_pressure.prefetch_limit())
            .await?;
        if let Some(revoke_timeout) = subscription.control.revoke_timeout() {
            if let Err(e) = self.config.validate_for_revoke_timeout(revoke_timeout) {
                // Leave the group at once instead of holding partitions that never flow.
                let _ = subscription.control.close().await;
                return Err(e.into());
            }
        }
        Ok(self.spawn_in(subscription, group))
    }

    /// Runs on `subscription` in a task of its own; the handle stops, aborts or awaits it.
    /// A configuration that does not fit the transport (see
    /// [`EngineConfig::validate_for_revoke_timeout`]) ends the engine at once with
    /// [`EngineError::Config`]. Must be called within a Tokio runtime.
    pub fn spawn(&self, subscription: Subscription) -> EngineHandle {
        self.spawn_in(subscription, None)
    }

    /// As [`spawn`](Self::spawn), in consumer group `group` when the configuration names none.
    fn spawn_in(&self, subscription: Subscription, group: Option<String>) -> EngineHandle {
        let mut config = self.config.clone();
        config.group = group.unwrap_or_else(|| config.group_or_default().to_owned());
        let bound = match (&self.transform, &subscription.outbox) {
            (None, _) => None,
            (Some(_), Some(outbox))
                if config.park_keys && outbox.guarantee() == crate::transform::OutputGuarantee::ExactlyOnce =>
            {
                return EngineHandle::unfit(
                    subscription,
                    ConfigError::invalid(
                        "park_keys",
                        "is not supported with an exactly-once transform (a transactional outbox) yet: a replayed message's outputs are committed after its replay is marked ended, so a crash between them would lose them; park keys with a handler, or run the transform without park_keys",
                    ),
                )
            }
            (Some(transform), Some(outbox)) => Some({
                tracing::info!(guarantee = ?outbox.guarantee(), "a transform's outputs go through the subscription's outbox");
                let handler = Arc::new(Transformer {
                    transform: transform.clone(),
                    outbox: outbox.clone(),
                }) as Arc<dyn crate::handler::Handler>;
                (handler, outbox.clone())
            }),
            (Some(_), None) => return EngineHandle::unfit(
                subscription,
                ConfigError::invalid(
                    "transform",
                    "this subscription has no outbox for a transform's outputs: start the engine on a convoy connection (convoy::connect), whose subscriptions have one",
                ),
            ),
        };
        // A group of its own, parked keys or a transform: a context of its own (each run reads
        // its group's parked keys afresh, and binds the transform to its own outbox).
        let context = match config.group != self.context.group || config.park_keys || bound.is_some() {
            true => Arc::new(self.context.in_group(&config.group, bound)),
            false => self.context.clone(),
        };
        let (signals, signals_rx) = watch::channel(0u8);
        let (inspector, inspects) = mpsc::channel(4);
        let (pauser, pauses) = mpsc::channel(16);
        let shard_count = config.effective_shards();
        let stats = Arc::new(EngineStats::new(shard_count));
        let (reports_tx, reports) = mpsc::unbounded_channel();
        let mut shard_tasks = JoinSet::new();
        let mut shards = Vec::with_capacity(shard_count);
        let mut shard_aborts = Vec::with_capacity(shard_count);
        let spares = BatchSpares::new(shard_count);
        // One pool of call slots for all shards, striped per shard (see `slots.rs`).
        let calls = self
            .config
            .max_in_flight
            .map(|n| Arc::new(CallSlots::new(n, shard_count)));
        for (index, shard_stats) in stats.shards.iter().enumerate() {
            let (tx, rx) = mpsc::unbounded_channel();
            shards.push(tx);
            let context = ShardContext {
                ctx: context.clone(),
                stats: shard_stats.clone(),
                calls: calls.clone(),
                index,
                retrying: Default::default(),
                finishing: Default::default(),
            };
            let shard = Shard::new(rx, reports_tx.clone(), context, job::run, spares.clone());
            shard_aborts.push(shard_tasks.spawn(shard.run()));
        }
        let intake = Intake::new(IntakeParts {
            config: config.clone(),
            subscription,
            reports,
            shards,
            shard_tasks,
            stats: stats.clone(),
            signals: signals_rx,
            spares,
            inspects,
            pauses,
            parking: context.parking.clone().map(|p| (p, context.sink.clone())),
            outbox: context.outbox.clone(),
        });
        EngineHandle {
            stopper: Stopper(Arc::new(signals)),
            task: tokio::spawn(stats::marks_ended(stats.clone(), intake.run())),
            shard_aborts,
            stats,
            inspector: Inspector(inspector),
            pauser: Pauser(pauser),
        }
    }

    /// Runs on `subscription` until the transport closes it, then drains and commits.
    pub async fn run(&self, subscription: Subscription) -> Result<EngineReport, EngineError> {
        self.spawn(subscription).join().await
    }
}

/// Asks a running engine to stop, from anywhere (a signal handler, another task), also while
/// its handle is awaiting the stop. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Stopper(Arc<watch::Sender<u8>>);

impl Stopper {
    /// The first call starts a graceful shutdown (stop fetching, let lanes finish up to the
    /// drain timeout, commit, close); the next one escalates it: the drain is aborted, what
    /// is unfinished is cancelled and left uncommitted, and what finished is committed.
    pub fn shutdown(&self) {
        self.0.send_modify(|n| *n = n.saturating_add(1));
    }

    /// How many stops were asked for so far.
    pub fn requests(&self) -> u8 {
        *self.0.borrow()
    }
}

/// A running engine's live counters, readable from anywhere. Cheap to clone.
#[derive(Clone)]
pub struct StatsReader(Arc<EngineStats>);

impl StatsReader {
    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        self.0.snapshot()
    }
}

impl std::fmt::Debug for StatsReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StatsReader").field(&self.snapshot()).finish()
    }
}

/// Controls a running engine.
pub struct EngineHandle {
    stopper: Stopper,
    task: JoinHandle<Result<EngineReport, EngineError>>,
    shard_aborts: Vec<AbortHandle>,
    stats: Arc<EngineStats>,
    inspector: Inspector,
    pauser: Pauser,
}

impl EngineHandle {
    /// An engine that ends at once with `error` (a configuration that does not fit its
    /// subscription), leaving the group first.
    fn unfit(subscription: Subscription, error: ConfigError) -> EngineHandle {
        let (signals, _) = watch::channel(0u8);
        let (inspector, _) = mpsc::channel(1);
        let (pauser, _) = mpsc::channel(1);
        let control = subscription.control;
        let stats = Arc::new(EngineStats::new(0));
        EngineHandle {
            stopper: Stopper(Arc::new(signals)),
            task: tokio::spawn(stats::marks_ended(stats.clone(), async move {
                let _ = control.close().await;
                Err(EngineError::Config(error))
            })),
            shard_aborts: Vec::new(),
            stats,
            inspector: Inspector(inspector),
            pauser: Pauser(pauser),
        }
    }

    /// Asks for a graceful shutdown: stop fetching, let lanes finish (up to the drain
    /// timeout), commit, close. A second call aborts the drain (then commits what finished).
    pub fn shutdown(&self) {
        self.stopper.shutdown();
    }

    /// A handle that can ask for (and escalate) a stop while this one is awaited.
    pub fn stopper(&self) -> Stopper {
        self.stopper.clone()
    }

    /// Waits for the engine to stop: its report, or why it failed.
    pub async fn join(self) -> Result<EngineReport, EngineError> {
        self.task.await.map_err(|e| EngineError::Crashed(e.to_string()))?
    }

    /// Runs until `stop` completes — a signal (`convoy::shutdown_signal()`), an application's
    /// `CancellationToken::cancelled()`, any future — then shuts down gracefully and returns
    /// the report. Returns earlier if the engine ends by itself (its transport closed the
    /// subscription, a message limit was reached, a failure). A [`Stopper`] taken before can
    /// still escalate the stop (abort the drain).
    pub async fn run_until(
        self,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<EngineReport, EngineError> {
        let stopper = self.stopper();
        let join = self.join();
        tokio::pin!(join);
        tokio::select! {
            report = &mut join => return report,
            () = stop => stopper.shutdown(),
        }
        join.await
    }

    /// Shuts down gracefully and waits.
    pub async fn stop(self) -> Result<EngineReport, EngineError> {
        self.shutdown();
        self.join().await
    }

    /// Kills the engine at once, as a crash would: no drain, no commit, the subscription is
    /// dropped without closing. Its sources go back to the broker at their committed watermarks.
    pub async fn abort(self) {
        // Shards first, and wait until they are gone: a dead process runs no handler, so no
        // handler of this engine may still run once its sources are handed to another member.
        for shard in &self.shard_aborts {
            shard.abort();
        }
        while !self.shard_aborts.iter().all(AbortHandle::is_finished) {
            tokio::task::yield_now().await;
        }
        self.task.abort();
        let _ = self.task.await;
    }

    /// Live counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Asks the engine what it is doing (sources, the longest-running and most-queued lanes),
    /// from anywhere while the handle is awaited.
    pub fn inspector(&self) -> Inspector {
        self.inspector.clone()
    }

    /// Pauses and resumes keys and sources, from anywhere while the handle is awaited.
    pub fn pauser(&self) -> Pauser {
        self.pauser.clone()
    }

    /// The live counters, readable from anywhere while the handle is awaited (by
    /// [`run_until`](Self::run_until), say).
    pub fn stats_reader(&self) -> StatsReader {
        StatsReader(self.stats.clone())
    }

    /// True once the engine task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}
