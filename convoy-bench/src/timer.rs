//! An async wait that lasts the time it is given: [`exact_sleep`].
//!
//! tokio's timer rounds every deadline up to its next 1 ms tick and fires it when a worker next
//! turns to the driver, so `tokio::time::sleep(1 ms)` lasts 2.1–2.4 ms here
//! (`examples/timer_precision.rs` measures it). A benchmark that models "1 ms of async work"
//! with it measures twice that work, and peers that sleep a thread for 1 ms wait ~1.1 ms.
//! Real I/O of 1 ms ends on socket readiness, not on a timer tick.
//!
//! Here one thread keeps the deadlines in a heap and parks until the earliest,
//! which the kernel ends within its timer slack (50 µs by default). The wait ignores tokio's
//! paused clock: tests under `tokio::time::pause` use [`Latency::Fixed`](crate::Latency).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// Waits `duration`, to within the kernel's timer slack. Falls back to tokio's sleep if the
/// timer thread could not be started.
pub async fn exact_sleep(duration: Duration) {
    match timer() {
        Some(timer) => {
            ExactSleep {
                deadline: Instant::now() + duration,
                timer,
                slot: None,
            }
            .await
        }
        None => tokio::time::sleep(duration).await,
    }
}

fn timer() -> Option<&'static Timer> {
    static TIMER: OnceLock<Option<Timer>> = OnceLock::new();
    TIMER.get_or_init(Timer::start).as_ref()
}

struct Timer {
    due: Arc<Mutex<BinaryHeap<Reverse<Due>>>>,
    thread: Thread,
}

/// One pending wait: when it ends and whom to wake.
struct Due {
    deadline: Instant,
    slot: Arc<Slot>,
}

struct Slot(Mutex<SlotState>);

struct SlotState {
    fired: bool,
    waker: Option<Waker>,
}

impl Timer {
    fn start() -> Option<Timer> {
        let due = Arc::new(Mutex::new(BinaryHeap::<Reverse<Due>>::new()));
        let thread = std::thread::Builder::new()
            .name("convoy-timer".into())
            .spawn({
                let due = due.clone();
                move || fire_forever(&due)
            })
            .ok()?
            .thread()
            .clone();
        Some(Timer { due, thread })
    }

    fn insert(&self, deadline: Instant, slot: Arc<Slot>) {
        let mut due = self.due.lock().unwrap_or_else(PoisonError::into_inner);
        let earliest = due.peek().is_none_or(|Reverse(d)| deadline < d.deadline);
        due.push(Reverse(Due { deadline, slot }));
        drop(due);
        // Only a new earliest deadline shortens the thread's park; a park that has not begun
        // yet returns at once on this token.
        if earliest {
            self.thread.unpark();
        }
    }
}

fn fire_forever(due: &Mutex<BinaryHeap<Reverse<Due>>>) {
    let mut fired = Vec::new();
    loop {
        let next = {
            let mut due = due.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            while due.peek().is_some_and(|Reverse(d)| d.deadline <= now) {
                if let Some(Reverse(d)) = due.pop() {
                    fired.push(d.slot);
                }
            }
            due.peek().map(|Reverse(d)| d.deadline)
        };
        for slot in fired.drain(..) {
            let waker = {
                let mut state = slot.0.lock().unwrap_or_else(PoisonError::into_inner);
                state.fired = true;
                state.waker.take()
            };
            if let Some(waker) = waker {
                waker.wake();
            }
        }
        match next {
            Some(deadline) => std::thread::park_timeout(deadline.saturating_duration_since(Instant::now())),
            None => std::thread::park(),
        }
    }
}

struct ExactSleep {
    deadline: Instant,
    timer: &'static Timer,
    slot: Option<Arc<Slot>>,
}

impl Future for ExactSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match &self.slot {
            Some(slot) => {
                let mut state = slot.0.lock().unwrap_or_else(PoisonError::into_inner);
                if state.fired {
                    return Poll::Ready(());
                }
                if !state.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    state.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            None if Instant::now() >= self.deadline => Poll::Ready(()),
            None => {
                let slot = Arc::new(Slot(Mutex::new(SlotState {
                    fired: false,
                    waker: Some(cx.waker().clone()),
                })));
                self.timer.insert(self.deadline, slot.clone());
                self.slot = Some(slot);
                Poll::Pending
            }
        }
    }
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.deadline == other.deadline
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        self.deadline.cmp(&other.deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_never_ends_before_its_duration() {
        for micros in [0, 1, 250, 1_000, 3_000] {
            let duration = Duration::from_micros(micros);
            let started = Instant::now();
            exact_sleep(duration).await;
            assert!(started.elapsed() >= duration, "{micros} µs ended early");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_waits_of_different_lengths_all_end_and_none_early() {
        let waits = (0..500u64).map(|i| {
            tokio::spawn(async move {
                let duration = Duration::from_micros((i * 7919) % 3_000);
                let started = Instant::now();
                exact_sleep(duration).await;
                started.elapsed() >= duration
            })
        });
        let mut ended = 0;
        for wait in waits {
            assert!(wait.await.expect("the wait task panicked"), "a wait ended early");
            ended += 1;
        }
        assert_eq!(ended, 500);
    }
}
