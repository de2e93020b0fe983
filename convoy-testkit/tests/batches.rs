//! Batch handlers on the memory transport with a paused clock: a key's run retried from its
//! first failure, and a stuck batch call. Time is virtual (`start_paused`), so the calls are
//! asserted exactly and no test waits on the wall clock.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::dead_letter::DL_CAUSE;
use convoy_core::{BatchConfig, BatchHandler, BatchResults, Delivery, Engine, HandlerError};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::{MemoryBed, MemoryTarget};
use convoy_testkit::probe::{decode_seq, publish_load, RecordingSink};
use convoy_testkit::OrderChecker;

const LIMIT: Duration = Duration::from_secs(3600);

/// Handles each key's messages of a batch in order, stopping at the key's first failure;
/// `fails(seq, attempt)` says which fail transiently, `hangs(seq)` which make the whole call
/// hang. Records every call as (seq, attempt) pairs.
struct Scripted {
    checker: Arc<OrderChecker>,
    calls: Mutex<Vec<Vec<(u64, u32)>>>,
    fails: fn(u64, u32) -> bool,
    hangs: fn(u64) -> bool,
}

#[async_trait]
impl BatchHandler for Scripted {
    async fn handle_batch(&self, batch: Vec<Delivery>) -> Result<BatchResults, HandlerError> {
        let seqs: Vec<(u64, u32)> = batch
            .iter()
            .map(|d| (decode_seq(d.payload()).unwrap(), d.attempt()))
            .collect();
        self.calls.lock().unwrap().push(seqs.clone());
        if seqs.iter().any(|&(seq, _)| (self.hangs)(seq)) {
            std::future::pending::<()>().await;
        }
        let mut failed = false;
        let mut results = Vec::new();
        for (d, (seq, attempt)) in batch.iter().zip(seqs) {
            failed = failed || (self.fails)(seq, attempt);
            if failed {
                results.push(Err(HandlerError::transient(format!("seq {seq} not written"))));
            } else {
                self.checker.handled(d.key().unwrap(), seq, None);
                results.push(Ok(()));
            }
        }
        Ok(results)
    }
}

fn scripted(
    checker: &Arc<OrderChecker>,
    fails: fn(u64, u32) -> bool,
    hangs: fn(u64) -> bool,
) -> Arc<Scripted> {
    Arc::new(Scripted {
        checker: checker.clone(),
        calls: Mutex::new(Vec::new()),
        fails,
        hangs,
    })
}

async fn start(
    bed: &MemoryBed,
    checker: &Arc<OrderChecker>,
    handler: Arc<Scripted>,
    stuck_timeout: Option<Duration>,
) -> convoy_core::EngineHandle {
    let mut config = test_config(bed.group());
    config.stuck_timeout = stuck_timeout;
    let batch = BatchConfig::new(16, Duration::from_millis(5)).per_key(3);
    let engine = Engine::batch_builder(handler, batch)
        .unwrap()
        .config(config)
        .dead_letter_sink(Arc::new(RecordingSink::new(
            bed.dead_letter_sink(),
            checker.clone(),
        )))
        .build()
        .unwrap();
    engine.spawn(bed.subscribe().await.unwrap())
}

/// A one-partition topic with six messages (seq 0-5) of key `k0`, registered with a checker.
async fn one_key_with_six_messages() -> (MemoryTarget, MemoryBed, Arc<OrderChecker>) {
    let target = MemoryTarget::new();
    let bed = target.memory_bed(1);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 6)
        .await
        .unwrap();
    (target, bed, checker)
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_retries_the_run_from_it_and_what_came_before_is_finished() {
    let (_target, bed, checker) = one_key_with_six_messages().await;
    // seq 2 fails on its first two attempts.
    let handler = scripted(&checker, |seq, attempt| seq == 2 && attempt < 3, |_| false);
    let engine = start(&bed, &checker, handler.clone(), None).await;
    assert!(checker.wait_complete(LIMIT).await);
    let report = engine.stop().await.unwrap();
    assert!(checker.report().is_clean(), "{:?}", checker.report());
    assert_eq!(report.stats.retries, 2);
    assert_eq!(report.stats.handled, 6);
    // The head goes alone (its lane was idle); the next three are a run; 1 is finished before
    // 2 fails, 3's result is not taken, the run goes on from 2 (attempts 2 and 3); then 4 and 5.
    assert_eq!(
        *handler.calls.lock().unwrap(),
        vec![
            vec![(0, 1)],
            vec![(1, 1), (2, 1), (3, 1)],
            vec![(2, 2), (3, 1)],
            vec![(2, 3), (3, 1)],
            vec![(4, 1), (5, 1)],
        ]
    );
    let committed = report.committed.values().copied().collect::<Vec<_>>();
    assert_eq!(committed, vec![5], "the watermark covers all six");
}

#[tokio::test(start_paused = true)]
async fn a_hung_batch_call_dead_letters_its_first_unfinished_message_and_the_key_goes_on() {
    let (target, bed, checker) = one_key_with_six_messages().await;
    // Any call holding seq 2 hangs: a call cannot say which of its messages hangs, so the stuck
    // timeout takes the first unfinished one each time (1, then 2) and puts the rest back.
    let handler = scripted(&checker, |_, _| false, |seq| seq == 2);
    let engine = start(&bed, &checker, handler.clone(), Some(Duration::from_secs(2))).await;
    assert!(checker.wait_complete(LIMIT).await);
    let report = engine.stop().await.unwrap();
    assert!(checker.report().is_clean(), "{:?}", checker.report());
    let dead = target.broker().read_all(&format!("{}.dlq", bed.topic()));
    let dead_seqs: Vec<u64> = dead.iter().map(|m| decode_seq(&m.payload).unwrap()).collect();
    assert_eq!(dead_seqs, vec![1, 2]);
    assert!(dead.iter().all(|m| m.headers.get_str(DL_CAUSE) == Some("stuck")));
    assert_eq!(report.stats.handled, 4, "0, 3, 4 and 5");
    assert_eq!(
        report.committed.values().copied().collect::<Vec<_>>(),
        vec![5],
        "the watermark passed the dead-lettered messages"
    );
    let calls = handler.calls.lock().unwrap().clone();
    assert_eq!(calls.first(), Some(&vec![(0, 1)]));
    assert_eq!(calls.last(), Some(&vec![(3, 1), (4, 1), (5, 1)]));
}
