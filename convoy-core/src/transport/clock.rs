//! Time for leases: elapsed time that also counts while the machine was suspended.
//!
//! A broker expires a lease by its own clock, which goes on while this host (or its VM) is
//! suspended. The monotonic clock behind `Instant` stops meanwhile on Linux, so after a resume
//! a lease would look valid that the broker expired long ago. A [`Mark`] reads two clocks — the
//! runtime's (which tests pause and advance) and, on Linux, `CLOCK_BOOTTIME` (which includes
//! suspended time) — and the time since it is the larger of the two.
//!
//! [`Renewals`] ticks a renewal loop and says when a tick ran far later than scheduled (the
//! process was frozen, the host suspended, the runtime starved): every lease it renews counts
//! as lost then, since the broker may have expired and handed them on while nothing ran here.

use std::time::Duration;

use tokio::time::Instant;

/// A point in time on both clocks.
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    runtime: Instant,
    boot: Option<Duration>,
}

impl Mark {
    /// Now.
    pub fn now() -> Self {
        Mark {
            runtime: Instant::now(),
            boot: boot_time(),
        }
    }

    /// The time since this mark: the larger of the runtime's and the boot clock's.
    pub fn elapsed(&self) -> Duration {
        let runtime = self.runtime.elapsed();
        match (self.boot, boot_time()) {
            (Some(then), Some(now)) => runtime.max(now.saturating_sub(then)),
            _ => runtime,
        }
    }
}

/// Time since boot, suspended time included (Linux's `CLOCK_BOOTTIME`).
#[cfg(target_os = "linux")]
fn boot_time() -> Option<Duration> {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    let secs = u64::try_from(t.tv_sec).ok()?;
    let nanos = u32::try_from(t.tv_nsec).ok()?;
    Some(Duration::new(secs, nanos))
}

/// Elsewhere only the runtime's clock is read (it may stop while the host sleeps).
#[cfg(not(target_os = "linux"))]
fn boot_time() -> Option<Duration> {
    None
}

/// How a renewal tick came.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tick {
    /// About when it was due.
    OnTime,
    /// This long after the previous tick — far later than scheduled.
    Late(Duration),
}

/// The ticks of a lease renewal loop: every `every`, and [`Tick::Late`] when the time since the
/// previous tick (on a [`Mark`]'s clocks) exceeded `every + late_by`.
#[derive(Debug)]
pub struct Renewals {
    interval: tokio::time::Interval,
    every: Duration,
    late_by: Duration,
    last: Option<Mark>,
}

impl Renewals {
    /// Ticks every `every`; one more than `late_by` overdue is late.
    pub fn new(every: Duration, late_by: Duration) -> Self {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Renewals {
            interval,
            every,
            late_by,
            last: None,
        }
    }

    /// Waits for the next tick (the first comes at once).
    pub async fn tick(&mut self) -> Tick {
        self.interval.tick().await;
        let now = Mark::now();
        let since = self.last.replace(now).map(|last| last.elapsed());
        match since {
            Some(gap) if gap > self.every + self.late_by => Tick::Late(gap),
            _ => Tick::OnTime,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_mark_counts_the_runtime_clock() {
        let mark = Mark::now();
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(mark.elapsed() >= Duration::from_secs(30));
    }

    #[test]
    fn a_mark_counts_real_time_too() {
        let mark = Mark::now();
        std::thread::sleep(Duration::from_millis(20));
        assert!(mark.elapsed() >= Duration::from_millis(20));
    }

    #[tokio::test(start_paused = true)]
    async fn a_tick_far_later_than_scheduled_is_late() {
        let mut renewals = Renewals::new(Duration::from_secs(2), Duration::from_secs(3));
        assert_eq!(renewals.tick().await, Tick::OnTime, "the first comes at once");
        assert_eq!(renewals.tick().await, Tick::OnTime);
        // Nothing ran for 10 s (a frozen process): the next tick says so.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(matches!(renewals.tick().await, Tick::Late(gap) if gap >= Duration::from_secs(10)));
        assert_eq!(renewals.tick().await, Tick::OnTime, "and then on time again");
    }
}
