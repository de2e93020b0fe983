//! The periodic turn: the stuck-gap check, how far commits cover for a lane waiting on one, and
//! the gauges (active lanes, per-source watermark and lag — asked of the transport, so lag
//! shows while fetching is paused).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::time::Instant;

use super::Intake;
use crate::engine::shard::ShardCommand;
use crate::engine::stats::StallOn;
use crate::message::{Offset, SourceId};
use crate::metrics::IntakeMetrics;

impl Intake {
    pub(super) fn on_tick(&mut self) {
        self.check_stuck();
        self.report_covered();
        self.report_gauges();
        self.report_stall();
        if self.stopping.is_none() {
            self.read_back_if_checkpoint_due();
        }
        if self.outbox.is_some() {
            // A transform's staged outputs also shrink outside the loop's events (the transport
            // releases a source's outputs with its ownership): look at the bytes gate again.
            self.publish_held();
            self.apply_flow();
        }
    }

    /// While a lane waits for a commit below its message (a replay's end, a parking dead
    /// letter), tells the parked keys' view how far each source's commit covers when no
    /// commit is coming: the last one committed the watermark as it is now, so every message
    /// received below the lowest unfinished one is committed — though that message's offset
    /// may lie past the commit's (offsets with holes), which only a commit started after its
    /// arrival would have said, and none starts while nothing new is finished.
    fn report_covered(&mut self) {
        let Some((parking, _)) = self.parking.as_ref().filter(|(p, _)| p.waiting()) else {
            return;
        };
        for state in self.sources.iter().flatten() {
            let next = state.tracker.next();
            if next.is_none() || state.committed != next {
                continue;
            }
            if let Some((_, offset)) = state.tracker.lowest_unfinished() {
                parking.committed_below(&state.id, offset);
            }
        }
    }

    /// Publishes what the engine has waited for past its deadline (readiness reads it): a
    /// source waiting for its read-back longer than `commit_timeout`, a revoke or a stop past
    /// its deadline.
    fn report_stall(&mut self) {
        let now = Instant::now();
        let read_back = self
            .read_back_waiting_since()
            .map(|since| (StallOn::ReadBack, since + self.config.commit_timeout));
        let revoke = self
            .revokes
            .iter()
            .map(|r| (StallOn::Revoke, r.deadline()))
            .min_by_key(|(_, at)| *at);
        let stop = self.stopping.as_ref().map(|s| (StallOn::Stop, s.deadline()));
        let stall = [read_back, revoke, stop]
            .into_iter()
            .flatten()
            .filter(|(_, at)| now >= *at)
            .min_by_key(|(_, at)| *at);
        if stall.map(|(on, _)| on) != self.stalled {
            match stall {
                Some((on, _)) => tracing::warn!(%on, "stalled past a deadline: the member is not ready"),
                None => tracing::info!("no longer stalled"),
            }
            self.stalled = stall.map(|(on, _)| on);
        }
        self.stats.set_stalled(stall);
    }

    /// Dead-letters a source's lowest unfinished message once it held the watermark back
    /// longer than the stuck timeout, and has every shard dead-letter each message whose
    /// handling started that long ago.
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
        // Every lane on its own too: with many keys failing forever, one head at a time (one
        // per stuck timeout) would hold the window for hours while healthy keys wait.
        for shard in &self.shards {
            let _ = shard.send(ShardCommand::CheckStuck { limit });
        }
    }

    fn report_gauges(&mut self) {
        let lanes: usize = self.stats.shards.iter().map(|s| s.lanes.load(Relaxed)).sum();
        self.metrics.active_lanes.set(lanes as f64);
        // Every gauge is set on every tick, changed or not: an exporter that drops series idle
        // for a while (metrics-exporter-prometheus's idle timeout) then drops only those of
        // sources this member no longer holds — never set again after their revoke or loss.
        self.metrics.in_flight.set(self.held_total as f64);
        self.metrics.held_bytes.set(self.held_bytes as f64);
        let paused = self.stats.intake.paused_sources.load(Relaxed);
        self.metrics.paused_sources.set(paused as f64);
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
            .map(|s| {
                (
                    s.id.clone(),
                    // A watermark that is no log position (an AMQP channel's delivery tag,
                    // starting again at 1 on every channel) would only mislead on a dashboard.
                    s.tracker.watermark().filter(|_| s.offsets_are_positions),
                    s.committed.and_then(|n| n.checked_sub(1)),
                )
            })
            .collect();
        if snapshot.is_empty() {
            return;
        }
        let control = self.control.clone();
        let group = self.config.group.clone();
        let lags = self.lags.clone();
        self.lag_probe = Some(tokio::spawn(async move {
            let asked: Vec<(SourceId, Option<Offset>)> = snapshot
                .iter()
                .map(|(id, _, committed)| (id.clone(), *committed))
                .collect();
            let backlogs = control.backlogs(&asked).await;
            let mut known = HashMap::with_capacity(asked.len());
            for ((id, watermark, _), lag) in snapshot.iter().zip(backlogs) {
                IntakeMetrics::source_gauges(&group, id, *watermark, lag);
                if let Some(lag) = lag {
                    known.insert(id.clone(), lag);
                }
            }
            *lags.lock().unwrap_or_else(|p| p.into_inner()) = known;
        }));
    }
}
