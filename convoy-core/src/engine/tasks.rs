//! A shard's running lane futures, polled by the shard itself.
//!
//! Each running lane future has a *slot*: a box the future is pinned in, kept for the next
//! future once this one ends, and a waker of its own, made once. Starting a message's future
//! therefore allocates nothing and counts no references (a `FuturesUnordered` task and a boxed
//! future per message were ~15 % of the engine's instructions), and cancelling one drops it at
//! once, before the shard answers whoever asked.
//!
//! A started future is polled right away (a handler that does not wait finishes without ever
//! being woken); a waiting one is polled again when its waker puts its slot on the ready list,
//! from whatever thread. Idle slots beyond [`KEEP_IDLE`] give their box back, so memory follows
//! the running lanes, not the most there ever were.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Idle slots kept (with their box and waker) for the next futures.
const KEEP_IDLE: usize = 1024;

/// Slots whose waker fired, shared with the wakers.
#[derive(Default)]
struct ReadyList {
    slots: Mutex<Vec<u32>>,
    /// Set with every push: lets the shard skip the lock when nothing woke.
    any: AtomicBool,
    /// The shard task, woken when a slot is.
    shard: AtomicWaker,
}

impl ReadyList {
    fn push(&self, slot: u32) {
        // A waker never panics while holding the lock; a poisoned list is still a valid list.
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).push(slot);
        self.any.store(true, Ordering::Release);
        self.shard.wake();
    }

    /// Moves the woken slots into `into` (which must be empty).
    fn take(&self, into: &mut Vec<u32>) {
        if self.any.swap(false, Ordering::AcqRel) {
            std::mem::swap(&mut *self.slots.lock().unwrap_or_else(|p| p.into_inner()), into);
        }
    }
}

/// One slot's waker.
struct SlotWaker {
    slot: u32,
    /// On the ready list already (or being polled): further wakes add nothing.
    queued: AtomicBool,
    ready: Arc<ReadyList>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            self.ready.push(self.slot);
        }
    }
}

struct Slot<F> {
    future: Pin<Box<Option<F>>>,
    /// The starter's tag for the running future (the shard's: its lane's hash).
    tag: u64,
    wake: Arc<SlotWaker>,
    waker: Waker,
}

/// A future that ended: its slot number, its tag and what it returned.
pub(crate) struct Ended<T> {
    pub number: u32,
    pub tag: u64,
    pub output: T,
}

/// The running futures of one shard, each identified by its slot number while it runs.
pub(crate) struct LaneTasks<F> {
    /// `None`: a free number whose box was given back.
    slots: Vec<Option<Slot<F>>>,
    /// Free numbers; those below `idle` boxes still have their slot.
    free: Vec<u32>,
    ready: Arc<ReadyList>,
    /// Started and not polled yet.
    fresh: Vec<u32>,
    /// The woken slots being polled (kept to reuse its allocation).
    woken: Vec<u32>,
    running: usize,
}

impl<F: Future> LaneTasks<F> {
    pub fn new() -> Self {
        LaneTasks {
            slots: Vec::new(),
            free: Vec::new(),
            ready: Arc::default(),
            fresh: Vec::new(),
            woken: Vec::new(),
            running: 0,
        }
    }

    /// Starts `future`, tagged `tag`, in a free slot; it is polled at the next
    /// [`LaneTasks::poll_round`]. Returns its slot number.
    pub fn start(&mut self, tag: u64, future: F) -> u32 {
        let number = match self.free.pop() {
            Some(n) => n,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.slots[number as usize];
        match entry {
            Some(slot) => {
                slot.tag = tag;
                slot.future.as_mut().set(Some(future));
            }
            None => {
                let wake = Arc::new(SlotWaker {
                    slot: number,
                    queued: AtomicBool::new(false),
                    ready: self.ready.clone(),
                });
                *entry = Some(Slot {
                    future: Box::pin(Some(future)),
                    tag,
                    waker: Waker::from(wake.clone()),
                    wake,
                });
            }
        }
        self.running += 1;
        self.fresh.push(number);
        number
    }

    /// Drops the future of `slot` now.
    pub fn cancel(&mut self, slot: u32) {
        if let Some(Some(s)) = self.slots.get_mut(slot as usize) {
            if s.future.is_some() {
                s.future.as_mut().set(None);
                self.release(slot);
            }
        }
    }

    fn release(&mut self, number: u32) {
        self.running -= 1;
        if self.free.len() >= KEEP_IDLE {
            // Enough idle boxes: give this one back (a late wake of it finds nothing to poll).
            self.slots[number as usize] = None;
        }
        self.free.push(number);
    }

    /// True if a slot is due to be polled; otherwise the shard's task is woken when one is.
    /// (`&mut`: a shared borrow held across the shard's await would need the futures `Sync`.)
    pub fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.fresh.is_empty() {
            return Poll::Ready(());
        }
        self.ready.shard.register(cx.waker());
        if self.ready.any.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Polls every started and every woken future once; pushes each that ended onto `ended`
    /// (its slot is free again by then). Returns false if there was nothing to poll.
    pub fn poll_round(&mut self, ended: &mut Vec<Ended<F::Output>>) -> bool {
        let mut woken = std::mem::take(&mut self.woken);
        self.ready.take(&mut woken);
        let progressed = !woken.is_empty() || !self.fresh.is_empty();
        for &number in &woken {
            self.poll_slot(number, true, ended);
        }
        woken.clear();
        self.woken = woken;
        self.poll_fresh(ended);
        progressed
    }

    /// Polls the futures started since the last poll (once each); pushes each that ended onto
    /// `ended`. Returns false if there were none.
    pub fn poll_fresh(&mut self, ended: &mut Vec<Ended<F::Output>>) -> bool {
        let any = !self.fresh.is_empty();
        while let Some(number) = self.fresh.pop() {
            self.poll_slot(number, false, ended);
        }
        any
    }

    /// Polls the future of `number`, if one runs there; frees the slot when it ends.
    fn poll_slot(&mut self, number: u32, woken: bool, ended: &mut Vec<Ended<F::Output>>) {
        let Some(Some(slot)) = self.slots.get_mut(number as usize) else {
            return;
        };
        if woken {
            // Cleared before the poll: a wake during or after it lists the slot again.
            slot.wake.queued.store(false, Ordering::Release);
        }
        let Some(future) = slot.future.as_mut().as_pin_mut() else {
            return;
        };
        let Poll::Ready(output) = future.poll(&mut Context::from_waker(&slot.waker)) else {
            return;
        };
        slot.future.as_mut().set(None);
        ended.push(Ended {
            number,
            tag: slot.tag,
            output,
        });
        self.release(number);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;

    /// Runs rounds until every future ended, waiting for wakes in between.
    async fn drive<F: Future<Output = usize>>(tasks: &mut LaneTasks<F>, ended: &mut Vec<usize>) {
        while tasks.running > 0 {
            std::future::poll_fn(|cx| tasks.poll_ready(cx)).await;
            let mut round = Vec::new();
            tasks.poll_round(&mut round);
            ended.extend(round.into_iter().map(|e| e.output));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_future_ends_whatever_thread_wakes_it() {
        let mut tasks = LaneTasks::new();
        for i in 0..200usize {
            tasks.start(0, async move {
                if i % 3 == 0 {
                    tokio::time::sleep(Duration::from_micros(50 * (i as u64 % 7))).await;
                }
                if i % 5 == 0 {
                    // Woken from another thread.
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    std::thread::spawn(move || {
                        let _ = tx.send(());
                    });
                    let _ = rx.await;
                }
                tokio::task::yield_now().await;
                i
            });
        }
        let mut ended = Vec::new();
        drive(&mut tasks, &mut ended).await;
        ended.sort_unstable();
        assert_eq!(ended, (0..200).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_cancelled_future_is_dropped_at_once_and_its_slot_reused() {
        struct Dropped(Arc<AtomicUsize>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let drops = Arc::new(AtomicUsize::new(0));
        let mut tasks = LaneTasks::new();
        let guard = Dropped(drops.clone());
        let slot = tasks.start(
            3,
            Box::pin(async move {
                let _guard = guard;
                std::future::pending::<()>().await;
                0usize
            }) as Pin<Box<dyn Future<Output = usize> + Send>>,
        );
        let mut ended = Vec::new();
        assert!(tasks.poll_round(&mut ended), "it was polled");
        assert!(ended.is_empty() && tasks.running == 1, "it never ends");
        tasks.cancel(slot);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "dropped by cancel, not later");
        assert_eq!(tasks.running, 0);
        let again = tasks.start(4, Box::pin(async { 7usize }));
        assert_eq!(again, slot, "the slot is reused");
        tasks.poll_round(&mut ended);
        let ended: Vec<_> = ended.iter().map(|e| (e.number, e.tag, e.output)).collect();
        assert_eq!(ended, [(slot, 4, 7)]);
    }

    #[tokio::test]
    async fn idle_slots_beyond_the_kept_number_give_their_box_back() {
        let mut tasks = LaneTasks::new();
        for _ in 0..KEEP_IDLE + 100 {
            tasks.start(0, std::future::ready(()));
        }
        tasks.poll_round(&mut Vec::new());
        assert_eq!(tasks.running, 0);
        let kept = tasks.slots.iter().filter(|s| s.is_some()).count();
        assert_eq!(kept, KEEP_IDLE);
    }
}
