//! The message model every transport translates into: a keyed payload with headers,
//! positioned at an offset in a source.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use smallvec::SmallVec;

pub use crate::header_names::EVENT_ID_HEADER;

/// A message's position in its source: a Kafka offset, an AMQP delivery tag, a JetStream
/// stream sequence. Offsets grow within one ownership of a source but need not be consecutive.
pub type Offset = u64;

/// The unit a broker orders and acknowledges by position (a topic-partition, a queue on
/// one channel, a partition consumer). Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceId(Arc<str>);

impl SourceId {
    /// A source id from its transport-specific name, e.g. `orders/3`.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        SourceId(name.into())
    }

    /// The name as given by the transport.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Partition `partition` of `topic`: `topic/partition`, as every partitioned transport
    /// names its sources.
    pub fn partition(topic: &str, partition: u32) -> Self {
        SourceId::new(format!("{topic}/{partition}"))
    }

    /// The topic and partition of a source named by [`SourceId::partition`].
    pub fn topic_partition(&self) -> Option<(&str, u32)> {
        let (topic, partition) = self.0.rsplit_once('/')?;
        Some((topic, partition.parse().ok()?))
    }
}

impl fmt::Display for SourceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SourceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SourceId({})", self.0)
    }
}

/// Header names convoy itself writes. A received header of one of these names shares the
/// static name instead of a copy ([`Headers::append_copied`]): one allocation less per header
/// of every message a transport converts.
const KNOWN_NAMES: &[&str] = &[
    EVENT_ID_HEADER,
    crate::header_names::TRACEPARENT,
    crate::header_names::DL_CAUSE,
    crate::header_names::DL_ERROR_CLASS,
    crate::header_names::DL_ERROR,
    crate::header_names::DL_ATTEMPTS,
    crate::header_names::DL_FIRST_FAILURE_MS,
    crate::header_names::DL_LAST_FAILURE_MS,
    crate::header_names::DL_SOURCE,
    crate::header_names::DL_OFFSET,
    crate::header_names::DL_GROUP,
];

/// Headers kept inside the message itself; more take one allocation. Two is what convoy's own
/// publishers write (event id, trace context): a transport converting a received message then
/// allocates nothing for its headers, on the thread that reads them, only to have another
/// thread free them.
const INLINE_HEADERS: usize = 2;

/// Ordered message headers; names may repeat, `get` returns the last value of a name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Headers(SmallVec<[(Cow<'static, str>, Bytes); INLINE_HEADERS]>);

impl Headers {
    /// Empty headers (no allocation).
    pub const fn new() -> Self {
        Headers(SmallVec::new_const())
    }

    /// Empty headers with room for `n` entries.
    pub fn with_capacity(n: usize) -> Self {
        Headers(SmallVec::with_capacity(n))
    }

    /// The last value of `name`, if any.
    pub fn get(&self, name: &str) -> Option<&Bytes> {
        self.0.iter().rev().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// The last value of `name` as UTF-8 text, if present and valid.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Sets `name` to `value`, replacing every earlier value of that name.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<Bytes>) {
        let name = name.into();
        self.0.retain(|(n, _)| *n != name);
        self.0.push((Cow::Owned(name), value.into()));
    }

    /// Appends a value without removing earlier ones.
    pub fn append(&mut self, name: impl Into<String>, value: impl Into<Bytes>) {
        self.0.push((Cow::Owned(name.into()), value.into()));
    }

    /// Appends a value under a copy of `name`, without removing earlier ones; the names
    /// convoy itself writes (event id, trace context, dead-letter reasons) are shared, not
    /// copied. For transports converting the headers of every received message.
    pub fn append_copied(&mut self, name: &str, value: impl Into<Bytes>) {
        let name = match KNOWN_NAMES.iter().find(|known| **known == name) {
            Some(known) => Cow::Borrowed(*known),
            None => Cow::Owned(name.to_owned()),
        };
        self.0.push((name, value.into()));
    }

    /// Iterates over `(name, value)` pairs in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Bytes)> {
        self.0.iter().map(|(n, v)| (n.as_ref(), v))
    }

    /// Number of header entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<N: Into<String>, V: Into<Bytes>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        Headers(
            iter.into_iter()
                .map(|(n, v)| (Cow::Owned(n.into()), v.into()))
                .collect(),
        )
    }
}

/// A message received from a source.
#[derive(Clone, Debug)]
pub struct Message {
    /// The correlation key; `None` for keyless messages.
    pub key: Option<Bytes>,
    /// The payload, untouched.
    pub payload: Bytes,
    /// Headers as the producer sent them.
    pub headers: Headers,
    /// The source the message came from.
    pub source: SourceId,
    /// Its position in the source.
    pub offset: Offset,
}

impl Message {
    /// The stable event id: the `convoy-event-id` header if present, else source and offset.
    pub fn event_id(&self) -> EventId {
        IdRef::of(self).to_owned()
    }

    /// The key, if any — read the same on a [`Delivery`](crate::Delivery).
    pub fn key(&self) -> Option<&Bytes> {
        self.key.as_ref()
    }

    /// The key as text: `None` when there is none or it is not UTF-8.
    pub fn key_str(&self) -> Option<&str> {
        self.key.as_deref().and_then(|k| std::str::from_utf8(k).ok())
    }

    /// The key that orders this message: its key, unless it has none or an empty one. Some
    /// producers send `""` for "no key"; treating it as a key would make one lane of every such
    /// message across all sources, so it follows the keyless policy instead.
    pub fn ordering_key(&self) -> Option<&Bytes> {
        self.key.as_ref().filter(|k| !k.is_empty())
    }

    /// What the message weighs in memory for back-pressure: key, payload, header names and
    /// values.
    pub fn weight(&self) -> usize {
        let headers: usize = self.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        self.key.as_ref().map_or(0, Bytes::len) + self.payload.len() + headers
    }

    /// The key as lossy UTF-8, for logs and spans.
    pub fn key_display(&self) -> std::borrow::Cow<'_, str> {
        match &self.key {
            Some(k) => String::from_utf8_lossy(k),
            None => std::borrow::Cow::Borrowed("<none>"),
        }
    }
}

/// A message's stable identity used for duplicate detection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EventId {
    /// Given by the producer in the `convoy-event-id` header (survives re-publishing).
    Header(Bytes),
    /// Derived from where the message was read (stable across redelivery from one source).
    Position(SourceId, Offset),
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        IdRef::from(self).fmt(f)
    }
}

/// An event id borrowed from its message: what the engine checks and records with its own
/// in-memory store, without cloning the id (whose reference count lives in the received
/// record's buffer, last written by the thread that read it).
#[derive(Clone, Copy, Debug)]
pub(crate) enum IdRef<'a> {
    Header(&'a Bytes),
    Position(&'a SourceId, Offset),
}

impl<'a> IdRef<'a> {
    /// The message's stable event id: the `convoy-event-id` header if present, else source
    /// and offset.
    pub(crate) fn of(message: &'a Message) -> Self {
        match message.headers.get(EVENT_ID_HEADER) {
            Some(id) => IdRef::Header(id),
            None => IdRef::Position(&message.source, message.offset),
        }
    }

    pub(crate) fn to_owned(self) -> EventId {
        match self {
            IdRef::Header(id) => EventId::Header(id.clone()),
            IdRef::Position(source, offset) => EventId::Position(source.clone(), offset),
        }
    }
}

impl<'a> From<&'a EventId> for IdRef<'a> {
    fn from(id: &'a EventId) -> Self {
        match id {
            EventId::Header(b) => IdRef::Header(b),
            EventId::Position(source, offset) => IdRef::Position(source, *offset),
        }
    }
}

/// One hash for both forms of an id, so the engine's borrowed ids and a caller's [`EventId`]s
/// find each other in one store.
impl std::hash::Hash for IdRef<'_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        match self {
            IdRef::Header(b) => {
                state.write_u8(0);
                state.write(b);
            }
            IdRef::Position(source, offset) => {
                state.write_u8(1);
                state.write(source.as_str().as_bytes());
                state.write_u64(*offset);
            }
        }
    }
}

impl fmt::Display for IdRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdRef::Header(id) => f.write_str(&String::from_utf8_lossy(id)),
            IdRef::Position(source, offset) => write!(f, "{source}@{offset}"),
        }
    }
}

/// A message to publish: key, payload and headers. The transport picks the source from the key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// The correlation key; all messages of one key land in one source.
    pub key: Option<Bytes>,
    /// The payload.
    pub payload: Bytes,
    /// Headers to send.
    pub headers: Headers,
}

impl OutgoingMessage {
    /// A keyed message.
    pub fn new(key: impl Into<Bytes>, payload: impl Into<Bytes>) -> Self {
        OutgoingMessage {
            key: Some(key.into()),
            payload: payload.into(),
            headers: Headers::new(),
        }
    }

    /// A keyless message.
    pub fn keyless(payload: impl Into<Bytes>) -> Self {
        OutgoingMessage {
            key: None,
            payload: payload.into(),
            headers: Headers::new(),
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Sets the stable event id used for duplicate detection.
    pub fn event_id(self, id: impl Into<Bytes>) -> Self {
        self.header(EVENT_ID_HEADER, id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_id_prefers_header_over_position() {
        let mut m = Message {
            key: Some(Bytes::from_static(b"k")),
            payload: Bytes::new(),
            headers: Headers::new(),
            source: SourceId::new("t/0"),
            offset: 7,
        };
        assert_eq!(m.event_id(), EventId::Position(SourceId::new("t/0"), 7));
        assert_eq!(m.event_id().to_string(), "t/0@7");
        m.headers.insert(EVENT_ID_HEADER, "evt-1");
        assert_eq!(m.event_id(), EventId::Header(Bytes::from_static(b"evt-1")));
    }

    #[test]
    fn an_empty_key_orders_like_no_key() {
        let mut m = Message {
            key: Some(Bytes::new()),
            payload: Bytes::from_static(b"12345"),
            headers: [("h", "ab")].into_iter().collect(),
            source: SourceId::new("t/0"),
            offset: 0,
        };
        assert_eq!(m.ordering_key(), None);
        assert_eq!(m.weight(), 5 + 3);
        m.key = Some(Bytes::from_static(b"k"));
        assert_eq!(m.ordering_key().map(|k| &k[..]), Some(&b"k"[..]));
        assert_eq!(m.weight(), 1 + 5 + 3);
    }

    #[test]
    fn headers_insert_replaces_and_append_keeps() {
        let mut h = Headers::new();
        h.append("a", "1");
        h.append("a", "2");
        assert_eq!(h.get_str("a"), Some("2"));
        h.insert("a", "3");
        assert_eq!(h.len(), 1);
        assert_eq!(h.get_str("a"), Some("3"));
    }

    #[test]
    fn copied_names_equal_owned_ones_whether_shared_or_not() {
        let mut copied = Headers::new();
        copied.append_copied(EVENT_ID_HEADER, "e");
        copied.append_copied("x-custom", "c");
        assert!(
            matches!(copied.0[0].0, Cow::Borrowed(_)),
            "convoy's own name is shared"
        );
        let owned: Headers = [(EVENT_ID_HEADER, "e"), ("x-custom", "c")].into_iter().collect();
        assert_eq!(copied, owned);
        assert_eq!(copied.get_str("x-custom"), Some("c"));
    }
}
