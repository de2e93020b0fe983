//! The offset map: finished offsets above the committed watermark, stored beside it (the
//! Parallel Consumer idea) — in Kafka's commit metadata, in a NATS watermark entry — so a
//! restart or a new owner skips work already done instead of handling it again.
//!
//! Format: `cv2:<base>:<form>:<body>:<check>`. `base` is the committed offset the map is
//! relative to (`W + 1`), so a map that no longer matches its offset — the group was rewound by
//! a tool that kept the metadata — is ignored instead of skipping never-handled offsets.
//! `form` is `b` (a bitset) or `r` (varint run lengths), whichever is smaller; `body` is
//! base64; `check` is a checksum of the rest. Decoding is bounded: a corrupt or hostile value
//! yields nothing rather than billions of offsets. When even the smaller form exceeds the
//! metadata limit, only the watermark is committed (losing nothing: the offsets are simply
//! handled again).

use crate::message::Offset;
use base64::engine::general_purpose::STANDARD_NO_PAD;
use base64::Engine as _;

/// Kafka's default `offset.metadata.max.bytes`.
pub const DEFAULT_MAX_METADATA: usize = 4096;

/// The most offsets a map may expand to; more means it is corrupt.
pub const MAX_DECODED: u64 = 1 << 20;

const TAG: &str = "cv2";

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

/// FNV-1a (32 bits): enough to tell a map from a damaged or foreign one.
fn checksum(text: &str) -> u32 {
    text.bytes()
        .fold(0x811c_9dc5, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// Encodes `finished` (ascending, all ≥ `next`, the committed position `W + 1`) into text of
/// at most `max_len` bytes (no `@`, so it can follow other fields separated by one); `None` when nothing is finished above or it is too big.
pub fn encode(next: Offset, finished: &[Offset], max_len: usize) -> Option<String> {
    let deltas: Vec<u64> = finished
        .iter()
        .filter(|&&o| o >= next)
        .map(|&o| o - next)
        .collect();
    let last = *deltas.last()?;
    // Bitset: one bit per offset from `next` to the last finished one.
    let bitset = usize::try_from(last / 8 + 1)
        .ok()
        .filter(|len| *len <= max_len * 3 / 4 + 3)
        .map(|len| {
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
    let (form, raw) = match bitset {
        Some(bits) if bits.len() <= runs.len() => ('b', bits),
        _ => ('r', runs),
    };
    let signed = format!("{TAG}:{next}:{form}:{}", STANDARD_NO_PAD.encode(raw));
    let text = format!("{signed}:{:08x}", checksum(&signed));
    (text.len() <= max_len).then_some(text)
}

/// Decodes commit metadata written by [`encode`] for the committed position `next`. Anything
/// else — empty, foreign, damaged, written for another position, expanding past
/// [`MAX_DECODED`] — yields no offsets, which only means they are handled again.
pub fn decode(next: Offset, metadata: &str) -> Vec<Offset> {
    decode_checked(next, metadata).unwrap_or_default()
}

fn decode_checked(next: Offset, metadata: &str) -> Option<Vec<Offset>> {
    let (signed, check) = metadata.rsplit_once(':')?;
    if u32::from_str_radix(check, 16).ok()? != checksum(signed) {
        return None;
    }
    let mut parts = signed.splitn(4, ':');
    let (tag, base, form, body) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if tag != TAG || base.parse::<Offset>().ok()? != next {
        return None;
    }
    let raw = STANDARD_NO_PAD.decode(body).ok()?;
    let mut out = Vec::new();
    match form {
        "b" => {
            for (byte_index, byte) in raw.iter().enumerate() {
                for bit in 0..8 {
                    if byte & (1 << bit) != 0 {
                        out.push(next.checked_add(byte_index as u64 * 8 + bit)?);
                    }
                }
            }
        }
        "r" => {
            let mut bytes = raw.into_iter();
            let mut cursor = 0u64;
            let mut total = 0u64;
            while let Some(gap) = get_varint(&mut bytes) {
                let len = get_varint(&mut bytes)?;
                total = total.checked_add(len)?;
                if total > MAX_DECODED {
                    return None;
                }
                let start = cursor.checked_add(gap)?;
                let end = start.checked_add(len)?;
                out.extend((start..end).map(|d| next.saturating_add(d)));
                cursor = end;
            }
        }
        _ => return None,
    }
    Some(out)
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
        assert!(m.starts_with("cv2:100:b:"), "{m}");
        assert_eq!(decode(100, &m), dense);
        // Two long runs far apart: run-lengths win.
        let runs: Vec<u64> = (1_000..2_000).chain(500_000..501_000).collect();
        let m = encode(10, &runs, DEFAULT_MAX_METADATA).unwrap();
        assert!(m.starts_with("cv2:10:r:") && m.len() < 40, "{m}");
        assert_eq!(decode(10, &m), runs);
    }

    #[test]
    fn too_large_degrades_to_watermark_only() {
        let scattered: Vec<u64> = (0..5_000u64).map(|i| 1 + i * 1_000).collect();
        assert_eq!(encode(0, &scattered, 64), None);
        assert_eq!(encode(0, &[], 64), None);
        assert!(decode(0, "").is_empty());
        assert!(decode(0, "cv2:0:r:!!!:00000000").is_empty());
        assert!(decode(0, "someone else's metadata").is_empty());
    }

    #[test]
    fn a_map_for_another_position_is_ignored() {
        // Committed at 100 with 105 and 107 finished; then a tool rewinds the group to 50 and
        // keeps the metadata. Skipping "55 and 57" (the same deltas from 50) would lose them.
        let m = encode(100, &[105, 107], DEFAULT_MAX_METADATA).unwrap();
        assert_eq!(decode(100, &m), vec![105, 107]);
        assert!(decode(50, &m).is_empty());
    }

    #[test]
    fn damaged_maps_are_ignored() {
        let m = encode(7, &[9, 10, 11, 40], DEFAULT_MAX_METADATA).unwrap();
        let mut damaged = m.clone().into_bytes();
        let middle = damaged.len() / 2;
        damaged[middle] ^= 0x01;
        assert!(decode(7, &String::from_utf8_lossy(&damaged)).is_empty());
        // The v1 format carried no base offset: it cannot be trusted, so it is ignored.
        assert!(decode(7, "cv1b:Bw").is_empty());
    }

    #[test]
    fn a_hostile_run_cannot_expand_without_bound() {
        // A well-formed, correctly signed map claiming 2^40 finished offsets.
        let mut runs = Vec::new();
        put_varint(&mut runs, 0);
        put_varint(&mut runs, 1 << 40);
        let signed = format!("cv2:0:r:{}", STANDARD_NO_PAD.encode(runs));
        let hostile = format!("{signed}:{:08x}", checksum(&signed));
        assert!(decode(0, &hostile).is_empty());
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
                // ≤ 400 offsets within 20,000 of `next` always fit in 2,700 bytes (runs: ≤ 5
                // bytes each, plus the tag, base and checksum).
                None => prop_assert!(finished.is_empty() || max_len < 2_750),
            }
        }
    }
}
