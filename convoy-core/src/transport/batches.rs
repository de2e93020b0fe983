//! A broker adapter's publisher as one confirmed batch send; [`Publisher`] comes with it.

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

    async fn publish_all(&self, mut messages: Vec<OutgoingMessage>) -> Result<Vec<Receipt>, TransportError> {
        if self.stamps() {
            messages.iter_mut().for_each(OutgoingMessage::stamp);
        }
        self.send_all(&messages).await
    }
}
