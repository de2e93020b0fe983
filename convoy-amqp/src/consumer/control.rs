//! What commits and lag are on RabbitMQ, for the member's control (`MemberControl`: pause,
//! resume and close are the same on every self-balancing transport). A member whose engine
//! crashed leaves without acknowledging anything more: closing its channels returns every
//! unacknowledged message to its queue.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::transport::Commit;
use convoy_core::transport::{Departure, MemberSources};
use convoy_core::{Offset, SourceId, TransportError};
use tokio::sync::watch;

use super::{acks, Shared};
use crate::topology;

#[async_trait]
impl MemberSources for Shared {
    fn pause_switch(&self, source: &SourceId) -> Option<watch::Sender<bool>> {
        self.owned().get(source).map(|o| o.paused.clone())
    }

    fn departure(&self) -> &Departure {
        &self.departure
    }

    /// `basic.ack(next - 1, multiple)` on each source's channel. The messages finished above it
    /// are acknowledged one by one when the channel is released (see `acks.rs`), so a stop or a
    /// handover that leaves a gap does not send them to the next owner.
    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError> {
        for c in commits {
            let (channel, acks) = {
                let mut owned = self.owned();
                let Some(o) = owned.get_mut(&c.source) else {
                    return Err(TransportError::NotOwner(c.source.clone()));
                };
                if o.token != c.token {
                    // Computed for an earlier channel of this partition: its tags name other
                    // messages here. That channel's unacknowledged messages were redelivered.
                    tracing::debug!(source = %c.source, "not acknowledging a commit of an earlier channel");
                    continue;
                }
                o.acks.keep_above(&c.finished_above);
                // Tags start at 1 on each channel: `next` 1 (or 0) means nothing is finished.
                let watermark = c.watermark().unwrap_or(0).min(o.delivered.load(Relaxed));
                let acks = o.acks.plan(watermark, &[]);
                if acks.is_empty() {
                    continue;
                }
                (o.channel.clone(), acks)
            };
            acks::send(&channel, &acks, c.source.as_str()).await?;
            if let Some(o) = self.owned().get_mut(&c.source) {
                // The same assignment still (its token), not merely a channel with the same
                // number: lapin hands a closed channel's id to the next one it opens.
                if o.token == c.token {
                    o.acks.done(&acks);
                }
            }
        }
        Ok(())
    }

    /// The newest "offset" of a source: the last tag delivered plus the messages still ready in
    /// its queue, so the engine's lag (newest minus watermark) is the unfinished delivered
    /// messages plus the queue's backlog — reported while paused too.
    async fn newest_offset(&self, source: &SourceId) -> Option<Offset> {
        let (channel, queue, delivered) = {
            let owned = self.owned();
            let o = owned.get(source)?;
            (o.channel.clone(), o.queue.clone(), o.delivered.load(Relaxed))
        };
        let (ready, _) = topology::partition_depth(&channel, &queue).await.ok()?;
        Some(delivered + u64::from(ready))
    }

    /// The messages above `committed`: the delivered ones not committed (delivery tags count
    /// every delivery of the channel from 1) and those still ready in the queue — 0 on an
    /// empty partition, whatever the engine committed.
    async fn backlog(&self, source: &SourceId, committed: Option<Offset>) -> Option<u64> {
        let (channel, queue, delivered) = {
            let owned = self.owned();
            let o = owned.get(source)?;
            (o.channel.clone(), o.queue.clone(), o.delivered.load(Relaxed))
        };
        let (ready, _) = topology::partition_depth(&channel, &queue).await.ok()?;
        Some(delivered.saturating_sub(committed.unwrap_or(0)) + u64::from(ready))
    }

    /// The prefetch: a partition channel receives nothing more while that many of its
    /// deliveries are unacknowledged.
    fn credit(&self) -> Option<u64> {
        Some(u64::from(self.prefetch))
    }

    fn revoke_timeout(&self) -> Duration {
        self.config.revoke_timeout()
    }
}
