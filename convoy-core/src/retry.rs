//! In-lane retry: how long to wait before the next attempt and when to give up.
//!
//! [`Backoff`] computes delays (exponential, capped, jittered); [`RetryPolicy`] adds the
//! limits and the decision taken when they are reached. The lane composes the two.

use std::time::Duration;

/// How randomness spreads retry delays so failing keys do not retry in lockstep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Jitter {
    /// The exact exponential delay.
    None,
    /// Uniform in `[0, delay]` (AWS "full jitter"): the best spread.
    #[default]
    Full,
    /// Uniform in `[delay/2, delay]`: spread but never much shorter than planned.
    Equal,
}

/// Exponential backoff: `min(cap, base * factor^(n-1))` for retry `n`, then jitter.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Backoff {
    /// Delay before the first retry (before jitter).
    pub base: Duration,
    /// Growth per retry (≥ 1).
    pub factor: f64,
    /// Largest delay (before jitter).
    pub cap: Duration,
    /// Jitter mode.
    pub jitter: Jitter,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(100),
            factor: 2.0,
            cap: Duration::from_secs(30),
            jitter: Jitter::Full,
        }
    }
}

impl Backoff {
    /// Exponential backoff from `base`, times `factor` per retry, at most `cap`, then `jitter`.
    pub fn new(base: Duration, factor: f64, cap: Duration, jitter: Jitter) -> Self {
        Backoff {
            base,
            factor,
            cap,
            jitter,
        }
    }

    /// The un-jittered delay before retry number `retry` (1-based).
    pub fn ceiling(&self, retry: u32) -> Duration {
        let exp = self.factor.powi(retry.saturating_sub(1).min(1_000) as i32);
        let secs = (self.base.as_secs_f64() * exp).min(self.cap.as_secs_f64());
        // Checked: a cap near `Duration::MAX` does not survive the round trip through f64.
        Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(self.cap)
    }

    /// The delay before retry number `retry` (1-based), jittered with `rng`.
    pub fn delay(&self, retry: u32, rng: &mut fastrand::Rng) -> Duration {
        let ceiling = self.ceiling(retry);
        match self.jitter {
            Jitter::None => ceiling,
            Jitter::Full => scale(ceiling, rng.f64()),
            Jitter::Equal => {
                let half = ceiling / 2;
                half.saturating_add(scale(half, rng.f64()))
            }
        }
    }
}

/// `d * fraction` for a fraction in `[0, 1)`, never panicking near `Duration::MAX`.
fn scale(d: Duration, fraction: f64) -> Duration {
    Duration::try_from_secs_f64(d.as_secs_f64() * fraction).map_or(d, |scaled| scaled.min(d))
}

/// What a lane does when a message's retries are exhausted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnExhausted {
    /// Dead-letter the message (reason `retries-exhausted`) and let the lane go on.
    #[default]
    DeadLetter,
    /// Keep retrying at the capped delay: the key stalls (other keys do not) until the
    /// cause is fixed. Pair with a stuck-gap timeout if the watermark must not stall forever.
    BlockLane,
}

/// When and how transient failures are retried inside a lane.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Delay between attempts.
    pub backoff: Backoff,
    /// Give up after this many attempts in total (first try included); `None`: no limit.
    pub max_attempts: Option<u32>,
    /// Give up once this much time has passed since the first failure; `None`: no limit.
    pub max_elapsed: Option<Duration>,
    /// Each attempt's time limit; a timed-out attempt is a transient failure.
    pub attempt_timeout: Option<Duration>,
    /// The decision when a limit is reached.
    pub on_exhausted: OnExhausted,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            backoff: Backoff::default(),
            max_attempts: Some(10),
            max_elapsed: None,
            attempt_timeout: None,
            on_exhausted: OnExhausted::DeadLetter,
        }
    }
}

impl RetryPolicy {
    /// This policy, giving up after `attempts` attempts in total (the first try counts).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// This policy, retrying until an attempt works (or another limit is reached).
    pub fn with_unlimited_attempts(mut self) -> Self {
        self.max_attempts = None;
        self
    }

    /// The default policy with `backoff` between attempts.
    pub fn with_backoff(backoff: Backoff) -> Self {
        RetryPolicy {
            backoff,
            ..RetryPolicy::default()
        }
    }
}

impl RetryPolicy {
    /// True when, after `attempts` attempts and `since_first_failure`, the next attempt
    /// (which would start after `next_delay`) is over a limit.
    pub fn exhausted(&self, attempts: u32, since_first_failure: Duration, next_delay: Duration) -> bool {
        self.max_attempts.is_some_and(|max| attempts >= max)
            || self
                .max_elapsed
                .is_some_and(|max| since_first_failure.saturating_add(next_delay) > max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff(jitter: Jitter) -> Backoff {
        Backoff {
            base: Duration::from_millis(10),
            factor: 2.0,
            cap: Duration::from_millis(100),
            jitter,
        }
    }

    #[test]
    fn exponential_and_capped() {
        let b = backoff(Jitter::None);
        let mut rng = fastrand::Rng::with_seed(1);
        let d: Vec<u128> = (1..=6).map(|n| b.delay(n, &mut rng).as_millis()).collect();
        assert_eq!(d, vec![10, 20, 40, 80, 100, 100]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_millis(100));
    }

    #[test]
    fn jitter_stays_within_its_band() {
        let mut rng = fastrand::Rng::with_seed(7);
        for n in 1..10 {
            let ceiling = backoff(Jitter::None).ceiling(n);
            for _ in 0..200 {
                let full = backoff(Jitter::Full).delay(n, &mut rng);
                assert!(full <= ceiling);
                let equal = backoff(Jitter::Equal).delay(n, &mut rng);
                assert!(equal >= ceiling / 2 && equal <= ceiling);
            }
        }
        // Full jitter actually spreads.
        let spread: std::collections::HashSet<_> = (0..50)
            .map(|_| backoff(Jitter::Full).delay(3, &mut rng))
            .collect();
        assert!(spread.len() > 40);
    }

    #[test]
    fn limits_by_attempts_and_elapsed() {
        let p = RetryPolicy {
            max_attempts: Some(3),
            max_elapsed: Some(Duration::from_secs(1)),
            ..RetryPolicy::default()
        };
        assert!(!p.exhausted(2, Duration::ZERO, Duration::ZERO));
        assert!(p.exhausted(3, Duration::ZERO, Duration::ZERO));
        assert!(p.exhausted(1, Duration::from_millis(900), Duration::from_millis(200)));
        let unlimited = RetryPolicy {
            max_attempts: None,
            ..RetryPolicy::default()
        };
        assert!(!unlimited.exhausted(1_000_000, Duration::from_secs(3600), Duration::ZERO));
        // A handler asking to retry after `Duration::MAX` with a time budget: no overflow.
        assert!(p.exhausted(1, Duration::from_millis(1), Duration::MAX));
    }

    #[test]
    fn huge_caps_do_not_overflow() {
        let b = Backoff {
            base: Duration::from_secs(1),
            factor: 10.0,
            cap: Duration::MAX,
            jitter: Jitter::Equal,
        };
        let mut rng = fastrand::Rng::with_seed(3);
        for retry in [1, 10, 30, 1_000, u32::MAX] {
            let ceiling = b.ceiling(retry);
            assert!(b.delay(retry, &mut rng) <= ceiling);
        }
    }
}
