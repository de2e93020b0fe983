//! One owned partition queue, read on its own channel: deliveries in batches to the engine,
//! reading paused while the engine says so (the broker's prefetch then stops delivery), until
//! the member stops it or the channel ends.
//!
//! The task hands its `Consumer` back when it ends instead of dropping it: dropping an active
//! lapin consumer sends `basic.cancel`, and a cancel before the channel closes would let the next
//! owner receive newer messages before this one's unacknowledged ones.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use async_trait::async_trait;
use convoy_core::transport::{EventSender, PartitionReader};
use convoy_core::SourceId;
use futures_util::{FutureExt, StreamExt};
use lapin::Consumer;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::MAX_BATCH;
use crate::convert::to_message;

/// Why a partition task ended.
pub(super) enum Ended {
    /// The member stopped it (handover, close, connection lost).
    Stopped,
    /// The broker cancelled the consumer (the queue was deleted).
    Cancelled,
    /// The channel or the connection failed.
    Failed(lapin::Error),
}

pub(super) struct PartitionTask {
    stop: watch::Sender<bool>,
    handle: JoinHandle<(Consumer, Ended)>,
}

/// What the task needs.
pub(super) struct PartitionParts {
    pub source: SourceId,
    pub consumer: Consumer,
    pub paused: watch::Receiver<bool>,
    pub delivered: Arc<AtomicU64>,
    pub events: EventSender,
    /// Told the source when the task ends by itself.
    pub ended: mpsc::UnboundedSender<SourceId>,
    pub batch_bytes: usize,
}

impl PartitionTask {
    pub fn spawn(parts: PartitionParts) -> Self {
        let (stop, stopped) = watch::channel(false);
        PartitionTask {
            stop,
            handle: tokio::spawn(read(parts, stopped)),
        }
    }
}

#[async_trait]
impl PartitionReader for PartitionTask {
    type Stopped = (Option<Consumer>, Ended);

    /// Stops reading (a batch waiting for room is dropped: it is redelivered, being unacked) and
    /// returns the consumer with why the task ended.
    async fn stop(self) -> (Option<Consumer>, Ended) {
        let _ = self.stop.send(true);
        match self.handle.await {
            Ok((consumer, ended)) => (Some(consumer), ended),
            Err(e) => {
                tracing::error!(error = %e, "a RabbitMQ partition task failed");
                (None, Ended::Stopped)
            }
        }
    }
}

async fn read(parts: PartitionParts, mut stopped: watch::Receiver<bool>) -> (Consumer, Ended) {
    let PartitionParts {
        source,
        mut consumer,
        mut paused,
        delivered,
        events,
        ended,
        batch_bytes,
    } = parts;
    let outcome = loop {
        if *stopped.borrow() {
            break Ended::Stopped;
        }
        // A closed watch (its sender dropped) means the member forgot this partition: stop.
        if *paused.borrow() {
            let open = tokio::select! {
                changed = stopped.changed() => changed.is_ok(),
                changed = paused.changed() => changed.is_ok(),
            };
            if !open {
                break Ended::Stopped;
            }
            continue;
        }
        let first = tokio::select! {
            biased;
            changed = stopped.changed() => match changed {
                Ok(()) => continue,
                Err(_) => break Ended::Stopped,
            },
            changed = paused.changed() => match changed {
                Ok(()) => continue,
                Err(_) => break Ended::Stopped,
            },
            first = consumer.next() => first,
        };
        let mut end = None;
        let mut batch = match first {
            Some(Ok(delivery)) => {
                let mut batch = events.batch_buffer();
                batch.push(to_message(delivery, &source));
                batch
            }
            Some(Err(e)) => break Ended::Failed(e),
            None => break Ended::Cancelled,
        };
        let mut bytes = batch[0].weight();
        while batch.len() < MAX_BATCH && bytes < batch_bytes {
            match consumer.next().now_or_never() {
                Some(Some(Ok(delivery))) => {
                    let message = to_message(delivery, &source);
                    bytes += message.weight();
                    batch.push(message);
                }
                Some(Some(Err(e))) => {
                    end = Some(Ended::Failed(e));
                    break;
                }
                Some(None) => {
                    end = Some(Ended::Cancelled);
                    break;
                }
                None => break,
            }
        }
        if let Some(last) = batch.last() {
            delivered.store(last.offset, Relaxed);
        }
        tokio::select! {
            sent = events.messages(source.clone(), batch) => {
                if sent.is_err() {
                    break Ended::Stopped; // the engine is gone
                }
            }
            _ = stopped.changed() => break Ended::Stopped,
        }
        if let Some(end) = end {
            break end;
        }
    };
    if !matches!(outcome, Ended::Stopped) {
        let _ = ended.send(source);
    }
    (consumer, outcome)
}
