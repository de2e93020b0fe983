//! A shard's share of `max_in_flight`: slots for handler calls.
//!
//! A counting semaphore made for the hot path: taking and returning a free slot is one atomic
//! operation each, and the waiter list (behind a lock) is touched only when the shard is at its
//! limit. (tokio's `Semaphore` takes its lock on every release: measured to halve the engine's
//! throughput on the 10,000-key memory benchmark.) A waiting call that is dropped — its lane
//! cancelled — leaves the list, and passes on a wake-up it was given, so no slot is ever lost.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

pub(crate) struct CallSlots {
    free: AtomicUsize,
    waiting: AtomicBool,
    waiters: Mutex<Waiters>,
}

#[derive(Default)]
struct Waiters {
    queue: VecDeque<(u64, Waker)>,
    next_id: u64,
}

impl CallSlots {
    pub fn new(slots: usize) -> Self {
        CallSlots {
            free: AtomicUsize::new(slots),
            waiting: AtomicBool::new(false),
            waiters: Mutex::default(),
        }
    }

    /// Waits for a free slot; it is returned when the [`Slot`] drops.
    pub fn acquire(&self) -> Acquire<'_> {
        Acquire {
            slots: self,
            registered: None,
        }
    }

    fn try_take(&self) -> bool {
        let mut free = self.free.load(Ordering::Acquire);
        while free > 0 {
            match self
                .free
                .compare_exchange_weak(free, free - 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(now) => free = now,
            }
        }
        false
    }

    fn waiters(&self) -> MutexGuard<'_, Waiters> {
        // Nothing panics while holding it; a poisoned list is still a valid list.
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the first waiter, if any (a slot just became free).
    fn wake_one(&self) {
        if !self.waiting.load(Ordering::Acquire) {
            return;
        }
        let mut waiters = self.waiters();
        if let Some((_, waker)) = waiters.queue.pop_front() {
            waker.wake();
        }
        if waiters.queue.is_empty() {
            self.waiting.store(false, Ordering::Release);
        }
    }

    fn release(&self) {
        self.free.fetch_add(1, Ordering::AcqRel);
        self.wake_one();
    }
}

/// A taken slot; returned on drop.
pub(crate) struct Slot<'a>(&'a CallSlots);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// The future of [`CallSlots::acquire`].
pub(crate) struct Acquire<'a> {
    slots: &'a CallSlots,
    /// Our place in the waiter list, once we had to wait.
    registered: Option<u64>,
}

impl Acquire<'_> {
    /// Leaves the waiter list; true if we were still in it (not yet woken).
    fn deregister(&mut self, waiters: &mut Waiters) -> bool {
        let Some(id) = self.registered.take() else {
            return false;
        };
        match waiters.queue.iter().position(|(i, _)| *i == id) {
            Some(index) => {
                waiters.queue.remove(index);
                true
            }
            None => false,
        }
    }
}

impl<'a> Future for Acquire<'a> {
    type Output = Slot<'a>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Slot<'a>> {
        let slots = self.slots;
        if self.registered.is_none() && slots.try_take() {
            return Poll::Ready(Slot(slots));
        }
        let mut waiters = slots.waiters();
        // Checked again under the lock: a slot freed meanwhile wakes nobody we could miss.
        if slots.try_take() {
            self.deregister(&mut waiters);
            return Poll::Ready(Slot(slots));
        }
        let waker = cx.waker().clone();
        match self.registered {
            Some(id) if waiters.queue.iter().any(|(i, _)| *i == id) => {
                if let Some(entry) = waiters.queue.iter_mut().find(|(i, _)| *i == id) {
                    entry.1 = waker;
                }
            }
            _ => {
                // First wait, or woken and beaten to the slot: (re)join the list.
                let id = waiters.next_id;
                waiters.next_id += 1;
                waiters.queue.push_back((id, waker));
                self.registered = Some(id);
            }
        }
        slots.waiting.store(true, Ordering::Release);
        Poll::Pending
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        if self.registered.is_none() {
            return;
        }
        let slots = self.slots;
        let still_waiting = {
            let mut waiters = slots.waiters();
            self.deregister(&mut waiters)
        };
        // Woken but dropped before taking the slot: pass the wake-up on.
        if !still_waiting && slots.free.load(Ordering::Acquire) > 0 {
            slots.wake_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn never_more_than_the_slots_and_none_lost() {
        let slots = Arc::new(CallSlots::new(3));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..200 {
            let (slots, running, most) = (slots.clone(), running.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                let acquire = slots.acquire();
                // Some callers give up while waiting (their lane was cancelled).
                if i % 7 == 0 {
                    let _ = tokio::time::timeout(std::time::Duration::from_micros(50), acquire).await;
                    return;
                }
                let _slot = acquire.await;
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::task::yield_now().await;
                running.fetch_sub(1, Ordering::SeqCst);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(most.load(Ordering::SeqCst) <= 3);
        assert_eq!(slots.free.load(Ordering::SeqCst), 3, "every slot came back");
        assert!(slots.waiters().queue.is_empty());
    }
}
