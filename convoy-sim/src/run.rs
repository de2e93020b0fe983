//! Running one seed: a fresh current-thread runtime whose clock is paused (time moves only when
//! every task waits), every random draw seeded (the world's, and the engine's thread-local one:
//! jitter, event ids, trace contexts), and the run's outcome — its violations, its trace and
//! the trace's hash.

use std::sync::{Arc, Mutex};

use crate::faults::Behaviour;
use crate::handler::PLANNED_PANIC;
use crate::ledger::Ledger;
use crate::plan::Plan;
use crate::shared::Shared;
use crate::trace::Trace;
use crate::world::World;
use convoy_memory::MemoryBroker;

/// What one run of a seed found.
pub struct Outcome {
    pub seed: u64,
    pub plan: Plan,
    pub violations: Vec<String>,
    /// The hash of the whole trace: the same for every run of the seed.
    pub hash: u64,
    /// The trace's lines (when kept).
    pub trace: Vec<String>,
    /// Handler calls made.
    pub calls: u64,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Plays `seed`; `keep_trace` keeps every line of the trace (else only its hash).
pub fn run(seed: u64, keep_trace: bool) -> Outcome {
    quiet_planned_panics();
    let plan = Plan::of(seed);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            return Outcome {
                seed,
                plan,
                violations: vec![format!("the simulator could not build its runtime: {e}")],
                hash: 0,
                trace: Vec::new(),
                calls: 0,
            }
        }
    };
    // The engine's own draws (backoff jitter, event ids, trace contexts) come from this thread's
    // generator: seeded, they are the same in every run.
    fastrand::seed(seed ^ 0x00c0_ffee);
    let shared = runtime.block_on(async {
        let rates = &plan.rates;
        let shared = Arc::new(Shared {
            ledger: Mutex::new(Ledger::new(
                plan.keyless,
                plan.delivery_offsets,
                Trace::new(keep_trace),
            )),
            behaviour: Behaviour::new(seed, rates.transient, rates.terminal, rates.panic, rates.hang),
            broker: MemoryBroker::new(),
        });
        shared.ledger().trace.event(&plan);
        let _logs = keep_trace.then(|| crate::logs::capture(&shared.ledger().trace));
        World::new(plan.clone(), shared.clone()).run().await;
        shared
    });
    // Whatever still runs (a member's tasks left by a crash) ends with the runtime.
    drop(runtime);
    let ledger = shared.ledger();
    Outcome {
        seed,
        plan,
        violations: ledger.violations.clone(),
        hash: ledger.trace.hash(),
        trace: ledger.trace.lines(),
        calls: ledger.calls,
    }
}

/// Panics the simulated handler plans are expected: they say nothing. Any other panic is
/// printed as usual.
fn quiet_planned_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() == Some(&PLANNED_PANIC) {
                return;
            }
            default(info);
        }));
    });
}
