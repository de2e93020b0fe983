//! What every member's handler and dead-letter sink share: the ledger, the handler's faults, and
//! the broker.

use std::sync::Mutex;

use convoy_memory::MemoryBroker;

use crate::faults::Behaviour;
use crate::ledger::Ledger;
use crate::plan::DLQ;

/// What every member's handler shares.
pub struct Shared {
    pub ledger: Mutex<Ledger>,
    pub behaviour: Behaviour,
    /// The broker, whose dead-letter destination the ledger reads before every check.
    pub broker: MemoryBroker,
}

impl Shared {
    pub fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ledger, with every dead letter published so far read into it.
    pub fn ledger_now(&self) -> std::sync::MutexGuard<'_, Ledger> {
        let records = self.broker.read_all(DLQ);
        let mut ledger = self.ledger();
        ledger.read_dead_letters(&records);
        ledger
    }
}
