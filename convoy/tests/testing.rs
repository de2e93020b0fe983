//! The README's "Testing a handler": a handler's test through the same API as production, on
//! `memory://` (no broker process), reading what it left with the connection's read helpers.

#![allow(clippy::unwrap_used)]

mod snippet;

// README:BEGIN
use std::time::Duration;

use convoy::prelude::*;

/// The handler under test: a debit of more than 1,000 cents is refused.
async fn debit(d: Delivery) -> Result<(), HandlerError> {
    let cents: i64 = d.payload_str()?.parse().malformed()?; // not a number: dead-lettered, unretried
    if cents < -1000 {
        return Err(HandlerError::terminal("over the limit"));
    }
    Ok(())
}

#[tokio::test(start_paused = true)] // virtual time: retries and timers cost nothing
async fn a_refused_debit_is_dead_lettered_with_its_reason() -> Result<(), Box<dyn std::error::Error>> {
    // A broker of this test's own (memory:// brokers are shared by name within a process).
    let connection = convoy::connect("memory://refused-debit?topics=ledger").await?;
    let engine = Engine::builder(handler_fn(debit))
        .dead_letter_sink(connection.dead_letter_sink()?)
        .build()?;
    let running = engine.start(&connection).await?;
    let publisher = connection.publisher("ledger")?;
    for cents in ["500", "-5000", "-300", "lots"] {
        publisher.publish(OutgoingMessage::new("acct-1", cents)).await?;
    }
    // `finished` counts handled and dead-lettered messages alike.
    while running.stats().finished() < 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    running.stop().await?;

    let dead = convoy::dlq::all(&connection).await?;
    let reasons: Vec<(String, &str)> = dead
        .iter()
        .map(|r| {
            (
                String::from_utf8_lossy(&r.message.payload).into_owned(),
                r.cause.as_str(),
            )
        })
        .collect();
    assert_eq!(
        reasons,
        [("-5000".into(), "terminal"), ("lots".into(), "malformed")]
    );
    assert_eq!(
        connection.read_topic("ledger").await?.len(),
        4,
        "the input, as published"
    );
    Ok(())
}
// README:END

#[test]
fn the_readme_shows_this_code() {
    snippet::assert_readme_shows("testing.rs", include_str!("testing.rs"));
}
