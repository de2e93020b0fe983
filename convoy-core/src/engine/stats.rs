//! Counters the engine keeps for its handle and report (independent of any metrics recorder).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

/// Per-shard counters; only their shard writes them, so increments never contend.
#[derive(Default, Debug)]
pub(crate) struct ShardStats {
    pub handled: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub parked: AtomicU64,
    pub duplicates: AtomicU64,
    pub retries: AtomicU64,
    pub lanes: AtomicUsize,
}

/// Intake counters.
#[derive(Default, Debug)]
pub(crate) struct IntakeStats {
    pub held: AtomicUsize,
    pub peak_held: AtomicUsize,
    pub held_bytes: AtomicUsize,
    pub peak_held_bytes: AtomicUsize,
    pub peak_window: AtomicUsize,
    pub staged_bytes: AtomicUsize,
    pub resets: AtomicU64,
    pub pauses: AtomicU64,
    pub paused_sources: AtomicUsize,
    pub sources: AtomicUsize,
    pub commits: AtomicU64,
    /// Since when commits fail, in milliseconds after the engine started, plus one (0: they
    /// do not).
    pub commits_failing_since: AtomicU64,
    /// What the engine waits for past its deadline ([`StallOn`] as a number, 0: nothing), and
    /// since when that deadline passed (milliseconds after the engine started).
    pub stalled_on: AtomicU8,
    pub stalled_since: AtomicU64,
    /// The engine's task has ended (returned, failed, panicked or was aborted).
    pub ended: AtomicBool,
}

/// What an engine has waited for past its deadline: a member in this state is not ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stall {
    /// What it waits for.
    pub on: StallOn,
    /// How long past the deadline.
    pub overdue: Duration,
}

/// What a [`Stall`] waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StallOn {
    /// A newly assigned source waits for its parked keys to be read back from the dead-letter
    /// destination for longer than `commit_timeout` (the destination is slow or unavailable).
    ReadBack,
    /// A revoke was not acknowledged by its deadline.
    Revoke,
    /// A stop did not end by its deadline.
    Stop,
}

impl StallOn {
    fn code(self) -> u8 {
        match self {
            StallOn::ReadBack => 1,
            StallOn::Revoke => 2,
            StallOn::Stop => 3,
        }
    }

    fn of(code: u8) -> Option<StallOn> {
        match code {
            1 => Some(StallOn::ReadBack),
            2 => Some(StallOn::Revoke),
            3 => Some(StallOn::Stop),
            _ => None,
        }
    }
}

impl std::fmt::Display for StallOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StallOn::ReadBack => "a newly assigned source waits for its parked keys to be read back from the dead-letter destination",
            StallOn::Revoke => "a revoke was not acknowledged by its deadline",
            StallOn::Stop => "the stop did not end by its deadline",
        })
    }
}

/// Shared by the engine's tasks and its handle.
#[derive(Debug)]
pub(crate) struct EngineStats {
    pub shards: Vec<Arc<ShardStats>>,
    pub intake: IntakeStats,
    /// When the engine started (what `commits_failing_since` counts from).
    pub started: Instant,
}

/// A point-in-time view of a running engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Messages handled successfully.
    pub handled: u64,
    /// Messages dead-lettered (confirmed by the sink).
    pub dead_lettered: u64,
    /// Messages set aside behind a dead letter of their key (parked keys).
    pub parked: u64,
    /// Messages skipped as duplicates.
    pub duplicates: u64,
    /// Retries after transient failures.
    pub retries: u64,
    /// Messages held now (buffered in lanes + in flight).
    pub held: usize,
    /// The most messages held at once.
    pub peak_held: usize,
    /// Bytes held now (keys, payloads, headers of the messages held).
    pub held_bytes: usize,
    /// The most bytes held at once.
    pub peak_held_bytes: usize,
    /// Bytes of a transform's outputs staged until a commit covers their inputs (exactly once);
    /// they count against the held-bytes bound.
    pub staged_bytes: usize,
    /// The longest watermark window of any source so far (received offsets from the lowest
    /// unfinished one to the newest).
    pub peak_window: usize,
    /// Position resets: a source delivered an offset at or below one it delivered before (its
    /// log was truncated and rewritten) and was tracked again from there.
    pub resets: u64,
    /// How often back-pressure paused a source.
    pub pauses: u64,
    /// Sources paused now.
    pub paused_sources: usize,
    /// Sources assigned now.
    pub sources: usize,
    /// Lanes (active keys) alive now.
    pub active_lanes: usize,
    /// Successful commits.
    pub commits: u64,
    /// How long commits have been failing (`None`: the last one went through): a member whose
    /// commits fail for long is not ready.
    pub commits_failing_for: Option<Duration>,
    /// What the engine has waited for past its deadline, if anything: a member in this state
    /// is not ready.
    pub stalled: Option<Stall>,
    /// The engine's task has ended — stopped, failed or panicked (its handle's `join` says
    /// which): nothing more is consumed. What a liveness probe answers ([`Self::health`]).
    pub ended: bool,
}

/// Commits failing for longer than this make a member not ready ([`StatsSnapshot::readiness`]).
pub const COMMITS_FAILING_AT_MOST: Duration = Duration::from_secs(30);

impl StatsSnapshot {
    /// Whether this member is ready to be sent traffic, and why not: what a readiness probe
    /// (Kubernetes' `readinessProbe`, the CLI's `/readyz`) answers. Not ready while it holds no
    /// source (joining, a rebalance, more members than partitions), while it waits for anything
    /// past its deadline ([`stalled`](Self::stalled)), and while commits have failed for longer
    /// than [`COMMITS_FAILING_AT_MOST`].
    pub fn readiness(&self) -> Result<(), String> {
        self.health()?;
        if self.sources == 0 {
            return Err(
                "no sources assigned (joining the group, a rebalance, or more members than partitions)"
                    .to_owned(),
            );
        }
        if let Some(stall) = self.stalled {
            return Err(format!(
                "{} ({} s past its deadline)",
                stall.on,
                stall.overdue.as_secs()
            ));
        }
        match self.commits_failing_for {
            Some(failing) if failing > COMMITS_FAILING_AT_MOST => {
                Err(format!("commits have been failing for {} s", failing.as_secs()))
            }
            _ => Ok(()),
        }
    }

    /// Whether the engine is alive: what a liveness probe (Kubernetes' `livenessProbe`, a
    /// service's `/healthz`) answers. Not alive once its task has ended, stopped or failed:
    /// a process that goes on serving without it consumes nothing, so restart it.
    pub fn health(&self) -> Result<(), String> {
        match self.ended {
            true => Err("the engine has ended (stopped or failed: join its handle for why)".to_owned()),
            false => Ok(()),
        }
    }

    /// Messages finished, whatever the outcome: handled, dead-lettered, set aside behind a
    /// parked key, or skipped as duplicates. What to wait on for "everything published so far
    /// is done" (`handled` alone never gets there once one message is dead-lettered).
    pub fn finished(&self) -> u64 {
        self.handled + self.dead_lettered + self.parked + self.duplicates
    }
}

/// The engine's task `f`, marking `stats` ended when it is over however it ends: returned,
/// panicked (the mark is set while unwinding) or aborted (dropped, polled or not: the mark is
/// made before the future is, and goes with it).
pub(crate) fn marks_ended<T>(
    stats: Arc<EngineStats>,
    f: impl std::future::Future<Output = T>,
) -> impl std::future::Future<Output = T> {
    struct MarkOnDrop(Arc<EngineStats>);
    impl Drop for MarkOnDrop {
        fn drop(&mut self) {
            self.0.intake.ended.store(true, Relaxed);
        }
    }
    let mark = MarkOnDrop(stats);
    async move {
        let _mark = mark;
        f.await
    }
}

impl EngineStats {
    pub fn new(shards: usize) -> Self {
        EngineStats {
            shards: (0..shards).map(|_| Arc::default()).collect(),
            intake: IntakeStats::default(),
            started: Instant::now(),
        }
    }

    /// Commits fail since `since` (`None`: they go through).
    pub fn set_commits_failing(&self, since: Option<Instant>) {
        let value = since.map_or(0, |since| {
            u64::try_from(since.saturating_duration_since(self.started).as_millis()).unwrap_or(u64::MAX - 1)
                + 1
        });
        self.intake.commits_failing_since.store(value, Relaxed);
    }

    /// The engine waits for `on` past its deadline, since `since` (`None`: it does not).
    pub fn set_stalled(&self, stall: Option<(StallOn, Instant)>) {
        match stall {
            None => self.intake.stalled_on.store(0, Relaxed),
            Some((on, since)) => {
                let ms = since.saturating_duration_since(self.started).as_millis();
                self.intake
                    .stalled_since
                    .store(u64::try_from(ms).unwrap_or(u64::MAX), Relaxed);
                self.intake.stalled_on.store(on.code(), Relaxed);
            }
        }
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let mut s = StatsSnapshot {
            held: self.intake.held.load(Relaxed),
            peak_held: self.intake.peak_held.load(Relaxed),
            held_bytes: self.intake.held_bytes.load(Relaxed),
            peak_held_bytes: self.intake.peak_held_bytes.load(Relaxed),
            peak_window: self.intake.peak_window.load(Relaxed),
            staged_bytes: self.intake.staged_bytes.load(Relaxed),
            resets: self.intake.resets.load(Relaxed),
            pauses: self.intake.pauses.load(Relaxed),
            paused_sources: self.intake.paused_sources.load(Relaxed),
            sources: self.intake.sources.load(Relaxed),
            commits: self.intake.commits.load(Relaxed),
            ended: self.intake.ended.load(Relaxed),
            commits_failing_for: match self.intake.commits_failing_since.load(Relaxed) {
                0 => None,
                ms => Some(
                    Instant::now().saturating_duration_since(self.started + Duration::from_millis(ms - 1)),
                ),
            },
            stalled: StallOn::of(self.intake.stalled_on.load(Relaxed)).map(|on| Stall {
                on,
                overdue: Instant::now().saturating_duration_since(
                    self.started + Duration::from_millis(self.intake.stalled_since.load(Relaxed)),
                ),
            }),
            ..StatsSnapshot::default()
        };
        for shard in &self.shards {
            s.handled += shard.handled.load(Relaxed);
            s.dead_lettered += shard.dead_lettered.load(Relaxed);
            s.parked += shard.parked.load(Relaxed);
            s.duplicates += shard.duplicates.load(Relaxed);
            s.retries += shard.retries.load(Relaxed);
            s.active_lanes += shard.lanes.load(Relaxed);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_counts_every_outcome_but_retries() {
        let s = StatsSnapshot {
            handled: 5,
            dead_lettered: 2,
            parked: 3,
            duplicates: 1,
            retries: 7,
            ..StatsSnapshot::default()
        };
        assert_eq!(s.finished(), 11);
    }

    #[test]
    fn readiness_says_why_not() {
        let mut s = StatsSnapshot::default();
        assert!(s.readiness().unwrap_err().contains("no sources assigned"));
        s.sources = 2;
        assert_eq!(s.readiness(), Ok(()));
        s.commits_failing_for = Some(Duration::from_secs(5));
        assert_eq!(s.readiness(), Ok(()), "a short commit outage is ridden out");
        s.commits_failing_for = Some(Duration::from_secs(31));
        assert!(s.readiness().unwrap_err().contains("failing for 31 s"));
        s.stalled = Some(Stall {
            on: StallOn::ReadBack,
            overdue: Duration::from_secs(4),
        });
        assert!(s.readiness().unwrap_err().contains("4 s past its deadline"));
        assert_eq!(s.health(), Ok(()), "a stall makes a member unready, not dead");
        s.ended = true;
        assert!(s.health().unwrap_err().contains("ended"));
        assert!(
            s.readiness().unwrap_err().contains("ended"),
            "an ended engine is not ready"
        );
    }

    /// The mark is set however the engine's task ends: returned, panicked or aborted.
    #[tokio::test]
    async fn the_engine_task_is_marked_ended_however_it_ends() {
        let returned = Arc::new(EngineStats::new(0));
        marks_ended(returned.clone(), async {}).await;
        assert!(returned.snapshot().ended);

        let panicked = Arc::new(EngineStats::new(0));
        let task = tokio::spawn(marks_ended(panicked.clone(), async { panic!("a handler bug") }));
        assert!(task.await.is_err());
        assert!(panicked.snapshot().ended);

        let aborted = Arc::new(EngineStats::new(0));
        let task = tokio::spawn(marks_ended(aborted.clone(), std::future::pending::<()>()));
        assert!(!aborted.snapshot().ended, "running");
        task.abort();
        assert!(task.await.is_err());
        assert!(aborted.snapshot().ended);
    }
}
