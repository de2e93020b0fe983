//! Faults at the boundaries the engine does not own: the dead-letter destination (publishes
//! and read-backs that fail or hang for a while) and the handler (transient and terminal
//! failures, panics, hangs until the world heals). Each is decided from the seed, so a run is
//! the same every time.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use convoy_core::transport::{ReadBack, ReadMark};
use convoy_core::{DeadLetter, DeadLetterSink, Message, TransportError};
use convoy_memory::MemoryDeadLetterSink;
use tokio::sync::Notify;
use tokio::time::Instant;

/// A window of time during which a fault holds.
#[derive(Clone, Copy, Debug, Default)]
pub struct Window {
    until: Option<Instant>,
}

impl Window {
    pub fn open_until(&mut self, until: Instant) {
        self.until = Some(self.until.map_or(until, |u| u.max(until)));
    }

    pub fn close(&mut self) {
        self.until = None;
    }

    /// The end of the window, if it holds now.
    pub fn holds(&self) -> Option<Instant> {
        self.until.filter(|&u| Instant::now() < u)
    }
}

/// The dead-letter destination's faults, shared by every member's sink.
#[derive(Default)]
pub struct SinkFaults {
    pub publish_fails: Window,
    pub publish_hangs: Window,
    pub read_back_fails: Window,
    pub read_back_hangs: Window,
}

/// A member's dead-letter sink: the memory broker's, behind the world's faults.
pub struct FaultySink {
    pub inner: MemoryDeadLetterSink,
    pub faults: Arc<Mutex<SinkFaults>>,
    /// The member, and the trace its publishes go to.
    pub member: usize,
    pub shared: Arc<crate::handler::Shared>,
}

impl FaultySink {
    fn faults(&self) -> std::sync::MutexGuard<'_, SinkFaults> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hangs while `window` holds, fails while `fails` holds.
    async fn pass(
        &self,
        hangs: impl Fn(&SinkFaults) -> Window,
        fails: impl Fn(&SinkFaults) -> Window,
        what: &str,
    ) -> Result<(), TransportError> {
        loop {
            let hang = hangs(&self.faults()).holds();
            match hang {
                Some(until) => tokio::time::sleep_until(until).await,
                None => break,
            }
        }
        if fails(&self.faults()).holds().is_some() {
            return Err(TransportError::Unavailable(format!(
                "simulated: the dead-letter destination refuses {what}"
            )));
        }
        Ok(())
    }
}

#[async_trait]
impl DeadLetterSink for FaultySink {
    async fn publish(&self, dead_letter: &DeadLetter) -> Result<(), TransportError> {
        self.pass(|f| f.publish_hangs, |f| f.publish_fails, "publishes")
            .await?;
        self.inner.publish(dead_letter).await?;
        let m = &dead_letter.message;
        let what = crate::ledger::Identity::of(m).map_or_else(|| "a marker".to_owned(), |i| i.to_string());
        self.shared.ledger().trace.event(format_args!(
            "m{} dead-letters {what} from {}@{} ({})",
            self.member,
            m.source,
            m.offset,
            dead_letter.reason.cause.as_str()
        ));
        Ok(())
    }

    fn can_read_back(&self) -> bool {
        true
    }

    async fn read_back(&self) -> Result<Vec<Message>, TransportError> {
        self.pass(|f| f.read_back_hangs, |f| f.read_back_fails, "reads")
            .await?;
        self.inner.read_back().await
    }

    async fn read_back_after(&self, mark: Option<&ReadMark>) -> Result<ReadBack, TransportError> {
        self.pass(|f| f.read_back_hangs, |f| f.read_back_fails, "reads")
            .await?;
        self.inner.read_back_after(mark).await
    }

    async fn load_checkpoint(&self, group: &str) -> Result<Option<Bytes>, TransportError> {
        self.pass(|f| f.read_back_hangs, |f| f.read_back_fails, "reads")
            .await?;
        self.inner.load_checkpoint(group).await
    }

    /// A checkpoint is a write: it fails (and hangs) when publishing does.
    async fn save_checkpoint(&self, group: &str, checkpoint: Bytes) -> Result<(), TransportError> {
        self.pass(|f| f.publish_hangs, |f| f.publish_fails, "writes")
            .await?;
        self.inner.save_checkpoint(group, checkpoint).await?;
        self.shared
            .ledger()
            .trace
            .event(format_args!("m{} saves a parked keys' checkpoint", self.member));
        Ok(())
    }
}

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
