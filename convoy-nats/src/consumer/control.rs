//! What commits and lag are on NATS, for the member's control (`MemberControl`: pause, resume
//! and close are the same on every self-balancing transport).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::kv::{Operation, UpdateErrorKind};
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::transport::Commit;
use convoy_core::transport::{Departure, MemberSources};
use convoy_core::{Offset, SourceId, TransportError};
use tokio::sync::watch;

use super::Shared;
use crate::error::nats_error;
use crate::topology::{self, WatermarkEntry};

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
    /// cut off), the commit is refused as not owned and the partition given up. A write whose
    /// answer was lost (a timeout while the server restarted) may still have been stored and
    /// moved the revision on: a refused write is resolved by reading the entry back — this
    /// member's own value means it was, and the write goes again against its revision. Each
    /// source is committed whatever happens to the others; one whose commits fail for longer
    /// than [`GIVE_UP_AFTER`] leases is given up loudly rather than handled on uncommitted.
    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError> {
        let mut first_error = None;
        for c in commits {
            let Some(watermark) = c.watermark() else {
                continue;
            };
            let (key, revision, stream_created) = {
                let owned = self.owned();
                match owned.get(&c.source) {
                    Some(o) if o.lease.is_valid() => {
                        (o.watermark_key.clone(), o.watermark_revision, o.stream_created)
                    }
                    _ => {
                        first_error.get_or_insert(TransportError::NotOwner(c.source.clone()));
                        continue;
                    }
                }
            };
            let value = WatermarkEntry {
                watermark: Some(watermark),
                writer: Some(self.member),
                stream_created: Some(stream_created),
                finished_above: c.finished_above.clone(),
            }
            .encode();
            match self.write_watermark(&c.source, &key, value, revision).await {
                Ok(revision) => {
                    if let Some(o) = self.owned().get_mut(&c.source) {
                        o.watermark_revision = revision;
                        o.commits_failing_since = None;
                    }
                }
                Err(e) => {
                    self.commit_failed(&c.source, &e).await;
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The newest sequence of the partition subject (reported while paused too). Lag is not
    /// derived from it (see [`backlog`](Self::backlog)).
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

    /// The messages of the partition's subject above `committed`, counted: stream sequences
    /// are shared by a topic's partitions, so a partition's own skip the others' and no
    /// subtraction counts them. Nothing above the committed one (the common case): the subject's
    /// last sequence says so in one request. Otherwise a consumer starting there, created only
    /// to read its pending count, then deleted.
    async fn backlog(&self, source: &SourceId, committed: Option<Offset>) -> Option<u64> {
        let (stream, subject) = {
            let owned = self.owned();
            let o = owned.get(source)?;
            (o.stream.clone(), o.subject.clone())
        };
        let last = match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(message) => message.sequence,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Some(0),
            Err(_) => return None,
        };
        // Stream sequences start at 1.
        let start = committed.map_or(1, |c| c + 1);
        if last < start {
            return Some(0);
        }
        let counter = stream
            .create_consumer(pull::Config {
                filter_subject: subject,
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: start,
                },
                ack_policy: AckPolicy::None,
                inactive_threshold: COUNTER_INACTIVE,
                ..pull::Config::default()
            })
            .await
            .ok()?;
        let info = counter.cached_info();
        let pending = info.num_pending;
        if let Err(e) = stream.delete_consumer(&info.name).await {
            // The server removes it once inactive anyway.
            tracing::debug!(error = %e, "deleting a consumer that counted a partition's backlog");
        }
        Some(pending)
    }

    fn revoke_timeout(&self) -> Duration {
        self.config.revoke_timeout()
    }
}

/// A consumer made only to count a backlog is removed by the server after this long, should
/// deleting it fail.
const COUNTER_INACTIVE: Duration = Duration::from_secs(10);

/// A source whose commits have failed for this many lease lifetimes is given up.
pub const GIVE_UP_AFTER: u32 = 3;

impl Shared {
    /// Writes a watermark entry against `revision`; a refusal for a wrong revision is resolved
    /// by reading the entry back (see [`MemberSources::commit`]).
    async fn write_watermark(
        &self,
        source: &SourceId,
        key: &str,
        value: Bytes,
        revision: u64,
    ) -> Result<u64, TransportError> {
        let refused = match self.watermarks.update(key, value.clone(), revision).await {
            Ok(revision) => return Ok(revision),
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => e,
            Err(e) => return Err(nats_error(&format!("committing {key}"), e)),
        };
        let entry = self
            .watermarks
            .entry(key)
            .await
            .map_err(|e| nats_error(&format!("reading back the watermark {key}"), e))?;
        match entry {
            Some(e)
                if e.operation == Operation::Put
                    && WatermarkEntry::decode(&e.value).writer == Some(self.member) =>
            {
                tracing::info!(key, "a watermark written before was stored although its answer was lost; committing on from its revision");
                self.watermarks
                    .update(key, value, e.revision)
                    .await
                    .map_err(|e| nats_error(&format!("committing {key}"), e))
            }
            _ => {
                tracing::debug!(key, error = %refused, "the watermark was written by another member");
                Err(TransportError::NotOwner(source.clone()))
            }
        }
    }

    /// A failed commit: another member's write gives the partition up at once; other failures
    /// give it up once they have lasted [`GIVE_UP_AFTER`] lease lifetimes.
    async fn commit_failed(&self, source: &SourceId, error: &TransportError) {
        let bound = self.config.lease_ttl() * GIVE_UP_AFTER;
        let give_up = {
            let mut owned = self.owned();
            let Some(o) = owned.get_mut(source) else { return };
            let since = *o
                .commits_failing_since
                .get_or_insert_with(tokio::time::Instant::now);
            matches!(error, TransportError::NotOwner(_)) || since.elapsed() >= bound
        };
        if !give_up {
            return;
        }
        tracing::error!(%source, %error, bound = ?bound, "cannot commit this partition: giving it up (its unfinished messages go to the next owner, from the last committed watermark)");
        let Some((topic, partition)) = source.topic_partition() else {
            return;
        };
        self.owned().remove(source);
        self.leases
            .give_up(&topology::partition_key(topic, partition))
            .await;
    }
}
