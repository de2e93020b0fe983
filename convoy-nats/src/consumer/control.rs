//! Pause, resume, commit, lag and close for one member.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::UpdateErrorKind;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::{Commit, Offset, SourceControl, SourceId, TransportError};

use super::Shared;
use crate::error::nats_error;

pub(super) struct NatsControl {
    shared: Arc<Shared>,
}

impl NatsControl {
    pub fn new(shared: Arc<Shared>) -> Self {
        NatsControl { shared }
    }

    fn set_paused(&self, sources: &[SourceId], paused: bool) {
        let owned = self.shared.owned();
        for source in sources {
            if let Some(o) = owned.get(source) {
                o.paused.send_replace(paused);
            }
        }
    }
}

#[async_trait]
impl SourceControl for NatsControl {
    fn pause(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.set_paused(sources, true);
        Ok(())
    }

    fn resume(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.set_paused(sources, false);
        Ok(())
    }

    /// Writes each watermark `next - 1` to the group's bucket against the revision this member
    /// wrote last: if anyone else wrote since (the partition moved on while this member was
    /// cut off), the commit is refused as not owned. Nothing is written once the lease ran out.
    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError> {
        for c in commits {
            let Some(watermark) = c.watermark() else {
                continue;
            };
            let (key, revision) = {
                let owned = self.shared.owned();
                match owned.get(&c.source) {
                    Some(o) if o.lease.is_valid() => (o.watermark_key.clone(), o.watermark_revision),
                    _ => return Err(TransportError::NotOwner(c.source.clone())),
                }
            };
            let value = Bytes::from(watermark.to_string());
            match self.shared.watermarks.update(key.as_str(), value, revision).await {
                Ok(revision) => {
                    if let Some(o) = self.shared.owned().get_mut(&c.source) {
                        o.watermark_revision = revision;
                    }
                }
                Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                    return Err(TransportError::NotOwner(c.source.clone()))
                }
                Err(e) => return Err(nats_error(&format!("committing {}", c.source), e)),
            }
        }
        Ok(())
    }

    /// The newest sequence of each partition subject (reported while paused too), so the
    /// engine's lag is that minus the watermark — in stream sequences, which the partitions of
    /// a topic share: an upper bound of the partition's unfinished messages.
    async fn last_offsets(&self, sources: &[SourceId]) -> Vec<Option<Offset>> {
        let mut newest = Vec::with_capacity(sources.len());
        for source in sources {
            let probe = {
                let owned = self.shared.owned();
                owned
                    .get(source)
                    .map(|o| (o.stream.clone(), o.subject.clone(), o.delivered.load(Relaxed)))
            };
            let Some((stream, subject, delivered)) = probe else {
                newest.push(None);
                continue;
            };
            let last = tokio::time::timeout(
                Duration::from_secs(1),
                stream.get_last_raw_message_by_subject(&subject),
            )
            .await;
            newest.push(match last {
                Ok(Ok(message)) => Some(message.sequence.max(delivered)),
                Ok(Err(e)) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Some(delivered),
                _ => None,
            });
        }
        newest
    }

    fn revoke_timeout(&self) -> Option<Duration> {
        Some(self.shared.config.revoke_timeout())
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.shared.departure.ask();
        self.shared.departure.wait_left().await;
        Ok(())
    }
}

impl Drop for NatsControl {
    fn drop(&mut self) {
        // Dropped without close (the engine crashed): leave without committing anything more.
        self.shared.departure.ask();
    }
}
