//! An operator's pause: a key whose messages must wait (a customer's account under review, a
//! device being re-provisioned) or a source whose fetching must stop (a partition whose
//! downstream is down), in this engine, until resumed.
//!
//! A paused key's lane starts no message (the one in flight finishes); its messages keep
//! arriving and wait in order, held like any other (back-pressure counts them, and its
//! source's watermark stops below the first), so nothing overtakes and nothing is committed
//! past them. A paused source fetches nothing more, and what still arrives of it (fetched
//! before the transport heard, or on an assignment after the pause) waits unrouted until
//! resumed; what had been routed before the pause goes on. Both hold for this engine only and
//! last until resumed or the engine stops: a source that moves to another member of the group
//! goes on there. To hold a key across the whole group and across
//! restarts, park it (see [`parking`](crate::parking)).

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use crate::message::SourceId;

/// What an operator pauses.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PauseTarget {
    /// The messages of one key.
    Key(Bytes),
    /// Fetching from one source (a partition, a queue), also if assigned later.
    Source(SourceId),
}

/// What is paused in an engine now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Paused {
    /// Keys, in byte order.
    pub keys: Vec<Bytes>,
    /// Sources, in name order.
    pub sources: Vec<SourceId>,
}

pub(crate) enum PauseRequest {
    /// Pause (`true`) or resume; answered once in effect.
    Set {
        target: PauseTarget,
        pause: bool,
        reply: oneshot::Sender<()>,
    },
    /// What is paused.
    List { reply: oneshot::Sender<Paused> },
}

/// Pauses and resumes keys and sources of a running engine, from anywhere while its handle is
/// awaited. Cheap to clone. Every call returns `false` (or `None`) once the engine stopped.
#[derive(Clone, Debug)]
pub struct Pauser(pub(crate) mpsc::Sender<PauseRequest>);

impl Pauser {
    /// Pauses `target`. Once this returns, no message of a paused key starts (the one in
    /// flight, if any, finishes), and a paused source fetches nothing more and routes nothing
    /// that arrives after this returns (what was routed before goes on).
    pub async fn pause(&self, target: PauseTarget) -> bool {
        self.set(target, true).await
    }

    /// Resumes `target`: a key's waiting messages start, in order; a source fetches again
    /// (unless back-pressure holds it).
    pub async fn resume(&self, target: PauseTarget) -> bool {
        self.set(target, false).await
    }

    /// Pauses the messages of `key`.
    pub async fn pause_key(&self, key: impl Into<Bytes>) -> bool {
        self.pause(PauseTarget::Key(key.into())).await
    }

    /// Resumes the messages of `key`.
    pub async fn resume_key(&self, key: impl Into<Bytes>) -> bool {
        self.resume(PauseTarget::Key(key.into())).await
    }

    /// Pauses fetching from `source`.
    pub async fn pause_source(&self, source: SourceId) -> bool {
        self.pause(PauseTarget::Source(source)).await
    }

    /// Resumes fetching from `source`.
    pub async fn resume_source(&self, source: SourceId) -> bool {
        self.resume(PauseTarget::Source(source)).await
    }

    /// What is paused now.
    pub async fn paused(&self) -> Option<Paused> {
        let (reply, answer) = oneshot::channel();
        self.0.send(PauseRequest::List { reply }).await.ok()?;
        answer.await.ok()
    }

    async fn set(&self, target: PauseTarget, pause: bool) -> bool {
        let (reply, answer) = oneshot::channel();
        let request = PauseRequest::Set { target, pause, reply };
        self.0.send(request).await.is_ok() && answer.await.is_ok()
    }
}
