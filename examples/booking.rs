//! Session bookings with corrections: "book a flight to London", then "make the destination
//! Paris". The booking system is slow (a few milliseconds per booking, a timer), so a consumer
//! that raced the two messages of a session would apply the correction first — to a booking
//! that does not exist yet — or let the slow booking overwrite the correction.
//!
//! Invariant: every session ends booked to Paris, each saw London then Paris, nothing was
//! dead-lettered.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy::{typed, Delivery, HandlerError, OutgoingMessage, RetryPolicy};
use convoy_examples::{main_of, verdict, Error, Example};

const SESSIONS: usize = 200;

#[derive(serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Command {
    Book { destination: String },
    ChangeDestination { destination: String },
}

async fn run() -> Result<ExitCode, Error> {
    let example = Example::setup("booking").await?;
    let mut commands = Vec::new();
    for s in 0..SESSIONS {
        commands.push(OutgoingMessage::new(
            format!("session-{s}"),
            r#"{"type":"book","destination":"London"}"#,
        ));
    }
    for s in 0..SESSIONS {
        commands.push(OutgoingMessage::new(
            format!("session-{s}"),
            r#"{"type":"change_destination","destination":"Paris"}"#,
        ));
    }
    example.publish(commands).await?;

    // Per session: the destinations it was set to, in order.
    let bookings = Arc::new(Mutex::new(HashMap::<String, Vec<String>>::new()));
    let b = bookings.clone();
    let handler = typed(move |command: Command, d: Delivery| {
        let bookings = b.clone();
        async move {
            let session = d.message().key_display().into_owned();
            match command {
                Command::Book { destination } => {
                    // The airline's booking API is slow.
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(1..4))).await;
                    let mut all = bookings
                        .lock()
                        .map_err(|_| HandlerError::terminal("lock poisoned"))?;
                    all.entry(session).or_default().push(destination);
                }
                Command::ChangeDestination { destination } => {
                    let mut all = bookings
                        .lock()
                        .map_err(|_| HandlerError::terminal("lock poisoned"))?;
                    let history = all.get_mut(&session).ok_or_else(|| {
                        HandlerError::terminal(format!("{session}: correction before its booking"))
                    })?;
                    history.push(destination);
                }
            }
            Ok(())
        }
    });
    let stats = example
        .run(handler, RetryPolicy::default(), 2 * SESSIONS as u64)
        .await?;
    let dead = example.dead_letters().await?;
    example.clean_up().await?;
    let bookings = bookings.lock().map_err(|_| "lock poisoned")?;
    println!(
        "booking: {} commands handled, {} dead-lettered",
        stats.handled, stats.dead_lettered
    );
    Ok(verdict(
        "booking",
        &[
            (
                "every session is booked to Paris, after London",
                bookings.len() == SESSIONS && bookings.values().all(|h| h == &["London", "Paris"]),
            ),
            (
                "no correction arrived before its booking (no dead letters)",
                dead.is_empty(),
            ),
        ],
    ))
}

fn main() -> ExitCode {
    main_of("booking", run())
}
