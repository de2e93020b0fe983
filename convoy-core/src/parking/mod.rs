//! Parked keys: for ledgers and state machines, where a dead-lettered message must not be
//! followed by the next one of its key. With [`EngineConfig::park_keys`], a key whose message is
//! dead-lettered is *parked*: every later message of it is set aside, in order, to the
//! dead-letter destination (cause `parked`) instead of being handled, until an operator
//! replays the key. Other keys never wait.
//!
//! The dead-letter destination is the only record: an engine reads it back ([`DeadLetterSink::
//! read_back`]) whenever it is assigned sources and folds it into [`ParkedKeys`], so parking
//! survives restarts, rebalances and crashes — the next owner of a parked key sets its later
//! messages aside too. The records, per key and group, in the destination's order:
//!
//! - a dead letter carrying [`DL_PARKS`] parks its key (the first of its *pending* records);
//! - a record of cause `parked` is a message set aside behind it;
//! - a *replay marker* (cause `replay`, written by [`replay_key`] before it publishes)
//!   names the pending records it re-publishes ([`REPLAY_OF`]) and the replay's id and size
//!   ([`REPLAY`]): those records are no longer pending, and the key is *replaying*. A key
//!   with more records than one header holds ([`MARKER_POSITIONS_BYTES`]) gets a marker in
//!   parts ([`REPLAY_OF_PART`]), and its replay starts once the last part is read: a tool that
//!   died between them started nothing (it publishes after the last);
//! - a *skip marker* (cause `skipped`, written by [`unpark_key`]) names failed records
//!   ([`DL_OF`]) the operator passed over: they are no longer pending, never replayed, and a
//!   copy of one delivered again is a duplicate;
//! - a *replay-done marker* (cause `replay-done`, written by the engine before the last message
//!   of a topic's part of the replay is finished, naming that topic in [`REPLAY_PART`]) ends
//!   that part; the replay ends when every topic's part has (a key on several topics is
//!   replayed to each, and each topic's copies are delivered in their own order).
//!
//! A replaying key handles the replay's messages (they carry [`REPLAY`]) in order and sets
//! aside everything else — messages published meanwhile come after the replayed ones. A replay
//! message that fails parks the key again and the rest of the replay follows it into the
//! parking — in its topic: a key's copies on other topics run on in theirs; the replay's
//! messages before it (in its topic) ran, and a copy of one delivered again (a resumed replay,
//! a redelivery) is a duplicate, never set aside. A key is parked while it is replaying or has pending records; its next replay
//! re-publishes the last replay's own records first (in the replay's order), then the others
//! in the order they were set aside: each key's original order, whatever interleaved.
//!
//! A record is known by its message's identity ([`DL_PARK_ID`]: its event id, or where it was
//! read when offsets are positions), so a message set aside twice (redelivered after a crash)
//! is recorded once, and one a replay took is not set aside again while its key stays parked —
//! until the group's commit passed where it was delivered from ([`ParkedKeys::forget_committed`]:
//! it is never delivered again then). A replay marker names the records it covers by where the
//! destination holds them.
//!
//! [`EngineConfig::park_keys`]: crate::EngineConfig::park_keys
//! [`DeadLetterSink::read_back`]: crate::DeadLetterSink::read_back

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::dead_letter::{
    replay_message, DeadLetter, DeadLetterCause, DeadLetterReason, DeadLetterSink, ReadMark, DL_CAUSE,
    DL_GROUP, DL_OFFSET, DL_SOURCE,
};
use crate::message::{Headers, Message, OutgoingMessage, SourceId};
use crate::transport::{Publisher, Receipt, TransportError};

mod checkpoint;
mod unpark;

use checkpoint::Checkpoint;
pub(crate) use checkpoint::Parts;
pub use checkpoint::CHECKPOINT_PART_BYTES;

pub use crate::header_names::{DL_OF, DL_PARKS, DL_PARK_ID, REPLAY, REPLAY_OF, REPLAY_OF_PART, REPLAY_PART};

/// Most bytes of positions one marker's header lists: well within every broker's bound on a
/// record's headers (NATS: 64 KiB for all of them; RabbitMQ: one frame, 128 KiB by default).
pub const MARKER_POSITIONS_BYTES: usize = 16 * 1024;
pub use unpark::{unpark_key, Unparked};

/// The cause of an end marker: a record that only says how far a read-back must read, for a
/// destination with no end to read to (a RabbitMQ stream).
pub const CAUSE_END: &str = "read-back-end";

/// True for the records of a dead-letter destination that are markers, not messages (replay,
/// replay-done, replayed, skipped, purged, end): listings and replays skip them.
pub fn is_marker(record: &Message) -> bool {
    record.headers.get_str(DL_CAUSE).is_some_and(|cause| {
        [
            DeadLetterCause::Replay.as_str(),
            CAUSE_END,
            DeadLetterCause::ReplayDone.as_str(),
            DeadLetterCause::Replayed.as_str(),
            DeadLetterCause::Skipped.as_str(),
            DeadLetterCause::Purged.as_str(),
        ]
        .contains(&cause)
    })
}

/// The records a marker of `cause` names in [`DL_OF`] (an unpark's skip marker, a purge
/// marker), by where the destination holds them; empty for every other record.
pub fn marked_by(record: &Message, cause: DeadLetterCause) -> Vec<Position> {
    if record.headers.get_str(DL_CAUSE) != Some(cause.as_str()) {
        return Vec::new();
    }
    positions(record.headers.get_str(DL_OF))
}

fn positions(list: Option<&str>) -> Vec<Position> {
    list.unwrap_or_default()
        .split(',')
        .filter_map(parse_position)
        .collect()
}

/// `positions` as comma-separated lists of at most [`MARKER_POSITIONS_BYTES`] each (a longer
/// position alone), in order: one marker's header each; one empty list for none.
pub fn position_lists(positions: &[String]) -> Vec<String> {
    let mut lists = vec![String::new()];
    for position in positions {
        let list = lists.last_mut().expect("never empty");
        if !list.is_empty() && list.len() + 1 + position.len() > MARKER_POSITIONS_BYTES {
            lists.push(position.clone());
        } else {
            if !list.is_empty() {
                list.push(',');
            }
            list.push_str(position);
        }
    }
    lists
}

/// A replay marker's place among its parts, `(part, parts)` from 1: `(1, 1)` for a marker in
/// one record (every marker of an older version).
pub fn marker_part(record: &Message) -> (u32, u32) {
    let part = record.headers.get_str(REPLAY_OF_PART).and_then(|v| {
        let (part, parts) = v.split_once('/')?;
        Some((part.parse().ok()?, parts.parse().ok()?))
    });
    part.unwrap_or((1, 1))
}

/// The records a marker says were re-published (a parked key's replay marker, or the audit
/// record of a replay of single dead letters), by where the destination holds them; empty for
/// every other record.
pub fn replayed_by(record: &Message) -> Vec<Position> {
    let cause = record.headers.get_str(DL_CAUSE);
    let replays = [
        DeadLetterCause::Replay.as_str(),
        DeadLetterCause::Replayed.as_str(),
    ];
    if !cause.is_some_and(|c| replays.contains(&c)) {
        return Vec::new();
    }
    positions(record.headers.get_str(REPLAY_OF))
}

/// A name a parked key's records share (a source's, a topic's, an id): one allocation, however
/// many records hold it.
pub type Name = Arc<str>;

/// Where a message was read (its source and offset): what a record is known by.
pub type Position = (Name, u64);

/// A replayed message's place in its replay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayTag {
    /// The replay's id.
    pub id: String,
    /// 1 for the first message; 0 on the replay's marker.
    pub index: u32,
    /// Messages in the replay.
    pub count: u32,
}

impl ReplayTag {
    /// The tag in `headers`, if well formed.
    pub fn of(headers: &Headers) -> Option<ReplayTag> {
        let value = headers.get_str(REPLAY)?;
        let (id, place) = value.rsplit_once(' ')?;
        let (index, count) = place.split_once('/')?;
        Some(ReplayTag {
            id: id.to_owned(),
            index: index.parse().ok()?,
            count: count.parse().ok()?,
        })
    }

    /// The header value.
    pub fn header_value(&self) -> String {
        format!("{} {}/{}", self.id, self.index, self.count)
    }

    /// True for the replay's last message.
    pub fn is_last(&self) -> bool {
        self.index >= self.count
    }
}

/// A failed or set-aside message of a parked key.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParkedRecord {
    /// What its message is known by, if anything identifies it.
    pub id: Option<Name>,
    /// Where the destination holds it (known once read back).
    pub stored: Option<Position>,
    /// The replay its message came from, if it was a replayed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<ReplayTag>,
    /// Its message failed (the dead letter that parked the key), rather than being set aside.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
    /// The topic its message came from, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<Name>,
    /// Where its message was delivered from (source and offset), if known: once the group's
    /// commit passed it there, the message is never delivered again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Position>,
    /// The record as the dead-letter destination holds it (`None` for one this engine wrote
    /// and has not read back, and in an engine's read-back, which needs no payloads). Boxed:
    /// a key parked under load holds many records, mostly without one.
    #[serde(skip)]
    pub record: Option<Box<Message>>,
}

impl ParkedRecord {
    /// The record of `message`, known by `id`, dead-lettered here (`failed`) or set aside.
    pub fn of(message: &Message, id: Option<String>, failed: bool) -> ParkedRecord {
        ParkedRecord {
            id: id.map(Name::from),
            stored: None,
            replay: ReplayTag::of(&message.headers),
            failed,
            topic: topic_of(message.source.as_str()),
            origin: Some((message.source.as_str().into(), message.offset)),
            record: None,
        }
    }
}

impl ParkedRecord {
    /// Shares its sources' and topic's names with other records (`names` holds each once).
    fn share_names(&mut self, names: &mut HashSet<Name>) {
        let stored = self.stored.as_mut().map(|(source, _)| source);
        let origin = self.origin.as_mut().map(|(source, _)| source);
        for name in [stored, origin, self.topic.as_mut()].into_iter().flatten() {
            share(name, names);
        }
    }
}

/// `name` as `names` holds it (added if new): one allocation however many records hold it.
fn share(name: &mut Name, names: &mut HashSet<Name>) {
    match names.get(&**name) {
        Some(shared) => *name = shared.clone(),
        None => {
            names.insert(name.clone());
        }
    }
}

/// The topic of a source named `topic/partition`.
pub fn topic_of(source: &str) -> Option<Name> {
    topic_name(source).map(Name::from)
}

/// The topic of a source named `topic/partition`, borrowed from it.
pub fn topic_name(source: &str) -> Option<&str> {
    source.rsplit_once('/').map(|(topic, _)| topic)
}

/// A replay under way: its id and size, and — when the records it re-publishes are known —
/// the topic of each of its messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replaying {
    /// The replay's id.
    pub id: String,
    /// Messages in it.
    pub count: u32,
    /// The topic of message `i` at `i - 1` (empty when not known for every message).
    pub topics: Vec<String>,
    /// The topics whose part of the replay ended.
    pub done: BTreeSet<String>,
}

impl Replaying {
    /// True if message `index` (from 1), of `topic`, is the last of its topic's part: the
    /// replay's last message, when the parts are not known.
    pub fn last_of_part(&self, index: u32, topic: Option<&str>) -> bool {
        match topic.filter(|_| !self.topics.is_empty()) {
            Some(topic) => self
                .topics
                .iter()
                .rposition(|t| t == topic)
                .is_some_and(|last| last as u32 + 1 == index),
            None => index >= self.count,
        }
    }

    /// True once every part ended (the one given now included).
    fn ends_with(&mut self, part: Option<String>) -> bool {
        match part.filter(|_| !self.topics.is_empty()) {
            Some(part) => {
                self.done.insert(part);
                self.topics.iter().all(|t| self.done.contains(t))
            }
            None => true,
        }
    }
}

/// What the dead-letter destination says of one key of a group.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct KeyParking {
    /// Records not covered by a replay, in the order they were written.
    pending: Vec<ParkedRecord>,
    /// The ids of records replays took (or an unpark passed over) since the key was parked,
    /// with where their messages were delivered from: a redelivery of one is not set aside
    /// again. Forgotten once the group's commit passed it ([`ParkedKeys::forget_committed`]):
    /// a key parked for hours would otherwise remember every message replayed meanwhile.
    replayed: HashMap<Name, Option<Position>>,
    replaying: Option<Replaying>,
    /// The records the replay under way re-publishes, in its order (what a resume publishes
    /// again).
    replaying_records: Vec<ParkedRecord>,
    /// The id of the key's last replay: its records come first in the next one.
    last_replay: Option<String>,
    /// Replays of the key that ended since it was parked: a message of one coming later is a
    /// duplicate (a resumed replay's copy of what ran already).
    ended: HashSet<String>,
    /// A replay marker in parts being read: its id, the parts read and the records they name.
    #[serde(default)]
    marker_parts: Option<(String, u32, Vec<Position>)>,
    /// The ids of the pending records: a message set aside is looked up once, not against every
    /// record of a key holding thousands (rebuilt from `pending` when a checkpoint is read).
    #[serde(skip)]
    pending_ids: HashSet<Name>,
}

impl KeyParking {
    /// True while the key's later messages are set aside (or it is replaying).
    pub fn is_parked(&self) -> bool {
        self.replaying.is_some() || !self.pending.is_empty()
    }

    /// The replay under way, if any.
    pub fn replaying(&self) -> Option<&Replaying> {
        self.replaying.as_ref()
    }

    /// The id of the key's last replay.
    pub fn last_replay(&self) -> Option<&str> {
        self.last_replay.as_deref()
    }

    /// How many failed and set-aside messages wait for a replay.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// True if the message known by `id` was recorded already (waiting, or replayed since),
    /// unless it was forgotten as never delivered again ([`ParkedKeys::forget_committed`]).
    pub fn holds(&self, id: &str) -> bool {
        self.replayed.contains_key(id) || self.pending_ids.contains(id)
    }

    /// True if replay `id` of the key ended.
    pub fn replay_ended(&self, id: &str) -> bool {
        self.ended.contains(id)
    }

    /// True if a message of replay `id` failed or was set aside: the rest of it follows.
    pub fn replay_failed(&self, id: &str) -> bool {
        self.pending
            .iter()
            .any(|r| r.replay.as_ref().is_some_and(|t| t.id == id))
    }

    /// True if a message of `topic`'s part of replay `id` failed or was set aside (any part's,
    /// when the topic is not known): the rest of that part follows it. Each topic's copies run
    /// in their own order, so a failure in one topic does not set the other topics' aside.
    pub fn part_failed(&self, id: &str, topic: Option<&str>) -> bool {
        self.pending.iter().any(|r| {
            r.replay.as_ref().is_some_and(|t| t.id == id)
                && topic.is_none_or(|topic| r.topic.as_deref().is_none_or(|t| t == topic))
        })
    }

    /// True if message `index` of the replay under way, of `topic`, was handled before the
    /// replay failed: the topic's messages run in the replay's order, so every one before the
    /// first that failed in the same topic ran. Such a message delivered again (a resumed
    /// replay publishes all of it again) is a duplicate, never set aside: a later replay would
    /// handle it twice.
    pub fn ran_before_failure(&self, index: u32, topic: Option<&str>) -> bool {
        let (Some(replay), Some(topic)) = (&self.replaying, topic) else {
            return false;
        };
        self.pending
            .iter()
            .filter(|r| r.failed && r.topic.as_deref() == Some(topic))
            .filter_map(|r| r.replay.as_ref().filter(|t| t.id == replay.id))
            .map(|t| t.index)
            .min()
            .is_some_and(|first_failed| index < first_failed)
    }

    /// The records a replay re-publishes now, in the key's order: the last replay's own
    /// records first (in that replay's order), then the others as they were written.
    pub fn to_replay(&self) -> Vec<&ParkedRecord> {
        let of_last = |r: &ParkedRecord| match (&r.replay, &self.last_replay) {
            (Some(tag), Some(last)) if &tag.id == last => Some(tag.index),
            _ => None,
        };
        let mut records: Vec<&ParkedRecord> = self.pending.iter().collect();
        // Stable: the others keep the order they were written in.
        records.sort_by_key(|r| of_last(r).map_or((1, 0), |index| (0, index)));
        records
    }

    fn set_aside(&mut self, record: ParkedRecord) {
        if let Some(id) = &record.id {
            if self.pending_ids.contains(id) {
                // Recorded already: by the engine that wrote it, before the destination was read
                // back (kept where it was applied). Now read back, where it is stored is known —
                // what a replay marker names it by. The engine's own are the latest records.
                if let Some(stored) = record.stored {
                    let own = self.pending.iter_mut().rev().find(|r| r.id.as_ref() == Some(id));
                    if let Some(own) = own.filter(|r| r.stored.is_none()) {
                        own.stored = Some(stored);
                    }
                }
                return;
            }
            if self.replayed.contains_key(id) {
                return;
            }
            self.pending_ids.insert(id.clone());
        }
        self.pending.push(record);
    }

    /// Moves the pending records at `stored` out (replayed or passed over), in pending order:
    /// their ids are remembered as replayed.
    fn take_pending(&mut self, stored: impl Fn(&Position) -> bool) -> Vec<ParkedRecord> {
        let (taken, pending): (Vec<ParkedRecord>, Vec<ParkedRecord>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|r| r.stored.as_ref().is_some_and(&stored));
        self.pending = pending;
        for r in &taken {
            if let Some(id) = &r.id {
                self.pending_ids.remove(id);
                // A replay's copy is delivered again by a resumed replay, from elsewhere: only
                // an original is forgotten once committed past.
                let origin = r.origin.clone().filter(|_| r.replay.is_none());
                self.replayed.insert(id.clone(), origin);
            }
        }
        taken
    }

    /// Forgets the ids of the messages `delivered_no_more` says are never delivered again:
    /// replayed ones, and waiting ones (which stay waiting, known by where the destination
    /// holds them). A replay's copy keeps its id: a resumed replay delivers it again.
    fn forget_committed(&mut self, delivered_no_more: &(dyn Fn(&Position) -> bool + Sync)) -> usize {
        let replayed = self.replayed.len();
        self.replayed
            .retain(|_, origin| !origin.as_ref().is_some_and(delivered_no_more));
        let mut forgotten = replayed - self.replayed.len();
        for record in self.pending.iter_mut().filter(|r| r.replay.is_none()) {
            if record.origin.as_ref().is_some_and(delivered_no_more) {
                record.origin = None;
                if let Some(id) = record.id.take() {
                    self.pending_ids.remove(&id);
                    forgotten += 1;
                }
            }
        }
        // Shrunk once less than a quarter full: a hot key's forgotten ids would otherwise keep
        // the tables' peak for as long as the key stays parked.
        if forgotten > 0 {
            if self.replayed.len() < self.replayed.capacity() / 4 {
                self.replayed.shrink_to_fit();
            }
            if self.pending_ids.len() < self.pending_ids.capacity() / 4 {
                self.pending_ids.shrink_to_fit();
            }
        }
        forgotten
    }

    /// Rebuilds what a checkpoint does not hold: the index of pending ids, and names shared.
    fn reindex(&mut self, names: &mut HashSet<Name>) {
        for record in self.pending.iter_mut().chain(&mut self.replaying_records) {
            record.share_names(names);
        }
        for (source, _) in self.replayed.values_mut().flatten() {
            share(source, names);
        }
        self.pending_ids = self.pending.iter().filter_map(|r| r.id.clone()).collect();
    }

    /// Part `part` of `parts` of a replay marker: the replay starts with the last part, read
    /// after all the others in order. A part read again (a publish retried) changes nothing; a
    /// part missing (the tool died) leaves the replay unstarted, its records pending.
    fn replay_marker(&mut self, tag: &ReplayTag, stored: Vec<Position>, (part, parts): (u32, u32)) {
        if parts <= 1 {
            self.marker_parts = None;
            return self.replay_started(tag, &stored);
        }
        let mut read = match self.marker_parts.take() {
            Some(read) if read.0 == tag.id => read,
            _ => (tag.id.clone(), 0, Vec::new()),
        };
        if part <= read.1 {
            self.marker_parts = Some(read);
            return;
        }
        if part != read.1 + 1 {
            return;
        }
        read.1 = part;
        read.2.extend(stored);
        match part == parts {
            true => self.replay_started(tag, &read.2),
            false => self.marker_parts = Some(read),
        }
    }

    fn replay_started(&mut self, tag: &ReplayTag, stored: &[Position]) {
        let place: HashMap<&Position, usize> = stored.iter().enumerate().map(|(i, p)| (p, i)).collect();
        let mut taken = self.take_pending(|p| place.contains_key(p));
        taken.sort_by_key(|r| r.stored.as_ref().and_then(|p| place.get(p).copied()));
        let topics: Option<Vec<String>> = taken
            .iter()
            .map(|r| r.topic.as_deref().map(str::to_owned))
            .collect();
        let topics = topics
            .filter(|t| t.len() == tag.count as usize)
            .unwrap_or_default();
        self.replaying_records = taken;
        self.replaying = Some(Replaying {
            id: tag.id.clone(),
            count: tag.count,
            topics,
            done: BTreeSet::new(),
        });
        self.last_replay = Some(tag.id.clone());
    }

    fn skip(&mut self, stored: &[Position]) {
        let stored: HashSet<&Position> = stored.iter().collect();
        self.take_pending(|p| stored.contains(p));
    }

    fn replay_done(&mut self, id: &str, part: Option<String>) {
        let Some(replaying) = self.replaying.as_mut().filter(|r| r.id == id) else {
            return;
        };
        if replaying.ends_with(part) {
            self.replaying = None;
            // Not `clear`: a hot key's replay held many records, and the key may stay parked.
            self.replaying_records = Vec::new();
            self.ended.insert(id.to_owned());
        }
    }
}

/// A change to a key's parking, as a record of the destination or the engine makes it.
#[derive(Clone, Debug)]
pub enum ParkingChange {
    /// A message of the key failed (parking it) or was set aside.
    SetAside(Box<ParkedRecord>),
    /// A replay marker (or part `.0` of `.1` of one) of the key: its replay re-publishes the
    /// records the destination holds at these positions.
    ReplayStarted(ReplayTag, Vec<Position>, (u32, u32)),
    /// The part of the replay with this id of one topic (`None`: all of it) ended.
    ReplayDone(String, Option<String>),
    /// An operator passed over the records the destination holds at these positions
    /// ([`unpark_key`]).
    Skipped(Vec<Position>),
}

/// The parked keys of one group, folded from its dead-letter destination.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ParkedKeys {
    /// Ordered: listings and replays of every key go in one order (and a simulation's trace).
    /// Shared: a copy (the snapshot a checkpoint is saved from while lanes go on) costs a
    /// pointer per key, and a key changed meanwhile is copied then, alone.
    #[serde(with = "bytes_keys")]
    keys: BTreeMap<Bytes, Arc<KeyParking>>,
    /// The replays that ended of keys no longer parked: a copy of one delivered later (a
    /// resumed replay's) is still a duplicate when its key parks again.
    #[serde(with = "bytes_keys")]
    ended: BTreeMap<Bytes, HashSet<String>>,
    /// The sources' and topics' names the records hold, each once: a hot parked key's
    /// hundreds of thousands of records name a handful.
    #[serde(skip)]
    names: HashSet<Name>,
}

impl ParkedKeys {
    /// Folds `records` (the dead-letter destination, in order per key) for `group`.
    pub fn read(group: &str, records: &[Message]) -> ParkedKeys {
        let mut keys = ParkedKeys::default();
        keys.fold(group, records, Payloads::Keep);
        keys
    }

    /// Folds `records` — what the destination holds past the mark these keys were read up to —
    /// into them, without their messages: an engine's read-back after its first. A record
    /// the engine applied already (its own, read back) changes nothing but learning where the
    /// destination holds it.
    pub(crate) fn fold_tail(&mut self, group: &str, records: &[Message]) {
        self.fold(group, records, Payloads::Drop);
    }

    fn fold(&mut self, group: &str, records: &[Message], payloads: Payloads) {
        for record in records {
            if let Some((key, change)) = change_of(group, record, payloads) {
                self.apply(key, change);
            }
        }
    }

    /// Reads `sink`'s whole destination back and folds it for `group`, each record with its
    /// message (what a replay re-publishes).
    pub async fn read_back(group: &str, sink: &dyn DeadLetterSink) -> Result<ParkedKeys, TransportError> {
        Ok(ParkedKeys::read(group, &sink.read_back().await?))
    }

    /// An engine's read-back: `group`'s last checkpoint, then only what the destination holds
    /// after it — in proportion to what was written since, not to the destination's history.
    /// When that was `checkpoint_after` records or more ([`CHECKPOINT_AFTER`] by default), a
    /// new checkpoint is saved (a failed save is logged: the next read reads further back,
    /// nothing else). The records keep no messages: an engine needs none.
    pub async fn catch_up(
        group: &str,
        sink: &dyn DeadLetterSink,
        checkpoint_after: usize,
    ) -> Result<CaughtUp, TransportError> {
        ParkedKeys::catch_up_forgetting(group, sink, checkpoint_after, &|_| false).await
    }

    /// [`catch_up`](Self::catch_up), forgetting what `delivered_no_more` says is never
    /// delivered again ([`forget_committed`](Self::forget_committed)) before it saves.
    pub async fn catch_up_forgetting(
        group: &str,
        sink: &dyn DeadLetterSink,
        checkpoint_after: usize,
        delivered_no_more: &(dyn Fn(&Position) -> bool + Sync),
    ) -> Result<CaughtUp, TransportError> {
        let loaded = Checkpoint::load(sink, group).await?;
        let checkpoint = loaded.checkpoint;
        let from_checkpoint = checkpoint.is_some();
        let (mut keys, mark) = match checkpoint {
            Some(c) => (c.keys, Some(c.mark)),
            None => (ParkedKeys::default(), None),
        };
        let tail = sink.read_back_after(mark.as_ref()).await?;
        if tail.restarted {
            tracing::warn!("the dead-letter destination was deleted and created again since the parked keys' checkpoint: reading it from its start");
            keys = ParkedKeys::default();
        }
        let from_checkpoint = from_checkpoint && !tail.restarted;
        keys.fold(group, &tail.records, Payloads::Drop);
        let forgotten = keys.forget_committed(delivered_no_more);
        let read = tail.records.len();
        let mut saved = false;
        let mut head = loaded.head;
        if let Some(mark) = tail.mark.as_ref().filter(|_| read >= checkpoint_after) {
            match Checkpoint::save(sink, group, mark, &keys, loaded.head).await {
                Ok(parts) => {
                    saved = true;
                    head = Some(parts);
                }
                Err(e) => {
                    tracing::warn!(error = %e, read, "cannot save the parked keys' checkpoint: the next read-back reads this far back again")
                }
            }
        }
        Ok(CaughtUp {
            keys,
            mark: tail.mark,
            head,
            read,
            from_checkpoint,
            saved,
            forgotten,
        })
    }

    /// Forgets, of every parked key, the ids of the messages (replayed or waiting)
    /// `delivered_no_more` says are never delivered again — the group's commit passed where
    /// they were delivered from: no redelivery needs recognising. Returns how many it forgot.
    pub fn forget_committed(&mut self, delivered_no_more: &(dyn Fn(&Position) -> bool + Sync)) -> usize {
        self.keys
            .values_mut()
            .map(|parking| Arc::make_mut(parking).forget_committed(delivered_no_more))
            .sum()
    }

    /// Rebuilds what a checkpoint does not hold ([`KeyParking::reindex`]).
    fn reindex(&mut self) {
        for parking in self.keys.values_mut() {
            Arc::make_mut(parking).reindex(&mut self.names);
        }
    }

    /// Applies a change to `key`'s parking.
    pub fn apply(&mut self, key: Bytes, change: ParkingChange) {
        let ended = &mut self.ended;
        let entry = self.keys.entry(key.clone()).or_insert_with(|| {
            Arc::new(KeyParking {
                ended: ended.remove(&key).unwrap_or_default(),
                ..KeyParking::default()
            })
        });
        let entry = Arc::make_mut(entry);
        match change {
            ParkingChange::SetAside(mut record) => {
                record.share_names(&mut self.names);
                entry.set_aside(*record)
            }
            ParkingChange::ReplayStarted(tag, positions, part) => entry.replay_marker(&tag, positions, part),
            ParkingChange::ReplayDone(id, part) => entry.replay_done(&id, part),
            ParkingChange::Skipped(positions) => entry.skip(&positions),
        }
        if !entry.is_parked() {
            if let Some(parking) = self.keys.remove(&key).filter(|p| !p.ended.is_empty()) {
                self.ended.insert(key, Arc::unwrap_or_clone(parking).ended);
            }
        }
    }

    /// True if replay `id` of `key` ended (the key parked or not).
    pub fn replay_ended(&self, key: &[u8], id: &str) -> bool {
        match self.get(key) {
            Some(parking) => parking.replay_ended(id),
            None => self.ended.get(key).is_some_and(|ended| ended.contains(id)),
        }
    }

    /// `key`'s parking, if it is parked.
    pub fn get(&self, key: &[u8]) -> Option<&KeyParking> {
        self.keys.get(key).map(|parking| &**parking)
    }

    /// The parked keys.
    pub fn iter(&self) -> impl Iterator<Item = (&Bytes, &KeyParking)> {
        self.keys.iter().map(|(key, parking)| (key, &**parking))
    }

    /// How many keys are parked.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when no key is parked.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// The bytes of `group`'s checkpoint as saved in `sink` (its data parts, deflated; 0 when none
/// is saved whole): what a read-back loads before it reads the destination's tail.
pub async fn checkpoint_bytes(group: &str, sink: &dyn DeadLetterSink) -> Result<usize, TransportError> {
    Ok(checkpoint::load_deflated(sink, group)
        .await?
        .map_or(0, |(deflated, _)| deflated.len()))
}

/// Saves `keys`, folded up to `mark` of `sink`'s destination, as `group`'s checkpoint, beside
/// `known`: a checkpoint known whole (the one loaded, or the one saved last) — never beside the
/// latest head, which two members saving at once may have torn: the next save would then
/// overwrite the only whole checkpoint. Returns where its parts are (whole once it returns).
pub(crate) async fn save_checkpoint(
    group: &str,
    sink: &dyn DeadLetterSink,
    mark: &ReadMark,
    keys: &ParkedKeys,
    known: Option<Parts>,
) -> Result<Parts, TransportError> {
    Checkpoint::save(sink, group, mark, keys, known).await
}

/// Records a read-back reads past its checkpoint before it saves a new one, by default
/// ([`EngineConfig::park_checkpoint_after`](crate::EngineConfig::park_checkpoint_after)): about
/// what an assignment reads, beyond what other members and groups wrote since (an engine also
/// reads back after writing this many records itself).
pub const CHECKPOINT_AFTER: usize = 1_000;

/// What [`ParkedKeys::catch_up`] read.
#[derive(Debug)]
pub struct CaughtUp {
    /// The group's parked keys.
    pub keys: ParkedKeys,
    /// Where the destination was read up to (`None` when it cannot be read from a mark).
    pub mark: Option<ReadMark>,
    /// Where the checkpoint known whole is: the one saved now, else the one loaded.
    pub(crate) head: Option<Parts>,
    /// Records read past the checkpoint.
    pub read: usize,
    /// A checkpoint was read first.
    pub from_checkpoint: bool,
    /// A new checkpoint was saved.
    pub saved: bool,
    /// Ids of messages never delivered again that were forgotten
    /// ([`ParkedKeys::forget_committed`]).
    pub forgotten: usize,
}

/// Whether a fold keeps each record's message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Payloads {
    Keep,
    Drop,
}

/// Maps keyed by `Bytes` (keys need not be UTF-8), as a list of pairs.
mod bytes_keys {
    use std::collections::BTreeMap;

    use bytes::Bytes;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer, V: Serialize>(map: &BTreeMap<Bytes, V>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(map.iter().map(|(k, v)| (k.as_ref(), v)))
    }

    pub fn deserialize<'de, D, V>(d: D) -> Result<BTreeMap<Bytes, V>, D::Error>
    where
        D: Deserializer<'de>,
        V: Deserialize<'de>,
    {
        let pairs: Vec<(Vec<u8>, V)> = Vec::deserialize(d)?;
        Ok(pairs.into_iter().map(|(k, v)| (Bytes::from(k), v)).collect())
    }
}

/// Why a parked key cannot be replayed (or its replay failed).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The key is not parked.
    #[error("{key} is not parked in group {group:?}")]
    NotParked {
        /// The key, as text.
        key: String,
        /// The group.
        group: String,
    },
    /// A replay of the key has not ended yet.
    #[error("a replay of {key} ({id}, {count} messages) is under way: replay again once its last message is handled, or resume it if its publishing stopped part-way")]
    UnderWay {
        /// The key, as text.
        key: String,
        /// The replay's id.
        id: String,
        /// Its messages.
        count: u32,
    },
    /// The key has no failed message waiting, only set-aside ones: nothing to pass over.
    #[error("{0} has no failed message waiting (only messages set aside behind an earlier one): replay it instead")]
    NothingToSkip(String),
    /// No replay of the key is under way (nothing to resume).
    #[error("no replay of {0} is under way: nothing to resume")]
    NoneUnderWay(String),
    /// A record names no source to replay to.
    #[error("a dead letter of {0} does not say where it came from (no convoy-dl-source header)")]
    NoSource(String),
    /// Reading or publishing failed (nothing is lost: the key stays parked; replay it again).
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// A publisher to the topic named.
pub type PublisherFor<'a> = dyn Fn(&str) -> Result<Arc<dyn Publisher>, TransportError> + Sync + 'a;

/// A parked key's replay: what it re-published, and where.
#[derive(Debug)]
pub struct KeyReplay {
    /// The replay's id (its messages carry it in [`REPLAY`]).
    pub id: String,
    /// The key's failed and set-aside records, in the order re-published.
    pub records: Vec<Message>,
    /// Where each went.
    pub receipts: Vec<Receipt>,
}

/// Replays parked key `key` of `group`: reads the dead-letter destination back through `sink`,
/// writes the replay marker there, then re-publishes the key's failed and set-aside messages
/// (through `publisher`, per topic they came from) in the key's original order. The engine
/// handles them and sets aside whatever else arrives for the key meanwhile; once the last one
/// is finished the key is unparked — unless one fails again (the key parks again there, the
/// rest of the replay behind it) or messages arrived during the replay (they wait for the
/// next one).
pub async fn replay_key(
    group: &str,
    key: &[u8],
    sink: &dyn DeadLetterSink,
    publisher: &PublisherFor<'_>,
) -> Result<KeyReplay, ReplayError> {
    let keys = ParkedKeys::read_back(group, sink).await?;
    replay_read(group, key, &keys, sink, publisher).await
}

/// Replays each of `keys` as [`replay_key`] does, in the order given, reading the dead-letter
/// destination back once for all of them (one key's replay changes no other's parking): an
/// operator replaying a hundred keys waits for one read of the destination, not a hundred. The
/// outcome per key; the first that could not be replayed is the last (nothing after it was
/// tried).
pub async fn replay_keys(
    group: &str,
    keys: &[&[u8]],
    sink: &dyn DeadLetterSink,
    publisher: &PublisherFor<'_>,
) -> Result<Vec<Result<KeyReplay, ReplayError>>, ReplayError> {
    let parked = ParkedKeys::read_back(group, sink).await?;
    let mut outcomes = Vec::with_capacity(keys.len());
    for key in keys {
        let outcome = replay_read(group, key, &parked, sink, publisher).await;
        let failed = outcome.is_err();
        outcomes.push(outcome);
        if failed {
            break;
        }
    }
    Ok(outcomes)
}

/// `key`'s parking in `keys` (of `group`), for an operator's replay or unpark: refused for a
/// key not parked, or with a replay under way.
fn idle_parking<'k>(group: &str, key: &[u8], keys: &'k ParkedKeys) -> Result<&'k KeyParking, ReplayError> {
    let shown = || String::from_utf8_lossy(key).into_owned();
    let Some(parking) = keys.get(key) else {
        return Err(ReplayError::NotParked {
            key: shown(),
            group: group.to_owned(),
        });
    };
    match parking.replaying() {
        Some(r) => Err(ReplayError::UnderWay {
            key: shown(),
            id: r.id.clone(),
            count: r.count,
        }),
        None => Ok(parking),
    }
}

/// Replays `key` as `keys`, read back from the destination, hold it.
async fn replay_read(
    group: &str,
    key: &[u8],
    keys: &ParkedKeys,
    sink: &dyn DeadLetterSink,
    publisher: &PublisherFor<'_>,
) -> Result<KeyReplay, ReplayError> {
    let shown = String::from_utf8_lossy(key).into_owned();
    let parking = idle_parking(group, key, keys)?;
    let in_order = parking.to_replay();
    let id = replay_id();
    let records: Vec<Message> = in_order
        .iter()
        .filter_map(|r| r.record.as_deref().cloned())
        .collect();
    let messages = replay_messages(&id, &records, &shown)?;
    let count = u32::try_from(records.len()).unwrap_or(u32::MAX);
    let tag = ReplayTag {
        id: id.clone(),
        index: 0,
        count,
    };
    let positions: Vec<String> = in_order
        .iter()
        .filter_map(|r| r.stored.as_ref().map(format_position))
        .collect();
    // All of the marker is written before anything is published: a replay whose marker is
    // not whole never started.
    let lists = position_lists(&positions);
    let parts = lists.len();
    for (i, list) in lists.into_iter().enumerate() {
        let mut headers = Headers::new();
        headers.insert(REPLAY, tag.header_value());
        headers.insert(REPLAY_OF, list);
        if parts > 1 {
            headers.insert(REPLAY_OF_PART, format!("{}/{parts}", i + 1));
        }
        let marker = marker(
            group,
            Some(Bytes::copy_from_slice(key)),
            records.first().map(|r| r.source.clone()),
            DeadLetterCause::Replay,
            format!("replays {count} messages of the key"),
            headers,
        );
        sink.publish(&marker).await?;
    }
    let receipts = publish(&messages, publisher).await?;
    Ok(KeyReplay {
        id,
        records,
        receipts,
    })
}

/// Publishes again the replay of `key` that is under way — all of it, with its id — for a
/// replay whose publishing stopped part-way (the tool died, a publish failed): the engine then
/// sees its last message and ends it. What of it ran already runs again (the same event ids: an
/// idempotency store that remembers them skips them).
pub async fn resume_replay(
    group: &str,
    key: &[u8],
    sink: &dyn DeadLetterSink,
    publisher: &PublisherFor<'_>,
) -> Result<KeyReplay, ReplayError> {
    let shown = String::from_utf8_lossy(key).into_owned();
    let keys = ParkedKeys::read_back(group, sink).await?;
    let Some((parking, replay)) = keys.get(key).and_then(|p| Some((p, p.replaying()?))) else {
        return Err(ReplayError::NoneUnderWay(shown));
    };
    let records: Vec<Message> = parking
        .replaying_records
        .iter()
        .filter_map(|r| r.record.as_deref().cloned())
        .collect();
    let messages = replay_messages(&replay.id, &records, &shown)?;
    let receipts = publish(&messages, publisher).await?;
    Ok(KeyReplay {
        id: replay.id.clone(),
        records,
        receipts,
    })
}

/// A marker record of `group` (not a message): `cause` and `text` say what it records,
/// `headers` what it names; stored beside the records of `source` (any source of the
/// destination will do for a marker naming none).
pub fn marker(
    group: &str,
    key: Option<Bytes>,
    source: Option<SourceId>,
    cause: DeadLetterCause,
    text: String,
    headers: Headers,
) -> DeadLetter {
    let now = SystemTime::now();
    DeadLetter {
        message: Message {
            key,
            payload: Bytes::new(),
            headers,
            source: source.unwrap_or_else(|| SourceId::new("?")),
            offset: 0,
        },
        reason: DeadLetterReason {
            cause,
            error_class: String::new(),
            error: text,
            attempts: 0,
            first_failure: now,
            last_failure: now,
            group: group.to_owned(),
            parks_key: false,
        },
    }
}

/// The messages of replay `id`: each record's, tagged, to the topic it came from.
fn replay_messages(
    id: &str,
    records: &[Message],
    shown: &str,
) -> Result<Vec<(String, OutgoingMessage)>, ReplayError> {
    let count = u32::try_from(records.len()).unwrap_or(u32::MAX);
    let mut messages = Vec::with_capacity(records.len());
    for (i, record) in records.iter().enumerate() {
        let source = record
            .headers
            .get_str(DL_SOURCE)
            .ok_or_else(|| ReplayError::NoSource(shown.to_owned()))?;
        let topic = source.rsplit_once('/').map_or(source, |(topic, _)| topic);
        let mut out = replay_message(record);
        let index = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let tag = ReplayTag {
            id: id.to_owned(),
            index,
            count,
        };
        out.headers.insert(REPLAY, tag.header_value());
        messages.push((topic.to_owned(), out));
    }
    Ok(messages)
}

/// Publishes `messages` in order, consecutive ones to one topic together.
async fn publish(
    messages: &[(String, OutgoingMessage)],
    publisher: &PublisherFor<'_>,
) -> Result<Vec<Receipt>, ReplayError> {
    let mut receipts = Vec::with_capacity(messages.len());
    let mut rest = messages;
    while let Some((topic, _)) = rest.first() {
        let run = rest.iter().take_while(|(t, _)| t == topic).count();
        let batch = rest[..run].iter().map(|(_, m)| m.clone()).collect();
        receipts.extend(publisher(topic)?.publish_all(batch).await?);
        rest = &rest[run..];
    }
    Ok(receipts)
}

/// A replay's id: 128 random bits, unique across operators and machines (drawn from the
/// thread's generator, so a simulation that seeds it replays the same ids).
fn replay_id() -> String {
    let mut rng = fastrand::Rng::new();
    format!("{:016x}{:016x}", rng.u64(..), rng.u64(..))
}

/// What a record of the dead-letter destination changes, if it is `group`'s and about parking.
fn change_of(group: &str, record: &Message, payloads: Payloads) -> Option<(Bytes, ParkingChange)> {
    let headers = &record.headers;
    if headers.get_str(DL_GROUP) != Some(group) {
        return None;
    }
    // The empty key is no key: never parked (records an older version wrote for it included).
    let key = record.key.clone().filter(|k| !k.is_empty())?;
    let cause = headers.get_str(DL_CAUSE)?;
    let change = if cause == DeadLetterCause::Replay.as_str() {
        ParkingChange::ReplayStarted(ReplayTag::of(headers)?, replayed_by(record), marker_part(record))
    } else if cause == DeadLetterCause::ReplayDone.as_str() {
        ParkingChange::ReplayDone(
            ReplayTag::of(headers)?.id,
            headers.get_str(REPLAY_PART).map(str::to_owned),
        )
    } else if cause == DeadLetterCause::Skipped.as_str() {
        ParkingChange::Skipped(marked_by(record, DeadLetterCause::Skipped))
    } else if cause == DeadLetterCause::Parked.as_str() || headers.get_str(DL_PARKS).is_some() {
        ParkingChange::SetAside(Box::new(ParkedRecord {
            id: headers.get_str(DL_PARK_ID).map(Name::from),
            stored: Some((record.source.as_str().into(), record.offset)),
            replay: ReplayTag::of(headers),
            failed: cause != DeadLetterCause::Parked.as_str(),
            topic: headers.get_str(DL_SOURCE).and_then(topic_of),
            origin: headers
                .get_str(DL_SOURCE)
                .zip(headers.get_str(DL_OFFSET))
                .and_then(|(source, offset)| Some((source.into(), offset.parse().ok()?))),
            record: (payloads == Payloads::Keep).then(|| Box::new(record.clone())),
        }))
    } else {
        return None;
    };
    Some((key, change))
}

/// `source@offset`.
pub fn format_position(position: &Position) -> String {
    format!("{}@{}", position.0, position.1)
}

fn parse_position(text: &str) -> Option<Position> {
    let (source, offset) = text.trim().rsplit_once('@')?;
    Some((source.into(), offset.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records of a dead-letter destination: each at its own offset of `t.dlq/0`.
    #[derive(Default)]
    struct Destination(Vec<Message>);

    impl Destination {
        fn push(&mut self, key: &str, headers: &[(&str, &str)]) -> &mut Self {
            let mut h = Headers::new();
            h.insert(DL_GROUP, "g");
            for (name, value) in headers {
                h.insert(*name, value.to_string());
            }
            let offset = self.0.len() as u64;
            self.0.push(Message {
                key: Some(Bytes::from(key.to_owned())),
                payload: Bytes::new(),
                headers: h,
                source: SourceId::new("t.dlq/0"),
                offset,
            });
            self
        }

        /// A dead letter of `key`'s message read at `t/1@n`, parking the key.
        fn failed(&mut self, key: &str, n: u64, replay: Option<&str>) -> &mut Self {
            let id = format!("t/1@{n}");
            let mut headers = vec![
                (DL_CAUSE, "terminal"),
                (DL_PARKS, "key"),
                (DL_PARK_ID, id.as_str()),
            ];
            headers.extend(replay.map(|tag| (REPLAY, tag)));
            self.push(key, &headers)
        }

        /// `key`'s message read at `t/1@n`, set aside.
        fn parked(&mut self, key: &str, n: u64, replay: Option<&str>) -> &mut Self {
            let id = format!("t/1@{n}");
            let mut headers = vec![(DL_CAUSE, "parked"), (DL_PARK_ID, id.as_str())];
            headers.extend(replay.map(|tag| (REPLAY, tag)));
            self.push(key, &headers)
        }

        /// A replay marker covering the records at these offsets of the destination.
        fn replay(&mut self, key: &str, tag: &str, covers: &[u64]) -> &mut Self {
            let of: Vec<String> = covers.iter().map(|o| format!("t.dlq/0@{o}")).collect();
            self.push(
                key,
                &[(DL_CAUSE, "replay"), (REPLAY, tag), (REPLAY_OF, &of.join(","))],
            )
        }

        /// Part `part` of `parts` of a replay marker, covering the records at these offsets.
        fn replay_part(&mut self, key: &str, tag: &str, covers: &[u64], part: u32, parts: u32) -> &mut Self {
            let of: Vec<String> = covers.iter().map(|o| format!("t.dlq/0@{o}")).collect();
            let place = format!("{part}/{parts}");
            self.push(
                key,
                &[
                    (DL_CAUSE, "replay"),
                    (REPLAY, tag),
                    (REPLAY_OF, &of.join(",")),
                    (REPLAY_OF_PART, &place),
                ],
            )
        }

        fn done(&mut self, key: &str, tag: &str) -> &mut Self {
            self.push(key, &[(DL_CAUSE, "replay-done"), (REPLAY, tag)])
        }

        fn keys(&self) -> ParkedKeys {
            ParkedKeys::read("g", &self.0)
        }
    }

    /// The read positions (`t/1@n`) of what a replay of `key` would re-publish, in order.
    fn replay_order(keys: &ParkedKeys, key: &[u8]) -> Vec<String> {
        let parking = keys.get(key).expect("parked");
        parking
            .to_replay()
            .iter()
            .filter_map(|r| r.id.as_deref().map(str::to_owned))
            .collect()
    }

    #[test]
    fn a_failure_parks_its_key_and_a_replay_then_its_end_unparks_it() {
        let mut d = Destination::default();
        d.failed("a", 3, None).parked("a", 5, None);
        d.parked("a", 5, None); // redelivered after a crash: recorded once
        d.push("b", &[(DL_CAUSE, "terminal"), (DL_PARK_ID, "t/1@4")]);
        d.parked("a", 9, None);
        let keys = d.keys();
        assert_eq!(keys.len(), 1, "b's dead letter does not park (no {DL_PARKS})");
        assert_eq!(replay_order(&keys, b"a"), ["t/1@3", "t/1@5", "t/1@9"]);
        assert!(
            ParkedKeys::read("other", &d.0).is_empty(),
            "other groups' records"
        );

        // A replay that read the destination before 9 was set aside.
        d.replay("a", "r1 0/2", &[0, 1]);
        let keys = d.keys();
        let a = keys.get(b"a").unwrap();
        assert_eq!(a.replaying().map(|r| r.count), Some(2));
        assert_eq!(
            replay_order(&keys, b"a"),
            ["t/1@9"],
            "set aside after the replay read"
        );
        assert!(
            a.holds("t/1@5"),
            "a replayed message redelivered is not set aside again"
        );
        d.done("a", "r1 2/2");
        assert_eq!(replay_order(&d.keys(), b"a"), ["t/1@9"], "still parked behind 9");
        d.replay("a", "r2 0/1", &[4]).done("a", "r2 1/1");
        assert!(d.keys().is_empty(), "replayed whole: unparked");
    }

    #[test]
    fn a_skip_marker_passes_over_the_failed_head_and_unparks_a_key_with_nothing_else() {
        let mut d = Destination::default();
        d.failed("a", 3, None).parked("a", 4, None).parked("a", 5, None);
        d.failed("b", 7, None);
        // The operator passes over a's head (offset 0) and b's (offset 3).
        d.push("a", &[(DL_CAUSE, "skipped"), (DL_OF, "t.dlq/0@0")]);
        d.push("b", &[(DL_CAUSE, "skipped"), (DL_OF, "t.dlq/0@3")]);
        let keys = d.keys();
        assert!(keys.get(b"b").is_none(), "b had nothing else waiting: unparked");
        let a = keys.get(b"a").expect("a still waits for the replay of the rest");
        assert_eq!(
            replay_order(&keys, b"a"),
            ["t/1@4", "t/1@5"],
            "the head is not replayed"
        );
        assert!(
            a.holds("t/1@3"),
            "a copy of the skipped head delivered again is not run"
        );
        assert!(is_marker(&d.0[4]) && is_marker(&d.0[5]));
        assert_eq!(
            marked_by(&d.0[4], DeadLetterCause::Skipped),
            [("t.dlq/0".into(), 0)]
        );
        assert!(marked_by(&d.0[4], DeadLetterCause::Purged).is_empty());
        // Another group's skip marker changes nothing here.
        let mut other = Destination::default();
        other.failed("c", 1, None);
        other.0.push({
            let mut m = other.0[0].clone();
            m.headers = Headers::new();
            m.headers.insert(DL_GROUP, "other");
            m.headers.insert(DL_CAUSE, "skipped");
            m.headers.insert(DL_OF, "t.dlq/0@0");
            m
        });
        assert!(other.keys().get(b"c").is_some());

        d.replay("a", "r1 0/2", &[1, 2]).done("a", "r1 2/2");
        assert!(d.keys().is_empty(), "the rest replayed: unparked");
    }

    #[test]
    fn a_failed_replay_goes_first_in_the_next_one() {
        let mut d = Destination::default();
        d.failed("a", 3, None).parked("a", 4, None).parked("a", 5, None);
        d.replay("a", "r1 0/3", &[0, 1, 2]);
        // Published while the replay ran: set aside before the replay's own failure.
        d.parked("a", 20, None);
        d.failed("a", 21, Some("r1 2/3")).parked("a", 22, Some("r1 3/3"));
        d.done("a", "r1 3/3");
        let keys = d.keys();
        let a = keys.get(b"a").unwrap();
        assert!(a.replaying().is_none() && a.replay_failed("r1"));
        assert_eq!(
            replay_order(&keys, b"a"),
            ["t/1@21", "t/1@22", "t/1@20"],
            "the replay's own first"
        );
    }

    /// A destination read from marks (offsets of `t.dlq/0`), with a checkpoint store.
    struct Marked {
        records: std::sync::Mutex<Vec<Message>>,
        /// The checkpoint's parts.
        checkpoint: std::sync::Mutex<BTreeMap<u32, Bytes>>,
        /// Records each read returned.
        reads: std::sync::Mutex<Vec<usize>>,
    }

    impl Marked {
        fn new(records: &[Message]) -> Marked {
            Marked {
                records: std::sync::Mutex::new(records.to_vec()),
                checkpoint: std::sync::Mutex::default(),
                reads: std::sync::Mutex::default(),
            }
        }

        /// The bytes of the checkpoint's data parts.
        async fn checkpoint_bytes(&self) -> usize {
            checkpoint_bytes("g", self).await.unwrap()
        }
    }

    #[async_trait::async_trait]
    impl DeadLetterSink for Marked {
        async fn publish(&self, _: &DeadLetter) -> Result<(), TransportError> {
            Ok(())
        }

        async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
            Ok(self.records.lock().unwrap().clone())
        }

        async fn read_back_after(
            &self,
            mark: Option<&ReadMark>,
        ) -> Result<crate::dead_letter::ReadBack, TransportError> {
            let from = mark
                .and_then(ReadMark::next_offsets)
                .and_then(|m| m.get(&0).copied())
                .unwrap_or(0);
            let all = self.records.lock().unwrap();
            let records: Vec<Message> = all.iter().filter(|r| r.offset >= from).cloned().collect();
            self.reads.lock().unwrap().push(records.len());
            let next = BTreeMap::from([(0, all.len() as u64)]);
            Ok(crate::dead_letter::ReadBack {
                records,
                mark: Some(ReadMark::of_next_offsets(&next)),
                restarted: false,
            })
        }

        async fn load_checkpoint(&self, group: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
            assert_eq!(group, "g");
            Ok(self.checkpoint.lock().unwrap().get(&part).cloned())
        }

        async fn save_checkpoint(&self, _: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
            self.checkpoint.lock().unwrap().insert(part, checkpoint);
            Ok(())
        }
    }

    /// Everything a parked key's state says, comparable (sets sorted).
    fn summary(keys: &ParkedKeys) -> Vec<String> {
        let sorted = |set: &HashSet<String>| {
            let mut v: Vec<&String> = set.iter().collect();
            v.sort();
            format!("{v:?}")
        };
        let record = |r: &ParkedRecord| {
            format!(
                "{:?} {:?} {:?} {} {:?}",
                r.id, r.stored, r.replay, r.failed, r.topic
            )
        };
        let mut lines: Vec<String> = keys
            .iter()
            .map(|(key, p)| {
                format!(
                    "{key:?}: pending {:?} replayed {} replaying {:?} of {:?} last {:?} ended {}",
                    p.to_replay().into_iter().map(record).collect::<Vec<_>>(),
                    sorted(&p.replayed.keys().map(|k| k.to_string()).collect()),
                    p.replaying,
                    p.replaying_records.iter().map(record).collect::<Vec<_>>(),
                    p.last_replay,
                    sorted(&p.ended)
                )
            })
            .collect();
        lines.extend(
            keys.ended
                .iter()
                .map(|(key, ended)| format!("{key:?} ended {}", sorted(ended))),
        );
        lines
    }

    /// Two keys through failures, replays (one failing again), set-asides and ends.
    fn history() -> Destination {
        let mut d = Destination::default();
        d.failed("a", 3, None).parked("a", 4, None).failed("b", 7, None);
        d.parked("a", 5, None).parked("b", 8, None);
        d.replay("a", "r1 0/3", &[0, 1, 3]);
        d.parked("a", 20, None).parked("b", 9, None);
        d.failed("a", 21, Some("r1 2/3")).parked("a", 22, Some("r1 3/3"));
        d.done("a", "r1 3/3");
        d.replay("b", "r2 0/3", &[2, 4, 7]).done("b", "r2 3/3");
        d.replay("a", "r3 0/3", &[9, 10, 6]).done("a", "r3 3/3");
        d.failed("a", 30, None);
        d
    }

    #[tokio::test]
    async fn a_read_back_from_a_checkpoint_knows_what_a_whole_read_knows() {
        let d = history();
        let whole = summary(&ParkedKeys::read("g", &d.0));
        assert!(!whole.is_empty());
        for split in 0..=d.0.len() {
            // A checkpoint saved after the first `split` records, then the rest written.
            let sink = Marked::new(&d.0[..split]);
            let first = ParkedKeys::catch_up("g", &sink, 1).await.unwrap();
            assert_eq!(first.saved, split > 0);
            sink.records.lock().unwrap().extend_from_slice(&d.0[split..]);
            let caught_up = ParkedKeys::catch_up("g", &sink, usize::MAX).await.unwrap();
            assert_eq!(caught_up.from_checkpoint, split > 0);
            assert_eq!(
                caught_up.read,
                d.0.len() - split,
                "only what came after the checkpoint"
            );
            assert_eq!(
                summary(&caught_up.keys),
                whole,
                "checkpoint after {split} records"
            );
            assert!(
                caught_up
                    .keys
                    .iter()
                    .flat_map(|(_, p)| &p.pending)
                    .all(|r| r.record.is_none()),
                "an engine's read-back holds no messages"
            );
        }
    }

    #[tokio::test]
    async fn a_checkpoint_of_another_group_or_version_is_ignored() {
        let d = history();
        let sink = Marked::new(&d.0);
        Checkpoint::save(
            &sink,
            "other",
            &ReadMark("0:9".into()),
            &ParkedKeys::default(),
            None,
        )
        .await
        .unwrap();
        let caught_up = ParkedKeys::catch_up("g", &sink, usize::MAX).await.unwrap();
        assert!(!caught_up.from_checkpoint);
        assert_eq!(caught_up.read, d.0.len(), "read from the start");
        sink.checkpoint
            .lock()
            .unwrap()
            .insert(0, Bytes::from_static(b"{not json"));
        let caught_up = ParkedKeys::catch_up("g", &sink, usize::MAX).await.unwrap();
        assert_eq!(summary(&caught_up.keys), summary(&ParkedKeys::read("g", &d.0)));
    }

    #[tokio::test]
    async fn a_million_dead_letters_with_ten_parked_keys_read_back_in_proportion() {
        // Ten parked keys, then a million records of other keys and groups, written in
        // stretches with read-backs between them (an engine reads back after writing
        // `checkpoint_after` records), then a stretch too short to have been checkpointed: an
        // assignment reads that stretch, not the history.
        let mut d = Destination::default();
        for k in 0..10 {
            d.failed(&format!("parked-{k}"), k, None);
        }
        let sink = Marked::new(&d.0);
        let mut headers = Headers::new();
        headers.insert(DL_GROUP, "another-group");
        headers.insert(DL_CAUSE, "terminal");
        let write = |n: usize| {
            let mut records = sink.records.lock().unwrap();
            for _ in 0..n {
                let offset = records.len() as u64;
                records.push(Message {
                    key: Some(Bytes::from(format!("k{offset}"))),
                    payload: Bytes::from_static(&[0; 100]),
                    headers: headers.clone(),
                    source: SourceId::new("t.dlq/0"),
                    offset,
                });
            }
            records.len()
        };
        while write(CHECKPOINT_AFTER) < 1_000_000 {
            ParkedKeys::catch_up("g", &sink, CHECKPOINT_AFTER).await.unwrap();
        }
        let total = write(CHECKPOINT_AFTER - 1);
        let assignment = ParkedKeys::catch_up("g", &sink, CHECKPOINT_AFTER).await.unwrap();
        assert!(total > 1_000_000);
        assert_eq!(assignment.keys.len(), 10);
        assert!(assignment.from_checkpoint);
        assert_eq!(
            assignment.read,
            2 * CHECKPOINT_AFTER - 1,
            "the stretch since the last checkpoint (and the one the last read read)"
        );
        let checkpoint = sink.checkpoint_bytes().await;
        assert!(
            checkpoint < 10_000,
            "a checkpoint of ten keys: {checkpoint} bytes"
        );
    }

    #[tokio::test]
    async fn a_checkpoint_of_a_key_holding_24_000_records_is_saved_in_parts() {
        // A hot key parked under load: 24,000 messages with convoy's event ids set aside
        // between other keys' dead letters, half of them taken by a replay (their ids are
        // remembered), half waiting.
        let mut d = Destination::default();
        let mut rng = fastrand::Rng::with_seed(38);
        let mut ids = Vec::new();
        for n in 0..24_000u32 {
            let id = format!("{:016x}{:016x}", rng.u64(..), rng.u64(..));
            let cause = if n == 0 { "terminal" } else { "parked" };
            let (source, offset) = (format!("soak-in/{}", n % 64), (n / 64).to_string());
            d.push(
                "hot",
                &[
                    (DL_CAUSE, cause),
                    (DL_PARKS, "key"),
                    (DL_PARK_ID, &id),
                    (DL_SOURCE, &source),
                    (DL_OFFSET, &offset),
                ],
            );
            d.push(&format!("other-{n}"), &[(DL_CAUSE, "terminal")]);
            ids.push(id);
        }
        let taken: Vec<String> = (0..12_000).map(|n| format!("t.dlq/0@{}", 2 * n)).collect();
        let lists = position_lists(&taken);
        let tag = format!("r1 0/{}", taken.len());
        for (i, list) in lists.iter().enumerate() {
            let part = format!("{}/{}", i + 1, lists.len());
            d.push(
                "hot",
                &[
                    (DL_CAUSE, "replay"),
                    (REPLAY, &tag),
                    (REPLAY_OF, list),
                    (REPLAY_OF_PART, &part),
                ],
            );
        }
        let sink = Marked::new(&d.0);
        let saved = ParkedKeys::catch_up("g", &sink, 1).await.unwrap();
        assert!(saved.saved);
        let checkpoint = sink.checkpoint_bytes().await;
        assert!(
            checkpoint < 45 * 24_000,
            "{checkpoint} bytes, {:.1} per record",
            checkpoint as f64 / 24_000.0
        );
        let parts = sink.checkpoint.lock().unwrap().clone();
        assert_eq!(parts.len(), 3, "974 KB in two parts and a head");
        assert!(
            parts.values().all(|p| p.len() <= CHECKPOINT_PART_BYTES + 16),
            "each part within Kafka's and NATS's default bound on a value"
        );
        let read = ParkedKeys::catch_up("g", &sink, usize::MAX).await.unwrap();
        assert!(read.from_checkpoint && read.read == 0);
        let hot = read.keys.get(b"hot").unwrap();
        assert_eq!(hot.pending(), 12_000);
        assert!(hot.replaying().is_some());
        assert!(
            ids.iter().all(|id| hot.holds(id)),
            "every message, waiting or replayed, known when delivered again"
        );
        assert_eq!(summary(&read.keys), summary(&ParkedKeys::read("g", &d.0)));
        // Once the group's commit passed them, no id is needed: the waiting records stay,
        // smaller (the replay under way keeps its records whole: 368,711 bytes in all).
        let forgot = ParkedKeys::catch_up_forgetting("g", &sink, 0, &|_| true)
            .await
            .unwrap();
        assert_eq!(forgot.forgotten, 24_000);
        let compact = sink.checkpoint_bytes().await;
        eprintln!("{checkpoint} bytes, then {compact} once every id is forgotten");
        assert!(
            compact * 2 < checkpoint,
            "{compact} bytes, {:.1} per record",
            compact as f64 / 24_000.0
        );
        assert_eq!(forgot.keys.get(b"hot").unwrap().pending(), 12_000);
    }

    #[tokio::test]
    async fn replayed_messages_are_forgotten_once_the_commit_passed_where_they_came_from() {
        let mut d = Destination::default();
        let record = |d: &mut Destination, n: u64, cause: &str| {
            let (id, offset) = (format!("e{n}"), n.to_string());
            d.push(
                "a",
                &[
                    (DL_CAUSE, cause),
                    (DL_PARK_ID, &id),
                    (DL_SOURCE, "t/1"),
                    (DL_OFFSET, &offset),
                ],
            );
        };
        record(&mut d, 10, "terminal");
        d.0[0].headers.insert(DL_PARKS, "key");
        record(&mut d, 11, "parked");
        record(&mut d, 12, "parked");
        d.replay("a", "r1 0/3", &[0, 1, 2]);
        record(&mut d, 13, "parked");
        let sink = Marked::new(&d.0);
        let committed_below_12 = |(source, offset): &Position| &**source == "t/1" && *offset < 12;
        let caught_up = ParkedKeys::catch_up_forgetting("g", &sink, 1, &committed_below_12)
            .await
            .unwrap();
        assert!(caught_up.saved);
        assert_eq!(caught_up.forgotten, 2);
        for keys in [
            caught_up.keys,
            ParkedKeys::catch_up("g", &sink, usize::MAX).await.unwrap().keys,
        ] {
            let a = keys.get(b"a").unwrap();
            assert!(
                !a.holds("e10") && !a.holds("e11"),
                "replayed, and the commit passed them: forgotten"
            );
            assert!(a.holds("e12"), "replayed, not committed past yet");
            assert!(a.holds("e13"), "waiting, not committed past yet");
            assert_eq!(a.pending(), 1);
        }
        let committed_below_14 = |(source, offset): &Position| &**source == "t/1" && *offset < 14;
        let caught_up = ParkedKeys::catch_up_forgetting("g", &sink, 0, &committed_below_14)
            .await
            .unwrap();
        assert_eq!(caught_up.forgotten, 2);
        let a = caught_up.keys.get(b"a").unwrap();
        assert!(!a.holds("e12") && !a.holds("e13"), "committed past: forgotten");
        assert_eq!(a.pending(), 1, "still waiting, for its replay");
        assert_eq!(
            a.to_replay()[0].stored,
            Some(("t.dlq/0".into(), 4)),
            "known by where the destination holds it"
        );
    }

    #[test]
    fn a_replay_marker_in_parts_starts_its_replay_at_its_last_part() {
        let mut d = Destination::default();
        d.failed("a", 3, None).parked("a", 4, None).parked("a", 5, None);
        d.replay_part("a", "r1 0/3", &[0, 1], 1, 2);
        let keys = d.keys();
        assert!(
            keys.get(b"a").unwrap().replaying().is_none(),
            "not before its last part"
        );
        assert_eq!(replay_order(&keys, b"a"), ["t/1@3", "t/1@4", "t/1@5"]);
        d.replay_part("a", "r1 0/3", &[0, 1], 1, 2); // a part published again
        d.parked("a", 6, None); // set aside while the tool wrote
        d.replay_part("a", "r1 0/3", &[2], 2, 2);
        let keys = d.keys();
        let a = keys.get(b"a").unwrap();
        assert_eq!(a.replaying().map(|r| r.count), Some(3));
        let taken: Vec<_> = a
            .replaying_records
            .iter()
            .filter_map(|r| r.id.as_deref())
            .collect();
        assert_eq!(
            taken,
            ["t/1@3", "t/1@4", "t/1@5"],
            "every part's records, in order"
        );
        assert_eq!(replay_order(&keys, b"a"), ["t/1@6"]);
    }

    #[test]
    fn a_replay_marker_missing_a_part_starts_nothing() {
        let mut d = Destination::default();
        d.failed("a", 3, None).parked("a", 4, None).parked("a", 5, None);
        // The tool died after part 1 of r1; r2 (whole) replays everything.
        d.replay_part("a", "r1 0/3", &[0], 1, 3);
        d.replay_part("a", "r1 0/3", &[2], 3, 3);
        let keys = d.keys();
        assert!(keys.get(b"a").unwrap().replaying().is_none());
        assert_eq!(replay_order(&keys, b"a"), ["t/1@3", "t/1@4", "t/1@5"]);
        d.replay_part("a", "r2 0/3", &[0, 1], 1, 2)
            .replay_part("a", "r2 0/3", &[2], 2, 2);
        d.done("a", "r2 3/3");
        assert!(d.keys().is_empty(), "replayed whole: unparked");
        assert_eq!(
            crate::parking::marker_part(&d.0[3]),
            (1, 3),
            "a part's place reads back"
        );
    }

    #[test]
    fn position_lists_fit_a_header_and_keep_the_order() {
        let positions: Vec<String> = (0..5_000).map(|n| format!("orders.dlq/7@{n}")).collect();
        let lists = position_lists(&positions);
        assert!(lists.len() > 1);
        assert!(lists.iter().all(|l| l.len() <= MARKER_POSITIONS_BYTES));
        let joined: Vec<&str> = lists.iter().flat_map(|l| l.split(',')).collect();
        assert_eq!(joined, positions);
        assert_eq!(position_lists(&[]), [""], "one empty list for none");
    }

    #[test]
    fn replay_tags_and_positions_read_back() {
        let mut h = Headers::new();
        h.insert(REPLAY, "a b 2/7");
        let tag = ReplayTag::of(&h).unwrap();
        assert_eq!((tag.id.as_str(), tag.index, tag.count), ("a b", 2, 7));
        assert_eq!(tag.header_value(), "a b 2/7");
        assert!(!tag.is_last());
        h.insert(REPLAY, "x 2");
        assert_eq!(ReplayTag::of(&h), None);
        assert_eq!(parse_position("t.v2/3@41"), Some(("t.v2/3".into(), 41)));
    }
}
