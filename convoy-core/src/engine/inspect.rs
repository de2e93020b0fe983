//! What a running engine is doing, for an operator: per source its watermark, lag, what it
//! holds and whether it is paused; the messages in flight longest (with their attempts and last
//! error: a stuck key shows here); the keys with the largest backlog. Bounded: at most `top`
//! lanes of each kind, never one entry per key.

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::message::{Offset, SourceId};

/// One source as the engine holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceView {
    /// The source.
    pub source: SourceId,
    /// The contiguous watermark (`None`: nothing finished yet, or offsets that are no log
    /// positions).
    pub watermark: Option<Offset>,
    /// The last committed watermark.
    pub committed: Option<Offset>,
    /// The newest offset minus the committed one, as last asked of the broker.
    pub lag: Option<u64>,
    /// Messages held (queued in lanes and in flight).
    pub held: usize,
    /// Received offsets from the lowest unfinished one to the newest.
    pub window: usize,
    /// Fetching paused by back-pressure.
    pub paused: bool,
}

/// One lane: its key, the message at its head and what waits behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneView {
    /// The key (lossy text; keyless lanes show `(keyless)`).
    pub key: String,
    /// The source of the lane's head.
    pub source: SourceId,
    /// The head's offset.
    pub offset: Offset,
    /// Attempts of the head so far (0: not started).
    pub attempts: u32,
    /// How long the head has been handled (its first attempt started that long ago).
    pub running_for: Option<Duration>,
    /// The head's last failure, while it is retried.
    pub last_error: Option<String>,
    /// Messages queued behind the head.
    pub queued: usize,
}

/// A running engine, as an operator sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inspection {
    /// Every source held, by id.
    pub sources: Vec<SourceView>,
    /// The lanes whose head has been handled longest (stuck keys first), at most `top`.
    pub oldest: Vec<LaneView>,
    /// The lanes with the most messages queued (hot keys), at most `top`.
    pub backlog: Vec<LaneView>,
    /// A lane whose head runs longer than this is dead-lettered as stuck (if set).
    pub stuck_timeout: Option<Duration>,
}

/// A request for an [`Inspection`] of at most `top` lanes of each kind.
pub(crate) struct InspectRequest {
    pub top: usize,
    pub reply: oneshot::Sender<Inspection>,
}

/// Asks a running engine what it is doing. Cheap to clone; works while the engine's handle is
/// awaited.
#[derive(Clone, Debug)]
pub struct Inspector(pub(crate) mpsc::Sender<InspectRequest>);

impl Inspector {
    /// The engine now, with at most `top` lanes of each kind; `None` once it stopped.
    pub async fn inspect(&self, top: usize) -> Option<Inspection> {
        let (reply, answer) = oneshot::channel();
        self.0.send(InspectRequest { top, reply }).await.ok()?;
        answer.await.ok()
    }
}

/// Keeps the `top` lanes by `order` (largest first).
pub(crate) fn top_by<K: Ord>(
    mut lanes: Vec<LaneView>,
    top: usize,
    order: impl Fn(&LaneView) -> K,
) -> Vec<LaneView> {
    lanes.sort_by_key(|l| std::cmp::Reverse(order(l)));
    lanes.truncate(top);
    lanes
}
