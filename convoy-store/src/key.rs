//! An event id as the bytes a store keys it by: a header id and a position id never collide,
//! whatever their text.

use convoy_core::EventId;

/// `h` + the header's bytes, or `p` + the source's name + `0` + the offset (big-endian).
pub fn encode(id: &EventId) -> Box<[u8]> {
    match id {
        EventId::Header(bytes) => {
            let mut key = Vec::with_capacity(1 + bytes.len());
            key.push(b'h');
            key.extend_from_slice(bytes);
            key.into_boxed_slice()
        }
        EventId::Position(source, offset) => {
            let name = source.as_str().as_bytes();
            let mut key = Vec::with_capacity(2 + name.len() + 8);
            key.push(b'p');
            key.extend_from_slice(name);
            key.push(0);
            key.extend_from_slice(&offset.to_be_bytes());
            key.into_boxed_slice()
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use convoy_core::SourceId;

    use super::*;

    #[test]
    fn header_and_position_ids_never_share_a_key() {
        let header = encode(&EventId::Header(Bytes::from_static(b"orders/0")));
        let position = encode(&EventId::Position(SourceId::new("orders/0"), 0));
        assert_ne!(header, position);
        assert_ne!(
            encode(&EventId::Position(SourceId::new("a"), 1)),
            encode(&EventId::Position(SourceId::new("a"), 2))
        );
    }
}
