//! The handler's faults (transient and terminal failures, panics, hangs until the world heals),
//! decided from the seed, so a run is the same every time. The dead-letter destination's are in
//! [`crate::sink`].

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

use tokio::sync::Notify;

/// What the handler does with one attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    Succeed,
    Transient,
    Terminal,
    Panic,
    Hang,
}

/// Decides each attempt from the seed: the same message and attempt always get the same act
/// (whatever interleaving led there) until the world heals, after which everything succeeds.
pub struct Behaviour {
    seed: u64,
    transient: f64,
    terminal: f64,
    panic: f64,
    hang: f64,
    healed: AtomicBool,
    /// Wakes hung handlers when the world heals.
    pub heal: Notify,
}

/// A 64-bit mix (splitmix64's finalizer): fixed, so a decision means the same in every process.
pub fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A number in [0, 1) from `x`.
fn unit(x: u64) -> f64 {
    (mix(x) >> 11) as f64 / (1u64 << 53) as f64
}

impl Behaviour {
    pub fn new(seed: u64, transient: f64, terminal: f64, panic: f64, hang: f64) -> Behaviour {
        Behaviour {
            seed,
            transient,
            terminal,
            panic,
            hang,
            healed: AtomicBool::new(false),
            heal: Notify::new(),
        }
    }

    /// What attempt `attempt` of message `n` (copy `copy` of a replay, 0 for the message itself)
    /// does. A terminal failure is the message's (every attempt, every copy: poison stays
    /// poison until the cause is fixed); the others are per attempt.
    pub fn act(&self, n: u64, copy: u32, attempt: u32) -> Act {
        if self.healed() {
            return Act::Succeed;
        }
        let message = mix(self.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        if unit(message) < self.terminal {
            return Act::Terminal;
        }
        let roll = unit(message ^ (u64::from(copy) << 32 | u64::from(attempt)));
        let mut at = 0.0;
        for (rate, act) in [
            (self.transient, Act::Transient),
            (self.panic, Act::Panic),
            (self.hang, Act::Hang),
        ] {
            at += rate;
            if roll < at {
                return act;
            }
        }
        Act::Succeed
    }

    pub fn healed(&self) -> bool {
        self.healed.load(SeqCst)
    }

    /// The causes are fixed: every later attempt succeeds, and hung calls return.
    pub fn heal_all(&self) {
        self.healed.store(true, SeqCst);
        self.heal.notify_waiters();
    }
}
