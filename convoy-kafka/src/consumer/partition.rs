//! One thread per assigned partition: it polls the partition's own queue and hands batches to
//! the engine, bounded in messages and bytes. Paused, it stops draining the queue (librdkafka
//! then stops fetching at its bounded queue limits).

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use convoy_core::transport::TrySendBatch;
use convoy_core::{Message, SourceId};

use super::{PartitionQueue, Shared, Tp, POLL};
use crate::convert::{source_id, to_message};

pub(super) struct PartitionThread {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl PartitionThread {
    /// Starts polling `queue` for `tp`; `None` (logged) if the thread cannot start.
    pub fn start(tp: &Tp, queue: PartitionQueue, shared: Arc<Shared>) -> Option<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let source = source_id(&tp.0, tp.1);
        let key = tp.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("convoy-kafka-{}", tp.1))
            .spawn(move || partition_loop(&queue, &source, &key, &shared, &flag));
        match spawned {
            Ok(thread) => Some(PartitionThread { stop, thread }),
            Err(e) => {
                tracing::error!(error = %e, topic = %tp.0, partition = tp.1, "cannot start a partition thread");
                None
            }
        }
    }

    pub fn stop(&self) {
        self.stop.store(true, SeqCst);
    }

    pub fn join(self) {
        // A partition thread only ends by noticing its stop flag; a panic there is a bug.
        if self.thread.join().is_err() {
            tracing::error!("a Kafka partition thread panicked");
        }
    }
}

/// Polls one record, reporting errors (a fatal one stops the thread: `Err`).
fn poll_one(
    queue: &PartitionQueue,
    timeout: Duration,
    source: &SourceId,
    shared: &Shared,
) -> Result<Option<Message>, ()> {
    match queue.poll(timeout) {
        None => Ok(None),
        Some(Ok(record)) => Ok(Some(to_message(&record, source))),
        Some(Err(e)) => {
            if shared.fail_if_fatal(&e, &format!("fetching {source}")) {
                return Err(());
            }
            tracing::warn!(%source, error = %e, "fetch error");
            Ok(None)
        }
    }
}

fn partition_loop(queue: &PartitionQueue, source: &SourceId, tp: &Tp, shared: &Shared, stop: &AtomicBool) {
    let (mut batches, mut messages, mut full_waits) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    let limits = shared.prefetch;
    while !stop.load(SeqCst) {
        if shared.is_paused(tp) {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let Ok(first) = poll_one(queue, POLL, source, shared) else {
            return;
        };
        let Some(first) = first else { continue };
        let mut bytes = first.weight();
        let mut batch = vec![first];
        while batch.len() < limits.batch_messages && bytes < limits.batch_bytes {
            match poll_one(queue, Duration::ZERO, source, shared) {
                Ok(Some(message)) => {
                    bytes += message.weight();
                    batch.push(message);
                }
                Ok(None) => break,
                Err(()) => return,
            }
        }
        batches += 1;
        messages += batch.len() as u64;
        // Wait for a free slot, but notice a stop: an unsent batch is simply fetched again by the
        // next owner (nothing of it was committed).
        loop {
            match shared.events.try_messages(source.clone(), batch) {
                Ok(()) => break,
                Err(TrySendBatch::Closed) => return,
                Err(TrySendBatch::Full(back)) => {
                    if stop.load(SeqCst) {
                        return;
                    }
                    full_waits += 1;
                    batch = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
    tracing::debug!(%source, batches, messages, full_waits, elapsed = ?started.elapsed(), "partition thread stopped");
}
