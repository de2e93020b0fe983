//! What commits and lag are on NATS, for the member's control (`MemberControl`: pause, resume
//! and close are the same on every self-balancing transport).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_nats::jetstream::kv::UpdateErrorKind;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::transport::{Departure, MemberSources};
use convoy_core::{Commit, Offset, SourceId, TransportError};
use tokio::sync::watch;

use super::Shared;
use crate::error::nats_error;

#[async_trait]
impl MemberSources for Shared {
    fn pause_switch(&self, source: &SourceId) -> Option<watch::Sender<bool>> {
        self.owned().get(source).map(|o| o.paused.clone())
    }

    fn departure(&self) -> &Departure {
        &self.departure
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
                let owned = self.owned();
                match owned.get(&c.source) {
                    Some(o) if o.lease.is_valid() => (o.watermark_key.clone(), o.watermark_revision),
                    _ => return Err(TransportError::NotOwner(c.source.clone())),
                }
            };
            let value = Bytes::from(watermark.to_string());
            match self.watermarks.update(key.as_str(), value, revision).await {
                Ok(revision) => {
                    if let Some(o) = self.owned().get_mut(&c.source) {
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

    /// The newest sequence of the partition subject (reported while paused too), so the
    /// engine's lag is that minus the watermark — in stream sequences, which the partitions of a
    /// topic share: an upper bound of the partition's unfinished messages.
    async fn newest_offset(&self, source: &SourceId) -> Option<Offset> {
        let (stream, subject, delivered) = {
            let owned = self.owned();
            let o = owned.get(source)?;
            (o.stream.clone(), o.subject.clone(), o.delivered.load(Relaxed))
        };
        match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(message) => Some(message.sequence.max(delivered)),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Some(delivered),
            Err(_) => None,
        }
    }

    fn revoke_timeout(&self) -> Duration {
        self.config.revoke_timeout()
    }
}
