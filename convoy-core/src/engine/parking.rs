//! The engine's view of its group's parked keys (see [`crate::parking`]): read back from the
//! dead-letter destination whenever sources are assigned (the previous owner's records are
//! there) — its group's last checkpoint and what was written after it the first time, then
//! only what was written past where it read last — kept current as lanes set messages aside
//! and end replays, and asked by each lane before it handles a keyed message.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use metrics::Gauge;

use crate::dead_letter::{DeadLetterSink, ReadBack, ReadMark};
use crate::message::{Message, Offset, SourceId};
use crate::parking::{
    save_checkpoint, topic_name, ParkedKeys, ParkedRecord, ParkingChange, Parts, Position, ReplayTag,
};
use crate::transport::TransportError;

/// How often a dead letter that parks its key looks for the commit below it.
const COMMIT_POLL: Duration = Duration::from_millis(10);

/// Longest wait between attempts to read the dead-letter destination back.
const MAX_READ_BACKOFF: Duration = Duration::from_secs(5);

/// A group's parked keys, for its engine.
pub(crate) struct Parking {
    group: String,
    state: Mutex<State>,
    /// Per assigned source, what was received and committed (see `wait_committed_below`).
    marks: Mutex<HashMap<SourceId, Marks>>,
    /// One read-back at a time.
    reading: tokio::sync::Mutex<()>,
    /// How many keys are parked: while none is, lanes skip the lock (the common case).
    parked: AtomicUsize,
    /// Lanes waiting in [`wait_committed_below`](Self::wait_committed_below): while one does,
    /// the intake tells what its commits cover even when nothing new is committed.
    waiting: AtomicUsize,
    /// Records this engine wrote since its last read-back: at `checkpoint_after` it reads
    /// back again (and so saves a checkpoint), which keeps the next assignment's read short
    /// even when no rebalance comes for a long time.
    written: AtomicUsize,
    checkpoint_after: usize,
    keys: Gauge,
}

#[derive(Default)]
struct State {
    keys: ParkedKeys,
    /// Where `keys` were read up to: the next read-back reads past it only (`None`: read the
    /// checkpoint first — at the first read-back, or when the destination gives no marks).
    mark: Option<ReadMark>,
    /// Where the checkpoint this engine knows whole is (the one it loaded or saved last): its
    /// next save goes beside it.
    head: Option<Parts>,
    /// Changes made while a read-back is under way: applied again to what it read when it
    /// builds the view anew, which may end before them (applying a change twice changes
    /// nothing). A read-back that folds into the view in place has them already.
    journal: Option<Vec<(Bytes, ParkingChange)>>,
    /// Replays a read-back did not find: their messages are set aside without reading again.
    unknown_replays: HashSet<String>,
}

/// What an assigned source received and committed.
#[derive(Default)]
struct Marks {
    /// Its offsets name positions (a redelivery has the offset of the first delivery).
    positions: bool,
    /// The first offset received in this assignment.
    first_received: Option<Offset>,
    /// Every offset received below this one is committed.
    committed_below: Offset,
}

/// What a lane does with a message, as its key's parking says.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Not parked: as usual.
    Free,
    /// A message of its key's replay: handled.
    Replay,
    /// Set aside to the dead-letter destination.
    SetAside,
    /// Set aside before (a redelivery): finished without another record.
    AlreadySetAside,
    /// A message of a replay that ended (a resumed replay's copy of what ran already): skipped.
    Duplicate,
    /// A replay not read of yet: read back, then ask again.
    ReadBack,
}

impl Parking {
    pub fn new(group: &str, checkpoint_after: usize) -> Parking {
        crate::metrics::describe();
        let keys = metrics::gauge!(crate::metrics::PARKED_KEYS, "group" => group.to_owned());
        keys.set(0.0);
        Parking {
            group: group.to_owned(),
            state: Mutex::default(),
            marks: Mutex::default(),
            reading: tokio::sync::Mutex::new(()),
            written: AtomicUsize::new(0),
            checkpoint_after,
            parked: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            keys,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while the lock was held left a complete state: every change is one call.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What to do with `message`, known by `id` (if anything identifies it). After a read-back
    /// (`read`), a replay still unknown is a stale one: its messages are set aside.
    pub fn gate(&self, message: &Message, id: Option<&str>, read: bool) -> Gate {
        // Parking is by ordering key, as everything else is: the empty key is no key (its
        // messages follow the keyless policy), so it never parks.
        let Some(key) = message.ordering_key() else {
            return Gate::Free;
        };
        let mut state = self.state();
        let tag = ReplayTag::of(&message.headers).filter(|t| t.index >= 1);
        let Some(parking) = state.keys.get(key) else {
            // A copy of a replay that ended, delivered again after its key was unparked.
            return match &tag {
                Some(tag) if state.keys.replay_ended(key, &tag.id) => Gate::Duplicate,
                _ => Gate::Free,
            };
        };
        if let Some(tag) = tag {
            let topic = topic_name(message.source.as_str());
            if parking.replaying().is_some_and(|r| r.id == tag.id) {
                if !parking.part_failed(&tag.id, topic) {
                    return Gate::Replay;
                }
                if parking.ran_before_failure(tag.index, topic) {
                    return Gate::Duplicate;
                }
            } else if parking.replay_ended(&tag.id) {
                return Gate::Duplicate;
            } else if parking.last_replay() != Some(tag.id.as_str())
                && !state.unknown_replays.contains(&tag.id)
            {
                // A replay this view has not read of (another member's view may be newer).
                if !read {
                    return Gate::ReadBack;
                }
                tracing::warn!(replay = %tag.id, "a replayed message of a parked key whose replay the dead-letter destination does not name: set aside (replay the key again)");
                state.unknown_replays.insert(tag.id);
            }
        }
        let Some(parking) = state.keys.get(key) else {
            return Gate::Free;
        };
        if id.is_some_and(|id| parking.holds(id)) {
            return Gate::AlreadySetAside;
        }
        Gate::SetAside
    }

    /// `source` was assigned here (its offsets naming positions or not): nothing of it
    /// received yet.
    pub fn source_assigned(&self, source: &SourceId, positions: bool) {
        let marks = Marks {
            positions,
            ..Marks::default()
        };
        self.marks().insert(source.clone(), marks);
    }

    /// Messages of `source` from `offset` on arrived (in offset order).
    pub fn received(&self, source: &SourceId, offset: Offset) {
        if let Some(marks) = self.marks().get_mut(source) {
            marks.first_received.get_or_insert(offset);
        }
    }

    /// Everything of `source` received below `offset` is committed.
    pub fn committed_below(&self, source: &SourceId, offset: Offset) {
        if let Some(marks) = self.marks().get_mut(source) {
            marks.committed_below = marks.committed_below.max(offset);
        }
    }

    /// `source` is no longer assigned here.
    pub fn source_gone(&self, source: &SourceId) {
        self.marks().remove(source);
    }

    fn marks(&self) -> std::sync::MutexGuard<'_, HashMap<SourceId, Marks>> {
        self.marks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until everything of `message`'s source received below it is committed, before a
    /// dead letter parks its key: after a crash, the key's messages before it are then never
    /// delivered again to find the key parked (and be set aside behind the message they
    /// precede). Returns at once when the source is no longer assigned here (a revoke's final
    /// commit covers them), or once `fenced` says the source's lease ran out.
    ///
    /// Offsets need not follow one another (NATS partitions share a stream's sequence, Kafka's
    /// transaction markers take offsets): when the last commit covers everything received
    /// before `message` but ends below its offset, no later commit may come — nothing new is
    /// finished — so the intake says how far it covers while a lane waits here
    /// ([`waiting`](Self::waiting)).
    pub async fn wait_committed_below(&self, message: &Message, fenced: impl Fn() -> bool) {
        let done = |marks: &HashMap<SourceId, Marks>| {
            marks.get(&message.source).is_none_or(|m| {
                m.first_received.is_none_or(|first| first >= message.offset)
                    || m.committed_below >= message.offset
            })
        };
        if done(&self.marks()) {
            return;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let _waited = Waited(&self.waiting);
        while !done(&self.marks()) && !fenced() {
            tokio::time::sleep(COMMIT_POLL).await;
        }
    }

    /// True while a lane waits for a commit below its message.
    pub fn waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }

    /// The replay `message` ends a part of — the replay's tag and the part's topic — if it is
    /// the last message of its topic's part of its key's replay under way: however it ended
    /// (handled, failed, set aside, set aside before), that part is over.
    pub fn ending_replay(&self, message: &Message) -> Option<(ReplayTag, Option<String>)> {
        let tag = ReplayTag::of(&message.headers).filter(|t| t.index >= 1)?;
        let topic = topic_name(message.source.as_str());
        let state = self.state();
        let replaying = state.keys.get(message.ordering_key()?)?.replaying()?;
        (replaying.id == tag.id && replaying.last_of_part(tag.index, topic))
            .then(|| (tag, topic.map(str::to_owned)))
    }

    /// Records a change a lane made (after the destination confirmed its record).
    pub fn record(&self, key: Bytes, change: ParkingChange) {
        let mut state = self.state();
        if let Some(journal) = state.journal.as_mut() {
            journal.push((key.clone(), change.clone()));
        }
        state.keys.apply(key, change);
        self.count(state.keys.len());
    }

    /// What a record of `message` is known by: its message's identity (`id`), or — for a
    /// message nothing identifies (no event id, offsets that name no position) — one of its
    /// own, so the record is never counted twice (read back by a read-back under way *and*
    /// applied again from its journal). A redelivery of such a message is recorded again:
    /// nothing tells it apart from another message.
    pub fn record_id(id: Option<String>) -> String {
        id.unwrap_or_else(|| {
            let mut rng = fastrand::Rng::new();
            format!("anonymous-{:016x}{:016x}", rng.u64(..), rng.u64(..))
        })
    }

    /// True if any key is parked (read without a lock: a lane asks before every keyed message).
    pub fn any_parked(&self) -> bool {
        self.parked.load(Ordering::Acquire) > 0
    }

    /// Publishes how many keys are parked (called under the state's lock).
    fn count(&self, parked: usize) {
        self.parked.store(parked, Ordering::Release);
        self.keys.set(parked as f64);
    }

    /// Records that `message`, known by `id`, failed and parked its key (`failed`), or was set
    /// aside.
    pub fn set_aside(&self, message: &Message, id: Option<String>, failed: bool) {
        if let Some(key) = message.ordering_key().cloned() {
            self.written.fetch_add(1, Ordering::Relaxed);
            self.record(
                key,
                ParkingChange::SetAside(Box::new(ParkedRecord::of(message, id, failed))),
            );
        }
    }

    /// Records read past a checkpoint before a new one is saved.
    pub fn checkpoint_after(&self) -> usize {
        self.checkpoint_after
    }

    /// True once this engine wrote enough records since its last read-back that the next
    /// assignment would read far: time to read back (and save a checkpoint).
    pub fn checkpoint_due(&self) -> bool {
        self.written.load(Ordering::Relaxed) >= self.checkpoint_after
    }

    /// Reads the dead-letter destination back into the view. The first read-back builds it
    /// from the group's checkpoint and what was written after it (changes made meanwhile
    /// applied again); later ones fold what was written past the view's mark into it, in
    /// place: one copy of the parked keys in memory, and work in proportion to what was
    /// written since, not to what is parked. A failed read is retried with backoff until it
    /// succeeds: nothing of a source may be handled before its parked keys are known.
    pub async fn read_back(&self, sink: &dyn DeadLetterSink) {
        let _one = self.reading.lock().await;
        // Where this engine's commits passed: a message delivered from below one is never
        // delivered again, so its key's parking need not know it by its id. Taken before the
        // journal starts: what this engine sets aside from then on (applied again after the
        // read, deduplicated by id) is committed only after it, so none of it is forgotten.
        let committed: HashMap<String, Offset> = self
            .marks()
            .iter()
            .filter(|(_, m)| m.positions)
            .map(|(source, m)| (source.to_string(), m.committed_below))
            .collect();
        let delivered_no_more =
            |(source, offset): &Position| committed.get(&**source).is_some_and(|below| offset < below);
        let mark = {
            let mut state = self.state();
            state.journal = Some(Vec::new());
            state.mark.clone()
        };
        self.written.store(0, Ordering::Relaxed);
        match mark {
            Some(mark) => self.read_past(sink, &mark, &delivered_no_more).await,
            None => self.read_anew(sink, &delivered_no_more).await,
        }
    }

    /// Builds the view anew: the checkpoint, what the destination holds after it, then the
    /// journal.
    async fn read_anew(
        &self,
        sink: &dyn DeadLetterSink,
        delivered_no_more: &(dyn Fn(&Position) -> bool + Sync),
    ) {
        let caught_up = retrying(|| {
            ParkedKeys::catch_up_forgetting(&self.group, sink, self.checkpoint_after, delivered_no_more)
        })
        .await;
        tracing::debug!(
            read = caught_up.read,
            from_checkpoint = caught_up.from_checkpoint,
            saved = caught_up.saved,
            forgotten = caught_up.forgotten,
            "dead-letter destination read back"
        );
        let mut state = self.state();
        self.replace(&mut state, caught_up.keys);
        state.mark = caught_up.mark;
        state.head = caught_up.head;
    }

    /// Folds what the destination holds past `mark` into the view, and saves a checkpoint of
    /// it once that was `checkpoint_after` records or more.
    async fn read_past(
        &self,
        sink: &dyn DeadLetterSink,
        mark: &ReadMark,
        delivered_no_more: &(dyn Fn(&Position) -> bool + Sync),
    ) {
        let tail = retrying(|| sink.read_back_after(Some(mark))).await;
        let read = tail.records.len();
        let (forgotten, snapshot) = self.fold_past(tail, delivered_no_more, read >= self.checkpoint_after);
        let mut saved = false;
        if let Some((mark, keys, known)) = snapshot {
            match save_checkpoint(&self.group, sink, &mark, &keys, known).await {
                Ok(parts) => {
                    saved = true;
                    self.state().head = Some(parts);
                }
                Err(e) => {
                    tracing::warn!(error = %e, read, "cannot save the parked keys' checkpoint: a member that starts reads this far back again")
                }
            }
        }
        tracing::debug!(
            read,
            from_checkpoint = false,
            saved,
            forgotten,
            "dead-letter destination read back"
        );
    }

    /// Folds `tail` into the view (anew if the destination restarted), forgets what is never
    /// delivered again, and moves the mark. Returns how many ids it forgot and, when `save`,
    /// what to save: a copy of the view (a pointer per key: lanes go on meanwhile), its mark,
    /// and the checkpoint known whole to save beside.
    fn fold_past(
        &self,
        tail: ReadBack,
        delivered_no_more: &(dyn Fn(&Position) -> bool + Sync),
        save: bool,
    ) -> (usize, Option<(ReadMark, ParkedKeys, Option<Parts>)>) {
        let mut state = self.state();
        if tail.restarted {
            tracing::warn!("the dead-letter destination was deleted and created again since this engine read it: reading its parked keys from its start");
            let mut keys = ParkedKeys::default();
            keys.fold_tail(&self.group, &tail.records);
            state.head = None;
            self.replace(&mut state, keys);
        } else {
            // The view has the journal's changes already.
            state.journal = None;
            state.keys.fold_tail(&self.group, &tail.records);
            self.count(state.keys.len());
        }
        let forgotten = state.keys.forget_committed(delivered_no_more);
        state.mark = tail.mark;
        let snapshot = state
            .mark
            .clone()
            .filter(|_| save)
            .map(|mark| (mark, state.keys.clone(), state.head));
        (forgotten, snapshot)
    }

    /// Replaces the view with `keys` (built anew), the journal's changes applied again.
    fn replace(&self, state: &mut State, mut keys: ParkedKeys) {
        for (key, change) in state.journal.take().unwrap_or_default() {
            keys.apply(key, change);
        }
        if keys.len() != state.keys.len() {
            tracing::info!(
                parked = keys.len(),
                "parked keys read back from the dead-letter destination"
            );
        }
        state.keys = keys;
        self.count(state.keys.len());
    }
}

/// Counts a lane out of [`Parking::wait_committed_below`] however its wait ends (a cancelled
/// lane's future is dropped mid-wait).
struct Waited<'a>(&'a AtomicUsize);

impl Drop for Waited<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `attempt`'s value, tried again with backoff while it fails (each failure logged).
async fn retrying<T, F, A>(mut attempt: A) -> T
where
    A: FnMut() -> F,
    F: Future<Output = Result<T, TransportError>>,
{
    let mut wait = Duration::from_millis(100);
    loop {
        match attempt().await {
            Ok(value) => return value,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?wait, "cannot read the dead-letter destination back to learn the parked keys; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(MAX_READ_BACKOFF);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;

    use super::*;
    use crate::dead_letter::{DeadLetter, DL_CAUSE, DL_GROUP, DL_OFFSET, DL_SOURCE};
    use crate::message::{Headers, SourceId};
    use crate::parking::{KeyParking, DL_PARKS, DL_PARK_ID, REPLAY, REPLAY_OF};
    use crate::transport::TransportError;

    fn message(key: &str, offset: u64, replay: Option<&str>) -> Message {
        let mut headers = Headers::new();
        if let Some(tag) = replay {
            headers.insert(REPLAY, tag.to_owned());
        }
        Message {
            key: Some(Bytes::from(key.to_owned())),
            payload: Bytes::new(),
            headers,
            source: SourceId::new("t/0"),
            offset,
        }
    }

    fn id(offset: u64) -> Option<String> {
        Some(format!("t/0@{offset}"))
    }

    /// A destination that holds what it is given, read back as is (from a mark too: the
    /// offset after the last record read), with its checkpoints' parts; it counts what it
    /// was asked.
    #[derive(Default)]
    struct Destination {
        records: Mutex<Vec<Message>>,
        checkpoints: Mutex<HashMap<u32, Bytes>>,
        /// Parts of checkpoints loaded, and records read.
        loads: AtomicUsize,
        read: AtomicUsize,
    }

    impl Destination {
        fn add(&self, key: &str, headers: &[(&str, String)]) {
            let mut records = self.records.lock().unwrap();
            let mut h = Headers::new();
            h.insert(DL_GROUP, "g");
            for (name, value) in headers {
                h.insert(*name, value.clone());
            }
            let offset = records.len() as u64;
            records.push(Message {
                headers: h,
                source: SourceId::new("t.dlq/0"),
                ..message(key, offset, None)
            });
        }
    }

    #[async_trait]
    impl DeadLetterSink for Destination {
        async fn publish(&self, _: &DeadLetter) -> Result<(), TransportError> {
            Ok(())
        }

        async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
            Ok(self.records.lock().unwrap().clone())
        }

        /// A mark past the end (the destination was emptied since) reads from the start.
        async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
            let records = self.records.lock().unwrap();
            let from = mark
                .and_then(ReadMark::next_offsets)
                .and_then(|next| next.get(&0).copied())
                .unwrap_or(0) as usize;
            let restarted = from > records.len();
            let tail = records[if restarted { 0 } else { from }..].to_vec();
            self.read.fetch_add(tail.len(), Ordering::Relaxed);
            let next = [(0, records.len() as u64)].into_iter().collect();
            Ok(ReadBack {
                records: tail,
                mark: Some(ReadMark::of_next_offsets(&next)),
                restarted,
            })
        }

        async fn load_checkpoint(&self, _: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
            self.loads.fetch_add(1, Ordering::Relaxed);
            Ok(self.checkpoints.lock().unwrap().get(&part).cloned())
        }

        async fn save_checkpoint(&self, _: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
            self.checkpoints.lock().unwrap().insert(part, checkpoint);
            Ok(())
        }
    }

    /// A destination whose read-backs wait until let through.
    struct Slow {
        records: Destination,
        through: tokio::sync::Semaphore,
    }

    #[async_trait]
    impl DeadLetterSink for Slow {
        async fn publish(&self, _: &DeadLetter) -> Result<(), TransportError> {
            Ok(())
        }

        async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
            let _through = self.through.acquire().await;
            self.records.read_back().await
        }
    }

    fn parked_record(offset: u64) -> Vec<(&'static str, String)> {
        vec![
            (DL_CAUSE, "parked".to_owned()),
            (DL_PARK_ID, format!("t/0@{offset}")),
        ]
    }

    /// After the first read-back (the checkpoint, then the records after it), an engine reads
    /// only what was written past its own mark, into its view in place; a record it wrote
    /// itself, read back, tells it where the destination holds it — what a replay marker
    /// names it by.
    #[tokio::test]
    async fn a_read_back_after_the_first_reads_past_its_mark_into_the_view() {
        let destination = Destination::default();
        destination.add("k", &parked_record(1));
        let parking = Parking::new("g", 2);
        parking.read_back(&destination).await;
        let (loads, read) = (
            destination.loads.load(Ordering::Relaxed),
            destination.read.load(Ordering::Relaxed),
        );
        assert_eq!(
            (loads, read),
            (1, 1),
            "a checkpoint's head looked for, then every record"
        );

        // The engine sets k@2 aside (the destination confirmed its record, at offset 1).
        destination.add("k", &parked_record(2));
        parking.set_aside(&message("k", 2, None), id(2), false);
        parking.read_back(&destination).await;
        assert_eq!(
            destination.loads.load(Ordering::Relaxed),
            loads,
            "no checkpoint loaded again"
        );
        assert_eq!(
            destination.read.load(Ordering::Relaxed),
            read + 1,
            "only the record past the mark"
        );
        assert_eq!(
            parking.state().keys.get(b"k").unwrap().pending(),
            2,
            "its own record once"
        );

        // A replay of both, as the tool names them: by where the destination holds them.
        destination.add(
            "k",
            &[
                (DL_CAUSE, "replay".to_owned()),
                (REPLAY, "r1 0/2".to_owned()),
                (REPLAY_OF, "t.dlq/0@0,t.dlq/0@1".to_owned()),
            ],
        );
        assert_eq!(
            parking.gate(&message("k", 9, Some("r1 1/2")), None, false),
            Gate::ReadBack
        );
        parking.read_back(&destination).await;
        {
            let state = parking.state();
            let k = state.keys.get(b"k").unwrap();
            assert_eq!(k.pending(), 0, "the replay took the engine's own record too");
            assert!(k.holds("t/0@2"), "remembered as replayed");
        }
        assert_eq!(
            parking.gate(&message("k", 9, Some("r1 1/2")), None, false),
            Gate::Replay
        );

        // Two records past the mark: a checkpoint saved, which a member that starts reads,
        // knowing what this engine knows without reading a record.
        assert!(destination.checkpoints.lock().unwrap().is_empty());
        destination.add("j", &parked_record(20));
        destination.add("j", &parked_record(21));
        parking.read_back(&destination).await;
        assert!(destination.checkpoints.lock().unwrap().contains_key(&0), "saved");
        let starting = Parking::new("g", 2);
        let read = destination.read.load(Ordering::Relaxed);
        starting.read_back(&destination).await;
        assert_eq!(
            destination.read.load(Ordering::Relaxed),
            read,
            "nothing past the checkpoint"
        );
        assert_eq!(
            format!("{:?}", starting.state().keys.get(b"k").unwrap().replaying()),
            format!("{:?}", parking.state().keys.get(b"k").unwrap().replaying())
        );
        assert_eq!(starting.state().keys.get(b"j").map(KeyParking::pending), Some(2));
    }

    /// A destination emptied since the engine read it (deleted and created again): its view
    /// is read anew from the start, the engine's changes made meanwhile applied again.
    #[tokio::test]
    async fn a_destination_created_again_is_read_from_its_start() {
        let destination = Destination::default();
        for offset in 1..=3 {
            destination.add("old", &parked_record(offset));
        }
        let parking = Parking::new("g", crate::parking::CHECKPOINT_AFTER);
        parking.read_back(&destination).await;
        assert!(parking.state().keys.get(b"old").is_some());
        destination.records.lock().unwrap().clear();
        destination.add("new", &parked_record(7));
        parking.read_back(&destination).await;
        let state = parking.state();
        assert!(
            state.keys.get(b"old").is_none(),
            "what the old destination held is void"
        );
        assert_eq!(state.keys.get(b"new").map(KeyParking::pending), Some(1));
    }

    /// Fails with a record known by nothing (`None`): written while a read-back is under way,
    /// it is both in what the read-back reads and in the journal applied after it, and counted
    /// twice — a replay then re-publishes the message twice.
    #[tokio::test]
    async fn a_record_written_during_a_read_back_counts_once() {
        let destination = Slow {
            records: Destination::default(),
            through: tokio::sync::Semaphore::new(0),
        };
        let parking = Parking::new("g", crate::parking::CHECKPOINT_AFTER);
        parking.set_aside(&message("k", 1, None), id(1), true);
        let anonymous = message("k", 2, None);
        let known_by = Parking::record_id(None);
        let writing = async {
            destination.records.add(
                "k",
                &[(DL_CAUSE, "parked".to_owned()), (DL_PARK_ID, known_by.clone())],
            );
            parking.set_aside(&anonymous, Some(known_by.clone()), false);
            destination.through.add_permits(1);
        };
        tokio::join!(parking.read_back(&destination), writing);
        let state = parking.state();
        let key = state.keys.get(b"k").expect("parked");
        assert_eq!(key.pending(), 1, "the set-aside record counts once");
    }

    /// A parked key replayed while it stays parked remembers what the replay took (a
    /// redelivery of one is not set aside again) only until the source's commit passed it.
    #[tokio::test]
    async fn a_replayed_message_is_forgotten_once_its_source_committed_past_it() {
        for positions in [true, false] {
            let destination = Destination::default();
            let parking = Parking::new("g", crate::parking::CHECKPOINT_AFTER);
            let source = SourceId::new("t/0");
            parking.source_assigned(&source, positions);
            for (offset, cause) in [(1u64, "terminal"), (2, "parked"), (3, "parked")] {
                destination.add(
                    "k",
                    &[
                        (DL_CAUSE, cause.to_owned()),
                        (DL_PARKS, "key".to_owned()),
                        (DL_PARK_ID, id(offset).unwrap()),
                        (DL_SOURCE, "t/0".to_owned()),
                        (DL_OFFSET, offset.to_string()),
                    ],
                );
            }
            destination.add(
                "k",
                &[
                    (DL_CAUSE, "replay".to_owned()),
                    (REPLAY, "r1 0/2".to_owned()),
                    (REPLAY_OF, "t.dlq/0@0,t.dlq/0@1".to_owned()),
                ],
            );
            let holds = |offset| {
                parking
                    .state()
                    .keys
                    .get(b"k")
                    .unwrap()
                    .holds(&id(offset).unwrap())
            };
            parking.read_back(&destination).await;
            assert!(holds(1) && holds(2) && holds(3));
            parking.committed_below(&source, 2);
            parking.read_back(&destination).await;
            assert_eq!(
                holds(1),
                !positions,
                "replayed and committed past (offsets naming positions): forgotten"
            );
            assert!(holds(2), "replayed, not committed past");
            assert!(holds(3), "waiting");
            parking.committed_below(&source, 4);
            parking.read_back(&destination).await;
            assert_eq!(holds(2) || holds(3), !positions, "committed past: forgotten");
            let state = parking.state();
            assert_eq!(state.keys.get(b"k").unwrap().pending(), 1, "still waiting");
        }
    }

    #[test]
    fn a_parked_key_sets_aside_its_later_messages_once_each() {
        let parking = Parking::new("g", crate::parking::CHECKPOINT_AFTER);
        let gate = |m: &Message, read| parking.gate(m, id(m.offset).as_deref(), read);
        assert_eq!(gate(&message("k", 1, None), false), Gate::Free);
        parking.set_aside(&message("k", 1, None), id(1), true);
        assert_eq!(
            gate(&message("other", 2, None), false),
            Gate::Free,
            "other keys never wait"
        );
        assert_eq!(gate(&message("k", 2, None), false), Gate::SetAside);
        parking.set_aside(&message("k", 2, None), id(2), false);
        assert_eq!(
            gate(&message("k", 2, None), false),
            Gate::AlreadySetAside,
            "a redelivery"
        );
        assert_eq!(
            parking.gate(&message("k", 2, None), None, false),
            Gate::SetAside,
            "no id: recorded again"
        );
        // A replay the view does not know of: read back first; still unknown: set aside.
        assert_eq!(gate(&message("k", 9, Some("r0 1/2")), false), Gate::ReadBack);
        assert_eq!(gate(&message("k", 9, Some("r0 1/2")), true), Gate::SetAside);
        assert_eq!(
            gate(&message("k", 9, Some("r0 2/2")), false),
            Gate::SetAside,
            "known stale now"
        );
    }

    #[tokio::test]
    async fn a_replay_read_back_is_handled_then_ends_and_what_came_meanwhile_waits() {
        let destination = Destination::default();
        let parked = |offset: u64| {
            vec![
                (DL_CAUSE, "parked".to_owned()),
                (DL_PARK_ID, format!("t/0@{offset}")),
            ]
        };
        destination.add("k", &parked(1));
        destination.add("k", &parked(2));
        let parking = Parking::new("g", crate::parking::CHECKPOINT_AFTER);
        let gate = |m: &Message| parking.gate(m, id(m.offset).as_deref(), false);
        parking.read_back(&destination).await;
        assert_eq!(
            gate(&message("k", 3, None)),
            Gate::SetAside,
            "parked, as read back"
        );
        assert_eq!(gate(&message("k", 2, None)), Gate::AlreadySetAside);

        destination.add(
            "k",
            &[
                (DL_CAUSE, "replay".to_owned()),
                (REPLAY, "r1 0/2".to_owned()),
                (REPLAY_OF, "t.dlq/0@0,t.dlq/0@1".to_owned()),
            ],
        );
        // Meanwhile a lane sets 10 aside: the destination confirmed it, then the view took it.
        destination.add("k", &parked(10));
        parking.set_aside(&message("k", 10, None), id(10), false);
        let first = message("k", 11, Some("r1 1/2"));
        assert_eq!(gate(&first), Gate::ReadBack);
        parking.read_back(&destination).await;
        assert_eq!(gate(&first), Gate::Replay);
        assert_eq!(parking.ending_replay(&first), None);
        assert_eq!(
            gate(&message("k", 2, None)),
            Gate::AlreadySetAside,
            "replayed: not recorded again"
        );
        let last = message("k", 12, Some("r1 2/2"));
        assert_eq!(gate(&last), Gate::Replay);
        assert_eq!(
            parking.ending_replay(&last).map(|(t, _)| t.id),
            Some("r1".to_owned())
        );
        parking.record(
            Bytes::from_static(b"k"),
            ParkingChange::ReplayDone("r1".into(), None),
        );
        assert_eq!(
            gate(&message("k", 13, None)),
            Gate::SetAside,
            "behind 10, set aside during the replay"
        );
        assert_eq!(
            gate(&message("k", 14, Some("r2 1/2"))),
            Gate::ReadBack,
            "a replay not read of"
        );
    }

    #[tokio::test]
    async fn a_replay_message_that_fails_takes_the_rest_of_its_replay_along() {
        let destination = Destination::default();
        destination.add(
            "k",
            &[(DL_CAUSE, "parked".to_owned()), (DL_PARK_ID, "t/0@1".to_owned())],
        );
        destination.add(
            "k",
            &[
                (DL_CAUSE, "replay".to_owned()),
                (REPLAY, "r1 0/3".to_owned()),
                (REPLAY_OF, "t.dlq/0@0".to_owned()),
            ],
        );
        let parking = Parking::new("g", crate::parking::CHECKPOINT_AFTER);
        parking.read_back(&destination).await;
        let gate = |m: &Message| parking.gate(m, id(m.offset).as_deref(), false);
        let first = message("k", 5, Some("r1 1/3"));
        assert_eq!(gate(&first), Gate::Replay);
        parking.set_aside(&first, id(5), true); // it failed again: dead-lettered, parking the key
        assert_eq!(gate(&message("k", 6, Some("r1 2/3"))), Gate::SetAside);
        // Set aside too, the replay's last message still ends it.
        let last = message("k", 7, Some("r1 3/3"));
        assert_eq!(gate(&last), Gate::SetAside);
        assert!(parking.ending_replay(&last).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_letter_that_parks_waits_for_the_commit_below_it() {
        let parking = Parking::new("g", crate::parking::CHECKPOINT_AFTER);
        let source = SourceId::new("t/0");
        let head = message("k", 9, None);
        parking.source_assigned(&source, true);
        parking.received(&source, 9);
        // The first message received here: nothing below it to wait for.
        parking.wait_committed_below(&head, || false).await;
        parking.source_assigned(&source, true);
        parking.received(&source, 5);
        let waiting = parking.wait_committed_below(&head, || false);
        tokio::pin!(waiting);
        assert!(futures_util::poll!(waiting.as_mut()).is_pending());
        parking.committed_below(&source, 7); // offsets 5 and 6 committed, 7 and 8 not yet
        tokio::time::advance(COMMIT_POLL * 2).await;
        assert!(futures_util::poll!(waiting.as_mut()).is_pending());
        parking.committed_below(&source, 9);
        tokio::time::advance(COMMIT_POLL * 2).await;
        assert!(futures_util::poll!(waiting.as_mut()).is_ready());
        // Revoked: its final commit covers what came before; nothing to wait for.
        parking.source_assigned(&source, true);
        parking.received(&source, 1);
        parking.source_gone(&source);
        parking.wait_committed_below(&head, || false).await;
    }
}
