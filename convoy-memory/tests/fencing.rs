//! A member that loses its connection and is given the same partitions again: nothing of its
//! earlier assignment may act on the new one. Driven through the transport contract directly
//! (no engine), so each step happens exactly where the race put it; the simulator found both.

use std::time::Duration;

use convoy_core::transform::{Outbox, Output};
use convoy_core::transport::{Commit, EventReceiver, RevokeAck, SourceEvent};
use convoy_core::{Message, OutgoingMessage, SourceId, Transport};
use convoy_memory::{MemoryBroker, MemoryTransport};
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(30);

async fn next(events: &mut EventReceiver) -> SourceEvent {
    match timeout(WAIT, events.recv()).await {
        Ok(Some(event)) => event,
        Ok(None) => panic!("the subscription ended"),
        Err(_) => panic!("no event within {WAIT:?}"),
    }
}

/// The next assignment (skipping messages), as (source, token) pairs.
async fn assigned(events: &mut EventReceiver) -> Vec<(SourceId, u64)> {
    loop {
        match next(events).await {
            SourceEvent::Assigned(list) => return list.into_iter().map(|a| (a.source, a.token)).collect(),
            SourceEvent::Messages { .. } => {}
            other => panic!("expected an assignment, got {other:?}"),
        }
    }
}

/// The next message of `source`.
async fn message_of(events: &mut EventReceiver, source: &SourceId) -> Message {
    loop {
        match next(events).await {
            SourceEvent::Messages { source: s, messages } if &s == source => return messages[0].clone(),
            SourceEvent::Messages { .. } | SourceEvent::Assigned(_) => {}
            other => panic!("expected messages of {source}, got {other:?}"),
        }
    }
}

/// Stages `text` as the output of `input`, as a transform's handling would.
async fn stage(outbox: &dyn Outbox, input: &Message, text: &str) {
    outbox
        .put(input, vec![Output::keyed("out", "k", text.to_owned())])
        .await
        .expect("staged");
}

fn commit(source: &SourceId, token: u64, next: u64) -> Commit {
    Commit {
        source: source.clone(),
        next,
        token,
        finished_above: Vec::new(),
    }
}

fn outputs(broker: &MemoryBroker) -> Vec<String> {
    broker
        .read_all("out")
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_commit_computed_for_an_earlier_assignment_is_refused() {
    let broker = MemoryBroker::new();
    broker.create_topic("in", 1);
    broker.create_topic("out", 1);
    broker
        .publish("in", OutgoingMessage::new("k", "a"))
        .expect("publish");
    let transport = MemoryTransport::new(&broker, "g", &["in"]).transactional();
    let mut sub = transport.subscribe().await.expect("subscribe");
    let outbox = sub.outbox.clone().expect("a transactional member has an outbox");
    let first = assigned(&mut sub.events).await;
    let (source, old_token) = first[0].clone();
    let input = message_of(&mut sub.events, &source).await;
    stage(outbox.as_ref(), &input, "from the first assignment").await;

    // The commit is computed now; the connection drops before it reaches the broker.
    let stale = commit(&source, old_token, 1);
    broker.drop_connection(broker.members("g")[0]);
    assert!(matches!(next(&mut sub.events).await, SourceEvent::Lost(_)));
    let again = assigned(&mut sub.events).await;
    let (_, new_token) = again[0].clone();
    assert_ne!(new_token, old_token, "a new assignment has a new token");

    let refused = sub.control.commit(&[stale]).await;
    assert!(
        refused.is_err(),
        "a commit of the earlier assignment must not land"
    );
    assert!(
        outputs(&broker).is_empty(),
        "nothing published by it: {:?}",
        outputs(&broker)
    );
    assert_eq!(
        broker.committed("g").get(&source),
        None,
        "nothing committed by it"
    );

    // The new assignment handles the input again and commits it, once.
    let input = message_of(&mut sub.events, &source).await;
    stage(outbox.as_ref(), &input, "from the second assignment").await;
    sub.control
        .commit(&[commit(&source, new_token, 1)])
        .await
        .expect("the new assignment's commit");
    assert_eq!(outputs(&broker), ["from the second assignment"]);
}

#[tokio::test(start_paused = true)]
async fn a_revoke_answered_after_a_loss_leaves_the_new_assignment_its_outputs() {
    let broker = MemoryBroker::new();
    // Lost partitions wait a session before they are handed on: the second member leaves first.
    broker.set_faults(|f| f.session_timeout = Duration::from_secs(1));
    broker.create_topic("in", 2);
    broker.create_topic("out", 1);
    let transport = MemoryTransport::new(&broker, "g", &["in"]).transactional();
    let mut a = transport.subscribe().await.expect("subscribe");
    let outbox = a.outbox.clone().expect("a transactional member has an outbox");
    assert_eq!(assigned(&mut a.events).await.len(), 2);

    // A second member joins: one partition is revoked from the first, which holds its answer.
    let b = transport.subscribe().await.expect("second member");
    let (revoked, ack): (Vec<SourceId>, RevokeAck) = match next(&mut a.events).await {
        SourceEvent::Revoked { sources, ack, .. } => (sources, ack),
        other => panic!("expected a revoke, got {other:?}"),
    };
    // The first member's connection drops, the second leaves: once the session times out,
    // both partitions come back to the first.
    broker.drop_connection(broker.members("g")[0]);
    assert!(matches!(next(&mut a.events).await, SourceEvent::Lost(_)));
    drop(b);
    let again = assigned(&mut a.events).await;
    let (source, token) = again
        .iter()
        .find(|(s, _)| s == &revoked[0])
        .cloned()
        .unwrap_or_else(|| {
            panic!("the revoked partition {revoked:?} is not in the new assignment {again:?}")
        });

    // Only now is the old revoke answered.
    ack.done();
    broker
        .publish("in", OutgoingMessage::new(key_of(&broker, &source), "x"))
        .expect("publish");
    let input = message_of(&mut a.events, &source).await;
    stage(outbox.as_ref(), &input, "handled after the loss").await;
    // Virtual time moves only once every task is idle: the revoke's end has run by then.
    tokio::time::sleep(Duration::from_millis(10)).await;
    a.control
        .commit(&[commit(&source, token, input.offset + 1)])
        .await
        .expect("commit");
    assert_eq!(
        outputs(&broker),
        ["handled after the loss"],
        "the commit covered the input: its output must go with it"
    );
}

/// A key that lands on `source`'s partition.
fn key_of(broker: &MemoryBroker, source: &SourceId) -> String {
    let partitions = broker.partitions("in").expect("topic");
    let (_, wanted) = source.topic_partition().expect("a partition");
    (0..)
        .map(|i| format!("k{i}"))
        .find(|k| convoy_core::partitioner::partition_for_key(k.as_bytes(), partitions) == wanted)
        .expect("some key lands there")
}
