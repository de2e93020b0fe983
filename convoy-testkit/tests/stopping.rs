//! How a graceful stop ends (issue 21, item 2), on the memory transport with a paused clock:
//! a stop finishes what is in flight, not the whole buffer (unless asked to); the whole stop
//! fits its shutdown timeout even when a handler never returns; a message limit takes exactly
//! that many messages and commits exactly them; `run_until` stops on any future (a signal, an
//! application's cancellation token). What a stop leaves uncommitted, the next consumer of the
//! group handles — nothing it finished comes again.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy_core::{handler_fn, Delivery, Drain, Engine, EngineConfig, EngineHandle, Handler, HandlerError};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::{MemoryBed, MemoryTarget};
use convoy_testkit::probe::{publish_load, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;
use tokio::time::Instant;

fn bed(partitions: u32) -> MemoryBed {
    MemoryTarget::new().memory_bed(partitions)
}

async fn start(
    bed: &MemoryBed,
    handler: impl Handler,
    config: EngineConfig,
    checker: &Arc<OrderChecker>,
) -> EngineHandle {
    Engine::builder(handler)
        .config(config)
        .dead_letter_sink(Arc::new(RecordingSink::new(
            bed.dead_letter_sink(),
            checker.clone(),
        )))
        .build()
        .unwrap()
        .spawn(bed.subscribe().await.unwrap())
}

/// What a [`slow`] handler finished (key and payload) and how many calls it started.
struct Record {
    done: Arc<Mutex<Vec<String>>>,
    started: Arc<AtomicUsize>,
}

/// A handler taking `work` per message, and its record.
fn slow(work: Duration) -> (impl Handler, Record) {
    let done = Arc::new(Mutex::new(Vec::new()));
    let started = Arc::new(AtomicUsize::new(0));
    let (d, s) = (done.clone(), started.clone());
    let handler = handler_fn(move |delivery: Delivery| {
        let (done, started) = (d.clone(), s.clone());
        async move {
            started.fetch_add(1, SeqCst);
            tokio::time::sleep(work).await;
            let text = String::from_utf8_lossy(delivery.payload()).into_owned();
            done.lock()
                .unwrap()
                .push(format!("{}:{text}", delivery.message().key_display()));
            Ok::<(), HandlerError>(())
        }
    });
    (handler, Record { done, started })
}

async fn wait_until(condition: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(3600);
    while !condition() {
        assert!(Instant::now() < deadline, "waited an hour of virtual time");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// One key, 50 messages of 3 s each: stopped while the first runs.
async fn stop_during_the_first(drain: Drain) -> (Duration, Vec<String>, Vec<String>, u64) {
    let bed = bed(1);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 50)
        .await
        .unwrap();
    let (handler, record) = slow(Duration::from_secs(3));
    let mut config = test_config(bed.group());
    config.drain = drain;
    let engine = start(&bed, handler, config, &checker).await;
    wait_until(|| record.started.load(SeqCst) > 0).await;
    let stopped_at = Instant::now();
    let report = engine.stop().await.unwrap();
    let took = stopped_at.elapsed();
    let first: Vec<String> = record.done.lock().unwrap().clone();
    // The next consumer of the group: everything else, nothing again.
    let (handler, next) = slow(Duration::from_millis(1));
    let engine = start(&bed, handler, test_config(bed.group()), &checker).await;
    wait_until(|| next.done.lock().unwrap().len() + first.len() >= 50).await;
    engine.stop().await.unwrap();
    let second = next.done.lock().unwrap().clone();
    (took, first, second, report.cancelled as u64)
}

#[tokio::test(start_paused = true)]
async fn a_stop_finishes_what_is_in_flight_and_leaves_the_queue_to_the_next_consumer() {
    let (took, first, second, cancelled) = stop_during_the_first(Drain::InFlight).await;
    assert!(
        took <= Duration::from_secs(3),
        "stopping took {took:?}: the buffer was drained"
    );
    assert_eq!(first, ["k0:0"], "only the message in flight was finished");
    assert_eq!(cancelled, 0, "nothing was cut short");
    assert_eq!(second.len(), 49);
    assert_eq!(
        second.first().map(String::as_str),
        Some("k0:1"),
        "the next starts right after"
    );
}

#[tokio::test(start_paused = true)]
async fn a_buffered_drain_works_through_the_buffer_until_its_timeout() {
    let (took, first, second, cancelled) = stop_during_the_first(Drain::Buffered).await;
    // test_config drains 8 s: the second message finishes at 6 s, the third is cut short at 8 s.
    assert_eq!(first, ["k0:0", "k0:1"]);
    assert_eq!(took, Duration::from_secs(8));
    assert_eq!(cancelled, 48, "the one cut short and the 47 queued behind it");
    assert_eq!(second.len(), 48);
    assert_eq!(second.first().map(String::as_str), Some("k0:2"));
}

#[tokio::test(start_paused = true)]
async fn a_stop_fits_its_shutdown_timeout_even_when_a_handler_never_returns() {
    let bed = bed(1);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 5)
        .await
        .unwrap();
    let (handler, record) = slow(Duration::from_secs(86_400)); // a day: as good as never
    let mut config = test_config(bed.group());
    config.drain_timeout = Duration::from_secs(20);
    config.shutdown_timeout = Duration::from_secs(9);
    let engine = start(&bed, handler, config, &checker).await;
    wait_until(|| record.started.load(SeqCst) > 0).await;
    let stopped_at = Instant::now();
    let report = engine.stop().await.unwrap();
    // The drain ends a third of the shutdown timeout before its end (6 s), whatever the drain
    // timeout says; the final commit and the close fit in the rest.
    assert_eq!(stopped_at.elapsed(), Duration::from_secs(6));
    assert_eq!(report.cancelled, 1, "the hung call was cancelled, uncommitted");
}

#[tokio::test(start_paused = true)]
async fn a_message_limit_takes_and_commits_exactly_that_many() {
    let bed = bed(4);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 10, 20)
        .await
        .unwrap();
    let mut seen = Vec::new();
    for limit in [50, 150] {
        let (handler, record) = slow(Duration::from_millis(1));
        let mut config = test_config(bed.group());
        config.max_messages = Some(limit);
        let engine = start(&bed, handler, config, &checker).await;
        // The engine stops by itself once it finished its limit.
        let report = tokio::time::timeout(Duration::from_secs(3600), engine.join())
            .await
            .expect("the engine stopped by itself")
            .unwrap();
        let done = record.done.lock().unwrap().clone();
        assert_eq!(done.len() as u64, limit, "handled exactly the limit");
        assert_eq!(report.stats.handled, limit);
        seen.extend(done);
    }
    let distinct: std::collections::HashSet<&String> = seen.iter().collect();
    assert_eq!(
        distinct.len(),
        200,
        "the second took exactly what the first left: none again, none lost"
    );
}

#[tokio::test(start_paused = true)]
async fn run_until_stops_on_any_future_and_returns_early_when_the_engine_ends() {
    let bed = bed(1);
    let checker = Arc::new(OrderChecker::new());
    publish_load(bed.publisher().as_ref(), &checker, "k", 3, 10)
        .await
        .unwrap();
    let engine = start(
        &bed,
        ProbeHandler::new(checker.clone()),
        test_config(bed.group()),
        &checker,
    )
    .await;
    // The application's own reason to stop: its CancellationToken.
    let token = tokio_util::sync::CancellationToken::new();
    let canceller = tokio::spawn({
        let checker = checker.clone();
        let token = token.clone();
        async move {
            while !checker.complete() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            token.cancel();
        }
    });
    let report = engine.run_until(token.cancelled()).await.unwrap();
    canceller.await.unwrap();
    assert_eq!(report.stats.handled, 30);

    // An engine that ends by itself (its message limit) returns without the future firing.
    let mut config = test_config(bed.group());
    config.max_messages = Some(1);
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 1)
        .await
        .unwrap();
    let engine = start(&bed, ProbeHandler::new(checker.clone()), config, &checker).await;
    let report = engine.run_until(std::future::pending()).await.unwrap();
    assert_eq!(report.stats.handled, 1);
}
