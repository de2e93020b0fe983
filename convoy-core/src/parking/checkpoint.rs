//! A group's checkpoint: its parked keys folded up to a mark of the dead-letter destination,
//! deflated JSON, saved in parts a store's value holds (Kafka's and NATS's are 1 MB by
//! default; a hot key parked for hours outgrows one).
//!
//! Part 0 is the *head*: a directory naming the checkpoint's data parts — how many, in which of
//! two *slots* they are stored, and a checksum of the whole — and the checkpoint before it the
//! same way. Each data part is framed with the checksum and its index. A save writes its data
//! parts into the slot the checkpoint it read does not use, then the head: a save that fails
//! half-way, or two members saving at once, never overwrite the parts of the checkpoint they
//! replace. A load checks every part against the head's checksum; a head whose parts another
//! save overwrote (three saves at once) is *torn*, and its previous checkpoint is read instead
//! (older: the read after it reads further). If both are torn the load is tried again, then the
//! destination is read from its start (logged; the next save mends the store).

use std::io::{BufReader, BufWriter, Read};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use flate2::read::DeflateDecoder;
use flate2::write::DeflateEncoder;
use flate2::Compression;
use serde::{Deserialize, Serialize};

use super::ParkedKeys;
use crate::dead_letter::{DeadLetterSink, ReadMark};
use crate::transport::TransportError;

/// Most bytes of deflated checkpoint one data part holds (its frame adds 16): half of the
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

/// How hard a checkpoint is deflated (of 0–9): most of what the best level saves, at a fraction
/// of its time.
const DEFLATE_LEVEL: u32 = 3;

/// Most bytes a checkpoint inflates to: far beyond any saved, short of reading forever from a
/// corrupt one.
const INFLATED_LIMIT: u64 = 1 << 30;

/// The buffer between JSON and deflate, each way.
const BUFFER: usize = 64 * 1024;

/// The first bytes of every part: "cvp" and the format's version.
const MAGIC: [u8; 4] = *b"cvp\x03";

/// A data part's frame: [`MAGIC`], the checksum (u64) and its index (u32), little-endian.
const FRAME: usize = 16;

/// Loads of a torn checkpoint before it is ignored, and the pause after each (times its
/// number): another member's save finishes within it.
const LOAD_ATTEMPTS: u32 = 3;
const TORN_PAUSE: Duration = Duration::from_millis(100);

/// Where a checkpoint's data parts are: what a head names, for the checkpoint and the one
/// before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Parts {
    /// The checksum of the whole deflated checkpoint.
    sum: u64,
    /// How many data parts (at least one).
    count: u32,
    /// The slot they are stored in: 0 or 1.
    slot: u8,
}

impl Parts {
    /// The store's number of data part `index` (from 1): the slots interleave.
    fn number(&self, index: u32) -> u32 {
        index
            .saturating_mul(2)
            .saturating_sub(1)
            .saturating_add(u32::from(self.slot))
    }
}

/// A checkpoint as loaded: the parked keys, and the head it was read from (the next save
/// stores its parts in the other slot and names it as its previous).
pub(super) struct Loaded {
    pub(super) checkpoint: Option<Checkpoint>,
    pub(super) head: Option<Parts>,
}

impl Checkpoint {
    /// 3: deflated JSON in framed parts (2: deflated JSON in one value; 1: plain JSON).
    const VERSION: u32 = 3;

    /// Saves `group`'s parked keys as folded up to `mark`, in as many data parts as it takes,
    /// beside `replaced` (a checkpoint known whole: the one the read-back loaded, or the one
    /// this engine saved last). Returns where its parts are.
    pub(super) async fn save(
        sink: &dyn DeadLetterSink,
        group: &str,
        mark: &ReadMark,
        keys: &ParkedKeys,
        replaced: Option<Parts>,
    ) -> Result<Parts, TransportError> {
        let deflated = Checkpoint::encode(group, mark, keys);
        save_parts(sink, group, &deflated, CHECKPOINT_PART_BYTES, replaced).await
    }

    /// `group`'s last checkpoint, if one of this version for `group` is saved whole (anything
    /// else is ignored, logged: the read starts from the destination's beginning).
    pub(super) async fn load(sink: &dyn DeadLetterSink, group: &str) -> Result<Loaded, TransportError> {
        Ok(match load_deflated(sink, group).await? {
            Some((deflated, head)) => Loaded {
                checkpoint: Checkpoint::decode(group, &deflated),
                head: Some(head),
            },
            None => Loaded {
                checkpoint: None,
                head: None,
            },
        })
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
        // Deflated (a parked key's records are ids and positions much alike) as it is written:
        // the JSON of a hot parked key is tens of megabytes, never held whole.
        let deflate = DeflateEncoder::new(Vec::new(), Compression::new(DEFLATE_LEVEL));
        let mut writer = BufWriter::with_capacity(BUFFER, deflate);
        // Writing into memory cannot fail, nor serializing maps, sets, strings and numbers.
        let written = serde_json::to_writer(&mut writer, &checkpoint).map_err(std::io::Error::from);
        let deflated = written
            .and_then(|()| writer.into_inner().map_err(|e| e.into_error()))
            .and_then(DeflateEncoder::finish);
        deflated.unwrap_or_default()
    }

    /// The checkpoint `deflated` holds, if it is one of this version for `group`.
    fn decode(group: &str, deflated: &[u8]) -> Option<Checkpoint> {
        // Inflated as it is read, as it was written.
        let json = BufReader::with_capacity(BUFFER, DeflateDecoder::new(deflated).take(INFLATED_LIMIT));
        match serde_json::from_reader::<_, Checkpoint>(json) {
            Ok(mut c) if c.version == Checkpoint::VERSION && c.group == group => {
                c.keys.reindex();
                Some(c)
            }
            Ok(c) => {
                tracing::warn!(version = c.version, group = %c.group, "ignoring a parked keys' checkpoint of another version or group; reading the dead-letter destination from its start");
                None
            }
            Err(e) => {
                // A checkpoint that does not inflate (`e.is_io()`) is unreadable too.
                tracing::warn!(error = %e, "ignoring an unreadable parked keys' checkpoint; reading the dead-letter destination from its start");
                None
            }
        }
    }
}

/// The latest whole checkpoint the head names (its own, or the one before it), deflated, and
/// where its parts are.
pub(super) async fn load_deflated(
    sink: &dyn DeadLetterSink,
    group: &str,
) -> Result<Option<(Vec<u8>, Parts)>, TransportError> {
    for attempt in 1..=LOAD_ATTEMPTS {
        let Some(head) = sink.load_checkpoint(group, 0).await? else {
            return Ok(None);
        };
        let Some((latest, previous)) = read_head(&head) else {
            tracing::warn!("ignoring a parked keys' checkpoint of another version; reading the dead-letter destination from its start");
            return Ok(None);
        };
        if let Some(parts) = latest {
            if let Some(deflated) = load_parts(sink, group, parts).await? {
                return Ok(Some((deflated, parts)));
            }
        }
        if let Some(parts) = previous {
            if let Some(deflated) = load_parts(sink, group, parts).await? {
                tracing::info!("the parked keys' latest checkpoint is torn (members saved it at once): reading from the one before it");
                return Ok(Some((deflated, parts)));
            }
        }
        if attempt < LOAD_ATTEMPTS {
            tokio::time::sleep(TORN_PAUSE * attempt).await;
        }
    }
    tracing::warn!("the parked keys' checkpoint and the one before it stay torn (members saved them at once); reading the dead-letter destination from its start");
    Ok(None)
}

/// Saves `deflated` in data parts of at most `part_bytes` in the slot `replaced` does not use,
/// then the head naming them and `replaced`. Returns where they are.
async fn save_parts(
    sink: &dyn DeadLetterSink,
    group: &str,
    deflated: &[u8],
    part_bytes: usize,
    replaced: Option<Parts>,
) -> Result<Parts, TransportError> {
    let mut bodies: Vec<&[u8]> = deflated.chunks(part_bytes.max(1)).collect();
    if bodies.is_empty() {
        bodies.push(&[]);
    }
    let parts = Parts {
        sum: checksum(deflated),
        count: u32::try_from(bodies.len()).unwrap_or(u32::MAX),
        slot: replaced.map_or(0, |r| 1 - r.slot),
    };
    for (index, body) in (1..=parts.count).zip(&bodies) {
        let mut part = BytesMut::with_capacity(FRAME + body.len());
        part.put_slice(&MAGIC);
        part.put_u64_le(parts.sum);
        part.put_u32_le(index);
        part.put_slice(body);
        sink.save_checkpoint(group, parts.number(index), part.freeze())
            .await?;
    }
    sink.save_checkpoint(group, 0, write_head(parts, replaced))
        .await?;
    Ok(parts)
}

/// The whole deflated checkpoint `parts` names, or `None` if it is torn (a part missing, or of
/// another save).
async fn load_parts(
    sink: &dyn DeadLetterSink,
    group: &str,
    parts: Parts,
) -> Result<Option<Vec<u8>>, TransportError> {
    let mut deflated = Vec::new();
    for index in 1..=parts.count {
        let part = sink.load_checkpoint(group, parts.number(index)).await?;
        match part.as_deref().and_then(read_data) {
            Some((sum, i, body)) if sum == parts.sum && i == index => deflated.extend_from_slice(body),
            _ => return Ok(None),
        }
    }
    Ok((checksum(&deflated) == parts.sum).then_some(deflated))
}

/// A head: [`MAGIC`], then the checkpoint's and the previous one's sum (u64), count (u32, 0 for
/// none) and slot (u8), little-endian.
fn write_head(parts: Parts, previous: Option<Parts>) -> Bytes {
    let mut head = BytesMut::with_capacity(4 + 2 * 13);
    head.put_slice(&MAGIC);
    for p in [Some(parts), previous] {
        let p = p.unwrap_or(Parts {
            sum: 0,
            count: 0,
            slot: 0,
        });
        head.put_u64_le(p.sum);
        head.put_u32_le(p.count);
        head.put_u8(p.slot);
    }
    head.freeze()
}

/// The parts a head names and its previous checkpoint's, if it is a head of this version.
fn read_head(mut head: &[u8]) -> Option<(Option<Parts>, Option<Parts>)> {
    if head.len() != 4 + 2 * 13 || head[..4] != MAGIC {
        return None;
    }
    head = &head[4..];
    let mut named = [None, None];
    for slot in &mut named {
        let parts = Parts {
            sum: head.get_u64_le(),
            count: head.get_u32_le(),
            slot: head.get_u8(),
        };
        *slot = (parts.count > 0 && parts.slot < 2).then_some(parts);
    }
    Some((named[0], named[1]))
}

/// A data part's checksum, index and body, if it is framed.
fn read_data(mut part: &[u8]) -> Option<(u64, u32, &[u8])> {
    if part.len() < FRAME || part[..4] != MAGIC {
        return None;
    }
    part = &part[4..];
    let (sum, index) = (part.get_u64_le(), part.get_u32_le());
    Some((sum, index, part))
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

    /// A store of parts, with the order parts were saved in.
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

    /// The head in the store.
    fn head(store: &Store) -> (Option<Parts>, Option<Parts>) {
        read_head(&store.parts.lock().unwrap()[&0]).unwrap()
    }

    /// What the head names, latest first, whole or torn (`None`).
    async fn load(store: &Store) -> [Option<Vec<u8>>; 2] {
        let (latest, previous) = head(store);
        let mut found = [None, None];
        for (f, parts) in found.iter_mut().zip([latest, previous]) {
            if let Some(parts) = parts {
                *f = load_parts(store, "g", parts).await.unwrap();
            }
        }
        found
    }

    #[tokio::test]
    async fn a_checkpoint_is_saved_in_parts_the_head_last_each_save_in_the_other_slot() {
        let store = Store::default();
        let first = noise(4_500, 1);
        assert_eq!(
            save_parts(&store, "g", &first, 1000, None).await.unwrap().count,
            5
        );
        assert_eq!(
            *store.saves.lock().unwrap(),
            [1, 3, 5, 7, 9, 0],
            "slot 0, the head last"
        );
        assert_eq!(load(&store).await, [Some(first.clone()), None]);
        let second = noise(1_500, 2);
        let replaced = head(&store).0;
        assert_eq!(
            save_parts(&store, "g", &second, 1000, replaced)
                .await
                .unwrap()
                .count,
            2
        );
        assert_eq!(store.saves.lock().unwrap()[6..], [2, 4, 0], "slot 1");
        assert_eq!(
            load(&store).await,
            [Some(second), Some(first)],
            "the one before kept"
        );
        let empty = Vec::new();
        let replaced = head(&store).0;
        assert_eq!(
            save_parts(&store, "g", &empty, 1000, replaced)
                .await
                .unwrap()
                .count,
            1
        );
        assert_eq!(load(&store).await[0], Some(empty));
    }

    #[tokio::test]
    async fn a_save_that_failed_half_way_leaves_the_checkpoint_it_replaced_whole() {
        let store = Store::default();
        let first = noise(2_500, 1);
        save_parts(&store, "g", &first, 1000, None).await.unwrap();
        let loaded = head(&store).0;
        // Another save's data parts land, its head does not.
        let head_before = store.parts.lock().unwrap()[&0].clone();
        save_parts(&store, "g", &noise(2_500, 2), 1000, loaded)
            .await
            .unwrap();
        store.parts.lock().unwrap().insert(0, head_before);
        let found = load_deflated(&store, "g").await.unwrap().map(|(d, _)| d);
        assert_eq!(found, Some(first));
    }

    #[tokio::test]
    async fn members_saving_at_once_fall_back_on_the_checkpoint_before() {
        let store = Store::default();
        let first = noise(2_500, 1);
        save_parts(&store, "g", &first, 1000, None).await.unwrap();
        let loaded = head(&store).0;
        // Two members read the same head and save at once: one's data parts, the other's data
        // parts over them, then the first one's head last.
        let (a, b) = (noise(2_500, 2), noise(2_500, 3));
        save_parts(&store, "g", &a, 1000, loaded).await.unwrap();
        let a_head = store.parts.lock().unwrap()[&0].clone();
        save_parts(&store, "g", &b, 1000, loaded).await.unwrap();
        store.parts.lock().unwrap().insert(0, a_head);
        assert_eq!(
            load(&store).await,
            [None, Some(first.clone())],
            "torn, the one before whole"
        );
        assert_eq!(
            load_deflated(&store, "g").await.unwrap().map(|(d, _)| d),
            Some(first)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_checkpoint_torn_with_the_one_before_is_loaded_again_then_ignored() {
        let store = Store::default();
        save_parts(&store, "g", &noise(2_500, 1), 1000, None)
            .await
            .unwrap();
        let loaded = head(&store).0;
        save_parts(&store, "g", &noise(2_500, 2), 1000, loaded)
            .await
            .unwrap();
        store.parts.lock().unwrap().retain(|part, _| *part == 0);
        let started = tokio::time::Instant::now();
        assert_eq!(load_deflated(&store, "g").await.unwrap().map(|(d, _)| d), None);
        assert_eq!(started.elapsed(), TORN_PAUSE * 3, "two more loads, with pauses");
    }

    #[tokio::test]
    async fn a_checkpoint_of_an_older_version_is_ignored() {
        let store = Store::default();
        // Version 2: deflated JSON in one value.
        let json = br#"{"version":2,"group":"g","mark":"0:1","keys":{"keys":[],"ended":[]}}"#;
        let mut old = DeflateEncoder::new(Vec::new(), Compression::new(DEFLATE_LEVEL));
        std::io::Write::write_all(&mut old, json).unwrap();
        let old = old.finish().unwrap();
        store.parts.lock().unwrap().insert(0, Bytes::from(old));
        assert_eq!(load_deflated(&store, "g").await.unwrap().map(|(d, _)| d), None);
    }

    #[tokio::test]
    async fn a_checkpoint_that_does_not_inflate_is_ignored() {
        let store = Store::default();
        save_parts(&store, "g", b"not deflated at all", 1000, None)
            .await
            .unwrap();
        let loaded = Checkpoint::load(&store, "g").await.unwrap();
        assert!(loaded.checkpoint.is_none(), "read from the start");
        assert!(loaded.head.is_some(), "the next save goes to the other slot");
    }

    #[test]
    fn the_checksum_is_fnv_1a() {
        // The published test vectors: stable across builds is the point.
        assert_eq!(checksum(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(checksum(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(checksum(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
