//! Answering an operator's request for a view of the engine (see `engine::inspect`).

use tokio::sync::oneshot;

use super::Intake;
use crate::engine::inspect::{top_by, InspectRequest, Inspection, LaneView, SourceView};
use crate::engine::shard::ShardCommand;

impl Intake {
    /// The sources from the intake's own state, the lanes from every shard's `top` — asked by
    /// a task of its own, which answers the request.
    pub(super) fn answer(&mut self, request: InspectRequest) {
        let lags = self.lags.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut sources: Vec<SourceView> = self
            .sources
            .iter()
            .flatten()
            .map(|s| SourceView {
                source: s.id.clone(),
                watermark: s.tracker.watermark().filter(|_| s.offsets_are_positions),
                committed: s.committed.and_then(|next| next.checked_sub(1)),
                lag: lags.get(&s.id).copied(),
                held: s.held,
                window: s.tracker.window_len(),
                paused: s.fetch_paused == Some(true),
            })
            .collect();
        sources.sort_by(|a, b| a.source.as_str().cmp(b.source.as_str()));
        let top = request.top;
        let replies: Vec<_> = self
            .shards
            .iter()
            .filter_map(|shard| {
                let (reply, answer) = oneshot::channel();
                shard.send(ShardCommand::Inspect { top, reply }).ok()?;
                Some(answer)
            })
            .collect();
        let stuck_timeout = self.config.stuck_timeout;
        tokio::spawn(async move {
            let (mut oldest, mut backlog): (Vec<LaneView>, Vec<LaneView>) = (Vec::new(), Vec::new());
            for answer in replies {
                // A shard gone without answering has no lanes to show.
                if let Ok((o, b)) = answer.await {
                    oldest.extend(o);
                    backlog.extend(b);
                }
            }
            let inspection = Inspection {
                sources,
                oldest: top_by(oldest, top, |v| v.running_for),
                backlog: top_by(backlog, top, |v| v.queued),
                stuck_timeout,
            };
            let _ = request.reply.send(inspection);
        });
    }
}
