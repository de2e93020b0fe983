//! The simulated world: a memory broker, the members of one group (engines) on it, producers,
//! an operator replaying parked keys, and the faults. [`World::run`] plays a seed: a faulty
//! phase of steps (each may produce, inject a fault, and advances the virtual clock a little),
//! then the world heals and must settle: every message handled or dead-lettered with its
//! reason, every parked key replayed, every position committed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use convoy_core::parking::{replay_key, resume_replay, ParkedKeys, PublisherFor};
use convoy_core::{
    BackPressure, Backoff, Engine, EngineConfig, EngineHandle, Jitter, OutgoingMessage, PauseTarget,
    Publisher, Receipt, RetryPolicy, SourceId, TransportError,
};
use convoy_memory::{MemoryBroker, MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::handler::SimHandler;
use crate::ledger::{show, Produced};
use crate::oracle::{self, Scene};
use crate::plan::{Plan, DLQ, GROUP, OUT};
use crate::shared::Shared;
use crate::sink::{FaultySink, SinkFaults};

/// A member of the group: a running engine.
struct Member {
    index: usize,
    /// Its id in the broker's group.
    broker_id: u64,
    handle: EngineHandle,
}

/// A graceful stop under way, and when it must be over.
struct Stopping {
    index: usize,
    deadline: Instant,
    task: JoinHandle<()>,
    /// What the stop left uncommitted, once it ended.
    uncommitted: Arc<Mutex<Option<u64>>>,
}

pub struct World {
    pub plan: Plan,
    rng: fastrand::Rng,
    pub broker: MemoryBroker,
    pub shared: Arc<Shared>,
    sink_faults: Arc<Mutex<SinkFaults>>,
    members: Vec<Member>,
    stopping: Vec<Stopping>,
    next_member: usize,
    /// Messages published so far, and the next key sequence per key.
    produced: u64,
    /// What a graceful stop may take, at most.
    shutdown_timeout: Duration,
    /// Until when commits may have been refused by a fault (a stop's commit is excused then).
    commit_trouble_until: Instant,
    /// Members whose connection dropped (their commits are refused).
    lost: std::collections::BTreeSet<usize>,
}

impl World {
    pub fn new(plan: Plan, shared: Arc<Shared>) -> World {
        let broker = shared.broker.clone();
        for topic in &plan.topics {
            broker.create_topic(&topic.name, topic.partitions);
        }
        broker.create_topic(DLQ, 1);
        broker.create_topic(OUT, 1 + (plan.seed % 3) as u32);
        broker.set_faults(|f| {
            f.rebalance_timeout = plan.rebalance_timeout;
            f.session_timeout = plan.session_timeout;
            f.max_batch = 4;
            f.offset_gap_every = plan.offset_gap_every;
            // Kafka aborts a transaction that outlives its timeout: here, one much larger than
            // the outbox's bound (a backlog committed whole).
            f.max_transaction_bytes = Some(plan.transaction_bytes.max(200) * 4);
        });
        World {
            rng: fastrand::Rng::with_seed(plan.seed ^ 0x5eed),
            plan,
            broker,
            shared,
            sink_faults: Arc::default(),
            members: Vec::new(),
            stopping: Vec::new(),
            next_member: 0,
            produced: 0,
            shutdown_timeout: Duration::from_secs(4),
            commit_trouble_until: Instant::now(),
            lost: std::collections::BTreeSet::new(),
        }
    }

    fn event(&self, what: impl std::fmt::Display) {
        self.shared.ledger().trace.event(what);
    }

    /// The engine configuration of every member: short timers, small bounds.
    fn config(&self) -> EngineConfig {
        let mut config = EngineConfig::for_group(GROUP);
        config.shards = 2;
        config.commit_interval = Duration::from_millis(100);
        config.commit_timeout = Duration::from_millis(500);
        config.commit_every = 8;
        config.drain_timeout = self.plan.rebalance_timeout / 2;
        config.drain = self.plan.drain;
        config.shutdown_timeout = self.shutdown_timeout;
        config.stuck_timeout = self.plan.stuck_timeout;
        config.keyless = self.plan.keyless;
        config.park_keys = self.plan.park_keys;
        config.park_checkpoint_after = self.plan.park_checkpoint_after;
        let mut retry = RetryPolicy::with_backoff(Backoff::new(
            Duration::from_millis(5),
            2.0,
            Duration::from_millis(100),
            Jitter::Full,
        ));
        retry.max_attempts = Some(4);
        config.retry = retry;
        config.dead_letter_backoff = Backoff::new(
            Duration::from_millis(10),
            2.0,
            Duration::from_millis(200),
            Jitter::Full,
        );
        let total_high = self.plan.total_high;
        let mut bounds = BackPressure::default();
        bounds.source_high = self.plan.source_high;
        bounds.source_low = self.plan.source_high / 2;
        bounds.total_high = total_high;
        bounds.total_low = total_high / 2;
        bounds.window_high = self.plan.source_high * 4;
        bounds.window_low = self.plan.source_high * 2;
        if self.plan.transform {
            bounds.total_bytes_high = self.plan.bytes_high;
            bounds.total_bytes_low = self.plan.bytes_high / 2;
        }
        config.back_pressure = bounds;
        config
    }

    fn topics(&self) -> Vec<&str> {
        self.plan.topics.iter().map(|t| t.name.as_str()).collect()
    }

    /// Starts a new member.
    pub async fn join(&mut self) {
        let index = self.next_member;
        self.next_member += 1;
        let handler = SimHandler {
            member: index,
            shared: self.shared.clone(),
        };
        let sink = FaultySink {
            inner: MemoryDeadLetterSink::new(&self.broker, DLQ),
            faults: self.sink_faults.clone(),
            member: index,
            shared: self.shared.clone(),
        };
        let builder = match self.plan.transform {
            true => Engine::transform_builder(handler),
            false => Engine::builder(handler),
        };
        let engine = match builder.config(self.config()).dead_letter_sink(sink).build() {
            Ok(engine) => engine,
            Err(e) => {
                self.shared
                    .ledger()
                    .violation(format!("the simulator's engine configuration is refused: {e}"));
                return;
            }
        };
        let before = self.broker.members(GROUP);
        let mut transport = MemoryTransport::new(&self.broker, GROUP, &self.topics());
        if self.plan.transform {
            transport = transport.max_transaction_bytes(self.plan.transaction_bytes);
        }
        if self.plan.delivery_offsets {
            transport = transport.delivery_offsets();
        }
        match engine.start(&transport).await {
            Ok(handle) => {
                let broker_id = self
                    .broker
                    .members(GROUP)
                    .into_iter()
                    .find(|m| !before.contains(m))
                    .unwrap_or(u64::MAX);
                self.event(format_args!("m{index} joins (broker member {broker_id})"));
                self.members.push(Member {
                    index,
                    broker_id,
                    handle,
                });
            }
            Err(e) => self
                .shared
                .ledger()
                .violation(format!("m{index} could not start: {e}")),
        }
    }

    /// A member is killed: no drain, no commit; its sources go back to the broker.
    async fn crash(&mut self) {
        if self.members.is_empty() {
            return;
        }
        let member = self.members.remove(self.rng.usize(..self.members.len()));
        self.event(format_args!("m{} crashes", member.index));
        self.shared.ledger().departed(member.index);
        member.handle.abort().await;
    }

    /// A member stops gracefully (its stop must end by the shutdown timeout).
    fn stop(&mut self) {
        if self.members.is_empty() {
            return;
        }
        let member = self.members.remove(self.rng.usize(..self.members.len()));
        self.event(format_args!("m{} stops", member.index));
        self.shared.ledger().departed(member.index);
        let shared = self.shared.clone();
        let index = member.index;
        let uncommitted = Arc::new(Mutex::new(None));
        let left = uncommitted.clone();
        let task = tokio::spawn(async move {
            match member.handle.stop().await {
                Ok(report) => {
                    shared.ledger().trace.event(format_args!(
                        "m{index} stopped: {} handled, {} cancelled, {} left uncommitted",
                        report.stats.handled, report.cancelled, report.uncommitted
                    ));
                    *left.lock().unwrap_or_else(|p| p.into_inner()) = Some(report.uncommitted);
                }
                Err(e) => shared
                    .ledger()
                    .violation(format!("m{index} failed while stopping: {e}")),
            }
        });
        self.stopping.push(Stopping {
            index,
            // A little slack over the timeout: the close and the handle's own return.
            deadline: Instant::now() + self.shutdown_timeout + Duration::from_millis(100),
            task,
            uncommitted,
        });
    }

    /// A member's connection drops: it loses its sources.
    fn lose(&mut self) {
        if self.members.is_empty() {
            return;
        }
        let member = &self.members[self.rng.usize(..self.members.len())];
        self.event(format_args!("m{} loses its connection", member.index));
        self.shared.ledger().departed(member.index);
        self.lost.insert(member.index);
        self.broker.drop_connection(member.broker_id);
    }

    /// Publishes up to `count` more messages.
    async fn produce(&mut self, count: usize) {
        for _ in 0..count {
            if self.produced as usize >= self.plan.messages {
                return;
            }
            let n = self.produced;
            self.produced += 1;
            let rates = &self.plan.rates;
            let topic = self.plan.topics[self.rng.usize(..self.plan.topics.len())]
                .name
                .clone();
            let key: Option<Bytes> = if self.rng.f64() < rates.keyless {
                None
            } else if self.rng.f64() < rates.empty_key {
                Some(Bytes::new())
            } else {
                Some(Bytes::from(format!("k{}", self.rng.usize(..self.plan.keys))))
            };
            let payload = Bytes::from(n.to_string());
            let mut message = match &key {
                Some(key) => OutgoingMessage::new(key.clone(), payload),
                None => OutgoingMessage::keyless(payload),
            };
            let has_id = self.rng.f64() >= rates.no_id;
            if has_id {
                message = message.event_id(format!("id-{n}"));
            }
            // A producer's retry of a keyed message lands beside the first (keyless ones go round
            // robin: another partition's lane, ordered there).
            let keyed = key.as_ref().is_some_and(|k| !k.is_empty());
            let twice = has_id && keyed && self.rng.f64() < rates.duplicate;
            let copies = if twice { 2 } else { 1 };
            for copy in 0..copies {
                match self.broker.publish(&topic, message.clone()) {
                    Ok(Receipt { source, offset }) => {
                        self.event(format_args!(
                            "produce #{n} key {} to {source}@{offset}{}{}",
                            show(&key),
                            if has_id { "" } else { " (no id)" },
                            if copy > 0 { " again" } else { "" }
                        ));
                        self.shared.ledger().produced(Produced {
                            n,
                            key: key.clone(),
                            source,
                            offset,
                            has_id,
                        });
                    }
                    Err(e) => self.shared.ledger().violation(format!("publishing #{n}: {e}")),
                }
            }
        }
    }

    /// The operator's view of the parked keys (a healthy read of the destination).
    fn parked_keys(&self) -> ParkedKeys {
        ParkedKeys::read(GROUP, &self.broker.read_all(DLQ))
    }

    /// The operator replays a parked key (or resumes one whose replay is under way); with
    /// `die_after`, the replay tool dies after publishing that many copies.
    async fn replay(&mut self, die_after: Option<usize>) {
        let keys = self.parked_keys();
        let mut parked: Vec<(Bytes, bool)> = keys
            .iter()
            .map(|(key, parking)| (key.clone(), parking.replaying().is_some()))
            .collect();
        parked.sort();
        if parked.is_empty() {
            return;
        }
        let (key, under_way) = parked[self.rng.usize(..parked.len())].clone();
        let sink = MemoryDeadLetterSink::new(&self.broker, DLQ);
        let broker = self.broker.clone();
        let left = Arc::new(Mutex::new(die_after));
        let publisher: &PublisherFor<'_> = &move |topic: &str| {
            Ok(Arc::new(DyingPublisher {
                inner: MemoryPublisher::new(&broker, topic),
                left: left.clone(),
            }) as Arc<dyn Publisher>)
        };
        let shown = show(&Some(key.clone()));
        let result = if under_way {
            resume_replay(GROUP, &key, &sink, publisher).await
        } else {
            replay_key(GROUP, &key, &sink, publisher).await
        };
        let verb = if under_way { "resumes" } else { "replays" };
        match result {
            Ok(replay) => self.event(format_args!(
                "operator {verb} key {shown}: {} messages (replay {})",
                replay.records.len(),
                replay.id
            )),
            Err(e) => self.event(format_args!("operator {verb} key {shown}: stopped ({e})")),
        }
    }

    /// Plays the faulty phase, then heals the world and lets it settle.
    pub async fn run(mut self) {
        for _ in 0..self.plan.members {
            self.join().await;
        }
        let burst = (self.plan.messages / self.plan.steps.max(1)).max(1) + 1;
        for _ in 0..self.plan.steps {
            let count = self.rng.usize(0..=burst * 2);
            self.produce(count).await;
            self.inject().await;
            let pause = Duration::from_millis(self.rng.u64(1..=250));
            tokio::time::sleep(pause).await;
            self.check();
            if self.failed() {
                oracle::dump_dead_letters(&self.scene());
                return; // the trace ends at the first violation
            }
        }
        self.produce(self.plan.messages).await;
        self.settle().await;
    }

    /// True once an invariant was violated.
    fn failed(&self) -> bool {
        !self.shared.ledger().violations.is_empty()
    }

    /// Maybe injects one fault of each kind, as the plan's rates say.
    async fn inject(&mut self) {
        let rates = self.plan.rates.clone();
        let now = Instant::now();
        let mut fires = |rate: f64| rate > 0.0 && self.rng.f64() < rate;
        let (crash, stop, join, lose) = (
            fires(rates.crash),
            fires(rates.stop),
            fires(rates.join),
            fires(rates.lose),
        );
        let (commit_fail, commit_hang, fetch_delay) = (
            fires(rates.commit_fail),
            fires(rates.commit_hang),
            fires(rates.fetch_delay),
        );
        let (sink_fail, sink_hang, rb_fail, rb_hang) = (
            fires(rates.sink_fail),
            fires(rates.sink_hang),
            fires(rates.read_back_fail),
            fires(rates.read_back_hang),
        );
        let (replay, partial) = (fires(rates.replay), fires(rates.partial_replay));
        if crash {
            self.crash().await;
        }
        if stop {
            self.stop();
        }
        if lose {
            self.lose();
        }
        if (join || self.members.is_empty()) && self.members.len() < self.plan.max_members {
            self.join().await;
        }
        let span = |rng: &mut fastrand::Rng, most: u64| now + Duration::from_millis(rng.u64(50..=most));
        if commit_fail {
            let n = self.rng.u32(1..=4);
            self.event(format_args!("fault: the next {n} commits fail"));
            self.broker.set_faults(|f| f.fail_commits += n);
            // Failures are taken by whichever commits come next: a stop's may be among them
            // for a while.
            self.commit_trouble_until = self.commit_trouble_until.max(now + self.shutdown_timeout * 2);
        }
        if commit_hang {
            let until = span(&mut self.rng, 2000);
            self.event(format_args!("fault: commits hang for {:?}", until - now));
            self.broker.set_faults(|f| f.hang_commits_until = Some(until));
            self.commit_trouble_until = self.commit_trouble_until.max(until + self.shutdown_timeout);
        }
        if fetch_delay {
            let sources = self.sources();
            let source = sources[self.rng.usize(..sources.len())].clone();
            let until = span(&mut self.rng, 1500);
            self.event(format_args!(
                "fault: {source} is not fetched for {:?}",
                until - now
            ));
            self.broker.set_faults(|f| {
                f.delayed_sources.insert(source, until);
            });
        }
        let mut sink_fault = |what: &str, most: u64, set: &dyn Fn(&mut SinkFaults, Instant)| {
            let until = now + Duration::from_millis(self.rng.u64(50..=most));
            set(
                &mut self.sink_faults.lock().unwrap_or_else(|p| p.into_inner()),
                until,
            );
            self.shared
                .ledger()
                .trace
                .event(format_args!("fault: dead-letter {what} for {:?}", until - now));
        };
        if sink_fail {
            sink_fault("publishes fail", 1500, &|f, u| f.publish_fails.open_until(u));
        }
        if sink_hang {
            sink_fault("publishes hang", 3000, &|f, u| f.publish_hangs.open_until(u));
        }
        if rb_fail {
            sink_fault("read-backs fail", 1500, &|f, u| f.read_back_fails.open_until(u));
        }
        if rb_hang {
            sink_fault("read-backs hang", 5000, &|f, u| f.read_back_hangs.open_until(u));
        }
        if replay {
            self.replay(None).await;
        }
        if partial {
            let die_after = self.rng.usize(0..3);
            self.replay(Some(die_after)).await;
        }
        // Drawn last, so that seeds without it inject what they did before it existed.
        if rates.operator_pause > 0.0 && self.rng.f64() < rates.operator_pause {
            self.operator_pause().await;
        }
    }

    /// An operator pauses a source or a key of one member, and resumes it a while later (from
    /// a task of its own, so the pause spans faults and steps).
    async fn operator_pause(&mut self) {
        if self.members.is_empty() {
            return;
        }
        let member = &self.members[self.rng.usize(..self.members.len())];
        let (index, pauser) = (member.index, member.handle.pauser());
        let target = if self.rng.bool() {
            let sources = self.plan.sources();
            PauseTarget::Source(sources[self.rng.usize(..sources.len())].clone())
        } else {
            PauseTarget::Key(Bytes::from(format!("k{}", self.rng.usize(..self.plan.keys))))
        };
        let span = Duration::from_millis(self.rng.u64(50..=2000));
        let paused = pauser.pause(target.clone()).await;
        self.event(format_args!(
            "operator pauses {target:?} of member {index} for {span:?}{}",
            if paused { "" } else { " (it had stopped)" }
        ));
        tokio::spawn(async move {
            tokio::time::sleep(span).await;
            pauser.resume(target).await;
        });
    }

    /// Every source of the consumed topics.
    pub fn sources(&self) -> Vec<SourceId> {
        self.plan.sources()
    }

    /// What the oracle looks at.
    fn scene(&self) -> Scene<'_> {
        Scene {
            plan: &self.plan,
            broker: &self.broker,
            shared: &self.shared,
        }
    }

    /// The invariants against the broker, after a step.
    fn check(&mut self) {
        let now = Instant::now();
        let late: Vec<usize> = self
            .stopping
            .iter()
            .filter(|s| !s.task.is_finished() && now > s.deadline)
            .map(|s| s.index)
            .collect();
        for index in late {
            self.shared.ledger().violation(format!(
                "deadline: m{index}'s graceful stop did not end by its shutdown timeout"
            ));
            self.stopping.retain(|s| s.index != index);
        }
        // A graceful stop ends with its commit accepted, unless the broker refused commits
        // (a fault) or the member lost its sources meanwhile.
        for stop in self.stopping.iter().filter(|s| s.task.is_finished()) {
            let left = stop
                .uncommitted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .unwrap_or(0);
            let excused = now <= self.commit_trouble_until || self.lost.contains(&stop.index);
            if left > 0 && !excused {
                self.shared.ledger().violation(format!(
                    "commit: m{}'s graceful stop left {left} finished messages uncommitted while the broker took commits",
                    stop.index
                ));
            }
        }
        self.stopping.retain(|s| !s.task.is_finished());
        let held: Vec<(usize, convoy_core::StatsSnapshot)> =
            self.members.iter().map(|m| (m.index, m.handle.stats())).collect();
        oracle::check_step(&self.scene(), &held);
    }

    /// Traces what each member holds (its longest-running and most-queued lanes, its sources):
    /// what a reader of a seed that did not settle needs first.
    async fn dump_lanes(&self) {
        for member in &self.members {
            self.event(format_args!(
                "m{} stats {:?}",
                member.index,
                member.handle.stats()
            ));
            let Some(view) = member.handle.inspector().inspect(8).await else {
                continue;
            };
            for source in &view.sources {
                self.event(format_args!("m{} holds {source:?}", member.index));
            }
            for lane in view.oldest.iter().chain(&view.backlog) {
                self.event(format_args!("m{} lane {lane:?}", member.index));
            }
        }
    }

    /// Heals every fault, keeps members running, replays parked keys until none is left, and
    /// waits until everything is committed; then the end state is checked.
    async fn settle(&mut self) {
        self.event("the world heals");
        self.shared.behaviour.heal_all();
        *self.sink_faults.lock().unwrap_or_else(|p| p.into_inner()) = SinkFaults::default();
        self.broker.set_faults(|f| {
            f.fail_commits = 0;
            f.hang_commits_until = None;
            f.delayed_sources.clear();
        });
        while self.members.len() < self.plan.members.max(1) {
            self.join().await;
        }
        let give_up = Instant::now() + Duration::from_secs(300);
        let mut quiet_since: Option<Instant> = None;
        let mut replays = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            self.check();
            if self.failed() {
                return;
            }
            let now = Instant::now();
            if now > give_up {
                break;
            }
            if !oracle::committed_everything(&self.scene()) || !self.stopping.is_empty() {
                quiet_since = None;
                continue;
            }
            let keys = self.parked_keys();
            if keys.is_empty() {
                break;
            }
            // Replay what is parked, once things are quiet (a replay under way is resumed if it
            // has not ended a while after). The world healed: a key that stays parked through
            // this many replays never comes back.
            let since = *quiet_since.get_or_insert(now);
            if now - since >= Duration::from_secs(2) {
                quiet_since = None;
                replays += 1;
                if replays > 12 {
                    break;
                }
                self.replay(None).await;
            }
        }
        if !oracle::committed_everything(&self.scene()) {
            self.dump_lanes().await;
        }
        oracle::check_end(&self.scene());
        for member in std::mem::take(&mut self.members) {
            let _ = member.handle.stop().await;
        }
    }
}

/// A publisher that stops working after publishing a number of messages (a replay tool that
/// dies part-way).
struct DyingPublisher {
    inner: MemoryPublisher,
    left: Arc<Mutex<Option<usize>>>,
}

#[async_trait::async_trait]
impl Publisher for DyingPublisher {
    async fn publish(&self, message: OutgoingMessage) -> Result<Receipt, TransportError> {
        {
            let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
            match left.as_mut() {
                Some(0) => {
                    return Err(TransportError::Unavailable(
                        "simulated: the replay tool died".into(),
                    ))
                }
                Some(n) => *n -= 1,
                None => {}
            }
        }
        self.inner.publish(message).await
    }
}
