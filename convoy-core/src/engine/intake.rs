//! The intake: the engine's control task. It takes events from the transport, tracks each
//! source's watermark, routes messages to shards by key, applies back-pressure, commits, and
//! runs the revoke and shutdown drains.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::shard::{Completion, Epochs, LaneKey, ShardCommand, Work};
use super::stats::EngineStats;
use super::EngineReport;
use crate::backpressure::Gate;
use crate::config::{EngineConfig, KeylessPolicy};
use crate::message::{Message, Offset, SourceId};
use crate::metrics::IntakeMetrics;
use crate::transport::{Assignment, Commit, RevokeAck, SourceControl, SourceEvent, Subscription};
use crate::watermark::{Seq, WatermarkTracker};

/// Salt for key → shard hashing. Brokers partition by a hash of the key too (Kafka: murmur2);
/// hashing the keys of one partition again with the same function would pile them onto few
/// shards, so shards use a different, seeded hash.
const SHARD_SALT: u64 = 0x636f_6e76_6f79_5348;

struct SourceState {
    id: SourceId,
    epoch: u64,
    tracker: WatermarkTracker,
    /// Finished offsets above the committed watermark, ascending, to skip on receipt.
    skip: Vec<Offset>,
    skip_next: usize,
    held: usize,
    gate: Gate,
    /// What the transport was last told; `None` right after an assignment, so the desired
    /// state is always re-applied (a transport may keep a pause flag from an earlier
    /// assignment of the same source, as librdkafka does).
    fetch_paused: Option<bool>,
    committed: Option<Offset>,
    dirty: bool,
    /// The lowest unfinished message and since when it has been the lowest.
    head_since: Option<(Seq, Instant)>,
    stuck_reported: Option<Seq>,
}

pub(crate) struct Intake {
    config: EngineConfig,
    control: Arc<dyn SourceControl>,
    /// The lag query in flight, if any (asked of the transport off the intake's own loop).
    lag_probe: Option<tokio::task::JoinHandle<()>>,
    last_lag_probe: Instant,
    events: mpsc::Receiver<SourceEvent>,
    completions: mpsc::UnboundedReceiver<Vec<Completion>>,
    shards: Vec<mpsc::UnboundedSender<ShardCommand>>,
    shard_tasks: JoinSet<()>,
    sources: Vec<Option<SourceState>>,
    by_id: HashMap<SourceId, u32>,
    next_epoch: u64,
    next_solo: u64,
    held_total: usize,
    total_gate: Gate,
    finished_since_commit: usize,
    last_commit: Instant,
    shard_hasher: foldhash::fast::FixedState,
    routes: Vec<Vec<Work>>,
    stats: Arc<EngineStats>,
    metrics: IntakeMetrics,
    signals: watch::Receiver<u8>,
    signals_open: bool,
}

pub(crate) struct IntakeParts {
    pub config: EngineConfig,
    pub subscription: Subscription,
    pub completions: mpsc::UnboundedReceiver<Vec<Completion>>,
    pub shards: Vec<mpsc::UnboundedSender<ShardCommand>>,
    pub shard_tasks: JoinSet<()>,
    pub stats: Arc<EngineStats>,
    pub signals: watch::Receiver<u8>,
}

impl Intake {
    pub fn new(parts: IntakeParts) -> Self {
        let bp = parts.config.back_pressure;
        let shard_count = parts.shards.len();
        Intake {
            metrics: IntakeMetrics::new(&parts.config.group),
            config: parts.config,
            control: Arc::from(parts.subscription.control),
            lag_probe: None,
            last_lag_probe: Instant::now(),
            events: parts.subscription.events,
            completions: parts.completions,
            shards: parts.shards,
            shard_tasks: parts.shard_tasks,
            sources: Vec::new(),
            by_id: HashMap::new(),
            next_epoch: 1,
            next_solo: 0,
            held_total: 0,
            total_gate: Gate::new(bp.total_high, bp.total_low),
            finished_since_commit: 0,
            last_commit: Instant::now(),
            shard_hasher: foldhash::fast::FixedState::with_seed(SHARD_SALT),
            routes: (0..shard_count).map(|_| Vec::new()).collect(),
            stats: parts.stats,
            signals: parts.signals,
            signals_open: true,
        }
    }

    /// Runs until shutdown is signalled or the transport closes, then drains and commits.
    pub async fn run(mut self) -> EngineReport {
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
            // Read the signal count itself, not just change notifications: a drain may already
            // have observed the change.
            if self.signal_count() > 0 {
                break;
            }
            tokio::select! {
                biased;
                changed = self.signals.changed(), if self.signals_open => {
                    // A dropped handle means nobody can ask for shutdown any more: run on.
                    self.signals_open = changed.is_ok();
                }
                Some(batch) = self.completions.recv() => self.on_completions(batch),
                event = self.events.recv() => match event {
                    Some(event) => self.on_event(event).await,
                    None => {
                        tracing::info!("transport closed the subscription; draining");
                        break;
                    }
                },
                _ = tick.tick() => self.on_tick().await,
            }
            if self.finished_since_commit >= self.config.commit_every {
                self.commit(None).await;
            }
        }
        self.shutdown().await
    }

    fn signal_count(&self) -> u8 {
        *self.signals.borrow()
    }

    fn state(&mut self, slot: u32) -> Option<&mut SourceState> {
        self.sources.get_mut(slot as usize).and_then(Option::as_mut)
    }

    async fn on_event(&mut self, event: SourceEvent) {
        match event {
            SourceEvent::Messages { source, messages } => self.on_messages(source, messages),
            SourceEvent::Assigned(assignments) => {
                for a in assignments {
                    self.assign(a).await;
                }
                self.apply_flow();
            }
            SourceEvent::Revoked { sources, ack } => self.revoke(sources, ack).await,
            SourceEvent::Lost(sources) => {
                tracing::warn!(?sources, "sources lost without a revoke; their unfinished work will be redelivered to the next owner");
                let slots: Vec<u32> = sources
                    .iter()
                    .filter_map(|s| self.by_id.get(s).copied())
                    .collect();
                self.cancel_slots(&slots).await;
                for slot in slots {
                    self.remove(slot);
                }
                self.apply_flow();
            }
        }
    }

    fn lane_key(&mut self, message: &Message, epoch: u64) -> LaneKey {
        match (&message.key, self.config.keyless) {
            (Some(key), _) => LaneKey::Key(key.clone()),
            (None, KeylessPolicy::PerSource) => LaneKey::Source(epoch),
            (None, KeylessPolicy::Unordered | KeylessPolicy::DeadLetter) => {
                self.next_solo += 1;
                LaneKey::Solo(self.next_solo)
            }
        }
    }

    fn on_messages(&mut self, source: SourceId, messages: Vec<Message>) {
        let Some(&slot) = self.by_id.get(&source) else {
            // Fetched under an assignment that has ended: the next owner reads them again.
            tracing::debug!(%source, count = messages.len(), "ignoring messages of a source not assigned to this consumer");
            return;
        };
        let received = Instant::now();
        let shard_count = self.shards.len();
        let mut routed = 0usize;
        for message in messages {
            let Some(state) = self.sources[slot as usize].as_mut() else {
                return;
            };
            let seq = match state.tracker.receive(message.offset) {
                Ok(seq) => seq,
                Err(e) => {
                    tracing::warn!(%source, error = %e, "transport broke offset order; ignoring the repeated message");
                    continue;
                }
            };
            // Skip offsets known finished (from commit metadata) instead of handling them again.
            while state
                .skip
                .get(state.skip_next)
                .is_some_and(|&o| o < message.offset)
            {
                state.skip_next += 1;
            }
            if state.skip.get(state.skip_next) == Some(&message.offset) {
                state.skip_next += 1;
                state.dirty |= state.tracker.finish(seq);
                continue;
            }
            let epoch = state.epoch;
            let lane = self.lane_key(&message, epoch);
            let shard = match &lane {
                LaneKey::Key(key) => (self.shard_hasher.hash_one(key) % shard_count as u64) as usize,
                other => (self.shard_hasher.hash_one(other) % shard_count as u64) as usize,
            };
            self.routes[shard].push(Work {
                message,
                lane,
                slot,
                epoch,
                seq,
                received,
            });
            routed += 1;
        }
        if let Some(state) = self.state(slot) {
            state.held += routed;
        }
        self.held_total += routed;
        self.metrics.consumed.increment(routed as u64);
        for (shard, route) in self.routes.iter_mut().enumerate() {
            if !route.is_empty() {
                let batch = std::mem::take(route);
                // A shard only stops when the intake drops it; a failed send means it panicked.
                if self.shards[shard].send(ShardCommand::Work(batch)).is_err() {
                    tracing::error!(
                        shard,
                        "shard task is gone; its messages stay unfinished and uncommitted"
                    );
                }
            }
        }
        self.publish_held();
        self.apply_flow();
    }

    fn on_completions(&mut self, batch: Vec<Completion>) {
        let mut finished = 0usize;
        for c in batch {
            let Some(state) = self.sources.get_mut(c.slot as usize).and_then(Option::as_mut) else {
                continue;
            };
            // A completion of an earlier assignment of this slot is never committed.
            if state.epoch != c.epoch {
                continue;
            }
            state.dirty |= state.tracker.finish(c.seq);
            state.held = state.held.saturating_sub(1);
            finished += 1;
        }
        self.held_total = self.held_total.saturating_sub(finished);
        self.finished_since_commit += finished;
        self.publish_held();
        self.apply_flow();
    }

    fn publish_held(&self) {
        let s = &self.stats.intake;
        s.held.store(self.held_total, Relaxed);
        s.peak_held.fetch_max(self.held_total, Relaxed);
        self.metrics.in_flight.set(self.held_total as f64);
    }

    /// Re-evaluates every gate and pauses or resumes fetching where a gate flipped.
    fn apply_flow(&mut self) {
        self.total_gate.update(self.held_total);
        let total_paused = self.total_gate.is_paused();
        let mut pause = Vec::new();
        let mut resume = Vec::new();
        for state in self.sources.iter_mut().flatten() {
            state.gate.update(state.held);
            let want = total_paused || state.gate.is_paused();
            if state.fetch_paused != Some(want) {
                state.fetch_paused = Some(want);
                if want {
                    pause.push(state.id.clone());
                } else {
                    resume.push(state.id.clone());
                }
            }
        }
        if !pause.is_empty() {
            self.stats.intake.pauses.fetch_add(pause.len() as u64, Relaxed);
            tracing::debug!(sources = ?pause, held = self.held_total, "back-pressure: pausing fetch");
            if let Err(e) = self.control.pause(&pause) {
                tracing::warn!(error = %e, "pausing fetch failed; messages keep arriving and are kept");
            }
        }
        if !resume.is_empty() {
            tracing::debug!(sources = ?resume, held = self.held_total, "back-pressure: resuming fetch");
            if let Err(e) = self.control.resume(&resume) {
                tracing::warn!(error = %e, "resuming fetch failed");
            }
        }
        let paused = self
            .sources
            .iter()
            .flatten()
            .filter(|s| s.fetch_paused == Some(true))
            .count();
        self.stats.intake.paused_sources.store(paused, Relaxed);
        self.metrics.paused_sources.set(paused as f64);
    }

    async fn assign(&mut self, a: Assignment) {
        if let Some(&slot) = self.by_id.get(&a.source) {
            tracing::warn!(source = %a.source, "source assigned again without a revoke; restarting it from the committed watermark");
            self.cancel_slots(&[slot]).await;
            self.remove(slot);
        }
        let bp = self.config.back_pressure;
        let mut skip: Vec<Offset> = a
            .finished_above
            .into_iter()
            .filter(|&o| a.committed.is_none_or(|c| o > c))
            .collect();
        skip.sort_unstable();
        skip.dedup();
        let state = SourceState {
            id: a.source.clone(),
            epoch: self.next_epoch,
            tracker: WatermarkTracker::new(a.committed),
            skip,
            skip_next: 0,
            held: 0,
            gate: Gate::new(bp.source_high, bp.source_low),
            fetch_paused: None,
            committed: a.committed,
            dirty: false,
            head_since: None,
            stuck_reported: None,
        };
        self.next_epoch += 1;
        tracing::info!(source = %a.source, committed = ?a.committed, "source assigned");
        let slot = match self.sources.iter().position(Option::is_none) {
            Some(free) => {
                self.sources[free] = Some(state);
                free as u32
            }
            None => {
                self.sources.push(Some(state));
                (self.sources.len() - 1) as u32
            }
        };
        self.by_id.insert(a.source, slot);
        self.stats.intake.sources.store(self.by_id.len(), Relaxed);
    }

    /// Forgets a source: its held messages no longer count, later completions are ignored.
    fn remove(&mut self, slot: u32) {
        if let Some(state) = self.sources.get_mut(slot as usize).and_then(Option::take) {
            self.held_total = self.held_total.saturating_sub(state.held);
            self.by_id.remove(&state.id);
        }
        self.stats.intake.sources.store(self.by_id.len(), Relaxed);
        self.publish_held();
    }

    fn epochs(&self, slots: &[u32]) -> Vec<u64> {
        slots
            .iter()
            .filter_map(|&s| {
                self.sources
                    .get(s as usize)
                    .and_then(Option::as_ref)
                    .map(|st| st.epoch)
            })
            .collect()
    }

    /// Sends a command to every live shard and collects their replies.
    async fn ask_shards<T>(&self, command: impl Fn(oneshot::Sender<T>) -> ShardCommand) -> Vec<T> {
        let mut replies = Vec::with_capacity(self.shards.len());
        for shard in &self.shards {
            let (reply, rx) = oneshot::channel();
            if shard.send(command(reply)).is_ok() {
                replies.push(rx);
            }
        }
        let mut answers = Vec::with_capacity(replies.len());
        for rx in replies {
            // A shard that died without answering has nothing left to report.
            if let Ok(answer) = rx.await {
                answers.push(answer);
            }
        }
        answers
    }

    /// Asks every shard to drop queued messages of `epochs`; returns drops per epoch.
    async fn drop_queued(&mut self, epochs: Epochs) -> HashMap<u64, usize> {
        let answers = self
            .ask_shards(|reply| ShardCommand::DropQueued {
                epochs: epochs.clone(),
                reply,
            })
            .await;
        let mut dropped = HashMap::new();
        for (epoch, n) in answers.into_iter().flatten() {
            *dropped.entry(epoch).or_insert(0) += n;
        }
        dropped
    }

    /// Asks every shard to abort in-flight messages of `epochs`, and waits until they did.
    async fn cancel(&mut self, epochs: Epochs) {
        self.ask_shards(|reply| ShardCommand::Cancel {
            epochs: epochs.clone(),
            reply,
        })
        .await;
    }

    /// Drops queued and aborts in-flight work of these sources.
    async fn cancel_slots(&mut self, slots: &[u32]) {
        let epochs = self.epochs(slots);
        if epochs.is_empty() {
            return;
        }
        self.drop_queued(Epochs::Some(epochs.clone())).await;
        self.cancel(Epochs::Some(epochs)).await;
    }

    /// Waits for the held messages of `slots` (all if `None`) to finish, until `deadline` or a
    /// second shutdown signal. Returns true when they all finished.
    async fn drain(&mut self, slots: Option<&[u32]>, deadline: Instant) -> bool {
        loop {
            let remaining: usize = match slots {
                Some(slots) => slots
                    .iter()
                    .filter_map(|&s| self.sources.get(s as usize).and_then(Option::as_ref))
                    .map(|st| st.held)
                    .sum(),
                None => self.held_total,
            };
            if remaining == 0 {
                return true;
            }
            tokio::select! {
                batch = self.completions.recv() => match batch {
                    Some(batch) => self.on_completions(batch),
                    None => return false,
                },
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(remaining, "drain timeout reached; cancelling unfinished messages (they stay uncommitted and are redelivered)");
                    return false;
                }
                changed = self.signals.changed(), if self.signals_open => {
                    self.signals_open = changed.is_ok();
                    if self.signal_count() > 1 {
                        tracing::warn!(remaining, "second shutdown signal: aborting the drain");
                        return false;
                    }
                }
            }
        }
    }

    async fn revoke(&mut self, sources: Vec<SourceId>, ack: RevokeAck) {
        let slots: Vec<u32> = sources
            .iter()
            .filter_map(|s| self.by_id.get(s).copied())
            .collect();
        tracing::info!(
            ?sources,
            "sources revoked; draining in-flight work before committing"
        );
        let epochs = self.epochs(&slots);
        // Not-yet-started messages belong to the next owner now.
        let dropped = self.drop_queued(Epochs::Some(epochs.clone())).await;
        let mut dropped_total = 0;
        for &slot in &slots {
            if let Some(state) = self.state(slot) {
                let n = dropped.get(&state.epoch).copied().unwrap_or(0);
                state.held = state.held.saturating_sub(n);
                dropped_total += n;
            }
        }
        self.held_total = self.held_total.saturating_sub(dropped_total);
        let deadline = Instant::now() + self.config.drain_timeout;
        if !self.drain(Some(&slots), deadline).await {
            self.cancel(Epochs::Some(epochs)).await;
        }
        self.commit(Some(&slots)).await;
        for slot in slots {
            self.remove(slot);
        }
        ack.done();
        self.apply_flow();
    }

    /// Commits dirty watermarks (of `only` these slots, or all).
    async fn commit(&mut self, only: Option<&[u32]>) {
        let wants_above = self.control.wants_finished_above();
        let mut commits = Vec::new();
        let mut slots = Vec::new();
        for (slot, state) in self.sources.iter().enumerate() {
            let Some(state) = state else { continue };
            if only.is_some_and(|o| !o.contains(&(slot as u32))) || !state.dirty {
                continue;
            }
            let Some(watermark) = state.tracker.watermark() else {
                continue;
            };
            commits.push(Commit {
                source: state.id.clone(),
                watermark,
                finished_above: if wants_above {
                    state.tracker.finished_above()
                } else {
                    Vec::new()
                },
            });
            slots.push((slot, watermark));
        }
        if only.is_none() {
            self.finished_since_commit = 0;
            self.last_commit = Instant::now();
        }
        if commits.is_empty() {
            return;
        }
        match self.control.commit(&commits).await {
            Ok(()) => {
                self.stats.intake.commits.fetch_add(1, Relaxed);
                for (slot, watermark) in slots {
                    if let Some(state) = self.sources[slot].as_mut() {
                        state.committed = Some(watermark);
                        state.dirty = state.tracker.watermark() != Some(watermark);
                    }
                }
                tracing::trace!(?commits, "committed");
            }
            Err(e) => {
                self.metrics.commit_failures.increment(1);
                tracing::warn!(error = %e, "commit failed; retrying on the next tick");
            }
        }
    }

    async fn on_tick(&mut self) {
        if self.last_commit.elapsed() >= self.config.commit_interval {
            self.commit(None).await;
        }
        self.check_stuck();
        self.report_gauges();
    }

    /// Dead-letters a source's lowest unfinished message once it held the watermark back
    /// longer than the stuck timeout.
    fn check_stuck(&mut self) {
        let Some(limit) = self.config.stuck_timeout else {
            return;
        };
        let now = Instant::now();
        let mut stuck = Vec::new();
        for state in self.sources.iter_mut().flatten() {
            match state.tracker.lowest_unfinished() {
                None => state.head_since = None,
                Some((seq, offset)) => {
                    let since = match state.head_since {
                        Some((s, since)) if s == seq => since,
                        _ => {
                            state.head_since = Some((seq, now));
                            now
                        }
                    };
                    let waited = now - since;
                    if waited >= limit && state.stuck_reported != Some(seq) {
                        state.stuck_reported = Some(seq);
                        tracing::error!(source = %state.id, offset, ?waited, "operational failure: the watermark is stuck behind this offset");
                        stuck.push((state.epoch, seq, waited));
                    }
                }
            }
        }
        for (epoch, seq, waited) in stuck {
            self.metrics.stuck.increment(1);
            for shard in &self.shards {
                let _ = shard.send(ShardCommand::Stuck { epoch, seq, waited });
            }
        }
    }

    fn report_gauges(&mut self) {
        let lanes: usize = self.stats.shards.iter().map(|s| s.lanes.load(Relaxed)).sum();
        self.metrics.active_lanes.set(lanes as f64);
        // Lag is asked of the transport (not derived from fetched messages) so it shows while
        // paused. The query may be a broker round-trip: run it beside the loop, one at a time.
        let busy = self.lag_probe.as_ref().is_some_and(|probe| !probe.is_finished());
        if busy || self.last_lag_probe.elapsed() < self.config.commit_interval.max(Duration::from_millis(100))
        {
            return;
        }
        self.last_lag_probe = Instant::now();
        let snapshot: Vec<(SourceId, Option<Offset>, Option<Offset>)> = self
            .sources
            .iter()
            .flatten()
            .map(|s| (s.id.clone(), s.tracker.watermark(), s.committed))
            .collect();
        if snapshot.is_empty() {
            return;
        }
        let control = self.control.clone();
        let group = self.config.group.clone();
        self.lag_probe = Some(tokio::spawn(async move {
            let ids: Vec<SourceId> = snapshot.iter().map(|(id, _, _)| id.clone()).collect();
            let newest = control.last_offsets(&ids).await;
            for ((id, watermark, committed), newest) in snapshot.iter().zip(newest) {
                let lag =
                    newest.map(|n| n.saturating_sub(committed.unwrap_or(0)) + u64::from(committed.is_none()));
                IntakeMetrics::source_gauges(&group, id.as_str(), *watermark, lag);
            }
        }));
    }

    /// Stops fetching, lets lanes finish (bounded), commits, and closes the transport.
    async fn shutdown(mut self) -> EngineReport {
        let ids: Vec<SourceId> = self.sources.iter().flatten().map(|s| s.id.clone()).collect();
        tracing::info!(held = self.held_total, "shutting down: draining lanes");
        if !ids.is_empty() {
            if let Err(e) = self.control.pause(&ids) {
                tracing::warn!(error = %e, "could not pause fetching for shutdown");
            }
        }
        let deadline = Instant::now() + self.config.drain_timeout;
        if !self.drain(None, deadline).await {
            // Unfinished work is not dead-lettered: it stays uncommitted and is redelivered.
            self.drop_queued(Epochs::All).await;
            self.cancel(Epochs::All).await;
        }
        self.commit(None).await;
        let committed = self
            .sources
            .iter()
            .flatten()
            .filter_map(|s| s.committed.map(|c| (s.id.clone(), c)))
            .collect();
        if let Err(e) = self.control.close().await {
            tracing::warn!(error = %e, "closing the transport failed");
        }
        self.shards.clear();
        while self.shard_tasks.join_next().await.is_some() {}
        let stats = self.stats.snapshot();
        tracing::info!(?stats, "engine stopped");
        EngineReport { stats, committed }
    }
}
