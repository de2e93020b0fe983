//! The offset map: finished offsets above the committed watermark, carried in the commit's
//! metadata (the Parallel Consumer idea), so a restart or a new owner skips work already done
//! instead of handling it again.
//!
//! Offsets are stored relative to the committed position (`W + 1`) either as a bitset or as
//! run-lengths (varints), whichever is smaller, base64-encoded behind a version tag. When even
//! the smaller form exceeds the broker's metadata limit, only the watermark is committed
//! (losing nothing: the offsets are simply handled again).

use base64::engine::general_purpose::STANDARD_NO_PAD;
use base64::Engine as _;
use convoy_core::Offset;

/// Kafka's default `offset.metadata.max.bytes`.
pub const DEFAULT_MAX_METADATA: usize = 4096;

const BITSET: &str = "cv1b:";
const RUNS: &str = "cv1r:";

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(bytes: &mut impl Iterator<Item = u8>) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = bytes.next()?;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Encodes `finished` (ascending, all ≥ `next`, the committed position `W + 1`) into commit
/// metadata of at most `max_len` bytes; `None` when nothing is finished above or it is too big.
pub fn encode(next: Offset, finished: &[Offset], max_len: usize) -> Option<String> {
    let deltas: Vec<u64> = finished
        .iter()
        .filter(|&&o| o >= next)
        .map(|&o| o - next)
        .collect();
    let last = *deltas.last()?;
    // Bitset: one bit per offset from `next` to the last finished one.
    let bitset_len = usize::try_from(last / 8 + 1).ok();
    let bitset = bitset_len.filter(|len| *len <= max_len * 3 / 4 + 3).map(|len| {
        let mut bits = vec![0u8; len];
        for d in &deltas {
            bits[(d / 8) as usize] |= 1 << (d % 8);
        }
        bits
    });
    // Runs: (gap from the previous run's end, run length) pairs.
    let mut runs = Vec::new();
    let mut cursor = 0u64;
    let mut i = 0;
    while i < deltas.len() {
        let start = deltas[i];
        let mut len = 1u64;
        while i + 1 < deltas.len() && deltas[i + 1] == deltas[i] + 1 {
            i += 1;
            len += 1;
        }
        put_varint(&mut runs, start - cursor);
        put_varint(&mut runs, len);
        cursor = start + len;
        i += 1;
    }
    let (tag, raw) = match bitset {
        Some(bits) if bits.len() <= runs.len() => (BITSET, bits),
        _ => (RUNS, runs),
    };
    let text = format!("{tag}{}", STANDARD_NO_PAD.encode(raw));
    (text.len() <= max_len).then_some(text)
}

/// Decodes commit metadata written by [`encode`]; anything else (empty, foreign, corrupt)
/// yields no offsets, which only means they are handled again.
pub fn decode(next: Offset, metadata: &str) -> Vec<Offset> {
    let (is_bitset, body) = if let Some(b) = metadata.strip_prefix(BITSET) {
        (true, b)
    } else if let Some(r) = metadata.strip_prefix(RUNS) {
        (false, r)
    } else {
        return Vec::new();
    };
    let Ok(raw) = STANDARD_NO_PAD.decode(body) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if is_bitset {
        for (byte_index, byte) in raw.iter().enumerate() {
            for bit in 0..8 {
                if byte & (1 << bit) != 0 {
                    out.push(next + byte_index as u64 * 8 + bit);
                }
            }
        }
    } else {
        let mut bytes = raw.into_iter();
        let mut cursor = 0u64;
        while let (Some(gap), Some(len)) = (get_varint(&mut bytes), get_varint(&mut bytes)) {
            let Some(start) = cursor.checked_add(gap) else {
                return Vec::new();
            };
            if len > 1 << 24 {
                return Vec::new(); // corrupt: refuse to expand absurd runs
            }
            out.extend((start..start + len).map(|d| next + d));
            cursor = start + len;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn picks_the_smaller_form() {
        // Dense and short: a bitset wins.
        let dense: Vec<u64> = (101..140).filter(|o| o % 3 != 0).collect();
        let m = encode(100, &dense, DEFAULT_MAX_METADATA).unwrap();
        assert!(m.starts_with(BITSET), "{m}");
        assert_eq!(decode(100, &m), dense);
        // Two long runs far apart: run-lengths win.
        let runs: Vec<u64> = (1_000..2_000).chain(500_000..501_000).collect();
        let m = encode(10, &runs, DEFAULT_MAX_METADATA).unwrap();
        assert!(m.starts_with(RUNS) && m.len() < 20, "{m}");
        assert_eq!(decode(10, &m), runs);
    }

    #[test]
    fn too_large_degrades_to_watermark_only() {
        let scattered: Vec<u64> = (0..5_000u64).map(|i| 1 + i * 1_000).collect();
        assert_eq!(encode(0, &scattered, 64), None);
        assert_eq!(encode(0, &[], 64), None);
        assert!(decode(0, "").is_empty());
        assert!(decode(0, "cv1r:!!!").is_empty());
        assert!(decode(0, "someone else's metadata").is_empty());
    }

    proptest! {
        #[test]
        fn round_trips_within_the_limit(
            next in 0u64..1_000_000,
            picks in proptest::collection::btree_set(1u64..20_000, 0..400),
            max_len in 16usize..4096,
        ) {
            let finished: Vec<u64> = picks.iter().map(|d| next + d).collect();
            match encode(next, &finished, max_len) {
                Some(m) => {
                    prop_assert!(m.len() <= max_len);
                    prop_assert_eq!(decode(next, &m), finished);
                }
                // ≤ 400 offsets within 20,000 of `next` always fit in 2,700 bytes (runs: ≤ 5 bytes each).
                None => prop_assert!(finished.is_empty() || max_len < 2_700),
            }
        }
    }
}
