//! An operator's pause of a source holds whatever of it still arrives: the first fetch of a
//! source assigned after the pause, or a batch already on its way when the transport was told
//! (a prefetch). Nothing of it starts until resumed, then all of it runs in order; nothing is
//! committed past it meanwhile, and neither a stop nor a message limit waits for it. On a paused clock, with a
//! scripted transport where the test plays the broker.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy_core::transport::{Assignment, SourceEvent};
use convoy_core::{handler_fn, Delivery, Engine, EngineHandle, HandlerError, Pauser, SourceId};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::MemoryTarget;
use convoy_testkit::script::{message, scripted, Script};

type Seen = Arc<Mutex<Vec<(String, u32)>>>;

/// An engine on a scripted transport whose handler records (key, payload as a number).
fn start() -> (Script, EngineHandle, Seen) {
    start_with(test_config("paused-source"))
}

fn start_with(config: convoy_core::EngineConfig) -> (Script, EngineHandle, Seen) {
    let seen = Seen::default();
    let handler = {
        let seen = seen.clone();
        handler_fn(move |d: Delivery| {
            let seen = seen.clone();
            async move {
                let n: u32 = d.payload_str()?.parse().map_err(HandlerError::malformed)?;
                seen.lock()
                    .unwrap()
                    .push((d.message().key_display().into_owned(), n));
                Ok(())
            }
        })
    };
    let bed = MemoryTarget::new().memory_bed(1);
    let (script, subscription) = scripted(Some(Duration::from_secs(60)));
    let running = Engine::builder(handler)
        .config(config)
        .dead_letter_sink(bed.dead_letter_sink())
        .build()
        .unwrap()
        .spawn(subscription);
    (script, running, seen)
}

/// Sends `key`'s messages `numbers` (payload = offset) of `source`.
async fn send(script: &Script, source: &SourceId, key: &str, numbers: std::ops::Range<u32>) {
    let batch = numbers
        .map(|n| message(source, u64::from(n), Some(key), &n.to_string()))
        .collect();
    script.messages(source, batch).await;
}

/// Pauses `t/0`, then assigns it and `t/1`: the paused source's first fetch is already on its
/// way when it is assigned. Returns (`t/0`, `t/1`).
async fn paused_before_assigned(script: &Script, pauser: &Pauser) -> (SourceId, SourceId) {
    let (paused, flowing) = (SourceId::new("t/0"), SourceId::new("t/1"));
    assert!(pauser.pause_source(paused.clone()).await);
    script.control(SourceEvent::Assigned(vec![
        Assignment::new(paused.clone(), None),
        Assignment::new(flowing.clone(), None),
    ]));
    (paused, flowing)
}

async fn wait_finished(running: &EngineHandle, finished: u64) {
    while running.stats().finished() < finished {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn of(seen: &Seen, key: &str) -> Vec<u32> {
    let seen = seen.lock().unwrap();
    seen.iter().filter(|(k, _)| k == key).map(|(_, n)| *n).collect()
}

#[tokio::test(start_paused = true)]
async fn what_arrives_of_a_paused_source_waits_unrouted_until_resumed() {
    let (script, running, seen) = start();
    let pauser = running.pauser();
    let (paused, flowing) = paused_before_assigned(&script, &pauser).await;
    send(&script, &paused, "a", 0..3).await;
    send(&script, &flowing, "b", 0..3).await;
    // One channel, in order: once b's messages finished, a's were received before them.
    wait_finished(&running, 3).await;
    assert_eq!(
        of(&seen, "a"),
        Vec::<u32>::new(),
        "nothing of the paused source started"
    );
    assert_eq!(running.stats().held, 3, "a's messages are held");
    script.wait_for(|s| s.paused().contains(&paused)).await;

    // Paused while flowing: a batch already on its way is held too.
    assert!(pauser.pause_source(flowing.clone()).await);
    send(&script, &flowing, "b", 3..5).await;
    let third = SourceId::new("t/2");
    script.assign(&third);
    send(&script, &third, "c", 0..1).await;
    wait_finished(&running, 4).await;
    assert_eq!(of(&seen, "b"), [0, 1, 2], "b's later batch waits");
    assert_eq!(running.stats().held, 5);
    // Nothing of what waits is committed: b's commit stops at 3, a has none past its start.
    script
        .wait_for(|s| s.commits().iter().any(|c| c.source == flowing && c.next == 3))
        .await;
    assert!(
        script
            .commits()
            .iter()
            .all(|c| c.source != flowing || c.next <= 3),
        "{:?}",
        script.commits()
    );
    assert!(
        script.commits().iter().all(|c| c.source != paused || c.next == 0),
        "{:?}",
        script.commits()
    );

    assert!(pauser.resume_source(paused.clone()).await);
    assert!(pauser.resume_source(flowing.clone()).await);
    wait_finished(&running, 9).await;
    assert_eq!(of(&seen, "a"), [0, 1, 2], "in order once resumed");
    assert_eq!(of(&seen, "b"), [0, 1, 2, 3, 4]);
    let report = running.stop().await.unwrap();
    assert_eq!(report.stats.handled, 9);
    assert!(script.commits().iter().any(|c| c.source == paused && c.next == 3));
}

#[tokio::test(start_paused = true)]
async fn a_stop_does_not_wait_for_what_a_paused_source_holds() {
    let (script, running, seen) = start();
    let pauser = running.pauser();
    let (paused, flowing) = paused_before_assigned(&script, &pauser).await;
    send(&script, &paused, "a", 0..3).await;
    send(&script, &flowing, "b", 0..2).await;
    wait_finished(&running, 2).await;
    let started = tokio::time::Instant::now();
    let report = running.stop().await.unwrap();
    assert!(
        started.elapsed() < test_config("paused-source").drain_timeout,
        "the stop waited for held messages: {:?}",
        started.elapsed()
    );
    assert_eq!(report.stats.handled, 2);
    assert_eq!(of(&seen, "a"), Vec::<u32>::new());
    // Uncommitted, so the next owner reads them: no commit of the paused source moved.
    assert!(script.commits().iter().all(|c| c.source != paused || c.next == 0));
    assert!(script.closed());
}

#[tokio::test(start_paused = true)]
async fn a_message_limit_reached_elsewhere_does_not_wait_for_a_paused_source() {
    let mut config = test_config("paused-source");
    config.max_messages = Some(3);
    let (script, running, seen) = start_with(config);
    let pauser = running.pauser();
    let (paused, flowing) = paused_before_assigned(&script, &pauser).await;
    send(&script, &paused, "a", 0..3).await;
    send(&script, &flowing, "b", 0..3).await;
    // Three taken and finished: the engine stops by itself, though a's wait unrouted.
    let report = tokio::time::timeout(Duration::from_secs(60), running.join())
        .await
        .expect("the engine stopped at its limit")
        .unwrap();
    assert_eq!(report.stats.handled, 3);
    assert_eq!(of(&seen, "b"), [0, 1, 2]);
    assert_eq!(of(&seen, "a"), Vec::<u32>::new());
    assert!(script.commits().iter().all(|c| c.source != paused || c.next == 0));
}
