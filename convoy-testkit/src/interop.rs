//! Messages another language's client produced, consumed by convoy: every message once, in
//! per-key order, and every key read from the partition convoy's own partitioner names for it —
//! the proof that a producer outside convoy and convoy agree on placement.
//!
//! The producer scripts (`scripts/interop/`) write `keys × per_key` messages, keys
//! [`key`]`(0..keys)`, payloads the probe encoding of 0, 1, … per key.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use convoy_core::partitioner::partition_for_key;
use convoy_core::{handler_fn, Delivery, HandlerError, SourceId};

use crate::conformance::{assert_clean, start, stop, subscribe, test_config, wait_complete, TestBed};
use crate::probe::decode_seq;
use crate::OrderChecker;

/// The key of the `k`-th key a producer script writes.
pub fn key(k: usize) -> Bytes {
    Bytes::from(format!("py-{k}"))
}

/// Runs `python script args…` and returns its standard output; panics with its standard error
/// if it failed.
pub async fn run_producer(python: &str, script: &str, args: &[&str]) -> String {
    let output = match tokio::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .await
    {
        Ok(output) => output,
        Err(e) => panic!("could not run {python} {script}: {e}"),
    };
    assert!(
        output.status.success(),
        "the producer {script} failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Asserts that every `key=partition` pair a producer printed (whitespace-separated) is the
/// partition convoy's partitioner picks for the key among `partitions`.
pub fn assert_printed_placements(stdout: &str, partitions: u32) {
    for pair in stdout.split_whitespace() {
        let placed = pair
            .split_once('=')
            .and_then(|(key, p)| Some((key, p.parse::<u32>().ok()?)));
        let Some((key, p)) = placed else {
            panic!("the producer printed {pair:?}, not key=partition");
        };
        assert_eq!(partition_for_key(key.as_bytes(), partitions), p, "{key}");
    }
}

/// Consumes the `keys × per_key` messages a producer script wrote to `bed` with a fresh engine
/// and asserts that each was handled once, in per-key order, from the source (`topic/p`) whose
/// partition convoy's partitioner picks for its key among `partitions`.
pub async fn consume_in_order(bed: &dyn TestBed, keys: usize, per_key: usize, partitions: u32) {
    let checker = Arc::new(OrderChecker::new());
    for _ in 0..per_key {
        for k in 0..keys {
            checker.expect(&key(k));
        }
    }
    let misplaced: Arc<Mutex<Vec<(Bytes, SourceId)>>> = Arc::default();
    let (c, m) = (checker.clone(), misplaced.clone());
    let handler = handler_fn(move |d: Delivery| {
        let (c, m) = (c.clone(), m.clone());
        async move {
            let key = d.key().cloned().unwrap_or_default();
            let read_from = d.source().topic_partition().map(|(_, p)| p);
            if read_from != Some(partition_for_key(&key, partitions)) {
                m.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((key.clone(), d.source().clone()));
            }
            let _inside = c.enter(&key);
            c.handled(&key, decode_seq(d.payload()).unwrap_or(u64::MAX), None);
            Ok::<(), HandlerError>(())
        }
    });
    let engine = start(
        bed.dead_letter_sink(),
        handler,
        test_config(bed.group()),
        subscribe(bed).await,
    );
    wait_complete(&checker, "messages of another client").await;
    stop(engine).await;
    let report = checker.report();
    assert_clean(&report, "messages of another client");
    assert_eq!(report.finished, (keys * per_key) as u64, "{report:#?}");
    let misplaced = misplaced.lock().unwrap_or_else(PoisonError::into_inner);
    assert!(
        misplaced.is_empty(),
        "keys read from another partition than convoy's partitioner picks: {misplaced:?}"
    );
}
