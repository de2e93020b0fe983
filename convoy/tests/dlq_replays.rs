//! Replays are recorded in the dead-letter topic (`memory://`): a listing counts how often each
//! dead letter was replayed — by a replay of single dead letters or a parked key's replay
//! marker, and through either record of a message dead-lettered twice — and
//! `Selection::not_replayed` leaves those out.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use convoy::dlq::{self, Selection};
use convoy::parking::{ReplayTag, REPLAY, REPLAY_OF};
use convoy::prelude::*;
use convoy::{DeadLetter, DeadLetterCause, DeadLetterReason, Headers, SourceId, EVENT_ID_HEADER};

fn dead_letter(key: &str, event_id: &str, offset: u64, cause: DeadLetterCause) -> DeadLetter {
    let mut headers = Headers::new();
    headers.insert(EVENT_ID_HEADER, event_id.to_owned());
    let failed = SystemTime::UNIX_EPOCH + Duration::from_secs(1_790_000_000);
    DeadLetter {
        message: Message {
            key: Some(Bytes::from(key.to_owned())),
            payload: Bytes::from_static(b"{}"),
            headers,
            source: SourceId::partition("ledger", 0),
            offset,
        },
        reason: DeadLetterReason {
            cause,
            error_class: "terminal".into(),
            error: "cannot apply".into(),
            attempts: 1,
            first_failure: failed,
            last_failure: failed,
            group: "billing".into(),
            parks_key: false,
        },
    }
}

fn replays(records: &[dlq::DeadLetterRecord]) -> Vec<(u64, u32)> {
    records.iter().map(|r| (r.message.offset, r.replays)).collect()
}

#[tokio::test]
async fn a_listing_counts_the_replays_the_dead_letter_topic_records() {
    let connection = convoy::connect("memory://dlq-replays?topics=ledger&partitions=1&group=billing")
        .await
        .unwrap();
    connection.create_topics().await.unwrap();
    let sink = connection.dead_letter_sink().unwrap();
    // Offsets 0 and 1: one message dead-lettered twice (delivered again after a crash); 2 and 3:
    // two others.
    for (n, event_id) in ["ev-a", "ev-a", "ev-b", "ev-c"].into_iter().enumerate() {
        sink.publish(&dead_letter(
            "acct-1",
            event_id,
            n as u64,
            DeadLetterCause::Terminal,
        ))
        .await
        .unwrap();
    }
    let listed = dlq::all(&connection).await.unwrap();
    assert_eq!(replays(&listed), [(0, 0), (1, 0), (2, 0), (3, 0)]);
    let at = listed[0].dead_lettered_at.unwrap();
    assert_eq!(
        at.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs(),
        1_790_000_000
    );
    assert!(listed[0].last_replayed_at.is_none());

    // Replaying the first record counts for both records of its message.
    let receipts = dlq::replay(&connection, &listed[..1], None).await.unwrap();
    assert_eq!(receipts.len(), 1);
    let listed = dlq::all(&connection).await.unwrap();
    assert_eq!(
        replays(&listed),
        [(0, 1), (1, 1), (2, 0), (3, 0)],
        "markers are not listed"
    );
    assert!(listed[0].last_replayed_at.is_some());
    let fresh = dlq::list(&connection, &Selection::any().not_replayed())
        .await
        .unwrap();
    assert_eq!(replays(&fresh), [(2, 0), (3, 0)]);

    // A parked key's replay marker counts too: it names where the topic holds its records.
    let mut marker = dead_letter("acct-1", "marker", 0, DeadLetterCause::Replay);
    let dlq_source = &listed[2].message.source;
    marker.message.headers.insert(
        REPLAY,
        ReplayTag {
            id: "r1".into(),
            index: 0,
            count: 1,
        }
        .header_value(),
    );
    marker
        .message
        .headers
        .insert(REPLAY_OF, format!("{dlq_source}@2"));
    sink.publish(&marker).await.unwrap();

    // Replaying on purpose again counts again, under an event id of its own.
    assert_eq!(
        listed[0].to_replay().headers.get_str(EVENT_ID_HEADER),
        Some(format!("ev-a/replay/{dlq_source}@0/2").as_str())
    );
    dlq::replay(&connection, &listed[..1], None).await.unwrap();
    let listed = dlq::all(&connection).await.unwrap();
    assert_eq!(replays(&listed), [(0, 2), (1, 2), (2, 1), (3, 0)]);
    let fresh = dlq::list(&connection, &Selection::key("acct-1").not_replayed())
        .await
        .unwrap();
    assert_eq!(replays(&fresh), [(3, 0)]);
}
