//! A dead-letter destination deleted while the engine runs (an operator's clean-up, a reset):
//! the sink declares it again, so the next poison message is dead-lettered there instead of
//! failing forever and blocking its lane. For every broker whose destination can be deleted.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::conformance::{test_config, TestBed};
use crate::probe::{decode_seq, probe_key, publish_probe, FaultPlan, ProbeHandler, RecordingSink};
use crate::OrderChecker;
use convoy_core::Engine;

const LIMIT: Duration = Duration::from_secs(60);

/// A poison message is dead-lettered; `delete` removes the destination; a second poison message
/// and a healthy one behind it on the same key are published: the second is dead-lettered into
/// the destination declared again, and the healthy one is handled after it.
pub async fn a_deleted_dead_letter_destination_is_declared_again<F: Future<Output = ()>>(
    bed: &dyn TestBed,
    delete: impl FnOnce() -> F,
) {
    let key: Bytes = probe_key("poison-", 0);
    let checker = Arc::new(OrderChecker::new());
    let mut plan = FaultPlan::default();
    // Probe sequence numbers of the key start at 0: the first and second are poison.
    plan.terminal_on.insert((key.clone(), 0));
    plan.terminal_on.insert((key.clone(), 1));
    let engine = Engine::builder(ProbeHandler::with_faults(checker.clone(), plan))
        .config(test_config(bed.group()))
        .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
        .build()
        .unwrap_or_else(|e| panic!("engine config: {e}"))
        .spawn(bed.subscribe().await.unwrap_or_else(|e| panic!("subscribe: {e}")));
    let publisher = bed.publisher();
    publish_probe(publisher.as_ref(), &checker, key.clone())
        .await
        .unwrap_or_else(|e| panic!("publish: {e}"));
    assert!(
        checker.wait_complete(LIMIT).await,
        "the first poison message: {:?}",
        checker.report()
    );
    let first = bed
        .dead_letters(1)
        .await
        .unwrap_or_else(|e| panic!("reading dead letters: {e}"));
    assert_eq!(first.len(), 1);

    delete().await;
    for _ in 0..2 {
        publish_probe(publisher.as_ref(), &checker, key.clone())
            .await
            .unwrap_or_else(|e| panic!("publish: {e}"));
    }
    assert!(
        checker.wait_complete(LIMIT).await,
        "after the destination was deleted, the lane never got past the second poison message: {:?}; engine {:?}",
        checker.report(),
        engine.stats()
    );
    let again = bed
        .dead_letters(1)
        .await
        .unwrap_or_else(|e| panic!("reading dead letters: {e}"));
    let seqs: Vec<Option<u64>> = again.iter().map(|m| decode_seq(&m.payload)).collect();
    assert_eq!(
        seqs,
        [Some(1)],
        "only the second poison message is in the new destination"
    );
    let report = engine.stop().await.unwrap_or_else(|e| panic!("stop: {e}"));
    assert_eq!(report.stats.dead_lettered, 2);
    let checked = checker.report();
    assert!(checked.is_clean(), "{checked:#?}");
    assert_eq!(checked.finished, 3);
}

/// A group's checkpoint of its parked keys is void once `delete` removed the destination it
/// was taken of: the read-back after the destination was declared again starts from its start
/// and knows only the new records (a stale mark would skip them; a stale fold would keep keys
/// whose records are gone).
pub async fn a_checkpoint_of_a_deleted_destination_is_void<F: Future<Output = ()>>(
    bed: &dyn TestBed,
    delete: impl FnOnce() -> F,
) {
    use convoy_core::parking::ParkedKeys;

    let (sink, group) = (bed.dead_letter_sink(), bed.group().to_owned());
    let publish = |key: &'static str, id: &'static str, parks: bool| {
        let sink = sink.clone();
        let record = crate::parking::parking_record(&group, key, id, parks);
        async move {
            // The first publish after a deletion may fail: the sink declares the destination
            // again before it answers, and the engine would retry.
            for attempt in 0.. {
                match sink.publish(&record).await {
                    Ok(()) => return,
                    Err(e) if attempt < 5 => {
                        tracing::info!(error = %e, "publishing a dead letter again");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => panic!("publishing a dead letter: {e}"),
                }
            }
        }
    };
    publish("ck-0", "ledger/0@1", true).await;
    publish("ck-0", "ledger/0@2", false).await;
    publish("ck-0", "ledger/0@3", false).await;
    let first = ParkedKeys::catch_up(&group, &*sink, 1)
        .await
        .unwrap_or_else(|e| panic!("read-back: {e}"));
    assert!(first.saved && first.keys.len() == 1, "{first:?}");

    delete().await;
    publish("ck-5", "ledger/0@9", true).await;
    let after = ParkedKeys::catch_up(&group, &*sink, usize::MAX)
        .await
        .unwrap_or_else(|e| panic!("read-back: {e}"));
    assert!(
        !after.from_checkpoint,
        "the checkpoint of the deleted destination is void"
    );
    let parked: Vec<(String, usize)> = after
        .keys
        .iter()
        .map(|(k, p)| (String::from_utf8_lossy(k).into_owned(), p.pending()))
        .collect();
    assert_eq!(
        parked,
        [("ck-5".to_owned(), 1)],
        "only what the new destination holds"
    );
}
