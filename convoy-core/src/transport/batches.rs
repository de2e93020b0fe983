//! A broker adapter's publisher as one confirmed batch send; [`Publisher`] comes with it.
//!
//! A key's order must survive a failed publish. A broker that confirms each message on its own
//! (RabbitMQ, NATS) may refuse message `n` of a pipelined batch and store `n + 1` of the same
//! key — a quorum queue or stream without a leader for a moment, a full queue, a connection cut
//! between two writes — and publishing `n` again would store it after `n + 1`. So unless the
//! broker orders a key's messages on failure by itself ([`BatchSender::orders_on_failure`]:
//! Kafka's idempotent producer), a batch goes out in *rounds*: round `i` holds the `i`-th
//! message of every key in the batch, pipelined, and round `i + 1` starts only once round `i`
//! was confirmed. A message is never sent before every earlier message of its key was
//! confirmed; after a failure nothing more is sent. Keyless messages (spread over partitions at
//! random) go in the first round.

use std::collections::HashMap;

use async_trait::async_trait;

use super::{Publisher, Receipt, TransportError};
use crate::message::OutgoingMessage;

/// What a broker's publisher implements: sending messages in order, confirmed. Its
/// [`Publisher`] — stamping first when [`stamps`](BatchSender::stamps), one message as a batch
/// of one — is the same for every broker.
#[async_trait]
pub trait BatchSender: Send + Sync + 'static {
    /// Whether [`Publisher`] calls give messages an event id and a `traceparent` before they
    /// are sent ([`OutgoingMessage::stamp`]).
    fn stamps(&self) -> bool;

    /// Sends `messages` as they are, in order (pipelined where the broker allows); returns once
    /// every one is confirmed.
    async fn send_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Receipt>, TransportError>;

    /// True when the broker keeps a key's messages in order by itself when one of a pipelined
    /// batch fails — later messages of its partition fail with it — so a batch needs no rounds.
    fn orders_on_failure(&self) -> bool {
        false
    }

    /// Sends one message as it is, confirmed.
    async fn send_one(&self, message: &OutgoingMessage) -> Result<Receipt, TransportError> {
        let mut receipts = self.send_all(std::slice::from_ref(message)).await?;
        receipts.pop().ok_or(TransportError::Closed)
    }
}

#[async_trait]
impl<S: BatchSender> Publisher for S {
    async fn publish(&self, mut message: OutgoingMessage) -> Result<Receipt, TransportError> {
        if self.stamps() {
            message.stamp();
        }
        self.send_one(&message).await
    }

    /// In rounds unless the broker orders on failure (see the module's documentation): on an
    /// error, every message of a key after its first unconfirmed one was not sent, and
    /// publishing the batch again keeps every key's order (what was stored comes again, a
    /// duplicate its event id lets consumers skip).
    async fn publish_all(&self, mut messages: Vec<OutgoingMessage>) -> Result<Vec<Receipt>, TransportError> {
        if self.stamps() {
            messages.iter_mut().for_each(OutgoingMessage::stamp);
        }
        if self.orders_on_failure() {
            return self.send_all(&messages).await;
        }
        send_in_rounds(self, messages).await
    }
}

/// Sends `messages` in rounds: the `i`-th message of each key in round `i`, each round
/// confirmed before the next starts. Receipts come back in the messages' order.
async fn send_in_rounds<S: BatchSender + ?Sized>(
    sender: &S,
    messages: Vec<OutgoingMessage>,
) -> Result<Vec<Receipt>, TransportError> {
    let rounds = rounds(&messages);
    if rounds.len() <= 1 {
        return sender.send_all(&messages).await;
    }
    let mut receipts: Vec<Option<Receipt>> = vec![None; messages.len()];
    let mut messages: Vec<Option<OutgoingMessage>> = messages.into_iter().map(Some).collect();
    for round in rounds {
        let batch: Vec<OutgoingMessage> = round.iter().filter_map(|&i| messages[i].take()).collect();
        let confirmed = sender.send_all(&batch).await?;
        for (i, receipt) in round.into_iter().zip(confirmed) {
            receipts[i] = Some(receipt);
        }
    }
    receipts
        .into_iter()
        .map(|r| r.ok_or(TransportError::Closed))
        .collect()
}

/// The indices of `messages` by round: a keyed message's round is the number of earlier
/// messages of its key; keyless messages are in round 0.
fn rounds(messages: &[OutgoingMessage]) -> Vec<Vec<usize>> {
    let mut seen: HashMap<&[u8], usize> = HashMap::new();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let round = match message.key.as_deref().filter(|k| !k.is_empty()) {
            Some(key) => {
                let n = seen.entry(key).or_default();
                *n += 1;
                *n - 1
            }
            None => 0,
        };
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push(i);
    }
    rounds
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SourceId;
    use std::sync::Mutex;

    /// A broker that confirms each message on its own and refuses the ones whose payload is
    /// `refuse`, storing the rest of the batch.
    #[derive(Default)]
    struct OneByOne {
        stored: Mutex<Vec<String>>,
        batches: Mutex<usize>,
        ordered: bool,
    }

    #[async_trait]
    impl BatchSender for OneByOne {
        fn stamps(&self) -> bool {
            false
        }
        fn orders_on_failure(&self) -> bool {
            self.ordered
        }
        async fn send_all(&self, messages: &[OutgoingMessage]) -> Result<Vec<Receipt>, TransportError> {
            *self.batches.lock().unwrap() += 1;
            let mut refused = false;
            let mut receipts = Vec::new();
            for m in messages {
                let text = String::from_utf8_lossy(&m.payload).into_owned();
                if text == "refuse" {
                    refused = true;
                    continue;
                }
                let mut stored = self.stored.lock().unwrap();
                stored.push(format!(
                    "{}:{text}",
                    String::from_utf8_lossy(m.key.as_deref().unwrap_or(b"-"))
                ));
                receipts.push(Receipt {
                    source: SourceId::partition("t", 0),
                    offset: stored.len() as u64,
                });
            }
            match refused {
                true => Err(TransportError::Unavailable("refused one".into())),
                false => Ok(receipts),
            }
        }
    }

    fn batch(messages: &[(&str, &str)]) -> Vec<OutgoingMessage> {
        messages
            .iter()
            .map(|(k, p)| match *k {
                "" => OutgoingMessage::keyless(p.to_string()),
                k => OutgoingMessage::new(k.to_string(), p.to_string()),
            })
            .collect()
    }

    #[tokio::test]
    async fn after_a_refused_message_nothing_later_of_its_key_is_sent() {
        let broker = OneByOne::default();
        let messages = batch(&[
            ("k", "1"),
            ("j", "1"),
            ("k", "refuse"),
            ("j", "2"),
            ("k", "3"),
            ("j", "3"),
        ]);
        assert!(broker.publish_all(messages).await.is_err());
        // Round 0: k1 j1; round 1: k-refused j2, refused — so k3 (and j3) never went out.
        assert_eq!(*broker.stored.lock().unwrap(), ["k:1", "j:1", "j:2"]);

        // Pipelined in one batch, the broker would have stored k3 after the refused one.
        let pipelined = OneByOne {
            ordered: true,
            ..OneByOne::default()
        };
        let messages = batch(&[("k", "1"), ("k", "refuse"), ("k", "3")]);
        assert!(pipelined.publish_all(messages).await.is_err());
        assert_eq!(*pipelined.stored.lock().unwrap(), ["k:1", "k:3"]);
    }

    #[tokio::test]
    async fn rounds_pipeline_across_keys_and_receipts_keep_the_batchs_order() {
        let broker = OneByOne::default();
        let messages = batch(&[
            ("a", "1"),
            ("b", "1"),
            ("", "x"),
            ("a", "2"),
            ("", "y"),
            ("a", "3"),
            ("b", "2"),
        ]);
        let receipts = broker.publish_all(messages).await.unwrap();
        assert_eq!(
            *broker.batches.lock().unwrap(),
            3,
            "as many rounds as the busiest key has messages"
        );
        assert_eq!(
            *broker.stored.lock().unwrap(),
            ["a:1", "b:1", "-:x", "-:y", "a:2", "b:2", "a:3"]
        );
        // Receipt i is message i's: a1 stored 1st, b1 2nd, x 3rd, a2 5th, y 4th, a3 7th, b2 6th.
        let offsets: Vec<u64> = receipts.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, [1, 2, 3, 5, 4, 7, 6]);

        let one_key = OneByOne::default();
        one_key
            .publish_all(batch(&[("a", "1"), ("b", "1")]))
            .await
            .unwrap();
        assert_eq!(
            *one_key.batches.lock().unwrap(),
            1,
            "one message per key: one batch"
        );
    }
}
