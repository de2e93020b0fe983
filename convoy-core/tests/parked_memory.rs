//! What a hot parked key costs an engine in memory (issue 38, RELIABILITY.md finding 5): the
//! bytes an engine's read-back holds for one key with 100,000 waiting records (counted by the
//! allocator, in a test binary of its own: no other test allocates meanwhile), and the process's
//! peak resident memory while it reads back from a checkpoint and saves the next one.
#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::alloc::System;
use std::collections::BTreeMap;
use std::sync::Mutex;

use bytes::Bytes;
use convoy_core::dead_letter::{ReadBack, ReadMark};
use convoy_core::header_names::{DL_CAUSE, DL_GROUP, DL_OFFSET, DL_PARKS, DL_PARK_ID, DL_SOURCE};
use convoy_core::parking::ParkedKeys;
use convoy_core::transport::TransportError;
use convoy_core::{DeadLetter, DeadLetterSink, Headers, Message, SourceId};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The process's resident and peak resident memory (`VmRSS`, `VmHWM`), in bytes.
fn resident() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb * 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// A dead-letter destination of one partition, read from marks, with a checkpoint store.
#[derive(Default)]
struct Destination {
    records: Mutex<Vec<Message>>,
    parts: Mutex<BTreeMap<u32, Bytes>>,
}

#[async_trait::async_trait]
impl DeadLetterSink for Destination {
    async fn publish(&self, _: &DeadLetter) -> Result<(), TransportError> {
        Ok(())
    }

    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        let from = mark
            .and_then(ReadMark::next_offsets)
            .and_then(|m| m.get(&0).copied())
            .unwrap_or(0);
        let all = self.records.lock().unwrap();
        Ok(ReadBack {
            records: all[from as usize..].to_vec(),
            mark: Some(ReadMark::of_next_offsets(&BTreeMap::from([(
                0,
                all.len() as u64,
            )]))),
            restarted: false,
        })
    }

    async fn load_checkpoint(&self, _: &str, part: u32) -> Result<Option<Bytes>, TransportError> {
        Ok(self.parts.lock().unwrap().get(&part).cloned())
    }

    async fn save_checkpoint(&self, _: &str, part: u32, checkpoint: Bytes) -> Result<(), TransportError> {
        self.parts.lock().unwrap().insert(part, checkpoint);
        Ok(())
    }
}

const RECORDS: u64 = 100_000;

/// One key parked, then `RECORDS` of its messages set aside, as the soak writes them: convoy's
/// 128-bit event ids, from 64 partitions of a topic.
fn hot_key(destination: &Destination) {
    let dlq = SourceId::new("soak-24102-18ef0416ba04cd40-0.dlq/0");
    let mut records = destination.records.lock().unwrap();
    for n in 0..RECORDS {
        let mut headers = Headers::new();
        headers.insert(DL_GROUP, "soak");
        headers.insert(DL_CAUSE, if n == 0 { "terminal" } else { "parked" });
        headers.insert(DL_PARKS, "key");
        headers.insert(
            DL_PARK_ID,
            format!("{:032x}", u128::from(n) * 0x9e37_79b9_7f4a_7c15),
        );
        headers.insert(DL_SOURCE, format!("soak-24102-18ef0416ba04cd40-0/{}", n % 64));
        headers.insert(DL_OFFSET, (n / 64).to_string());
        records.push(Message {
            key: Some(Bytes::from_static(b"key-0")),
            payload: Bytes::new(),
            headers,
            source: dlq.clone(),
            offset: n,
        });
    }
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

#[tokio::test(flavor = "current_thread")]
async fn a_hot_parked_key_costs_an_engine_its_records() {
    let destination = Destination::default();
    hot_key(&destination);
    // The first read-back saves a checkpoint.
    let first = ParkedKeys::catch_up("soak", &destination, 1).await.unwrap();
    assert!(first.saved);
    drop(first);

    // An assignment's read-back: from the checkpoint, saving the next one (what an engine does
    // every `park_checkpoint_after` records it writes).
    let (rss_before, _) = resident();
    let region = Region::new(GLOBAL);
    let read = ParkedKeys::catch_up("soak", &destination, 0).await.unwrap();
    let change = region.change();
    let (rss_after, peak) = resident();
    assert!(read.from_checkpoint && read.saved && read.read == 0);
    assert_eq!(read.keys.get(b"key-0").unwrap().pending(), RECORDS as usize);
    let held = change.bytes_allocated as f64 - change.bytes_deallocated as f64;
    let per_record = held / RECORDS as f64;
    let checkpoint = convoy_core::parking::checkpoint_bytes("soak", &destination)
        .await
        .unwrap();
    println!(
        "{RECORDS} waiting records: {:.1} MiB held ({per_record:.0} bytes a record, {:.1} allocations), {:.1} MiB allocated during the read-back; RSS {:.1} -> {:.1} MiB, peak {:.1}; checkpoint {:.2} MiB ({:.1} bytes a record)",
        mib(held),
        (change.allocations as f64 - change.deallocations as f64) / RECORDS as f64,
        mib(change.bytes_allocated as f64),
        mib(rss_before),
        mib(rss_after),
        mib(peak),
        mib(checkpoint as f64),
        checkpoint as f64 / RECORDS as f64,
    );
    // 258 bytes a record, one allocation (its id): the names are shared (422 and five before).
    assert!(per_record < 300.0, "{per_record:.0} bytes a waiting record");
    // 57.9 MiB (126.8 when the checkpoint's JSON was written and read whole, not streamed).
    let allocated = change.bytes_allocated as f64;
    assert!(allocated < 4.0 * held, "{:.1} MiB allocated", mib(allocated));
}
