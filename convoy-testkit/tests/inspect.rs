//! The live view of an engine (`EngineHandle::inspector`, what `convoy lanes` shows), on the
//! memory transport with a paused clock: a key retrying forever shows at the top of the
//! longest-running lanes with its attempts and last error; a key with a backlog at the top of
//! the queued ones; each source with its watermark and what it holds — bounded to `top` lanes.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::Arc;
use std::time::Duration;

use convoy_core::{handler_fn, Delivery, Engine, HandlerError};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::MemoryTarget;
use convoy_testkit::probe::{publish_load, RecordingSink};
use convoy_testkit::OrderChecker;

#[tokio::test(start_paused = true)]
async fn a_retrying_key_and_a_backlog_show_in_the_view() {
    let bed = MemoryTarget::new().memory_bed(2);
    let checker = Arc::new(OrderChecker::new());
    // k0: 20 messages, its first failing forever; k1 … k9: 2 each, handled at once.
    publish_load(bed.publisher().as_ref(), &checker, "k", 1, 20)
        .await
        .unwrap();
    publish_load(bed.publisher().as_ref(), &checker, "j", 9, 2)
        .await
        .unwrap();
    let handler = handler_fn(|d: Delivery| async move {
        match d.message().key_display().as_ref() {
            "k0" => Err(HandlerError::transient("the ledger is locked")),
            _ => Ok(()),
        }
    });
    let mut config = test_config(bed.group());
    config.retry.max_attempts = None; // retried forever
    config.retry.backoff.cap = Duration::from_millis(200);
    let engine = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(Arc::new(RecordingSink::new(
            bed.dead_letter_sink(),
            checker.clone(),
        )))
        .build()
        .unwrap()
        .spawn(bed.subscribe().await.unwrap());
    let inspector = engine.inspector();
    // Every other key is done and k0 has been retried a while.
    while engine.stats().handled < 18 || engine.stats().retries < 5 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let view = inspector.inspect(3).await.unwrap();
    let head = &view.oldest[0];
    assert_eq!(head.key, "k0");
    assert!(head.attempts >= 5, "{head:?}");
    assert_eq!(head.last_error.as_deref(), Some("the ledger is locked"));
    assert!(head.running_for.unwrap() >= Duration::from_secs(3), "{head:?}");
    assert_eq!(view.backlog[0].key, "k0");
    assert_eq!(view.backlog[0].queued, 19, "its other 19 wait behind it");
    assert!(
        view.oldest.len() <= 3 && view.backlog.len() <= 3,
        "bounded to top"
    );
    assert_eq!(view.sources.len(), 2);
    let held: usize = view.sources.iter().map(|s| s.held).sum();
    assert_eq!(held, 20, "{:?}", view.sources);
    engine.stop().await.unwrap();
    assert!(
        inspector.inspect(3).await.is_none(),
        "nothing answers once the engine stopped"
    );
}
