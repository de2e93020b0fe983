//! Stream messages ↔ convoy messages, and headers ↔ NATS headers.
//!
//! NATS headers are text: a value may not hold CR or LF, and the server trims its spaces. A
//! convoy header (or key) that is not such text travels base64-encoded, its name listed in the
//! `convoy-b64` header, so every byte — of a key above all, which decides order — comes back
//! as it was sent. Server headers (`Nats-*`) are not passed to handlers.

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use bytes::Bytes;
use convoy_core::{Headers, Message, Offset, SourceId, EVENT_ID_HEADER};

/// Header carrying the message key: NATS messages have no key of their own.
pub const KEY_HEADER: &str = "convoy-key";

/// Header listing (comma-separated) the headers whose values are base64.
pub const BASE64_HEADER: &str = "convoy-b64";

/// True when `value` reaches the other side unchanged as a NATS header value.
fn plain(value: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(value).ok()?;
    let untrimmed = text.trim() == text;
    let one_line = !text.contains(['\r', '\n']);
    (untrimmed && one_line).then_some(text)
}

/// convoy headers plus the key as NATS headers (names NATS cannot carry are left out, with a
/// warning).
pub fn to_header_map(key: Option<&Bytes>, headers: &Headers) -> HeaderMap {
    let mut map = HeaderMap::new();
    let mut encoded = Vec::new();
    let all = key.map(|k| (KEY_HEADER, k)).into_iter().chain(headers.iter());
    for (name, value) in all {
        let Ok(header) = name.parse::<HeaderName>() else {
            tracing::warn!(name, "header name NATS cannot carry left out");
            continue;
        };
        let value = match plain(value).and_then(|t| t.parse::<HeaderValue>().ok()) {
            Some(text) => text,
            None => {
                encoded.push(name);
                match BASE64.encode(value).parse::<HeaderValue>() {
                    Ok(v) => v,
                    Err(_) => continue, // base64 is always a valid value
                }
            }
        };
        map.append(header, value);
    }
    if !encoded.is_empty() {
        if let Ok(list) = encoded.join(",").parse::<HeaderValue>() {
            map.insert(BASE64_HEADER, list);
        }
    }
    map
}

/// NATS headers as the key and convoy headers.
pub fn from_header_map(map: Option<&HeaderMap>) -> (Option<Bytes>, Headers) {
    let Some(map) = map else {
        return (None, Headers::new());
    };
    let encoded: Vec<&str> = map
        .get(BASE64_HEADER)
        .map(|v| v.as_str().split(',').collect())
        .unwrap_or_default();
    let mut key = None;
    let mut headers = Headers::new();
    for (name, values) in map.iter() {
        let name: &str = name.as_ref();
        if name == BASE64_HEADER || name.starts_with("Nats-") {
            continue;
        }
        for value in values {
            let bytes = if encoded.contains(&name) {
                match BASE64.decode(value.as_str()) {
                    Ok(bytes) => Bytes::from(bytes),
                    Err(_) => Bytes::copy_from_slice(value.as_str().as_bytes()),
                }
            } else {
                Bytes::copy_from_slice(value.as_str().as_bytes())
            };
            if name == KEY_HEADER {
                key = Some(bytes);
            } else {
                headers.append(name, bytes);
            }
        }
    }
    (key, headers)
}

/// A stream message as a convoy message of `source`; its offset is the stream sequence. A
/// message without a `convoy-event-id` header is identified by NATS's own `Nats-Msg-Id` (the
/// producer's deduplication id) when it has one, else by its stream sequence.
pub fn to_message(headers: Option<&HeaderMap>, payload: Bytes, source: &SourceId, offset: Offset) -> Message {
    let nats_id = headers.and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID));
    let (key, mut headers) = from_header_map(headers);
    if headers.get(EVENT_ID_HEADER).is_none() {
        if let Some(id) = nats_id {
            headers.insert(EVENT_ID_HEADER, Bytes::copy_from_slice(id.as_str().as_bytes()));
        }
    }
    Message {
        key,
        payload,
        headers,
        source: source.clone(),
        offset,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_of_keys_and_headers_comes_back() {
        let mut h = Headers::new();
        h.insert("convoy-event-id", "evt-1");
        h.insert("bin", Bytes::from_static(&[0, 159, 146, 150]));
        h.insert("lines", "a\r\nb");
        h.insert("padded", "  x  ");
        h.insert("empty", "");
        let key = Bytes::from_static(b" key\nwith breaks ");
        let (back_key, back) = from_header_map(Some(&to_header_map(Some(&key), &h)));
        assert_eq!(back_key, Some(key));
        assert_eq!(back.get_str("convoy-event-id"), Some("evt-1"));
        assert_eq!(back.get("bin").map(|b| b.to_vec()), Some(vec![0, 159, 146, 150]));
        assert_eq!(back.get_str("lines"), Some("a\r\nb"));
        assert_eq!(back.get_str("padded"), Some("  x  "));
        assert_eq!(back.get_str("empty"), Some(""));
        assert!(back.get(BASE64_HEADER).is_none());
    }

    #[test]
    fn a_nats_msg_id_is_the_event_id_of_a_message_without_one() {
        let source = SourceId::partition("t", 0);
        let mut foreign = HeaderMap::new();
        foreign.insert("Nats-Msg-Id", "order-7");
        let m = to_message(Some(&foreign), Bytes::new(), &source, 3);
        assert_eq!(m.headers.get_str(EVENT_ID_HEADER), Some("order-7"));
        let mut stamped = HeaderMap::new();
        stamped.insert("Nats-Msg-Id", "order-7");
        stamped.insert(EVENT_ID_HEADER, "evt-1");
        let m = to_message(Some(&stamped), Bytes::new(), &source, 3);
        assert_eq!(m.headers.get_str(EVENT_ID_HEADER), Some("evt-1"));
        let m = to_message(None, Bytes::new(), &source, 3);
        assert!(
            m.headers.get(EVENT_ID_HEADER).is_none(),
            "the stream sequence identifies it"
        );
    }

    #[test]
    fn names_nats_cannot_carry_are_left_out_and_server_headers_hidden() {
        let mut h = Headers::new();
        h.insert("bad:name", "x");
        h.insert("ok", "y");
        let mut map = to_header_map(None, &h);
        map.insert("Nats-Msg-Id", "evt");
        let (key, back) = from_header_map(Some(&map));
        assert_eq!(key, None);
        assert_eq!(back.get_str("ok"), Some("y"));
        assert!(back.get("bad:name").is_none() && back.get("Nats-Msg-Id").is_none());
    }
}
