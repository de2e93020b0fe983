//! Deliveries ↔ convoy messages, and headers ↔ AMQP field tables.
//!
//! Headers are written as long strings (binary-safe); on reading, long strings and byte arrays
//! (what pika sends for Python `bytes`) are taken as bytes and numbers as their decimal text.
//! A field table is a sorted map: header order and repeated names (last wins) are not kept.

use bytes::Bytes;
use convoy_core::{Headers, Message, SourceId, EVENT_ID_HEADER};
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

/// convoy headers as an AMQP field table (names over 255 bytes are left out: AMQP cannot carry them).
pub fn to_field_table(headers: &Headers) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in headers.iter() {
        match ShortString::try_new(name) {
            Ok(name) => {
                table.insert(name, AMQPValue::LongString(LongString::from(value.to_vec())));
            }
            Err(_) => tracing::warn!(name, "header name over 255 bytes left out"),
        }
    }
    table
}

/// An AMQP field table as convoy headers.
pub fn from_field_table(table: Option<&FieldTable>) -> Headers {
    let Some(table) = table else {
        return Headers::new();
    };
    table
        .inner()
        .iter()
        .filter_map(|(name, value)| {
            let bytes = match value {
                AMQPValue::LongString(s) => Bytes::copy_from_slice(s.as_bytes()),
                AMQPValue::ByteArray(b) => Bytes::copy_from_slice(b.as_slice()),
                AMQPValue::ShortString(s) => Bytes::copy_from_slice(s.as_str().as_bytes()),
                AMQPValue::LongLongInt(n) => Bytes::from(n.to_string()),
                AMQPValue::LongInt(n) => Bytes::from(n.to_string()),
                AMQPValue::ShortInt(n) => Bytes::from(n.to_string()),
                AMQPValue::LongUInt(n) => Bytes::from(n.to_string()),
                _ => return None,
            };
            Some((name.to_string(), bytes))
        })
        .collect()
}

/// Header carrying the message key: AMQP messages have no key of their own. Messages without
/// it take their key from the `correlation_id` property, if set (what some producers use).
pub const KEY_HEADER: &str = "convoy-key";

/// A delivery as a convoy message of `source`; its offset is the delivery tag. A message without
/// a `convoy-event-id` header is identified by AMQP's own `message_id` property when it has one
/// (what a foreign producer sets to make a re-sent message recognisable); with neither, it has no
/// event id (delivery tags restart on every channel: no id is derived from them).
pub fn to_message(delivery: Delivery, source: &SourceId) -> Message {
    let mut headers = from_field_table(delivery.properties.headers().as_ref());
    if headers.get(EVENT_ID_HEADER).is_none() {
        if let Some(id) = delivery.properties.message_id() {
            headers.insert(EVENT_ID_HEADER, Bytes::copy_from_slice(id.as_str().as_bytes()));
        }
    }
    let key = match headers.get(KEY_HEADER).cloned() {
        Some(key) => {
            headers = headers
                .iter()
                .filter(|(n, _)| *n != KEY_HEADER)
                .map(|(n, v)| (n, v.clone()))
                .collect();
            Some(key)
        }
        None => delivery
            .properties
            .correlation_id()
            .as_ref()
            .map(|id| Bytes::copy_from_slice(id.as_str().as_bytes())),
    };
    Message {
        key,
        payload: Bytes::from(delivery.data),
        headers,
        source: source.clone(),
        offset: delivery.delivery_tag,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_through_a_field_table() {
        let mut h = Headers::new();
        h.insert("convoy-event-id", "evt-1");
        h.insert("bin", Bytes::from_static(&[0, 159, 146, 150]));
        let back = from_field_table(Some(&to_field_table(&h)));
        assert_eq!(back.get_str("convoy-event-id"), Some("evt-1"));
        assert_eq!(back.get("bin").map(|b| b.to_vec()), Some(vec![0, 159, 146, 150]));
    }

    #[test]
    fn foreign_byte_arrays_and_numbers_are_read() {
        let mut t = FieldTable::default();
        t.insert("b".into(), AMQPValue::ByteArray(vec![1, 2].into()));
        t.insert("n".into(), AMQPValue::LongInt(5));
        let h = from_field_table(Some(&t));
        assert_eq!(h.get("b").map(|b| b.to_vec()), Some(vec![1, 2]));
        assert_eq!(h.get_str("n"), Some("5"));
    }
}
