//! Translation between Kafka records and convoy messages.

use bytes::BytesMut;
use convoy_core::{Headers, Message, SourceId};
use rdkafka::message::{BorrowedMessage, Header, Headers as _, OwnedHeaders};
use rdkafka::Message as _;

/// The source id of a topic-partition: `topic/partition`.
pub fn source_id(topic: &str, partition: i32) -> SourceId {
    SourceId::new(format!("{topic}/{partition}"))
}

/// The topic and partition of a source id made by [`source_id`].
pub fn topic_partition(source: &SourceId) -> Option<(&str, i32)> {
    let (topic, partition) = source.as_str().rsplit_once('/')?;
    Some((topic, partition.parse().ok()?))
}

/// Headers of a record read into a stack array; more than this many take a vector.
const INLINE_HEADERS: usize = 8;

/// Copies a fetched record into a convoy message: key, payload and header values share one
/// allocation (a record outlives its fetch buffer only as long as its message lives).
pub fn to_message(record: &BorrowedMessage<'_>, source: &SourceId) -> Message {
    let key = record.key().unwrap_or_default();
    let payload = record.payload().unwrap_or_default();
    // Each header read validates its name (librdkafka hands out C strings): read them once.
    let mut inline = [("", &[][..]); INLINE_HEADERS];
    let mut more = Vec::new();
    let mut count = 0;
    if let Some(hs) = record.headers() {
        for h in hs.iter() {
            let pair = (h.key, h.value.unwrap_or_default());
            match inline.get_mut(count) {
                Some(slot) => *slot = pair,
                None => more.push(pair),
            }
            count += 1;
        }
    }
    let pairs = || inline[..count.min(INLINE_HEADERS)].iter().chain(&more);
    let header_bytes: usize = pairs().map(|(_, v)| v.len()).sum();
    // One buffer for key, payload and header values; the parts are slices of it.
    let mut buf = BytesMut::with_capacity(key.len() + payload.len() + header_bytes);
    buf.extend_from_slice(key);
    buf.extend_from_slice(payload);
    for (_, value) in pairs() {
        buf.extend_from_slice(value);
    }
    let buf = buf.freeze();
    let mut headers = Headers::with_capacity(count);
    let mut at = key.len() + payload.len();
    for (name, value) in pairs() {
        headers.append_copied(name, buf.slice(at..at + value.len()));
        at += value.len();
    }
    Message {
        key: record.key().map(|_| buf.slice(..key.len())),
        payload: buf.slice(key.len()..key.len() + payload.len()),
        headers,
        source: source.clone(),
        offset: record.offset().max(0) as u64,
    }
}

/// convoy headers as Kafka record headers.
pub fn to_kafka_headers(headers: &Headers) -> OwnedHeaders {
    headers.iter().fold(
        OwnedHeaders::new_with_capacity(headers.len()),
        |acc, (key, value)| {
            acc.insert(Header {
                key,
                value: Some(value.as_ref()),
            })
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_ids_round_trip_even_with_slashes_in_names() {
        let s = source_id("orders.v2", 7);
        assert_eq!(s.as_str(), "orders.v2/7");
        assert_eq!(topic_partition(&s), Some(("orders.v2", 7)));
        assert_eq!(topic_partition(&SourceId::new("nonsense")), None);
    }

    #[test]
    fn headers_keep_order_and_repeats() {
        let mut h = Headers::new();
        h.append("a", "1");
        h.append("a", "2");
        h.append("traceparent", "00-x");
        let k = to_kafka_headers(&h);
        let back: Vec<(String, Vec<u8>)> = k
            .iter()
            .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
            .collect();
        assert_eq!(back.len(), 3);
        assert_eq!(back[1], ("a".to_owned(), b"2".to_vec()));
    }
}
