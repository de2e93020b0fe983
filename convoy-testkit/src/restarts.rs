//! A broker killed (`kill -9`) and restarted twice while an engine consumes and a producer
//! publishes: nothing is lost and no key's order is violated. A transport's test runs its own
//! private broker and says how to crash it; this module runs the load and asserts the outcome.

use std::sync::Arc;
use std::time::Duration;

use convoy_core::{DeadLetterSink, EngineHandle, OutgoingMessage, Publisher, Transport};

use crate::conformance::{stop, test_config};
use crate::probe::probe_batch;
use crate::support::start_probe_engine;
use crate::OrderChecker;

/// Keys, chunks and messages per chunk of the load.
const KEYS: usize = 20;
const CHUNKS: usize = 12;
const PER_CHUNK: usize = 200;
/// The chunks after which the broker is crashed.
const CRASH_AFTER: [usize; 2] = [3, 7];
/// How long publishing one chunk, progress before a crash, or the whole drain may take.
const LIMIT: Duration = Duration::from_secs(180);

/// Starts the engine of a restart test on `transport`: the probe handler recording into
/// `checker`, dead letters through `sink` recorded too, a 5-second drain.
pub async fn start_engine(
    transport: &dyn Transport,
    sink: Arc<dyn DeadLetterSink>,
    group: &str,
    checker: &Arc<OrderChecker>,
) -> EngineHandle {
    let mut config = test_config(group);
    config.drain_timeout = Duration::from_secs(5);
    start_probe_engine(transport, sink, config, checker).await
}

/// What the producer puts on each message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ids {
    /// A stable event id, so a chunk re-sent after an outage is recognised as duplicates.
    Stable,
    /// None: a foreign producer's messages, identified (where at all) by the broker's position.
    None,
}

/// Publishes 12 chunks of 200 probe messages over 20 keys, with `ids`. After the 4th and the 8th
/// chunk, once half of what was published is handled, calls `crash(0)` and `crash(1)` (on a
/// blocking section: they kill the broker and bring it back), and measures the time to recover:
/// from the broker's return until the next chunk, published then, was handled with everything
/// before it (printed with the outcome). Then waits for everything,
/// stops `engine` and asserts that every message was handled, in per-key order.
pub async fn publish_through_two_crashes(
    engine: EngineHandle,
    publisher: &dyn Publisher,
    ids: Ids,
    checker: &OrderChecker,
    mut crash: impl FnMut(usize),
) {
    let mut crashes = 0;
    let (mut recovered, mut back) = (Vec::new(), None::<tokio::time::Instant>);
    for chunk in 0..CHUNKS {
        let batch: Vec<OutgoingMessage> = probe_batch(checker, "key-", KEYS, chunk * PER_CHUNK, PER_CHUNK, 0)
            .into_iter()
            .map(|m| {
                if ids == Ids::None {
                    return m;
                }
                let id = format!(
                    "{}-{}",
                    String::from_utf8_lossy(m.key.as_deref().unwrap_or_default()),
                    String::from_utf8_lossy(&m.payload)
                );
                m.event_id(id)
            })
            .collect();
        publish_until_accepted(publisher, batch).await;
        if let Some(back) = back.take() {
            // The first chunk after a restart: the time to recover is until it was handled
            // (and everything before it), from the broker's return.
            let published = checker.published();
            assert!(
                checker.wait_for(LIMIT, |c| c.finished() >= published).await,
                "the chunk after crash {crashes} was not handled: {:?}",
                checker.report()
            );
            recovered.push(back.elapsed());
        }
        if CRASH_AFTER.contains(&chunk) {
            let target = checker.published() / 2;
            assert!(
                checker.wait_for(LIMIT, |c| c.finished() >= target).await,
                "no progress before crash {crashes}: {:?}",
                checker.report()
            );
            tokio::task::block_in_place(|| crash(crashes));
            back = Some(tokio::time::Instant::now());
            crashes += 1;
        }
    }
    assert!(
        checker.wait_complete(LIMIT).await,
        "not everything was handled after two broker crashes: {:?}",
        checker.report()
    );
    stop(engine).await;
    let report = checker.report();
    println!(
        "broker restarts: {crashes}, recovered {recovered:.2?} after each restart, published {}, finished {}, redelivered duplicates {}, lost {}, violations {}",
        report.published, report.finished, report.duplicates, report.lost, report.order_violations
    );
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, report.published);
}

/// Publishes `batch` until the broker accepts it (it may be down): the same messages with the
/// same event ids each time.
async fn publish_until_accepted(publisher: &dyn Publisher, batch: Vec<OutgoingMessage>) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while let Err(e) = publisher.publish_all(batch.clone()).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "publishing never succeeded: {e}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
