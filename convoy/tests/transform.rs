//! The README's transform, verbatim between the markers, run on the embedded broker, on Kafka
//! with a transactional id (exactly once) and on NATS (deduplicated by `Nats-Msg-Id`) when
//! their variables are set (scripts/test sets them).

#![allow(clippy::unwrap_used)]

mod snippet;

// README:BEGIN
use std::time::Duration;

use convoy::{transform_fn, Delivery, Engine, HandlerError, Message, OutgoingMessage, Output};

/// Doubles every amount of `input` into `output`. With `transactional_id` in a Kafka URL, each
/// output and the commit of its input go into one transaction: exactly once.
async fn doubler(url: &str, input: &str, output: &str) -> Result<Vec<Message>, Box<dyn std::error::Error>> {
    let connection = convoy::connect(url).await?.with_topics(&[input]);
    connection.create_topics().await?;
    connection.with_topics(&[output]).create_topics().await?; // partitions as the URL says
    let to = output.to_owned();
    let transform = transform_fn(move |d: Delivery| {
        let to = to.clone();
        async move {
            let cents: i64 = std::str::from_utf8(d.payload())
                .ok()
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| HandlerError::malformed("not a number"))?; // dead-lettered, no output
            let key = d.key().cloned().unwrap_or_default();
            Ok(vec![Output::keyed(to, key, (cents * 2).to_string())]) // its id: "<input id>/out/0"
        }
    });
    let engine = Engine::transform_builder(transform)
        .dead_letter_sink(connection.dead_letter_sink()?)
        .build()?;
    let running = engine.start(&connection).await?;
    let publisher = connection.publisher(input)?;
    for i in 0..300 {
        publisher
            .publish(OutgoingMessage::new(format!("acct-{}", i % 30), i.to_string()))
            .await?;
    }
    while running.stats().finished() < 300 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    running.stop().await?; // the last commit publishes what is left (on Kafka, in its transaction)
    Ok(connection.read_topic(output).await?)
}
// README:END

/// Every input's output once, its id derived from the input's, in per-key order.
fn check(outputs: &[Message]) {
    assert_eq!(outputs.len(), 300, "one output per input");
    let mut last = std::collections::HashMap::new();
    let mut ids = std::collections::HashSet::new();
    for o in outputs {
        let doubled: i64 = std::str::from_utf8(&o.payload).unwrap().parse().unwrap();
        let key = o.key_display().into_owned();
        assert_eq!(key, format!("acct-{}", doubled / 2 % 30));
        let before = last.insert(key, doubled);
        assert!(
            before.is_none_or(|b| b < doubled),
            "out of order: {before:?} then {doubled}"
        );
        let id = o.headers.get_str(convoy::EVENT_ID_HEADER).unwrap();
        assert!(id.ends_with("/out/0") && ids.insert(id.to_owned()), "{id}");
    }
}

fn unique() -> String {
    format!(
        "{}-{:x}",
        std::process::id(),
        std::time::UNIX_EPOCH.elapsed().unwrap().as_nanos()
    )
}

#[tokio::test]
async fn the_readme_transform_on_memory() {
    check(&doubler("memory://transform", "amounts", "doubled").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_transform_exactly_once_on_kafka() {
    let Some(bootstrap) = convoy_testkit::support::required("CONVOY_KAFKA_BOOTSTRAP") else {
        return;
    };
    let u = unique();
    let url = format!("kafka://{bootstrap}?group=doubler-{u}&transactional_id=doubler-{u}&partitions=4");
    check(
        &doubler(&url, &format!("amounts-{u}"), &format!("doubled-{u}"))
            .await
            .unwrap(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_transform_on_nats() {
    let Some(server) = convoy_testkit::support::required("CONVOY_NATS_URL") else {
        return;
    };
    let u = unique();
    let url = format!("{server}?group=doubler-{u}");
    let (input, output) = (format!("amounts-{u}"), format!("doubled-{u}"));
    let outputs = doubler(&url, &input, &output).await;
    // The server is shared: delete what the run created, whatever it returned.
    let connection = convoy::connect(&url).await.unwrap().with_topics(&[&input]);
    for topic in [&input, &output] {
        connection.delete_topic(topic).await.unwrap();
    }
    check(&outputs.unwrap());
}

/// An engine built around a transform refuses a subscription without an outbox (one made by
/// hand, not by a convoy connection) instead of dead-lettering every message.
#[tokio::test]
async fn a_transform_needs_an_outbox() {
    let broker = convoy::memory_broker("transform-no-outbox");
    broker.create_topic("in", 1);
    let transport = convoy_memory::MemoryTransport::new(&broker, "g", &["in"]);
    let engine = Engine::transform_builder(transform_fn(|_| async { Ok(Vec::new()) }))
        .dead_letter_sink(convoy_memory::MemoryDeadLetterSink::new(&broker, "in.dlq"))
        .build()
        .unwrap();
    let error = engine.start(&transport).await.unwrap().join().await.unwrap_err();
    assert!(error.to_string().contains("outbox"), "{error}");
}

#[test]
fn the_readme_shows_this_code() {
    snippet::assert_readme_shows("transform.rs", include_str!("transform.rs"));
}
