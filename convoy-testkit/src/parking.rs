//! The conformance case of parked keys: a key whose message is dead-lettered waits — its
//! later messages set aside, across a restart — until it is replayed, then handles everything
//! in its original order; other keys never wait.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use convoy_core::parking::{replay_key, ParkedKeys, CHECKPOINT_PART_BYTES, DL_PARK_ID};
use convoy_core::{
    DeadLetter, DeadLetterCause, DeadLetterReason, Delivery, EngineHandle, Handler, HandlerError, Headers,
    Message, OutgoingMessage, Publisher, SourceId, TransportError,
};

use crate::conformance::{self, test_config, ConformanceTarget, TestBed};
use crate::probe::{decode_seq, probe_key};

/// Upper bound for any wait; a healthy run takes a small fraction of it.
const LIMIT: Duration = Duration::from_secs(60);

/// Records what it handled, per key in order; fails one message terminally while broken.
struct Ledger {
    handled: Mutex<HashMap<Bytes, Vec<u64>>>,
    broken: AtomicBool,
    poison: (Bytes, u64),
}

impl Ledger {
    fn of(&self, key: &Bytes) -> Vec<u64> {
        let handled = self.handled.lock().unwrap_or_else(|p| p.into_inner());
        handled.get(key).cloned().unwrap_or_default()
    }
}

#[async_trait::async_trait]
impl Handler for Ledger {
    async fn handle(&self, delivery: Delivery) -> Result<(), HandlerError> {
        let key = delivery.key().cloned().unwrap_or_default();
        let seq = decode_seq(delivery.payload())
            .ok_or_else(|| HandlerError::malformed("payload is not a probe sequence number"))?;
        if self.broken.load(Ordering::SeqCst) && (key.clone(), seq) == self.poison {
            return Err(HandlerError::terminal("injected: the account is overdrawn"));
        }
        let mut handled = self.handled.lock().unwrap_or_else(|p| p.into_inner());
        handled.entry(key).or_default().push(seq);
        Ok(())
    }
}

async fn publish(publisher: &dyn Publisher, key: &Bytes, seqs: std::ops::Range<u64>) {
    for seq in seqs {
        if let Err(e) = publisher
            .publish(OutgoingMessage::new(key.clone(), seq.to_string()))
            .await
        {
            panic!("publishing failed: {e}");
        }
    }
}

/// Waits until `done` holds, failing with `what` after [`LIMIT`].
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    until_read(what, || std::future::ready(done())).await;
}

/// [`until`], for a condition that reads the broker.
async fn until_read<F: std::future::Future<Output = bool>>(what: &str, mut done: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {LIMIT:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn parked_keys(bed: &dyn TestBed) -> ParkedKeys {
    match ParkedKeys::read_back(bed.group(), &*bed.dead_letter_sink()).await {
        Ok(keys) => keys,
        Err(e) => panic!("reading the dead-letter destination back failed: {e}"),
    }
}

fn start(
    bed: &dyn TestBed,
    ledger: &Arc<Ledger>,
    subscription: convoy_core::transport::Subscription,
) -> EngineHandle {
    let mut config = test_config(bed.group());
    config.park_keys = true;
    conformance::start(bed.dead_letter_sink(), ledger.clone(), config, subscription)
}

/// Key `k0`'s third message fails terminally: its later messages are set aside (also by a new
/// engine after a restart, which reads the parking back from the dead-letter destination)
/// while `k1`..`k3` are handled whole. After the fix, a replay re-publishes `k0`'s failed and
/// set-aside messages; they are handled in order and the key is unparked: its next message is
/// handled at once.
pub async fn parked_key_waits_for_its_replay(target: &dyn ConformanceTarget) {
    let bed = conformance::bed(target, 2).await;
    let publisher = bed.publisher();
    let keys: Vec<Bytes> = (0..4).map(|i| probe_key("k", i)).collect();
    let parked = keys[0].clone();
    let ledger = Arc::new(Ledger {
        handled: Mutex::default(),
        broken: AtomicBool::new(true),
        poison: (parked.clone(), 2),
    });
    for key in &keys {
        publish(publisher.as_ref(), key, 0..10).await;
    }
    let first = start(bed.as_ref(), &ledger, conformance::subscribe(bed.as_ref()).await);
    until("k1..k3 handled, k0 dead-lettered at 2 and 7 set aside", || {
        let stats = first.stats();
        keys[1..].iter().all(|k| ledger.of(k).len() == 10) && stats.dead_lettered == 1 && stats.parked == 7
    })
    .await;
    assert_eq!(ledger.of(&parked), [0, 1], "nothing after the dead letter");
    for key in &keys[1..] {
        assert_eq!(
            ledger.of(key),
            (0..10).collect::<Vec<_>>(),
            "other keys never wait"
        );
    }
    conformance::stop(first).await;

    // A restart: the parking is read back from the destination, not remembered.
    publish(publisher.as_ref(), &parked, 10..12).await;
    publish(publisher.as_ref(), &keys[1], 10..11).await;
    let second = start(bed.as_ref(), &ledger, conformance::subscribe(bed.as_ref()).await);
    until("k0's new messages set aside after the restart", || {
        second.stats().parked == 2 && ledger.of(&keys[1]).len() == 11
    })
    .await;
    assert_eq!(ledger.of(&parked), [0, 1]);
    let keys_now = parked_keys(bed.as_ref()).await;
    assert_eq!(keys_now.len(), 1, "only k0 is parked");
    assert_eq!(
        keys_now.get(&parked).map(|p| p.pending()),
        Some(10),
        "the failed one and 9 set aside"
    );

    // The fix, then the replay.
    ledger.broken.store(false, Ordering::SeqCst);
    let publisher_for = |_: &str| Ok::<_, TransportError>(publisher.clone());
    let replay = match replay_key(bed.group(), &parked, &*bed.dead_letter_sink(), &publisher_for).await {
        Ok(r) => r,
        Err(e) => panic!("the replay failed: {e}"),
    };
    let replayed: Vec<u64> = replay
        .records
        .iter()
        .filter_map(|r| decode_seq(&r.payload))
        .collect();
    assert_eq!(
        replayed,
        (2..12).collect::<Vec<_>>(),
        "re-published in the key's order"
    );
    until("k0's replay handled", || ledger.of(&parked).len() == 12).await;
    assert_eq!(
        ledger.of(&parked),
        (0..12).collect::<Vec<_>>(),
        "k0 in its original order"
    );

    // Unparked: the next message is handled, not set aside.
    publish(publisher.as_ref(), &parked, 12..13).await;
    until("k0 handled after its replay", || ledger.of(&parked).len() == 13).await;
    assert_eq!(second.stats().parked, 2, "nothing set aside after the replay");
    conformance::stop(second).await;
    assert!(
        parked_keys(bed.as_ref()).await.is_empty(),
        "nothing parked any more"
    );
}

/// A replay of one message ends though its partition is quiet and the message's offset does
/// not follow the last one's (NATS: the partitions share one stream's sequence; Kafka: a
/// transaction's marker; the memory broker: offset gaps): the replay's end waits for the commit
/// below its last message, and no new commit comes when nothing else is finished. Key `p`'s
/// only message fails; other keys are published until one lands on another source, so that
/// the replay's copy comes after a hole in `p`'s source where sources share a sequence.
pub async fn a_replay_of_one_message_ends_on_a_quiet_source(target: &dyn ConformanceTarget) {
    let bed = conformance::bed(target, 2).await;
    let publisher = bed.publisher();
    let parked = probe_key("p", 0);
    let ledger = Arc::new(Ledger {
        handled: Mutex::default(),
        broken: AtomicBool::new(true),
        poison: (parked.clone(), 0),
    });
    let first = match publisher.publish(OutgoingMessage::new(parked.clone(), "0")).await {
        Ok(receipt) => receipt,
        Err(e) => panic!("publishing failed: {e}"),
    };
    // The last receipt of each source: what its commit must reach before the replay.
    let mut last: HashMap<SourceId, u64> = HashMap::from([(first.source.clone(), first.offset)]);
    let mut others = Vec::new();
    for i in 0..64 {
        let key = probe_key("q", i);
        let receipt = match publisher.publish(OutgoingMessage::new(key.clone(), "0")).await {
            Ok(receipt) => receipt,
            Err(e) => panic!("publishing failed: {e}"),
        };
        others.push(key);
        last.insert(receipt.source.clone(), receipt.offset);
        if receipt.source != first.source {
            break;
        }
    }
    let engine = start(bed.as_ref(), &ledger, conformance::subscribe(bed.as_ref()).await);
    until("p dead-lettered and every other key handled", || {
        engine.stats().dead_lettered == 1 && others.iter().all(|key| ledger.of(key) == [0])
    })
    .await;
    assert!(
        parked_keys(bed.as_ref()).await.get(&parked).is_some(),
        "p is parked"
    );
    // Quiet: everything committed before the replay's copy arrives (where commits are log
    // positions), so the only commit that could cover the copy would have to start after it.
    if target.capabilities().positions == conformance::Positions::Log {
        until_read("everything published committed", || async {
            let committed = conformance::committed(bed.as_ref()).await;
            last.iter()
                .all(|(source, offset)| committed.get(source).is_some_and(|c| c >= offset))
        })
        .await;
    }

    ledger.broken.store(false, Ordering::SeqCst);
    let publisher_for = |_: &str| Ok::<_, TransportError>(publisher.clone());
    if let Err(e) = replay_key(bed.group(), &parked, &*bed.dead_letter_sink(), &publisher_for).await {
        panic!("the replay failed: {e}");
    }
    until("p's replay handled", || ledger.of(&parked) == [0]).await;
    until_read(
        "p's only message was replayed and handled, but its replay never ended: the key stays parked",
        || async { parked_keys(bed.as_ref()).await.is_empty() },
    )
    .await;
    // Unparked in the engine's view too: p's next message is handled, not set aside.
    if let Err(e) = publisher.publish(OutgoingMessage::new(parked.clone(), "1")).await {
        panic!("publishing failed: {e}");
    }
    until("p's next message handled", || ledger.of(&parked) == [0, 1]).await;
    assert_eq!(engine.stats().parked, 0, "nothing was set aside");
    conformance::stop(engine).await;
}

/// A dead letter of `key` for `group` that parks its key (`failed`), or a message set aside
/// behind it, known by `id`.
pub(crate) fn parking_record(group: &str, key: &str, id: &str, failed: bool) -> DeadLetter {
    let cause = match failed {
        true => DeadLetterCause::Terminal,
        false => DeadLetterCause::Parked,
    };
    dead_letter(
        group,
        key,
        id,
        cause,
        failed,
        Bytes::from(format!("payload of {id}")),
    )
}

/// A dead letter of `key`'s message known by `id`, of `group`, with `cause` (and parking its
/// key if `parks`), as the engine writes one.
pub(crate) fn dead_letter(
    group: &str,
    key: &str,
    id: &str,
    cause: DeadLetterCause,
    parks: bool,
    payload: Bytes,
) -> DeadLetter {
    let mut headers = Headers::new();
    headers.insert(DL_PARK_ID, id.to_owned());
    let now = SystemTime::now();
    DeadLetter {
        message: Message {
            key: Some(Bytes::from(key.to_owned())),
            payload,
            headers,
            source: SourceId::partition("ledger", 0),
            offset: 0,
        },
        reason: DeadLetterReason {
            cause,
            error_class: "terminal".into(),
            error: "cannot apply the entry".into(),
            attempts: 1,
            first_failure: now,
            last_failure: now,
            group: group.to_owned(),
            parks_key: parks,
        },
    }
}

/// Each parked key and how many of its messages wait, in key order.
fn waiting(keys: &ParkedKeys) -> Vec<(String, usize)> {
    keys.iter()
        .map(|(k, p)| (String::from_utf8_lossy(k).into_owned(), p.pending()))
        .collect()
}

/// An engine's read-back reads its group's checkpoint and only what the dead-letter
/// destination got after it (records of another group among them), and knows what a whole
/// read knows: the transport's marks and checkpoint store, end to end.
pub async fn parked_keys_read_back_from_a_checkpoint(target: &dyn ConformanceTarget) {
    let bed = conformance::bed(target, 1).await;
    let (sink, group) = (bed.dead_letter_sink(), bed.group().to_owned());
    let other = format!("{group}-other");
    for record in [
        parking_record(&group, "ck-0", "ledger/0@1", true),
        parking_record(&group, "ck-0", "ledger/0@2", false),
        parking_record(&other, "ck-9", "ledger/0@3", true),
    ] {
        sink.publish(&record).await.expect("dead letter published");
    }
    let first = ParkedKeys::catch_up(&group, &*sink, 1)
        .await
        .expect("first read-back");
    assert!(!first.from_checkpoint, "no checkpoint yet");
    assert_eq!(first.read, 3, "the whole destination, read once");
    assert!(first.saved, "a checkpoint saved after reading past the threshold");

    for record in [
        parking_record(&group, "ck-0", "ledger/0@4", false),
        parking_record(&other, "ck-9", "ledger/0@5", false),
        parking_record(&group, "ck-1", "ledger/0@6", true),
    ] {
        sink.publish(&record).await.expect("dead letter published");
    }
    let second = ParkedKeys::catch_up(&group, &*sink, usize::MAX)
        .await
        .expect("second read-back");
    assert!(second.from_checkpoint, "read from the checkpoint");
    assert_eq!(second.read, 3, "only what came after the checkpoint");
    assert_eq!(
        waiting(&second.keys),
        [("ck-0".to_owned(), 3), ("ck-1".to_owned(), 1)]
    );
    assert_eq!(
        waiting(&second.keys),
        waiting(&parked_keys(bed.as_ref()).await),
        "what a whole read knows"
    );
}

/// The checkpoint store keeps each part of a group's checkpoint apart, at the full size a part
/// may have ([`CHECKPOINT_PART_BYTES`] and its frame), each replacing the last saved under its
/// number: what a checkpoint in parts rests on (a hot key parked for hours outgrows one value).
pub async fn checkpoint_parts_are_kept_apart_at_full_size(target: &dyn ConformanceTarget) {
    let bed = conformance::bed(target, 1).await;
    let (sink, group) = (bed.dead_letter_sink(), bed.group().to_owned());
    let other = format!("{group}-other");
    let mut rng = fastrand::Rng::with_seed(38);
    // Incompressible, as a deflated checkpoint is.
    let mut noise = |len: usize| Bytes::from((0..len).map(|_| rng.u8(..)).collect::<Vec<u8>>());
    let full = CHECKPOINT_PART_BYTES + 16;
    let parts: Vec<Bytes> = (0..3).map(|_| noise(full)).collect();
    for (part, bytes) in parts.iter().enumerate().rev() {
        sink.save_checkpoint(&group, part as u32, bytes.clone())
            .await
            .expect("a part saved");
    }
    let others = noise(100);
    sink.save_checkpoint(&other, 0, others.clone())
        .await
        .expect("another group's checkpoint saved");
    for (part, bytes) in parts.iter().enumerate() {
        let loaded = sink
            .load_checkpoint(&group, part as u32)
            .await
            .expect("a part loaded");
        assert!(loaded.as_ref() == Some(bytes), "part {part} as saved");
    }
    assert_eq!(
        sink.load_checkpoint(&group, 3).await.expect("a part loaded"),
        None,
        "no part never saved"
    );
    let newer = noise(full);
    sink.save_checkpoint(&group, 1, newer.clone())
        .await
        .expect("a part saved again");
    let loaded = sink.load_checkpoint(&group, 1).await.expect("a part loaded");
    assert!(loaded == Some(newer), "the latest save of a part");
    let loaded = sink.load_checkpoint(&group, 0).await.expect("a part loaded");
    assert!(loaded.as_ref() == Some(&parts[0]), "the other parts untouched");
    assert_eq!(
        sink.load_checkpoint(&other, 0).await.expect("a part loaded"),
        Some(others),
        "each group's own"
    );
}
