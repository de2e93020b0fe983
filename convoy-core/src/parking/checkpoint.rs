//! A group's checkpoint: its parked keys folded up to a mark of the dead-letter destination,
//! deflated JSON, saved in parts a store's value holds (Kafka's and NATS's are 1 MB by
//! default; a hot key parked for hours outgrows one).
//!
//! Each part is framed: a magic, a checksum of the whole deflated checkpoint, and, in part 0
//! (the *head*), how many parts there are — in the others, their index. A save writes the
//! other parts first and the head last, so a head names parts already saved. Two members
//! saving at once may leave a head beside another save's parts: the checksums disagree, the
//! load is tried again, and a checkpoint that stays torn is ignored (the read starts from the
//! destination's beginning; the next save mends it). Parts beyond the head's count are stale
//! leftovers of a larger checkpoint, never read.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use super::{KeyParking, ParkedKeys};
use crate::dead_letter::{DeadLetterSink, ReadMark};
use crate::transport::TransportError;

/// Most bytes of deflated checkpoint one part holds (its frame adds [`FRAME`]): half of the
/// smallest default bound on a store's value, leaving room for the record's own overhead.
pub const CHECKPOINT_PART_BYTES: usize = 512 * 1024;

/// A group's parked keys as folded up to a mark of its destination.
#[derive(Serialize, Deserialize)]
pub(super) struct Checkpoint {
    /// The format's version: another one is ignored (read from the start instead).
    version: u32,
    group: String,
    pub(super) mark: ReadMark,
    pub(super) keys: ParkedKeys,
}

/// How hard a checkpoint is deflated (of miniz's 0–10): most of what the best level saves, at a
/// fraction of its time.
const DEFLATE_LEVEL: u8 = 3;

/// Most bytes a checkpoint inflates to: far beyond any saved, short of exhausting memory on a
/// corrupt one.
const INFLATED_LIMIT: usize = 1 << 30;

/// The first bytes of every part: "cvp" and the format's version.
const MAGIC: [u8; 4] = *b"cvp\x03";

/// A part's frame: [`MAGIC`], the checksum (u64) and the count or index (u32), little-endian.
const FRAME: usize = 16;

/// Loads of a torn checkpoint before it is ignored, and the pause after each (times its
/// number): another member's save finishes within it.
const LOAD_ATTEMPTS: u32 = 3;
const TORN_PAUSE: Duration = Duration::from_millis(100);

impl Checkpoint {
    /// 3: deflated JSON in framed parts (2: deflated JSON in one value; 1: plain JSON).
    const VERSION: u32 = 3;

    /// Saves `group`'s parked keys as folded up to `mark`, in as many parts as it takes.
    /// Returns how many.
    pub(super) async fn save(
        sink: &dyn DeadLetterSink,
        group: &str,
        mark: &ReadMark,
        keys: &ParkedKeys,
    ) -> Result<usize, TransportError> {
        save_parts(
            sink,
            group,
            &Checkpoint::encode(group, mark, keys),
            CHECKPOINT_PART_BYTES,
        )
        .await
    }

    /// `group`'s last checkpoint, if one of this version for `group` is saved whole (anything
    /// else is ignored, logged: the read starts from the destination's beginning).
    pub(super) async fn load(
        sink: &dyn DeadLetterSink,
        group: &str,
    ) -> Result<Option<Checkpoint>, TransportError> {
        for attempt in 1..=LOAD_ATTEMPTS {
            match load_parts(sink, group).await? {
                Loaded::None => return Ok(None),
                Loaded::Whole(deflated) => return Ok(Checkpoint::decode(group, &deflated)),
                Loaded::Foreign => {
                    tracing::warn!("ignoring a parked keys' checkpoint of another version; reading the dead-letter destination from its start");
                    return Ok(None);
                }
                Loaded::Torn if attempt < LOAD_ATTEMPTS => tokio::time::sleep(TORN_PAUSE * attempt).await,
                Loaded::Torn => {}
            }
        }
        tracing::warn!("the parked keys' checkpoint stays torn (members saved it at once, or a save failed half-way); reading the dead-letter destination from its start");
        Ok(None)
    }

    fn encode(group: &str, mark: &ReadMark, keys: &ParkedKeys) -> Vec<u8> {
        #[derive(Serialize)]
        struct Borrowed<'a> {
            version: u32,
            group: &'a str,
            mark: &'a ReadMark,
            keys: &'a ParkedKeys,
        }
        let checkpoint = Borrowed {
            version: Checkpoint::VERSION,
            group,
            mark,
            keys,
        };
        // Serializing maps, sets, strings and numbers cannot fail.
        let json = serde_json::to_vec(&checkpoint).unwrap_or_default();
        // Deflated: a parked key's records are ids and positions much alike.
        miniz_oxide::deflate::compress_to_vec(&json, DEFLATE_LEVEL)
    }

    /// The checkpoint `deflated` holds, if it is one of this version for `group`.
    fn decode(group: &str, deflated: &[u8]) -> Option<Checkpoint> {
        let json = match miniz_oxide::inflate::decompress_to_vec_with_limit(deflated, INFLATED_LIMIT) {
            Ok(json) => json,
            Err(e) => {
                tracing::warn!(error = ?e.status, "ignoring a parked keys' checkpoint that does not inflate; reading the dead-letter destination from its start");
                return None;
            }
        };
        match serde_json::from_slice::<Checkpoint>(&json) {
            Ok(mut c) if c.version == Checkpoint::VERSION && c.group == group => {
                c.keys.keys.values_mut().for_each(KeyParking::reindex);
                Some(c)
            }
            Ok(c) => {
                tracing::warn!(version = c.version, group = %c.group, "ignoring a parked keys' checkpoint of another version or group; reading the dead-letter destination from its start");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "ignoring an unreadable parked keys' checkpoint; reading the dead-letter destination from its start");
                None
            }
        }
    }
}

/// The group a checkpoint saved in one part ([`DeadLetterSink::save_checkpoint`]'s part 0) is
/// of, if it is one of this version: what a store holds is framed and deflated, not readable as
/// it is.
pub fn checkpoint_group(head: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Head {
        version: u32,
        group: String,
    }
    let (_, 1, body) = unframe(head)? else {
        return None;
    };
    let json = miniz_oxide::inflate::decompress_to_vec_with_limit(body, INFLATED_LIMIT).ok()?;
    let head: Head = serde_json::from_slice(&json).ok()?;
    (head.version == Checkpoint::VERSION).then_some(head.group)
}

/// Saves `deflated` in parts of at most `part_bytes`, the head last. Returns how many.
async fn save_parts(
    sink: &dyn DeadLetterSink,
    group: &str,
    deflated: &[u8],
    part_bytes: usize,
) -> Result<usize, TransportError> {
    let sum = checksum(deflated);
    let bodies: Vec<&[u8]> = deflated.chunks(part_bytes.max(1)).collect();
    let count = bodies.len().max(1);
    for (index, body) in bodies.iter().enumerate().skip(1).rev() {
        sink.save_checkpoint(group, part_number(index), frame(sum, part_number(index), body))
            .await?;
    }
    let head = bodies.first().copied().unwrap_or_default();
    sink.save_checkpoint(group, 0, frame(sum, part_number(count), head))
        .await?;
    Ok(count)
}

/// What a load of a checkpoint's parts found.
enum Loaded {
    /// No checkpoint saved.
    None,
    /// A head of another format (an older version's checkpoint).
    Foreign,
    /// A head and parts of different saves, or a part missing.
    Torn,
    /// The whole deflated checkpoint.
    Whole(Vec<u8>),
}

async fn load_parts(sink: &dyn DeadLetterSink, group: &str) -> Result<Loaded, TransportError> {
    let Some(head) = sink.load_checkpoint(group, 0).await? else {
        return Ok(Loaded::None);
    };
    let Some((sum, count, body)) = unframe(&head) else {
        return Ok(Loaded::Foreign);
    };
    let mut deflated = body.to_vec();
    for index in 1..count {
        let part = sink.load_checkpoint(group, index).await?;
        match part.as_deref().and_then(unframe) {
            Some((s, i, body)) if s == sum && i == index => deflated.extend_from_slice(body),
            _ => return Ok(Loaded::Torn),
        }
    }
    Ok(if checksum(&deflated) == sum {
        Loaded::Whole(deflated)
    } else {
        Loaded::Torn
    })
}

fn frame(sum: u64, number: u32, body: &[u8]) -> Bytes {
    let mut part = BytesMut::with_capacity(FRAME + body.len());
    part.put_slice(&MAGIC);
    part.put_u64_le(sum);
    part.put_u32_le(number);
    part.put_slice(body);
    part.freeze()
}

/// A part's checksum, count or index, and body, if it is framed.
fn unframe(part: &[u8]) -> Option<(u64, u32, &[u8])> {
    let (frame, body) = (part.get(..FRAME)?, part.get(FRAME..)?);
    let (magic, rest) = frame.split_at(4);
    let (sum, number) = rest.split_at(8);
    (magic == MAGIC).then(|| {
        let sum = u64::from_le_bytes(sum.try_into().unwrap_or_default());
        let number = u32::from_le_bytes(number.try_into().unwrap_or_default());
        (sum, number, body)
    })
}

/// A checkpoint has far fewer parts than a u32 counts (each is half a megabyte).
fn part_number(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// FNV-1a, 64 bits: stable across builds and platforms (members of a group may run different
/// ones), and it tells two saves apart.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use super::*;
    use crate::dead_letter::DeadLetter;

    /// A store of parts, with a count of each part's saves.
    #[derive(Default)]
    struct Store {
        parts: Mutex<BTreeMap<u32, Bytes>>,
        saves: Mutex<Vec<u32>>,
    }

    #[async_trait::async_trait]
    impl DeadLetterSink for Store {
        async fn publish(&self, _: &DeadLetter) -> Result<(), TransportError> {
            Ok(())
        }

        async fn load_checkpoint(&self, _: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
            Ok(self.parts.lock().unwrap().get(&part).cloned())
        }

        async fn save_checkpoint(&self, _: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
            assert!(checkpoint.len() <= FRAME + 1000, "a part within its bound");
            self.saves.lock().unwrap().push(part);
            self.parts.lock().unwrap().insert(part, checkpoint);
            Ok(())
        }
    }

    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..len).map(|_| rng.u8(..)).collect()
    }

    async fn load(store: &Store) -> Option<Vec<u8>> {
        match load_parts(store, "g").await.unwrap() {
            Loaded::Whole(bytes) => Some(bytes),
            _ => None,
        }
    }

    #[tokio::test]
    async fn a_checkpoint_is_saved_in_parts_the_head_last_and_read_back_whole() {
        let store = Store::default();
        let big = noise(4_500, 1);
        assert_eq!(save_parts(&store, "g", &big, 1000).await.unwrap(), 5);
        assert_eq!(*store.saves.lock().unwrap(), [4, 3, 2, 1, 0], "the head last");
        assert_eq!(load(&store).await, Some(big));
        // A smaller checkpoint after it: the larger one's last parts stay, never read.
        let small = noise(1_500, 2);
        assert_eq!(save_parts(&store, "g", &small, 1000).await.unwrap(), 2);
        assert_eq!(store.parts.lock().unwrap().len(), 5);
        assert_eq!(load(&store).await, Some(small));
        let empty = Vec::new();
        assert_eq!(save_parts(&store, "g", &empty, 1000).await.unwrap(), 1);
        assert_eq!(load(&store).await, Some(empty));
    }

    #[tokio::test]
    async fn a_head_beside_another_saves_parts_is_torn_and_ignored() {
        let store = Store::default();
        save_parts(&store, "g", &noise(2_500, 1), 1000).await.unwrap();
        let first_head = store.parts.lock().unwrap()[&0].clone();
        // Another member's save of the same size, then the first member's head again (it wrote
        // its parts before the other's and its head after it).
        save_parts(&store, "g", &noise(2_500, 2), 1000).await.unwrap();
        store.parts.lock().unwrap().insert(0, first_head);
        assert!(matches!(load_parts(&store, "g").await.unwrap(), Loaded::Torn));
        // A part gone (a store that lost it) is torn too.
        store.parts.lock().unwrap().remove(&2);
        assert!(matches!(load_parts(&store, "g").await.unwrap(), Loaded::Torn));
    }

    #[tokio::test(start_paused = true)]
    async fn a_torn_checkpoint_is_loaded_again_then_ignored() {
        let store = Store::default();
        save_parts(&store, "g", &noise(2_500, 1), 1000).await.unwrap();
        store.parts.lock().unwrap().remove(&1);
        let started = tokio::time::Instant::now();
        assert!(Checkpoint::load(&store, "g").await.unwrap().is_none());
        assert_eq!(started.elapsed(), TORN_PAUSE * 3, "two more loads, with pauses");
    }

    #[tokio::test]
    async fn a_checkpoint_of_an_older_version_is_ignored() {
        let store = Store::default();
        // Version 2: deflated JSON, unframed.
        let json = br#"{"version":2,"group":"g","mark":"0:1","keys":{"keys":[],"ended":[]}}"#;
        let old = miniz_oxide::deflate::compress_to_vec(json, DEFLATE_LEVEL);
        store.parts.lock().unwrap().insert(0, Bytes::from(old));
        assert!(matches!(load_parts(&store, "g").await.unwrap(), Loaded::Foreign));
        assert!(Checkpoint::load(&store, "g").await.unwrap().is_none());
    }

    #[test]
    fn the_checksum_is_fnv_1a() {
        // The published test vectors: stable across builds is the point.
        assert_eq!(checksum(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(checksum(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(checksum(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
