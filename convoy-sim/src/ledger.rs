//! What happened, as the handlers and the dead-letter destination saw it, and the invariants
//! checked the moment something happens:
//!
//! - **ownership**: no lane (a key of one source, or a source's keyless messages) has two
//!   handler calls at once, on one member or two; no member runs two calls of one key;
//! - **order, at the start**: a message starts only once every earlier message of its lane is
//!   settled (handled, dead-lettered or set aside); a replay's copy only once the replay's
//!   earlier copies are;
//! - **order, of effects**: the first time a message is handled, every earlier message of its
//!   lane has been handled, or dead-lettered for good (not parked: a parked message is handled
//!   later, by its replay, and must not be overtaken);
//! - **replays**: a message is handled by at most one replay (a resumed replay is the same one).
//!
//! Everything else — what is committed, deadlines, memory, the end state — is checked against
//! the broker by [`crate::oracle`].

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use convoy_core::dead_letter::{DL_CAUSE, DL_OFFSET, DL_SOURCE};
use convoy_core::parking::{ReplayTag, DL_PARKS, REPLAY_OF};
use convoy_core::{KeylessPolicy, Message, Offset, SourceId};

use crate::trace::Trace;

/// What a delivered message is: produced message `n`, or a copy of it in a replay.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Identity {
    pub n: u64,
    /// The replay's id and the copy's index in it.
    pub replay: Option<(String, u32)>,
}

impl Identity {
    /// The identity of a delivered (or dead-lettered) message, from its payload (`n`) and its
    /// replay tag.
    pub fn of(message: &Message) -> Option<Identity> {
        let n = std::str::from_utf8(&message.payload).ok()?.parse().ok()?;
        let replay = ReplayTag::of(&message.headers).map(|t| (t.id, t.index));
        Some(Identity { n, replay })
    }

    /// The same message, not as a replay's copy.
    pub fn original(&self) -> Identity {
        Identity {
            n: self.n,
            replay: None,
        }
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.replay {
            None => write!(f, "#{}", self.n),
            Some((id, index)) => write!(f, "#{}(replay {}:{index})", self.n, short(id)),
        }
    }
}

/// The last few characters of a replay id (enough to tell replays apart in a trace).
fn short(id: &str) -> &str {
    &id[id.len().saturating_sub(6)..]
}

/// A lane as the invariants see it: a key of one source, or the keyless messages of one.
pub type Lane = (SourceId, Option<Bytes>);

/// A message the world published.
#[derive(Clone, Debug)]
pub struct Produced {
    pub n: u64,
    pub key: Option<Bytes>,
    /// Where it was stored first (a producer's retry stores it again, with the same id).
    pub source: SourceId,
    pub offset: Offset,
    pub has_id: bool,
}

impl Produced {
    fn lane(&self) -> Lane {
        (self.source.clone(), self.key.clone().filter(|k| !k.is_empty()))
    }
}

/// A dead letter as read from the destination.
#[derive(Clone, Debug)]
pub struct DeadRecord {
    pub cause: String,
    /// It parked its key (or was set aside behind a parked one): handled later by a replay.
    pub parks: bool,
}

/// A handler call under way, as recorded at its start (released at its end).
pub struct Call {
    pub member: usize,
    lane: Lane,
    key: Option<Bytes>,
    pub identity: Identity,
    /// The record delivered (`source@offset`).
    record: String,
}

/// Everything the invariants need, and what they found.
pub struct Ledger {
    keyless: KeylessPolicy,
    /// Offsets name no position: a message without an event id has no identity at all.
    delivery_offsets: bool,
    produced: BTreeMap<u64, Produced>,
    /// Each lane's messages, in the order they were stored.
    chains: BTreeMap<Lane, Vec<u64>>,
    /// Where each message sits in its chain.
    place: BTreeMap<u64, usize>,
    /// Identities handled successfully.
    handled: BTreeSet<Identity>,
    /// Per message: the replays that handled it (`None`: handled as itself), and by which
    /// members.
    handled_by: BTreeMap<u64, BTreeMap<Option<String>, BTreeSet<usize>>>,
    /// Members that crashed, lost their connection or stopped: what they handled and did not
    /// commit may run again elsewhere (at least once), and they forgot what they handled.
    departed: BTreeSet<usize>,
    /// Dead letters read from the destination so far, by identity (several: a message set
    /// aside twice before a crash's commit).
    dead: BTreeMap<Identity, Vec<DeadRecord>>,
    /// How many records of the destination were read into `dead`.
    dead_read: usize,
    /// Each replay's messages, in its order (from its marker in the destination).
    replays: BTreeMap<String, Vec<u64>>,
    /// Calls under way per lane, and per member and key.
    lanes: BTreeMap<Lane, (usize, Identity)>,
    member_keys: BTreeMap<(usize, Bytes), Identity>,
    /// Per input record (`source@offset`), how its latest handling ended: handled (true) or
    /// dead-lettered (false), numbered in the order they were seen.
    fates: BTreeMap<String, (u64, bool)>,
    fate_seq: u64,
    pub violations: Vec<String>,
    pub trace: Trace,
    pub calls: u64,
}

impl Ledger {
    pub fn new(keyless: KeylessPolicy, delivery_offsets: bool, trace: Trace) -> Ledger {
        Ledger {
            keyless,
            delivery_offsets,
            produced: BTreeMap::new(),
            chains: BTreeMap::new(),
            place: BTreeMap::new(),
            handled: BTreeSet::new(),
            handled_by: BTreeMap::new(),
            departed: BTreeSet::new(),
            dead: BTreeMap::new(),
            dead_read: 0,
            replays: BTreeMap::new(),
            lanes: BTreeMap::new(),
            member_keys: BTreeMap::new(),
            fates: BTreeMap::new(),
            fate_seq: 0,
            violations: Vec::new(),
            trace,
            calls: 0,
        }
    }

    /// Records a violated invariant (and traces it).
    pub fn violation(&mut self, what: String) {
        self.trace.event(format_args!("VIOLATION {what}"));
        self.violations.push(what);
    }

    /// Message `p` was published (a second publish of `n`, a producer's retry, is the same
    /// message).
    pub fn produced(&mut self, p: Produced) {
        if self.produced.contains_key(&p.n) {
            return;
        }
        let ordered =
            p.key.as_ref().is_some_and(|k| !k.is_empty()) || self.keyless == KeylessPolicy::PerSource;
        if ordered {
            let chain = self.chains.entry(p.lane()).or_default();
            self.place.insert(p.n, chain.len());
            chain.push(p.n);
        }
        self.produced.insert(p.n, p);
    }

    pub fn produced_messages(&self) -> impl Iterator<Item = &Produced> {
        self.produced.values()
    }

    /// Takes the destination's records not read yet.
    pub fn read_dead_letters(&mut self, records: &[Message]) {
        for record in records.iter().skip(self.dead_read) {
            let Some(cause) = record.headers.get_str(DL_CAUSE) else {
                continue;
            };
            if cause == "replay" {
                self.read_replay_marker(record, records);
                continue;
            }
            let Some(identity) = Identity::of(record) else {
                continue; // a marker (replay, replay-done): no message of the world
            };
            let parks = cause == "parked" || record.headers.get_str(DL_PARKS).is_some();
            if let (Some(source), Some(offset)) = (
                record.headers.get_str(DL_SOURCE),
                record.headers.get_str(DL_OFFSET),
            ) {
                self.fate_seq += 1;
                self.fates
                    .insert(format!("{source}@{offset}"), (self.fate_seq, false));
            }
            self.dead.entry(identity).or_default().push(DeadRecord {
                cause: cause.to_owned(),
                parks,
            });
        }
        self.dead_read = records.len();
    }

    /// A replay's marker names the records it re-publishes, in order: their messages are the
    /// replay's copies 1, 2, ….
    fn read_replay_marker(&mut self, marker: &Message, records: &[Message]) {
        let Some(tag) = ReplayTag::of(&marker.headers) else {
            return;
        };
        let positions = marker.headers.get_str(REPLAY_OF).unwrap_or_default();
        let messages = positions
            .split(',')
            .filter_map(|p| p.trim().rsplit_once('@')?.1.parse::<u64>().ok())
            .filter_map(|offset| records.iter().find(|r| r.offset == offset))
            .filter_map(|r| Identity::of(r).map(|i| i.n))
            .collect::<Vec<u64>>();
        // A replay re-publishes each parked message once: twice means the destination's fold
        // counted one record twice (or the message was set aside twice, which at least once
        // allows only for a message nothing identifies, after a member departed).
        let mut seen = BTreeSet::new();
        for &n in &messages {
            let anonymous = self.delivery_offsets && self.produced.get(&n).is_some_and(|p| !p.has_id);
            let allowed = anonymous && !self.departed.is_empty();
            if !seen.insert(n) && !allowed {
                self.violation(format!(
                    "replay: replay {} re-publishes #{n} twice",
                    short(&tag.id)
                ));
            }
        }
        self.replays.insert(tag.id, messages);
    }

    pub fn is_handled(&self, identity: &Identity) -> bool {
        self.handled.contains(identity)
    }

    /// Handled as itself or by any replay.
    pub fn handled_any(&self, n: u64) -> bool {
        self.handled_by.contains_key(&n)
    }

    pub fn dead_letters(&self, identity: &Identity) -> &[DeadRecord] {
        self.dead.get(identity).map_or(&[], Vec::as_slice)
    }

    /// Dead-lettered for good (not parked, so no replay will handle it), as itself or as a copy.
    pub fn dead_for_good(&self, n: u64) -> bool {
        self.dead
            .range(
                Identity { n, replay: None }..Identity {
                    n: n + 1,
                    replay: None,
                },
            )
            .flat_map(|(_, records)| records)
            .any(|r| !r.parks)
    }

    /// Handled, dead-lettered or set aside.
    fn settled(&self, identity: &Identity) -> bool {
        self.handled.contains(identity) || self.dead.contains_key(identity)
    }

    /// A member starts a handler call for `message` (attempt `attempt`); returns what to give
    /// back to [`Ledger::end`].
    pub fn start(&mut self, member: usize, message: &Message, identity: Identity, attempt: u32) -> Call {
        self.calls += 1;
        let key = message.ordering_key().cloned();
        let lane: Lane = (message.source.clone(), key.clone());
        self.trace.event(format_args!(
            "m{member} start {identity} key {} at {}@{} attempt {attempt}",
            show(&message.key),
            message.source,
            message.offset
        ));
        let ordered = key.is_some() || self.keyless == KeylessPolicy::PerSource;
        if ordered {
            if let Some((other, running)) = self.lanes.get(&lane).cloned() {
                self.violation(format!(
                    "ownership: m{member} starts {identity} of lane {} while m{other} runs {running} of it",
                    show_lane(&lane)
                ));
            } else {
                self.lanes.insert(lane.clone(), (member, identity.clone()));
            }
        }
        if let Some(key) = &key {
            match self.member_keys.get(&(member, key.clone())).cloned() {
                Some(running) => self.violation(format!(
                    "lane: m{member} starts {identity} while it runs {running} of key {}",
                    show(&Some(key.clone()))
                )),
                None => {
                    self.member_keys.insert((member, key.clone()), identity.clone());
                }
            }
        }
        if ordered && !self.handled.contains(&identity) {
            self.check_start_order(member, &message.source, &identity);
        }
        Call {
            member,
            lane,
            key,
            identity,
            record: format!("{}@{}", message.source, message.offset),
        }
    }

    /// A message starts only when every earlier one of its lane (or of its replay, in its
    /// source) is settled.
    fn check_start_order(&mut self, member: usize, source: &SourceId, identity: &Identity) {
        let unsettled = match &identity.replay {
            None => self
                .earlier(identity.n)
                .find(|&m| !self.settled(&Identity { n: m, replay: None }) && !self.handled_any(m)),
            Some((id, index)) => {
                let copies = self.replays.get(id).cloned().unwrap_or_default();
                (1..*index)
                    .filter(|&j| {
                        // Copies of messages of other sources (a key on several topics) are
                        // ordered in theirs.
                        copies
                            .get(j as usize - 1)
                            .and_then(|n| self.produced.get(n))
                            .is_some_and(|p| {
                                p.source == *source && p.key.as_ref().is_some_and(|k| !k.is_empty())
                            })
                    })
                    .map(|j| Identity {
                        n: u64::MAX,
                        replay: Some((id.clone(), j)),
                    })
                    .find(|copy| !self.copy_settled(copy))
                    .map(|copy| copy.replay.map_or(0, |(_, j)| u64::from(j)))
            }
        };
        if let Some(earlier) = unsettled {
            let what = match &identity.replay {
                None => format!("#{earlier}"),
                Some(_) => format!("copy {earlier} of its replay"),
            };
            self.violation(format!(
                "order: m{member} starts {identity} before {what} was handled, dead-lettered or set aside"
            ));
        }
    }

    /// A replay's copy (known by its replay id and index, whatever message it is) is settled.
    fn copy_settled(&self, copy: &Identity) -> bool {
        let same = |i: &Identity| i.replay == copy.replay;
        self.handled.iter().any(same) || self.dead.keys().any(same)
    }

    /// The messages stored before `n` in its lane.
    fn earlier(&self, n: u64) -> impl Iterator<Item = u64> + '_ {
        let chain = self.produced.get(&n).and_then(|p| self.chains.get(&p.lane()));
        let place = self.place.get(&n).copied().unwrap_or(0);
        chain
            .into_iter()
            .flat_map(move |c| c[..place.min(c.len())].iter().copied())
    }

    /// The call ended (returned, failed, panicked or was cancelled).
    pub fn end(&mut self, call: &Call, outcome: &str) {
        self.trace
            .event(format_args!("m{} end {} {outcome}", call.member, call.identity));
        if self
            .lanes
            .get(&call.lane)
            .is_some_and(|(m, i)| *m == call.member && *i == call.identity)
        {
            self.lanes.remove(&call.lane);
        }
        if let Some(key) = &call.key {
            let entry = (call.member, key.clone());
            if self.member_keys.get(&entry) == Some(&call.identity) {
                self.member_keys.remove(&entry);
            }
        }
    }

    /// The call succeeded: the message's effect happened.
    pub fn succeeded(&mut self, call: &Call) {
        self.fate_seq += 1;
        self.fates.insert(call.record.clone(), (self.fate_seq, true));
        let identity = &call.identity;
        let first = !self.handled_any(identity.n);
        self.handled.insert(identity.clone());
        let replay = identity.replay.as_ref().map(|(id, _)| id.clone());
        let by = self.handled_by.entry(identity.n).or_default();
        // Another replay ran it before: only a member that departed since (crashed, lost its
        // sources, stopped) may have left it to run again (at least once).
        let earlier_live = by
            .iter()
            .filter(|(r, _)| r.is_some() && **r != replay)
            .any(|(_, members)| members.iter().any(|m| !self.departed.contains(m)));
        by.entry(replay.clone()).or_default().insert(call.member);
        let replays: Vec<String> = by.keys().flatten().map(|id| short(id).to_owned()).collect();
        // A message nothing identifies (no event id, offsets that name no position) set aside
        // again after a crash is a new record to the destination: at least once, and nothing
        // can tell.
        let anonymous = self.delivery_offsets && self.produced.get(&identity.n).is_some_and(|p| !p.has_id);
        if replay.is_some() && earlier_live && !anonymous {
            self.violation(format!(
                "replay: #{} was handled by {} replays ({}): a parked message is handled once by its replay",
                identity.n,
                replays.len(),
                replays.join(", ")
            ));
        }
        let ordered = call.key.is_some() || self.keyless == KeylessPolicy::PerSource;
        if first && ordered {
            let overtaken: Option<u64> = self
                .earlier(identity.n)
                .find(|&m| !self.handled_any(m) && !self.dead_for_good(m));
            if let Some(earlier) = overtaken {
                self.violation(format!(
                    "order: m{} handled {identity} before #{earlier} of its lane (which is neither handled nor dead-lettered for good)",
                    call.member
                ));
            }
        }
    }

    /// Member `member` crashed, lost its connection or stopped.
    pub fn departed(&mut self, member: usize) {
        self.departed.insert(member);
    }

    /// True if the latest handling of input record `record` (`source@offset`) seen ended in a
    /// dead letter.
    pub fn last_dead_lettered(&self, record: &str) -> bool {
        self.fates.get(record).is_some_and(|(_, ok)| !ok)
    }

    /// Calls under way now.
    pub fn running(&self) -> usize {
        self.lanes.len()
    }
}

/// A key as text.
pub fn show(key: &Option<Bytes>) -> String {
    match key {
        None => "<none>".to_owned(),
        Some(k) => format!("{:?}", String::from_utf8_lossy(k)),
    }
}

fn show_lane(lane: &Lane) -> String {
    format!("{}/{}", lane.0, show(&lane.1))
}

#[cfg(test)]
mod tests {
    use convoy_core::Headers;

    use super::*;

    fn message(n: u64, key: &str, offset: u64) -> Message {
        Message {
            key: Some(Bytes::from(key.to_owned())),
            payload: Bytes::from(n.to_string()),
            headers: Headers::new(),
            source: SourceId::new("t/0"),
            offset,
        }
    }

    fn ledger() -> Ledger {
        let mut ledger = Ledger::new(KeylessPolicy::PerSource, false, Trace::new(false));
        for n in 0..3 {
            ledger.produced(Produced {
                n,
                key: Some(Bytes::from_static(b"k")),
                source: SourceId::new("t/0"),
                offset: n,
                has_id: true,
            });
        }
        ledger
    }

    #[test]
    fn in_order_and_one_at_a_time_is_clean() {
        let mut l = ledger();
        for n in 0..3 {
            let call = l.start(0, &message(n, "k", n), Identity { n, replay: None }, 1);
            l.succeeded(&call);
            l.end(&call, "ok");
        }
        assert!(l.violations.is_empty(), "{:?}", l.violations);
    }

    #[test]
    fn overtaking_and_two_owners_are_caught() {
        let mut l = ledger();
        let a = l.start(0, &message(0, "k", 0), Identity { n: 0, replay: None }, 1);
        let b = l.start(1, &message(1, "k", 1), Identity { n: 1, replay: None }, 1);
        // Two members in one lane, and #1 started before #0 settled.
        assert_eq!(l.violations.len(), 2, "{:?}", l.violations);
        l.succeeded(&b);
        assert!(l.violations.iter().any(|v| v.starts_with("order: m1 handled")));
        l.end(&a, "cancelled");
        l.end(&b, "ok");
    }

    #[test]
    fn two_replays_of_one_message_are_caught() {
        let mut l = ledger();
        for (n, replay) in [(0, "r1"), (0, "r2")] {
            let identity = Identity {
                n,
                replay: Some((replay.to_owned(), 1)),
            };
            let call = l.start(0, &message(n, "k", 9), identity, 1);
            l.succeeded(&call);
            l.end(&call, "ok");
        }
        assert!(
            l.violations.iter().any(|v| v.starts_with("replay:")),
            "{:?}",
            l.violations
        );
    }
}
