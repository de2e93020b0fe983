//! The Confluent Schema Registry wire format: a magic byte `0`, the schema id as a big-endian
//! 32-bit integer, then the encoded value. Protobuf values carry one more field before the
//! value: the path of the message type within its `.proto` file ("message indexes"), as a
//! zig-zag varint count and varints, with `[0]` (the first message) written as the single byte
//! `0`.
//!
//! Framing is independent of the registry client: a service that knows its schema ids may frame
//! and unframe without one.

use bytes::{BufMut, Bytes, BytesMut};
use convoy_core::codec::CodecError;

/// The first byte of every framed payload.
pub const MAGIC: u8 = 0;

/// The bytes before the value: the magic byte and the schema id.
pub const HEADER_LEN: usize = 5;

/// A payload taken apart: the writer's schema id and what follows the header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Framed {
    /// The id under which the registry holds the writer's schema.
    pub schema_id: u32,
    /// The value (for Protobuf, still preceded by its message indexes).
    pub body: Bytes,
}

/// Frames `value` under `schema_id`; for Protobuf, pass the message indexes (`&[0]` for the
/// file's first message).
pub fn frame(schema_id: u32, message_indexes: Option<&[u32]>, value: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN + 1 + value.len());
    out.put_slice(&header(schema_id));
    if let Some(indexes) = message_indexes {
        put_message_indexes(&mut out, indexes);
    }
    out.put_slice(value);
    out.freeze()
}

/// The header of a value of `schema_id`: the magic byte and the id. An encoder may write the
/// value after a placeholder and put this over it once the id is known.
pub fn header(schema_id: u32) -> [u8; HEADER_LEN] {
    let [a, b, c, d] = schema_id.to_be_bytes();
    [MAGIC, a, b, c, d]
}

/// Reads the header, without copying the value.
pub fn unframe(payload: &Bytes) -> Result<Framed, CodecError> {
    if payload.len() < HEADER_LEN {
        return Err(CodecError::malformed(format!(
            "{} bytes is too short for the schema registry's wire format (a magic byte and a 4-byte schema id)",
            payload.len()
        )));
    }
    if payload[0] != MAGIC {
        return Err(CodecError::malformed(format!(
            "the payload starts with byte {:#04x}, not the schema registry's magic byte 0: \
             it was not written by a schema-registry serializer",
            payload[0]
        )));
    }
    let schema_id = u32::from_be_bytes([payload[1], payload[2], payload[3], payload[4]]);
    Ok(Framed {
        schema_id,
        body: payload.slice(HEADER_LEN..),
    })
}

/// Splits a Protobuf body into its message indexes and the message.
pub fn message_indexes(body: &Bytes) -> Result<(Vec<u32>, Bytes), CodecError> {
    let mut at = 0;
    let count = read_zigzag(body, &mut at)?;
    // `[0]`, the common case, is the single byte 0 (a count of zero).
    if count == 0 {
        return Ok((vec![0], body.slice(at..)));
    }
    if count < 0 || count as usize > body.len() {
        return Err(CodecError::malformed(format!(
            "message index count {count} is not possible here"
        )));
    }
    let mut indexes = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let index = read_zigzag(body, &mut at)?;
        let index = u32::try_from(index)
            .map_err(|_| CodecError::malformed(format!("negative message index {index}")))?;
        indexes.push(index);
    }
    Ok((indexes, body.slice(at..)))
}

fn put_message_indexes(out: &mut BytesMut, indexes: &[u32]) {
    if indexes == [0] {
        out.put_u8(0);
        return;
    }
    put_zigzag(out, indexes.len() as i64);
    for &index in indexes {
        put_zigzag(out, i64::from(index));
    }
}

fn put_zigzag(out: &mut BytesMut, value: i64) {
    let mut v = ((value << 1) ^ (value >> 63)) as u64;
    while v >= 0x80 {
        out.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

fn read_zigzag(body: &[u8], at: &mut usize) -> Result<i64, CodecError> {
    let mut v: u64 = 0;
    for shift in (0..64).step_by(7) {
        let Some(&byte) = body.get(*at) else {
            return Err(CodecError::malformed(
                "the message indexes end before the value begins",
            ));
        };
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(((v >> 1) as i64) ^ -((v & 1) as i64));
        }
    }
    Err(CodecError::malformed(
        "a message index varint is longer than 10 bytes",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_as_confluent_serializers_do() {
        // Schema id 258 = 0x00000102; a value "ab".
        assert_eq!(&frame(258, None, b"ab")[..], &[0, 0, 0, 1, 2, b'a', b'b']);
        // Protobuf, the first message: one extra byte 0.
        assert_eq!(&frame(1, Some(&[0]), b"x")[..], &[0, 0, 0, 0, 1, 0, b'x']);
        // Protobuf, a nested message [1, 0]: count 2 → zig-zag 4, then 1 → 2, 0 → 0.
        assert_eq!(&frame(1, Some(&[1, 0]), b"")[..], &[0, 0, 0, 0, 1, 4, 2, 0]);
    }

    #[test]
    fn unframes_what_it_framed_and_names_what_is_wrong() {
        for indexes in [vec![0], vec![1, 0], vec![3, 200, 70000]] {
            let framed = unframe(&frame(7, Some(&indexes), b"value")).unwrap();
            assert_eq!(framed.schema_id, 7);
            let (read, value) = message_indexes(&framed.body).unwrap();
            assert_eq!(read, indexes);
            assert_eq!(&value[..], b"value");
        }
        let plain = unframe(&frame(u32::MAX, None, b"v")).unwrap();
        assert_eq!((plain.schema_id, &plain.body[..]), (u32::MAX, &b"v"[..]));

        let err = unframe(&Bytes::from_static(b"{\"json\":1}")).unwrap_err();
        assert!(
            err.to_string().contains("not the schema registry's magic byte"),
            "{err}"
        );
        let err = unframe(&Bytes::from_static(&[0, 0, 1])).unwrap_err();
        assert!(err.to_string().contains("too short"), "{err}");
        let err = message_indexes(&Bytes::from_static(&[4, 2])).unwrap_err();
        assert!(err.to_string().contains("end before"), "{err}");
        assert!(matches!(err, CodecError::Malformed(_)));
    }
}
