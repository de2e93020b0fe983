//! The engine's `max_in_flight`: slots for handler calls, shared by all shards.
//!
//! A counting semaphore made for the hot path. The free slots are counted in one stripe per
//! shard: a shard takes from its own stripe and returns to it (one uncontended atomic operation
//! each), and takes from another shard's stripe only when its own is empty — so keys that crowd
//! one shard borrow the slots others do not use, and the limit holds for the engine as a whole.
//! (A fixed share per shard made lanes of a crowded shard wait while others had slots to spare:
//! 1,000 keys with 1 ms of work ran 20 % slower under the default 1,024. tokio's `Semaphore`
//! takes its lock on every release: measured to halve the engine's throughput on the
//! 10,000-key memory benchmark.) The waiter list (behind a lock) is touched only when every
//! stripe is empty. A waiting call that is dropped — its lane cancelled — leaves the list, and
//! passes on a wake-up it was given, so no slot is ever lost.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// One shard's count of free slots, on a cache line of its own.
#[repr(align(128))]
#[derive(Default)]
struct Stripe(AtomicUsize);

impl Stripe {
    fn take(&self) -> bool {
        let mut free = self.0.load(SeqCst);
        while free > 0 {
            match self.0.compare_exchange_weak(free, free - 1, SeqCst, SeqCst) {
                Ok(_) => return true,
                Err(now) => free = now,
            }
        }
        false
    }
}

pub(crate) struct CallSlots {
    stripes: Box<[Stripe]>,
    waiting: AtomicBool,
    waiters: Mutex<Waiters>,
}

#[derive(Default)]
struct Waiters {
    queue: VecDeque<(u64, Waker)>,
    next_id: u64,
}

impl CallSlots {
    /// `slots` slots, spread over `stripes` stripes (one per shard).
    pub fn new(slots: usize, stripes: usize) -> Self {
        let stripes = stripes.max(1);
        CallSlots {
            stripes: (0..stripes)
                .map(|i| {
                    Stripe(AtomicUsize::new(
                        slots / stripes + usize::from(i < slots % stripes),
                    ))
                })
                .collect(),
            waiting: AtomicBool::new(false),
            waiters: Mutex::default(),
        }
    }

    /// Waits for a free slot for shard `home`; it is returned when the [`Slot`] drops.
    pub fn acquire(&self, home: usize) -> Acquire<'_> {
        Acquire {
            slots: self,
            home: home % self.stripes.len(),
            registered: None,
        }
    }

    /// Takes a slot from `home`'s stripe, else from any other.
    fn try_take(&self, home: usize) -> bool {
        let n = self.stripes.len();
        (0..n).any(|i| self.stripes[(home + i) % n].take())
    }

    fn free(&self) -> usize {
        self.stripes.iter().map(|s| s.0.load(SeqCst)).sum()
    }

    fn waiters(&self) -> MutexGuard<'_, Waiters> {
        // Nothing panics while holding it; a poisoned list is still a valid list.
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes the first waiter, if any (a slot just became free).
    fn wake_one(&self) {
        if !self.waiting.load(SeqCst) {
            return;
        }
        let mut waiters = self.waiters();
        if let Some((_, waker)) = waiters.queue.pop_front() {
            waker.wake();
        }
        if waiters.queue.is_empty() {
            self.waiting.store(false, SeqCst);
        }
    }

    fn release(&self, home: usize) {
        // Sequentially consistent with the waiter's `waiting` store and re-check: either it
        // sees this slot, or this sees it waiting.
        self.stripes[home].0.fetch_add(1, SeqCst);
        self.wake_one();
    }
}

/// A taken slot; returned on drop, to the stripe of the shard that took it.
pub(crate) struct Slot<'a> {
    slots: &'a CallSlots,
    home: usize,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.slots.release(self.home);
    }
}

/// The future of [`CallSlots::acquire`].
pub(crate) struct Acquire<'a> {
    slots: &'a CallSlots,
    home: usize,
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
        if self.registered.is_none() && slots.try_take(self.home) {
            return Poll::Ready(Slot {
                slots,
                home: self.home,
            });
        }
        let mut waiters = slots.waiters();
        // Announce the wait first, then look again: a slot released after this look sees
        // `waiting` and wakes someone; one released before it is found here.
        slots.waiting.store(true, SeqCst);
        if slots.try_take(self.home) {
            self.deregister(&mut waiters);
            if waiters.queue.is_empty() {
                slots.waiting.store(false, SeqCst);
            }
            drop(waiters);
            return Poll::Ready(Slot {
                slots,
                home: self.home,
            });
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
        if !still_waiting && slots.free() > 0 {
            slots.wake_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn never_more_than_the_slots_and_none_lost() {
        // Three slots over two stripes: callers of both shards borrow from each other.
        let slots = Arc::new(CallSlots::new(3, 2));
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..200 {
            let (slots, running, most) = (slots.clone(), running.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                let acquire = slots.acquire(i % 2);
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
        assert_eq!(slots.free(), 3, "every slot came back");
        assert!(slots.waiters().queue.is_empty());
    }

    /// One slot passed between callers of different stripes on two threads: a release on one
    /// stripe must wake a waiter of the other (a lost wake-up would hang this test; the guard
    /// turns a hang into a failure).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slot_released_on_one_stripe_wakes_a_waiter_of_another() {
        let slots = Arc::new(CallSlots::new(1, 4));
        let mut tasks = Vec::new();
        for home in 0..4 {
            let slots = slots.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..2_000 {
                    let _slot = slots.acquire(home).await;
                    tokio::task::yield_now().await;
                }
            }));
        }
        let all = async {
            for t in tasks {
                t.await.unwrap();
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(120), all)
            .await
            .expect("every caller got the slot 2,000 times (no wake-up lost)");
        assert_eq!(slots.free(), 1);
        assert!(slots.waiters().queue.is_empty());
    }
}
