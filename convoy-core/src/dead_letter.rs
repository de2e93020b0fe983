//! Dead letters: a message taken out of its lane and published, with its reason, to a
//! dead-letter destination. The original key, payload and headers travel untouched; the
//! reason is added as `convoy-dl-*` headers so an operator can find, fix and replay.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;

use crate::message::{Headers, Message, OutgoingMessage};
use crate::transport::TransportError;

pub use crate::header_names::{
    DL_ATTEMPTS, DL_CAUSE, DL_ERROR, DL_ERROR_CLASS, DL_FIRST_FAILURE_MS, DL_GROUP, DL_LAST_FAILURE_MS,
    DL_OFFSET, DL_SOURCE, REPLAYED_FROM,
};

/// The message that replays the dead-letter `record` (as read from its destination): its
/// original key, payload and headers, the reason headers removed, event id
/// `<original id>/replay/<dead-letter position>` (an idempotency store that remembered the
/// original lets it through; replaying the same dead letter twice is still caught) and a
/// [`REPLAYED_FROM`] header.
pub fn replay_message(record: &Message) -> OutgoingMessage {
    let position = format!("{}@{}", record.source, record.offset);
    let mut headers = Headers::new();
    for (name, value) in record.headers.iter() {
        if !name.starts_with("convoy-dl-")
            && name != crate::header_names::EVENT_ID_HEADER
            && name != crate::header_names::REPLAY
        {
            headers.append(name, value.clone());
        }
    }
    let original_id = record
        .headers
        .get_str(crate::header_names::EVENT_ID_HEADER)
        .map(str::to_owned)
        .unwrap_or_else(|| {
            let h = |name| record.headers.get_str(name).unwrap_or("?");
            format!("{}@{}", h(DL_SOURCE), h(DL_OFFSET))
        });
    headers.insert(
        crate::header_names::EVENT_ID_HEADER,
        format!("{original_id}/replay/{position}"),
    );
    headers.insert(REPLAYED_FROM, position);
    OutgoingMessage {
        key: record.key.clone(),
        payload: record.payload.clone(),
        headers,
    }
}

/// Why a message left its lane, or which marker a record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterCause {
    /// The handler returned a terminal error.
    Terminal,
    /// The payload could not be decoded.
    Malformed,
    /// The handler panicked.
    Panic,
    /// Transient failures exhausted the retry policy.
    RetriesExhausted,
    /// The message held the watermark back longer than the stuck-gap timeout.
    Stuck,
    /// Set aside unhandled: its key is parked behind an earlier dead letter until replayed
    /// (see [`parking`](crate::parking)).
    Parked,
    /// Not a message: the marker a replay of a parked key writes before it re-publishes the
    /// key's records (see [`parking`](crate::parking)).
    Replay,
    /// Not a message: the marker an engine writes when the last message of a parked key's
    /// replay is finished (see [`parking`](crate::parking)).
    ReplayDone,
    /// Not a message: the audit record a replay of single dead letters writes once it
    /// re-published them, naming where the destination holds them
    /// ([`REPLAY_OF`](crate::parking::REPLAY_OF)): what tells a listing and a later replay that
    /// they were replayed.
    Replayed,
    /// Not a message: the audit record of an operator's `unpark` of a parked key, naming the
    /// failed records passed over ([`DL_OF`](crate::parking::DL_OF)): they are not replayed,
    /// and the key goes on without them.
    Skipped,
    /// Not a message: the audit record of an operator's purge, naming the dead letters purged
    /// ([`DL_OF`](crate::parking::DL_OF)): listings and replays leave them out.
    Purged,
}

impl DeadLetterCause {
    /// The header value.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterCause::Terminal => "terminal",
            DeadLetterCause::Malformed => "malformed",
            DeadLetterCause::Panic => "panic",
            DeadLetterCause::RetriesExhausted => "retries-exhausted",
            DeadLetterCause::Stuck => "stuck",
            DeadLetterCause::Parked => "parked",
            DeadLetterCause::Replay => "replay",
            DeadLetterCause::ReplayDone => "replay-done",
            DeadLetterCause::Replayed => "replayed",
            DeadLetterCause::Skipped => "skipped",
            DeadLetterCause::Purged => "purged",
        }
    }
}

impl fmt::Display for DeadLetterCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The reason attached to a dead letter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterReason {
    /// Why it left the lane.
    pub cause: DeadLetterCause,
    /// The class of the last error (`transient`, `terminal`, `malformed`, `panic`, `stuck`).
    pub error_class: String,
    /// The last error's text.
    pub error: String,
    /// Attempts made.
    pub attempts: u32,
    /// When the first attempt failed.
    pub first_failure: SystemTime,
    /// When the last attempt failed.
    pub last_failure: SystemTime,
    /// The consumer group.
    pub group: String,
    /// True when this dead letter parks its key (the group parks keys and the message has
    /// one): written as [`DL_PARKS`](crate::parking::DL_PARKS).
    pub parks_key: bool,
}

/// A message on its way to the dead-letter destination.
#[derive(Clone, Debug)]
pub struct DeadLetter {
    /// The original message, untouched.
    pub message: Message,
    /// Why.
    pub reason: DeadLetterReason,
}

fn unix_ms(t: SystemTime) -> String {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
        .to_string()
}

impl DeadLetter {
    /// The original headers plus the reason headers.
    pub fn headers(&self) -> Headers {
        let mut h = self.message.headers.clone();
        let r = &self.reason;
        h.insert(DL_CAUSE, r.cause.as_str());
        h.insert(DL_ERROR_CLASS, r.error_class.clone());
        h.insert(DL_ERROR, r.error.clone());
        h.insert(DL_ATTEMPTS, r.attempts.to_string());
        h.insert(DL_FIRST_FAILURE_MS, unix_ms(r.first_failure));
        h.insert(DL_LAST_FAILURE_MS, unix_ms(r.last_failure));
        h.insert(DL_SOURCE, self.message.source.to_string());
        h.insert(DL_OFFSET, self.message.offset.to_string());
        h.insert(DL_GROUP, r.group.clone());
        if r.parks_key {
            h.insert(crate::header_names::DL_PARKS, "key");
        }
        h
    }

    /// The message to publish: original key and payload, headers with the reason.
    pub fn to_outgoing(&self) -> OutgoingMessage {
        OutgoingMessage {
            key: self.message.key.clone(),
            payload: self.message.payload.clone(),
            headers: self.headers(),
        }
    }
}

/// Publishes dead letters. Return `Ok` only once the destination confirmed the write: the
/// engine finishes the message's offset after that, and retries (blocking the lane) on error.
#[async_trait]
pub trait DeadLetterSink: Send + Sync + 'static {
    /// Publishes one dead letter, confirmed.
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError>;

    /// True if [`read_back`](Self::read_back) works: an engine that parks keys needs it (and
    /// refuses a sink without it when built).
    fn can_read_back(&self) -> bool {
        false
    }

    /// Every record the destination holds, in order per key (what an engine that parks keys
    /// derives them from, see [`parking`](crate::parking)). Sinks that cannot read their
    /// destination keep this default.
    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        Err(TransportError::broker(
            "reading dead letters back",
            "this dead-letter sink cannot read its destination: use the transport's own sink",
        ))
    }

    /// The records written after `mark` (every record when `None`), in order per key, and the
    /// mark after the last of them: what an engine reads on top of its group's checkpoint
    /// ([`load_checkpoint`](Self::load_checkpoint)), so that a read-back reads what was written
    /// since, not the destination's whole history. The default reads everything and gives no
    /// mark (no checkpoint is then saved).
    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        let _ = mark;
        Ok(ReadBack {
            records: self.read_back().await?,
            mark: None,
            restarted: false,
        })
    }

    /// Part `part` of `group`'s checkpoint as last saved with
    /// [`save_checkpoint`](Self::save_checkpoint), if any (the default keeps none).
    async fn load_checkpoint(&self, group: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
        let _ = (group, part);
        Ok(None)
    }

    /// Saves part `part` of `group`'s checkpoint: the folded state of the destination up to a
    /// [`ReadMark`], in parts of at most [`CHECKPOINT_PART_BYTES`](crate::parking::CHECKPOINT_PART_BYTES)
    /// and a small frame (what [`parking`](crate::parking) writes; part 0 names the others).
    /// Each part replaces the last one saved under its number. Only the latest checkpoint
    /// matters; a lost save costs a longer read next time, nothing else.
    async fn save_checkpoint(&self, group: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
        let _ = (group, part, checkpoint);
        Ok(())
    }
}

/// Where a read of a dead-letter destination stopped, in the transport's own terms (a stream
/// sequence, offsets per partition): opaque to the engine, kept in checkpoints.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReadMark(pub String);

impl ReadMark {
    /// The mark of a destination read up to these positions: per partition, the next offset
    /// to read (`0:15,1:7`). A stream without partitions is partition 0.
    pub fn of_next_offsets(next: &BTreeMap<u32, u64>) -> ReadMark {
        let parts: Vec<String> = next.iter().map(|(p, o)| format!("{p}:{o}")).collect();
        ReadMark(parts.join(","))
    }

    /// The same, for the destination known by `epoch` (what tells it from one of the same name
    /// deleted and created again, e.g. a stream's creation time): `epoch|0:15`.
    pub fn of_next_offsets_in(epoch: &str, next: &BTreeMap<u32, u64>) -> ReadMark {
        ReadMark(format!("{epoch}|{}", ReadMark::of_next_offsets(next).0))
    }

    /// The epoch a mark was made in, if it names one.
    pub fn epoch(&self) -> Option<&str> {
        self.0.split_once('|').map(|(epoch, _)| epoch)
    }

    /// The positions of a mark made by [`of_next_offsets`](Self::of_next_offsets) (or
    /// `of_next_offsets_in`); `None` if it is not one (a read then starts from the beginning).
    pub fn next_offsets(&self) -> Option<BTreeMap<u32, u64>> {
        let positions = self.0.split_once('|').map_or(self.0.as_str(), |(_, p)| p);
        if positions.is_empty() {
            return Some(BTreeMap::new());
        }
        positions
            .split(',')
            .map(|part| {
                let (p, o) = part.split_once(':')?;
                Some((p.parse().ok()?, o.parse().ok()?))
            })
            .collect()
    }
}

/// What [`DeadLetterSink::read_back_after`] read.
#[derive(Debug, Default)]
pub struct ReadBack {
    /// The records after the mark given, in order per key.
    pub records: Vec<Message>,
    /// The mark after the last record read (where the next read starts); `None` when the
    /// destination cannot be read from a mark.
    pub mark: Option<ReadMark>,
    /// The mark given was not this destination's (it was deleted and created again since): the
    /// records were read from its start, and what was folded up to the mark is void.
    pub restarted: bool,
}

#[async_trait]
impl<S: DeadLetterSink + ?Sized> DeadLetterSink for std::sync::Arc<S> {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        (**self).publish(dead_letter).await
    }

    fn can_read_back(&self) -> bool {
        (**self).can_read_back()
    }

    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        (**self).read_back().await
    }

    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        (**self).read_back_after(mark).await
    }

    async fn load_checkpoint(&self, group: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
        (**self).load_checkpoint(group, part).await
    }

    async fn save_checkpoint(&self, group: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
        (**self).save_checkpoint(group, part, checkpoint).await
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::message::SourceId;

    #[test]
    fn reason_headers_keep_the_original_ones() {
        let mut headers = Headers::new();
        headers.insert("traceparent", "00-abc");
        let dl = DeadLetter {
            message: Message {
                key: Some(Bytes::from_static(b"acct-1")),
                payload: Bytes::from_static(b"{}"),
                headers,
                source: SourceId::new("orders/2"),
                offset: 17,
            },
            reason: DeadLetterReason {
                cause: DeadLetterCause::RetriesExhausted,
                error_class: "transient".into(),
                error: "db down".into(),
                attempts: 5,
                first_failure: UNIX_EPOCH + std::time::Duration::from_millis(1_000),
                last_failure: UNIX_EPOCH + std::time::Duration::from_millis(9_000),
                group: "billing".into(),
                parks_key: false,
            },
        };
        let out = dl.to_outgoing();
        assert_eq!(out.key.as_deref(), Some(&b"acct-1"[..]));
        let h = &out.headers;
        assert_eq!(h.get_str("traceparent"), Some("00-abc"));
        assert_eq!(h.get_str(DL_CAUSE), Some("retries-exhausted"));
        assert_eq!(h.get_str(DL_ERROR_CLASS), Some("transient"));
        assert_eq!(h.get_str(DL_ERROR), Some("db down"));
        assert_eq!(h.get_str(DL_ATTEMPTS), Some("5"));
        assert_eq!(h.get_str(DL_FIRST_FAILURE_MS), Some("1000"));
        assert_eq!(h.get_str(DL_LAST_FAILURE_MS), Some("9000"));
        assert_eq!(h.get_str(DL_SOURCE), Some("orders/2"));
        assert_eq!(h.get_str(DL_OFFSET), Some("17"));
        assert_eq!(h.get_str(DL_GROUP), Some("billing"));
    }
}
