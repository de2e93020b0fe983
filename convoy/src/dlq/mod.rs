//! Dead letters for operators: read them with their reasons, pick some, and replay them to
//! the topic they came from once the cause is fixed.
//!
//! A replayed message keeps its key, payload and headers (the `convoy-dl-*` reason headers
//! removed) and goes to the end of its key's stream, so it is handled after everything its key
//! already had. Its event id becomes `<original id>/replay/<dead-letter position>`: an
//! idempotency store that remembered the original (dead-lettered messages count as finished)
//! lets the replay through, and replaying the same dead letter twice is still caught.
//!
//! A *parked* key (see [`convoy_core::parking`]) is replayed whole, by [`replay_parked`]: its
//! failed and set-aside messages in its original order, behind a replay marker that tells the
//! engine to handle them — and only them — until the last one unparks the key.
//!
//! Every replay is recorded in the dead-letter topic: a parked key's by its replay marker, single
//! dead letters' by an audit record written once they were re-published. A listing counts how
//! often each dead letter was replayed ([`DeadLetterRecord::replays`]), and
//! [`Selection::not_replayed`] leaves those out, so that replaying a ledger's history twice
//! takes a deliberate choice (`convoy dlq replay --force`).
//!
//! An operator may also pass over a parked key's failed head without replaying it
//! ([`unpark`]: the rest of the key is replayed), and purge dead letters ([`purge`]): both write
//! an audit record naming what they concern, with the operator's reason; listings mark skipped
//! dead letters and leave purged ones out.

mod operator;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convoy_core::dead_letter::{
    replay_message, DL_ATTEMPTS, DL_CAUSE, DL_ERROR, DL_ERROR_CLASS, DL_FIRST_FAILURE_MS, DL_GROUP,
    DL_LAST_FAILURE_MS, DL_OFFSET, DL_SOURCE,
};
use convoy_core::parking::{self, KeyReplay, ParkedKeys, Position, ReplayTag, REPLAY_OF};
use convoy_core::{
    ConfigError, DeadLetterCause, Headers, Message, OutgoingMessage, Publisher, Receipt, TransportError,
};

use crate::connection::Connection;
use crate::error::ConnectError;

pub use convoy_core::dead_letter::REPLAYED_FROM;
pub use convoy_core::parking::Unparked;
pub use operator::{purge, unpark};

/// A message read from a dead-letter topic, with its reason decoded.
#[derive(Clone, Debug)]
pub struct DeadLetterRecord {
    /// The dead letter as stored (its source and offset are the dead-letter topic's).
    pub message: Message,
    /// Why it left its lane (`terminal`, `malformed`, `panic`, `retries-exhausted`, `stuck`).
    pub cause: String,
    /// The last error's class.
    pub error_class: String,
    /// The last error's text.
    pub error: String,
    /// Attempts made.
    pub attempts: u32,
    /// Where it was read from originally (`topic/partition`).
    pub original_source: Option<String>,
    /// Its offset there.
    pub original_offset: Option<u64>,
    /// The consumer group that gave up on it.
    pub group: String,
    /// When its first attempt failed.
    pub first_failure_at: Option<SystemTime>,
    /// When it was dead-lettered (its last attempt failed, or it was set aside).
    pub dead_lettered_at: Option<SystemTime>,
    /// How many replays re-published it (filled in by [`list`]; 0 from [`Self::from_message`]).
    pub replays: u32,
    /// When the last of them was recorded.
    pub last_replayed_at: Option<SystemTime>,
    /// When an unpark passed over it (a parked key's failed head, never replayed), if one did.
    pub skipped_at: Option<SystemTime>,
    /// When it was purged, if it was (listed only by a selection that asks for purged ones).
    pub purged_at: Option<SystemTime>,
}

/// A time written as milliseconds since the Unix epoch.
fn time_of(headers: &Headers, name: &str) -> Option<SystemTime> {
    let ms = headers.get_str(name)?.parse::<u64>().ok()?;
    UNIX_EPOCH.checked_add(Duration::from_millis(ms))
}

impl DeadLetterRecord {
    /// Decodes the reason headers (missing ones read as empty).
    pub fn from_message(message: Message) -> Self {
        let h = |name: &str| message.headers.get_str(name).unwrap_or_default().to_owned();
        DeadLetterRecord {
            first_failure_at: time_of(&message.headers, DL_FIRST_FAILURE_MS),
            dead_lettered_at: time_of(&message.headers, DL_LAST_FAILURE_MS),
            replays: 0,
            last_replayed_at: None,
            skipped_at: None,
            purged_at: None,
            cause: h(DL_CAUSE),
            error_class: h(DL_ERROR_CLASS),
            error: h(DL_ERROR),
            attempts: h(DL_ATTEMPTS).parse().unwrap_or(0),
            original_source: message.headers.get_str(DL_SOURCE).map(str::to_owned),
            original_offset: message.headers.get_str(DL_OFFSET).and_then(|o| o.parse().ok()),
            group: h(DL_GROUP),
            message,
        }
    }

    /// The topic it came from (the original source without its `/partition`).
    pub fn original_topic(&self) -> Option<&str> {
        let source = self.original_source.as_deref()?;
        Some(source.rsplit_once('/').map_or(source, |(topic, _)| topic))
    }

    /// The message to publish again: original key, payload and headers, reason headers
    /// removed, a replay event id and a [`REPLAYED_FROM`] header. A dead letter replayed
    /// before gets an event id of its own for each replay (`…/replay/<position>/<n>`): a
    /// replay on purpose runs again, where a store or a broker that deduplicates by id
    /// (JetStream's window) would drop a copy under the first replay's id.
    pub fn to_replay(&self) -> OutgoingMessage {
        let mut message = replay_message(&self.message);
        if self.replays > 0 {
            if let Some(id) = message.headers.get_str(convoy_core::EVENT_ID_HEADER) {
                let id = format!("{id}/{}", self.replays + 1);
                message.headers.insert(convoy_core::EVENT_ID_HEADER, id);
            }
        }
        message
    }
}

/// Which dead letters to pick: every condition given must hold.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// Keys (exact match); empty: any key.
    pub keys: Vec<String>,
    /// Text found in the cause, error class or error message.
    pub reason: Option<String>,
    /// Offsets in the dead-letter topic.
    pub offsets: Option<RangeInclusive<u64>>,
    /// Only those replayed before (`Some(true)`) or only those never replayed (`Some(false)`).
    pub replayed: Option<bool>,
    /// Only those dead-lettered before this time.
    pub before: Option<SystemTime>,
    /// Purged ones too (left out otherwise).
    pub purged: bool,
}

impl Selection {
    /// Every dead letter.
    pub fn any() -> Self {
        Selection::default()
    }

    /// The dead letters of `key`.
    pub fn key(key: impl Into<String>) -> Self {
        Selection::any().or_key(key)
    }

    /// … of `key` too.
    pub fn or_key(mut self, key: impl Into<String>) -> Self {
        self.keys.push(key.into());
        self
    }

    /// … whose cause, error class or error message contains `text` (`"retries-exhausted"`,
    /// `"terminal"`, a word of the error).
    pub fn reason(mut self, text: impl Into<String>) -> Self {
        self.reason = Some(text.into());
        self
    }

    /// … at these offsets of the dead-letter topic.
    pub fn offsets(mut self, offsets: RangeInclusive<u64>) -> Self {
        self.offsets = Some(offsets);
        self
    }

    /// … never replayed before: what a replay should pick unless the operator means to apply
    /// the same messages again.
    pub fn not_replayed(mut self) -> Self {
        self.replayed = Some(false);
        self
    }

    /// … dead-lettered more than `age` ago (a dead letter whose time is not recorded is never
    /// old enough).
    pub fn older_than(mut self, age: Duration) -> Self {
        self.before = SystemTime::now().checked_sub(age);
        self
    }

    /// … purged ones included.
    pub fn with_purged(mut self) -> Self {
        self.purged = true;
        self
    }

    /// True when `record` is selected.
    pub fn matches(&self, record: &DeadLetterRecord) -> bool {
        let key_ok = self.keys.is_empty()
            || record
                .message
                .key
                .as_ref()
                .is_some_and(|k| self.keys.iter().any(|want| want.as_bytes() == k.as_ref()));
        let reason_ok = self.reason.as_ref().is_none_or(|text| {
            [&record.cause, &record.error_class, &record.error]
                .iter()
                .any(|field| field.contains(text.as_str()))
        });
        let offset_ok = self
            .offsets
            .as_ref()
            .is_none_or(|range| range.contains(&record.message.offset));
        let replayed_ok = self.replayed.is_none_or(|want| want == (record.replays > 0));
        let age_ok = self
            .before
            .is_none_or(|before| record.dead_lettered_at.is_some_and(|at| at < before));
        let purged_ok = self.purged || record.purged_at.is_none();
        key_ok && reason_ok && offset_ok && replayed_ok && age_ok && purged_ok
    }
}

/// Parses `A..B` or `A..=B` (both inclusive) or a single offset.
pub fn parse_offsets(text: &str) -> Result<RangeInclusive<u64>, String> {
    let number = |t: &str| {
        t.trim()
            .parse::<u64>()
            .map_err(|_| format!("expected an offset range like 10..20, got {text:?}"))
    };
    match text.split_once("..") {
        Some((a, b)) => {
            let (from, to) = (number(a)?, number(b.trim_start_matches('='))?);
            if from > to {
                return Err(format!(
                    "the offset range {text:?} is empty: give the lower offset first ({to}..{from})"
                ));
            }
            Ok(from..=to)
        }
        None => number(text).map(|o| o..=o),
    }
}

/// Every dead letter in `connection`'s dead-letter topic, in order, with its reason (the
/// markers of parked keys' replays left out).
///
/// ```no_run
/// # async fn demo(connection: &convoy::Connection) -> Result<(), convoy::ConnectError> {
/// for record in convoy::dlq::all(connection).await? {
///     println!("{} {}: {}", record.message.key_display(), record.cause, record.error);
/// }
/// let failed = convoy::dlq::list(connection, &convoy::dlq::Selection::key("acct-7").reason("terminal")).await?;
/// # Ok(()) }
/// ```
pub async fn all(connection: &Connection) -> Result<Vec<DeadLetterRecord>, ConnectError> {
    list(connection, &Selection::any()).await
}

/// The dead letters in `connection`'s dead-letter topic that `selection` picks (the markers
/// of parked keys' replays left out).
pub async fn list(
    connection: &Connection,
    selection: &Selection,
) -> Result<Vec<DeadLetterRecord>, ConnectError> {
    let records = read_dead_letters(connection).await?;
    // Every replay recorded, by the dead letters it re-published.
    let mut replays: HashMap<Position, (u32, Option<SystemTime>)> = HashMap::new();
    // Passed over by an unpark, and purged: when.
    let mut skipped: HashMap<Position, Option<SystemTime>> = HashMap::new();
    let mut purged: HashMap<Position, Option<SystemTime>> = HashMap::new();
    let unfinished = unfinished_markers(&records);
    for marker in records.iter().filter(|m| parking::is_marker(m)) {
        if ReplayTag::of(&marker.headers).is_some_and(|tag| unfinished.contains(&tag.id)) {
            continue;
        }
        let at = time_of(&marker.headers, DL_LAST_FAILURE_MS);
        for position in parking::replayed_by(marker) {
            let seen = replays.entry(position).or_default();
            seen.0 += 1;
            seen.1 = seen.1.max(at);
        }
        for position in parking::marked_by(marker, DeadLetterCause::Skipped) {
            skipped.insert(position, at);
        }
        for position in parking::marked_by(marker, DeadLetterCause::Purged) {
            purged.insert(position, at);
        }
    }
    // A message dead-lettered twice (delivered again after a crash) is replayed with either
    // record: both count, by what identifies the message.
    let mut by_identity: HashMap<&str, (u32, Option<SystemTime>)> = HashMap::new();
    for m in records.iter().filter(|m| !parking::is_marker(m)) {
        if let (Some(id), Some(&seen)) = (identity(m), replays.get(&(m.source.as_str().into(), m.offset))) {
            by_identity.insert(id, seen);
        }
    }
    let mut listed = Vec::new();
    for m in records.iter().filter(|m| !parking::is_marker(m)) {
        let seen = replays
            .get(&(m.source.as_str().into(), m.offset))
            .or_else(|| identity(m).and_then(|id| by_identity.get(id)));
        let mut record = DeadLetterRecord::from_message(m.clone());
        if let Some(&(count, at)) = seen {
            record.replays = count;
            record.last_replayed_at = at;
        }
        let position: parking::Position = (m.source.as_str().into(), m.offset);
        record.skipped_at = skipped.get(&position).map(|at| at.unwrap_or(UNIX_EPOCH));
        record.purged_at = purged.get(&position).map(|at| at.unwrap_or(UNIX_EPOCH));
        if selection.matches(&record) {
            listed.push(record);
        }
    }
    Ok(listed)
}

/// The ids of replays whose marker in parts misses some (the tool died while writing it): they
/// replayed nothing.
fn unfinished_markers(records: &[Message]) -> HashSet<String> {
    let mut parts: HashMap<String, (BTreeSet<u32>, u32)> = HashMap::new();
    for record in records.iter().filter(|m| parking::is_marker(m)) {
        let (part, of) = parking::marker_part(record);
        if let Some(tag) = ReplayTag::of(&record.headers).filter(|_| of > 1) {
            let read = parts.entry(tag.id).or_insert_with(|| (BTreeSet::new(), of));
            read.0.insert(part);
        }
    }
    parts
        .into_iter()
        .filter(|(_, (read, of))| read.len() < *of as usize)
        .map(|(id, _)| id)
        .collect()
}

/// The dead-letter topic's records up to now, read as an engine reads it back: to an end fixed
/// first (a RabbitMQ stream to an end marker written then, not until it goes quiet — dead
/// letters that keep coming, a hot parked key's, would keep such a read going forever).
async fn read_dead_letters(connection: &Connection) -> Result<Vec<Message>, ConnectError> {
    Ok(connection.dead_letter_sink()?.read_back().await?)
}

/// What a dead letter's message is known by: its parked record's id, or its event id.
fn identity(record: &Message) -> Option<&str> {
    record
        .headers
        .get_str(parking::DL_PARK_ID)
        .or_else(|| record.headers.get_str(convoy_core::EVENT_ID_HEADER))
}

/// The keys parked in `connection`'s consumer group, as its dead-letter topic records them.
pub async fn parked(connection: &Connection) -> Result<ParkedKeys, ConnectError> {
    let records = read_dead_letters(connection).await?;
    Ok(ParkedKeys::read(&connection.endpoint().group, &records))
}

/// The keys parked in each consumer group that wrote to `connection`'s dead-letter topic (a
/// topic's groups share it), by group: what tells an operator that names no group, or another,
/// where a key is parked.
pub async fn parked_by_group(connection: &Connection) -> Result<BTreeMap<String, ParkedKeys>, ConnectError> {
    let records = read_dead_letters(connection).await?;
    let groups: BTreeSet<&str> = records
        .iter()
        .filter_map(|r| r.headers.get_str(DL_GROUP))
        .collect();
    Ok(groups
        .into_iter()
        .map(|group| (group.to_owned(), ParkedKeys::read(group, &records)))
        .filter(|(_, keys)| !keys.is_empty())
        .collect())
}

/// Replays parked key `key` of `connection`'s group ([`parking::replay_key`]): its failed and
/// set-aside messages, in its original order, each to the topic it came from; the engine
/// unparks the key once the last one is handled.
pub async fn replay_parked(connection: &Connection, key: &[u8]) -> Result<KeyReplay, ConnectError> {
    replay_or_resume(connection, key, false).await
}

/// Replays parked keys `keys` of `connection`'s group as [`replay_parked`] does, in the order
/// given, reading the dead-letter topic back once for all ([`parking::replay_keys`]). The
/// outcome per key; the first that could not be replayed is the last.
pub async fn replay_parked_keys(
    connection: &Connection,
    keys: &[&[u8]],
) -> Result<Vec<Result<KeyReplay, ConnectError>>, ConnectError> {
    let group = &connection.endpoint().group;
    let sink = connection.dead_letter_sink()?;
    let partitions = Partitions::of(connection).await?;
    let publisher = partitions.publisher_for(connection);
    let outcomes = parking::replay_keys(group, keys, &*sink, &publisher)
        .await
        .map_err(refused)?;
    Ok(outcomes.into_iter().map(|o| o.map_err(refused)).collect())
}

/// Publishes again the replay of parked key `key` that is under way
/// ([`parking::resume_replay`]), for one whose publishing stopped part-way.
pub async fn resume_parked(connection: &Connection, key: &[u8]) -> Result<KeyReplay, ConnectError> {
    replay_or_resume(connection, key, true).await
}

async fn replay_or_resume(
    connection: &Connection,
    key: &[u8],
    resume: bool,
) -> Result<KeyReplay, ConnectError> {
    let group = &connection.endpoint().group;
    let sink = connection.dead_letter_sink()?;
    let partitions = Partitions::of(connection).await?;
    let publisher = partitions.publisher_for(connection);
    let replay = match resume {
        true => parking::resume_replay(group, key, &*sink, &publisher).await,
        false => parking::replay_key(group, key, &*sink, &publisher).await,
    };
    replay.map_err(refused)
}

/// A parked key's operation that failed: a broker's error, or a refusal naming the key.
pub(crate) fn refused(e: parking::ReplayError) -> ConnectError {
    match e {
        parking::ReplayError::Transport(e) => ConnectError::from(e),
        refused => ConfigError::invalid("key", refused.to_string()).into(),
    }
}

/// Where `record` is replayed to: `to`, or else the topic it came from.
fn target_topic(record: &DeadLetterRecord, to: Option<&str>) -> Result<String, ConnectError> {
    match to.or(record.original_topic()) {
        Some(t) => Ok(t.to_owned()),
        None => Err(ConfigError::invalid(
            "to",
            format!(
                "the dead letter at offset {} does not say where it came from (no {DL_SOURCE} header): name the topic to replay to",
                record.message.offset
            ),
        )
        .into()),
    }
}

/// Publishes `records` again, in the order given, each to `to` or else the topic it came from,
/// then records in the dead-letter topic that they were replayed (see the [module](self)
/// documentation) — those replayed to the topic they came from. Pick them with [`Selection::not_replayed`] unless they are meant to run again.
pub async fn replay(
    connection: &Connection,
    records: &[DeadLetterRecord],
    to: Option<&str>,
) -> Result<Vec<Receipt>, ConnectError> {
    // One publisher per target topic; order within a topic is the order given.
    let mut by_topic: BTreeMap<String, Vec<OutgoingMessage>> = BTreeMap::new();
    for record in records {
        let topic = target_topic(record, to)?;
        by_topic.entry(topic).or_default().push(record.to_replay());
    }
    let partitions = Partitions::of(connection).await?;
    let mut receipts = Vec::new();
    for (topic, messages) in by_topic {
        receipts.extend(
            partitions
                .publisher(connection, &topic)?
                .publish_all(messages)
                .await?,
        );
    }
    // Only a replay to where a dead letter came from counts: one sent elsewhere (`to` a staging
    // topic) leaves it to be replayed to its own topic.
    let home: Vec<DeadLetterRecord> = records
        .iter()
        .filter(|r| to.is_none() || to == r.original_topic())
        .cloned()
        .collect();
    record_replay(connection, &home).await.map_err(|e| {
        TransportError::broker(
            format!(
                "the {} dead letters were replayed, but recording so in the dead-letter topic failed \
                 (for all of them, or for some of the last): `dlq list` \
                 does not mark those, and a later replay would replay them again",
                records.len()
            ),
            e,
        )
    })?;
    Ok(receipts)
}

/// Writes the audit records of a replay of `records`: where the dead-letter topic holds them.
async fn record_replay(connection: &Connection, records: &[DeadLetterRecord]) -> Result<(), ConnectError> {
    record_marks(connection, records, REPLAY_OF, DeadLetterCause::Replayed, |n| {
        format!("replayed {n} dead letters")
    })
    .await
}

/// Writes audit records of `cause` naming where the dead-letter topic holds `records` (in
/// header `header`, as many per record as one header holds: [`parking::position_lists`]),
/// each saying `text` of its count.
pub(crate) async fn record_marks(
    connection: &Connection,
    records: &[DeadLetterRecord],
    header: &str,
    cause: DeadLetterCause,
    text: impl Fn(usize) -> String,
) -> Result<(), ConnectError> {
    let sink = connection.dead_letter_sink()?;
    let group = connection.endpoint().group.clone();
    let positions: Vec<String> = records
        .iter()
        .map(|r| parking::format_position(&(r.message.source.as_str().into(), r.message.offset)))
        .collect();
    // Each audit record names as many as one header holds, the first of them beside it.
    let mut first = 0;
    for list in parking::position_lists(&positions) {
        let named = list.split(',').filter(|p| !p.is_empty()).count();
        let mut headers = Headers::new();
        headers.insert(header, list);
        let marker = parking::marker(
            &group,
            None,
            records.get(first).map(|r| r.message.source.clone()),
            cause,
            text(named),
            headers,
        );
        sink.publish(&marker).await?;
        first += named;
    }
    Ok(())
}

/// The partition counts of the broker's topics. A replay partitions as its target topic does
/// (a key's replayed messages join its partition), whatever count the connection was given:
/// the operator names a group and a topic, not how the topic was declared.
pub(crate) struct Partitions(HashMap<String, u32>);

impl Partitions {
    pub(crate) async fn of(connection: &Connection) -> Result<Partitions, ConnectError> {
        let listed = connection.list_topics().await?;
        Ok(Partitions(
            listed.into_iter().map(|t| (t.name, t.partitions)).collect(),
        ))
    }

    /// What a parked key's replay publishes through: a publisher per topic.
    pub(crate) fn publisher_for<'a>(
        &'a self,
        connection: &'a Connection,
    ) -> impl Fn(&str) -> Result<Arc<dyn Publisher>, TransportError> + Sync + 'a {
        move |topic: &str| {
            self.publisher(connection, topic)
                .map_err(|e| TransportError::broker(format!("publishing to {topic}"), e))
        }
    }

    /// A publisher to `topic` with the topic's own partition count; an error naming the topic
    /// when it does not exist (a replay never creates its target).
    pub(crate) fn publisher(
        &self,
        connection: &Connection,
        topic: &str,
    ) -> Result<Arc<dyn Publisher>, ConnectError> {
        match self.0.get(topic) {
            Some(&n) if n == connection.endpoint().partitions => connection.publisher(topic),
            Some(&n) => connection.with_partitions(n).publisher(topic),
            None => Err(ConfigError::invalid(
                "to",
                format!(
                    "topic {topic}, where the dead letters go back to, does not exist on this broker: \
                     create it as it was (`convoy topic create {topic} --partitions N`), or replay to another topic"
                ),
            )
            .into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use convoy_core::{Headers, SourceId, EVENT_ID_HEADER};

    use super::*;

    fn dead_letter(key: &str, cause: &str, offset: u64) -> DeadLetterRecord {
        let mut headers = Headers::new();
        headers.insert(EVENT_ID_HEADER, "ev-1");
        headers.insert("traceparent", "00-abc");
        headers.insert(DL_CAUSE, cause.to_owned());
        headers.insert(DL_ERROR_CLASS, cause.to_owned());
        headers.insert(DL_ERROR, "overdraft on acct");
        headers.insert(DL_ATTEMPTS, "3");
        headers.insert(DL_SOURCE, "ledger.v2/3");
        headers.insert(DL_OFFSET, "41");
        DeadLetterRecord::from_message(Message {
            key: Some(Bytes::from(key.to_owned())),
            payload: Bytes::from_static(b"{}"),
            headers,
            source: SourceId::new("ledger.v2.dlq/0"),
            offset,
        })
    }

    #[test]
    fn a_replay_keeps_key_payload_and_headers_but_not_the_reason() {
        let r = dead_letter("acct-1", "terminal", 7);
        assert_eq!((r.attempts, r.original_offset), (3, Some(41)));
        assert_eq!(r.original_topic(), Some("ledger.v2"));
        let out = r.to_replay();
        assert_eq!(out.key.as_deref(), Some(&b"acct-1"[..]));
        assert_eq!(out.headers.get_str("traceparent"), Some("00-abc"));
        assert!(out.headers.iter().all(|(n, _)| !n.starts_with("convoy-dl-")));
        assert_eq!(
            out.headers.get_str(EVENT_ID_HEADER),
            Some("ev-1/replay/ledger.v2.dlq/0@7")
        );
        assert_eq!(out.headers.get_str(REPLAYED_FROM), Some("ledger.v2.dlq/0@7"));
    }

    #[test]
    fn selections_combine_key_reason_and_offsets() {
        let records = [
            dead_letter("a", "terminal", 1),
            dead_letter("b", "malformed", 2),
            dead_letter("a", "malformed", 3),
        ];
        let pick = |s: Selection| -> Vec<u64> {
            records
                .iter()
                .filter(|r| s.matches(r))
                .map(|r| r.message.offset)
                .collect()
        };
        assert_eq!(pick(Selection::default()), [1, 2, 3]);
        assert_eq!(
            pick(Selection {
                keys: vec!["a".into()],
                ..Selection::default()
            }),
            [1, 3]
        );
        assert_eq!(
            pick(Selection {
                reason: Some("malformed".into()),
                ..Selection::default()
            }),
            [2, 3]
        );
        assert_eq!(
            pick(Selection {
                reason: Some("overdraft".into()),
                offsets: Some(2..=3),
                ..Selection::default()
            }),
            [2, 3]
        );
        assert_eq!(parse_offsets("2..3"), Ok(2..=3));
        assert_eq!(parse_offsets("2..=3"), Ok(2..=3));
        assert_eq!(parse_offsets("5"), Ok(5..=5));
        assert!(parse_offsets("x..3").is_err());
    }
}
