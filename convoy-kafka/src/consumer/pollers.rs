//! Assigned partitions, polled by a bounded pool of threads.
//!
//! Each partition keeps its own queue (split off librdkafka's main queue), so partitions stay
//! independent: a paused or slow one never holds another back. But a thread per partition does
//! not scale to a member owning hundreds of them, so a few threads (one per CPU, at most
//! [`MAX_THREADS`]) serve them all: librdkafka calls a partition's *non-empty callback* when its
//! queue goes from empty to non-empty, which puts the partition on a ready list; a thread takes
//! it, hands the engine one batch (bounded in messages and bytes), and puts it back at the end of
//! the list while it has more, so every ready partition gets its turn. A paused partition is not
//! served (librdkafka keeps what it prefetched and stops fetching at its bounded queue limits)
//! until `resume` puts it back on the list.
//!
//! A wake-up can only be missed in one window — a message arriving while the partition is still
//! marked ready — so a thread that finds a queue empty clears the mark and then looks once more.
//! As a safety net every partition is looked at every [`SWEEP`] anyway.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use convoy_core::transport::TrySendBatch;
use convoy_core::{Message, SourceId};

use super::{PartitionQueue, Shared, Tp};
use crate::convert::{source_id, to_message};

/// Most poller threads of one consumer, whatever the CPU count.
pub const MAX_THREADS: usize = 8;
/// How often every assigned partition is looked at, ready or not.
const SWEEP: Duration = Duration::from_millis(100);

/// One assigned partition.
struct Slot {
    tp: Tp,
    source: SourceId,
    /// `None` once the partition was removed: nothing of it is polled or sent after that.
    queue: Mutex<Option<Served>>,
    /// On the ready list or being served.
    ready: AtomicBool,
    /// Set before the queue is taken away, so a thread waiting to send a batch gives up.
    removed: AtomicBool,
}

/// A partition's queue, and a message taken from it for its next batch.
struct Served {
    queue: PartitionQueue,
    carry: Option<Message>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; a poisoned one is still consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Default)]
struct Pool {
    ready: Mutex<VecDeque<Arc<Slot>>>,
    wake: Condvar,
    slots: Mutex<HashMap<Tp, Arc<Slot>>>,
    stop: AtomicBool,
}

impl Pool {
    /// Puts `slot` on the ready list unless it is there already (or being served).
    fn schedule(&self, slot: &Arc<Slot>) {
        if !slot.ready.swap(true, SeqCst) {
            lock(&self.ready).push_back(slot.clone());
            self.wake.notify_one();
        }
    }

    /// The next ready partition, waiting up to `timeout`.
    fn next(&self, timeout: Duration) -> Option<Arc<Slot>> {
        let mut ready = lock(&self.ready);
        if ready.is_empty() && !self.stop.load(SeqCst) {
            ready = self
                .wake
                .wait_timeout(ready, timeout)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        ready.pop_front()
    }

    fn sweep(&self) {
        let slots: Vec<Arc<Slot>> = lock(&self.slots).values().cloned().collect();
        for slot in &slots {
            self.schedule(slot);
        }
    }
}

/// The partitions of one consumer and the threads that poll them.
pub(super) struct Pollers {
    pool: Arc<Pool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    max_threads: usize,
}

impl Pollers {
    pub fn new() -> Self {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        Pollers {
            pool: Arc::default(),
            threads: Mutex::default(),
            max_threads: cpus.clamp(1, MAX_THREADS),
        }
    }

    /// Starts serving `queue` for `tp` (and a poller thread, while there are fewer than the
    /// partitions and the limit).
    pub fn add(&self, tp: Tp, mut queue: PartitionQueue, shared: &Arc<Shared>) {
        let slot = Arc::new(Slot {
            source: source_id(&tp.0, tp.1),
            tp: tp.clone(),
            queue: Mutex::new(None),
            ready: AtomicBool::new(false),
            removed: AtomicBool::new(false),
        });
        let (pool, waker) = (Arc::downgrade(&self.pool), Arc::downgrade(&slot));
        // Called on librdkafka's threads: only marks the partition ready.
        queue.set_nonempty_callback(move || {
            if let (Some(pool), Some(slot)) = (pool.upgrade(), waker.upgrade()) {
                pool.schedule(&slot);
            }
        });
        *lock(&slot.queue) = Some(Served { queue, carry: None });
        let count = {
            let mut slots = lock(&self.pool.slots);
            slots.insert(tp, slot.clone());
            slots.len()
        };
        self.spawn_up_to(count, shared);
        // It may hold messages already (no transition to wake anyone).
        self.pool.schedule(&slot);
    }

    fn spawn_up_to(&self, partitions: usize, shared: &Arc<Shared>) {
        let mut threads = lock(&self.threads);
        while threads.len() < partitions.min(self.max_threads) {
            let (pool, shared) = (self.pool.clone(), shared.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("convoy-kafka-poll-{}", threads.len()))
                .spawn(move || poll_loop(&pool, &shared));
            match spawned {
                Ok(thread) => threads.push(thread),
                Err(e) => {
                    tracing::error!(error = %e, "cannot start a Kafka poller thread");
                    break;
                }
            }
        }
    }

    /// Stops serving `which`: when this returns, no message of them is polled or sent.
    pub fn remove(&self, which: &[Tp]) {
        let removed: Vec<Arc<Slot>> = {
            let mut slots = lock(&self.pool.slots);
            which.iter().filter_map(|tp| slots.remove(tp)).collect()
        };
        for slot in &removed {
            slot.removed.store(true, SeqCst);
        }
        for slot in removed {
            // Waits for a thread serving it to finish its batch (or give it up).
            drop(lock(&slot.queue).take());
        }
    }

    /// The partitions served now.
    pub fn partitions(&self) -> Vec<Tp> {
        lock(&self.pool.slots).keys().cloned().collect()
    }

    /// Serves `which` again after a pause.
    pub fn resume(&self, which: &[Tp]) {
        let slots: Vec<Arc<Slot>> = {
            let slots = lock(&self.pool.slots);
            which.iter().filter_map(|tp| slots.get(tp).cloned()).collect()
        };
        for slot in &slots {
            self.pool.schedule(slot);
        }
    }

    /// Stops the threads (after `remove` of every partition) and waits for them.
    pub fn shutdown(&self) {
        self.pool.stop.store(true, SeqCst);
        self.pool.wake.notify_all();
        let threads = std::mem::take(&mut *lock(&self.threads));
        for thread in threads {
            // A poller thread only ends by noticing the stop; a panic there is a bug.
            if thread.join().is_err() {
                tracing::error!("a Kafka poller thread panicked");
            }
        }
    }
}

fn poll_loop(pool: &Pool, shared: &Shared) {
    let mut swept = Instant::now();
    while !pool.stop.load(SeqCst) {
        if swept.elapsed() >= SWEEP {
            swept = Instant::now();
            pool.sweep();
        }
        if let Some(slot) = pool.next(SWEEP) {
            if serve(pool, &slot, shared).is_err() {
                return; // a fatal error, reported: the engine stops
            }
        }
    }
}

/// Hands the engine one batch of `slot`, if it has one and is not paused, and puts it back at
/// the end of the ready list while it may have more. `Err` after a fatal error.
fn serve(pool: &Pool, slot: &Arc<Slot>, shared: &Shared) -> Result<(), ()> {
    let mut guard = lock(&slot.queue);
    let Some(served) = guard.as_mut() else {
        return Ok(()); // removed
    };
    if shared.is_paused(&slot.tp) {
        slot.ready.store(false, SeqCst); // `resume` schedules it again
        return Ok(());
    }
    let limits = shared.prefetch;
    let mut batch = shared.events.batch_buffer();
    batch.extend(served.carry.take());
    let mut bytes: usize = batch.iter().map(Message::weight).sum();
    let mut drained = false;
    while batch.len() < limits.batch_messages && bytes < limits.batch_bytes {
        match poll_one(&served.queue, &slot.source, shared)? {
            Some(message) => {
                bytes += message.weight();
                batch.push(message);
            }
            None => {
                drained = true;
                break;
            }
        }
    }
    if drained {
        // Clear the mark, then look once more: a message that arrived before the mark was
        // cleared woke nobody. One found is carried into the partition's next batch.
        slot.ready.store(false, SeqCst);
        if let Some(message) = poll_one(&served.queue, &slot.source, shared)? {
            served.carry = Some(message);
            slot.ready.store(true, SeqCst);
            drained = false;
        }
    }
    if !batch.is_empty() {
        send(slot, batch, shared);
    }
    drop(guard);
    if !drained {
        lock(&pool.ready).push_back(slot.clone());
        pool.wake.notify_one();
    }
    Ok(())
}

/// Polls one record without waiting, reporting errors (`Err` after a fatal one).
fn poll_one(queue: &PartitionQueue, source: &SourceId, shared: &Shared) -> Result<Option<Message>, ()> {
    match queue.poll(Duration::ZERO) {
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

/// Sends `batch` to the engine, waiting for room; gives up if the partition is removed or the
/// consumer stops meanwhile (nothing of it was committed: the next owner fetches it again).
fn send(slot: &Slot, mut batch: Vec<Message>, shared: &Shared) {
    loop {
        match shared.events.try_messages(slot.source.clone(), batch) {
            Ok(()) | Err(TrySendBatch::Closed) => return,
            Err(TrySendBatch::Full(back)) => {
                if slot.removed.load(SeqCst) || shared.stopped.load(SeqCst) {
                    return;
                }
                batch = back;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
