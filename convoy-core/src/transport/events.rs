//! What a subscription reports, and the channel that carries it.
//!
//! One FIFO carries everything, so order holds between control events and message batches
//! (`Assigned(s)` before any message of `s`, no message of an assignment after its `Revoked`).
//! Control events are never dropped and never wait for room; message batches take one of a
//! fixed number of slots, which the engine returns as it takes each batch. So a revoke waits
//! behind at most `capacity` batches, however many partitions are fetching.

use std::fmt;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio::time::Instant;

use super::{Assignment, TransportError};
use crate::message::{Message, SourceId};
use crate::spares::Spares;

/// The engine's acknowledgement that revoked sources were drained and committed.
#[derive(Debug)]
pub struct RevokeAck(oneshot::Sender<()>);

impl RevokeAck {
    /// A pair: the ack the engine completes, and the receiver the transport waits on.
    pub fn new() -> (RevokeAck, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        (RevokeAck(tx), rx)
    }

    /// Tells the transport it may release the sources.
    pub fn done(self) {
        // The transport may have given up waiting; nothing more to do then.
        let _ = self.0.send(());
    }
}

/// What a subscription reports to the engine.
#[derive(Debug)]
pub enum SourceEvent {
    /// Messages of one source, in offset order.
    Messages {
        /// The source.
        source: SourceId,
        /// The batch.
        messages: Vec<Message>,
    },
    /// Sources now owned by this consumer.
    Assigned(Vec<Assignment>),
    /// Sources being taken away: drain, commit, then acknowledge — all before `deadline`, when
    /// the transport releases them whether acknowledged or not. The engine cancels whatever of
    /// these sources still runs before the deadline, so no message is ever handled by two
    /// members at once.
    Revoked {
        /// The sources.
        sources: Vec<SourceId>,
        /// When the transport hands the sources on regardless.
        deadline: Instant,
        /// Complete after the final commit.
        ack: RevokeAck,
    },
    /// Sources already gone (session expired, connection lost): do not commit them.
    Lost(Vec<SourceId>),
    /// The subscription cannot go on (fenced member, authorization failure, a fatal client
    /// error): the engine stops and reports this error.
    Failed(TransportError),
}

enum Envelope {
    Control(SourceEvent),
    /// A message batch and the slot it holds until the engine takes it (dropping the permit
    /// frees the slot).
    Batch {
        event: SourceEvent,
        _slot: OwnedSemaphorePermit,
    },
}

/// The event channel between a transport and the engine (see the module docs).
pub fn event_channel(capacity: usize) -> (EventSender, EventReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    let capacity = capacity.max(1);
    // Every batch in flight, and one being filled, can come back for reuse.
    let spares = Spares::new(capacity + 1);
    (
        EventSender {
            tx,
            slots: Arc::new(Semaphore::new(capacity)),
            spares: spares.clone(),
        },
        EventReceiver { rx, spares },
    )
}

/// The engine stopped listening: nothing sent now can be delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the engine stopped receiving events")]
pub struct EventsClosed;

/// Why a batch was not sent by [`EventSender::try_messages`]; the batch comes back.
#[derive(Debug)]
pub enum TrySendBatch {
    /// Every slot is taken: try again once the engine took a batch.
    Full(Vec<Message>),
    /// The engine stopped listening.
    Closed,
}

/// The transport's end of the event channel. Cheap to clone.
#[derive(Clone)]
pub struct EventSender {
    tx: mpsc::UnboundedSender<Envelope>,
    slots: Arc<Semaphore>,
    spares: Spares<Message>,
}

impl fmt::Debug for EventSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventSender")
            .field("free_slots", &self.slots.available_permits())
            .finish_non_exhaustive()
    }
}

impl EventSender {
    /// An empty vector to fill with the next batch: one the engine emptied, if there is one.
    /// A batch grown from nothing reallocates several times (and glibc consolidates its heap on
    /// each large request); a recycled one does not allocate at all.
    pub fn batch_buffer(&self) -> Vec<Message> {
        self.spares.take()
    }

    /// Sends a control event (`Assigned`, `Revoked`, `Lost`, `Failed`): never waits, never
    /// dropped while the engine listens.
    pub fn control(&self, event: SourceEvent) -> Result<(), EventsClosed> {
        self.tx.send(Envelope::Control(event)).map_err(|_| EventsClosed)
    }

    /// Sends a batch of one source, waiting for a free slot.
    pub async fn messages(&self, source: SourceId, messages: Vec<Message>) -> Result<(), EventsClosed> {
        let permit = tokio::select! {
            permit = self.slots.clone().acquire_owned() => permit.map_err(|_| EventsClosed)?,
            _ = self.tx.closed() => return Err(EventsClosed),
        };
        self.tx
            .send(Envelope::Batch {
                event: SourceEvent::Messages { source, messages },
                _slot: permit,
            })
            .map_err(|_| EventsClosed)
    }

    /// Sends a batch if a slot is free now (for transports polling from threads).
    pub fn try_messages(&self, source: SourceId, messages: Vec<Message>) -> Result<(), TrySendBatch> {
        if self.tx.is_closed() {
            return Err(TrySendBatch::Closed);
        }
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(TryAcquireError::NoPermits) => return Err(TrySendBatch::Full(messages)),
            Err(TryAcquireError::Closed) => return Err(TrySendBatch::Closed),
        };
        self.tx
            .send(Envelope::Batch {
                event: SourceEvent::Messages { source, messages },
                _slot: permit,
            })
            .map_err(|_| TrySendBatch::Closed)
    }

    /// True once the engine stopped listening.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Completes when the engine stops listening.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// The engine's end of the event channel.
pub struct EventReceiver {
    rx: mpsc::UnboundedReceiver<Envelope>,
    spares: Spares<Message>,
}

impl fmt::Debug for EventReceiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventReceiver").finish_non_exhaustive()
    }
}

impl EventReceiver {
    /// The next event in order; `None` once every sender is gone. Taking a batch frees its slot.
    pub async fn recv(&mut self) -> Option<SourceEvent> {
        self.rx.recv().await.map(Self::open)
    }

    /// The next event if one is queued now.
    pub fn try_recv(&mut self) -> Option<SourceEvent> {
        self.rx.try_recv().ok().map(Self::open)
    }

    /// Gives back an emptied batch vector for [`EventSender::batch_buffer`].
    pub(crate) fn recycle(&self, batch: Vec<Message>) {
        self.spares.keep(batch);
    }

    fn open(envelope: Envelope) -> SourceEvent {
        match envelope {
            Envelope::Control(event) | Envelope::Batch { event, .. } => event,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> Vec<Message> {
        Vec::new()
    }

    #[tokio::test]
    async fn control_events_pass_full_batch_slots_and_keep_their_place() {
        let (tx, mut rx) = event_channel(2);
        let s = SourceId::new("t/0");
        tx.try_messages(s.clone(), batch()).unwrap();
        tx.try_messages(s.clone(), batch()).unwrap();
        assert!(matches!(
            tx.try_messages(s.clone(), batch()),
            Err(TrySendBatch::Full(_))
        ));
        // The slots are taken, yet a control event goes through at once, behind the batches.
        tx.control(SourceEvent::Lost(vec![s.clone()])).unwrap();
        assert!(matches!(rx.recv().await, Some(SourceEvent::Messages { .. })));
        // Taking a batch frees its slot.
        tx.try_messages(s.clone(), batch()).unwrap();
        assert!(matches!(rx.recv().await, Some(SourceEvent::Messages { .. })));
        assert!(matches!(rx.recv().await, Some(SourceEvent::Lost(_))));
        assert!(matches!(rx.recv().await, Some(SourceEvent::Messages { .. })));
        assert!(rx.try_recv().is_none());
    }

    #[tokio::test]
    async fn emptied_batches_come_back_to_the_sender_for_reuse() {
        let (tx, mut rx) = event_channel(2);
        let mut buffer = tx.batch_buffer();
        buffer.push(Message {
            key: None,
            payload: "payload".into(),
            headers: Default::default(),
            source: SourceId::new("t/0"),
            offset: 0,
        });
        tx.try_messages(SourceId::new("t/0"), buffer).unwrap();
        let Some(SourceEvent::Messages { mut messages, .. }) = rx.recv().await else {
            panic!("expected the batch");
        };
        assert_eq!(messages.drain(..).count(), 1);
        let capacity = messages.capacity();
        rx.recycle(messages);
        let again = tx.batch_buffer();
        assert!(again.is_empty());
        assert_eq!(again.capacity(), capacity, "the emptied vector is reused");
    }

    #[tokio::test]
    async fn a_waiting_sender_notices_the_engine_is_gone() {
        let (tx, rx) = event_channel(1);
        let s = SourceId::new("t/0");
        tx.messages(s.clone(), batch()).await.unwrap();
        let waiting = tokio::spawn({
            let tx = tx.clone();
            async move { tx.messages(s, batch()).await }
        });
        drop(rx);
        assert_eq!(waiting.await.unwrap(), Err(EventsClosed));
        assert!(tx.is_closed());
        assert_eq!(
            tx.control(SourceEvent::Lost(Vec::new())).unwrap_err(),
            EventsClosed
        );
    }
}
