//! # convoy-testkit
//!
//! Everything needed to test convoy handlers and transports without a broker process:
//! - [`broker`]: an in-memory partitioned broker with consumer groups and fault injection;
//! - [`transport`]: convoy's transport contract over it (subscriptions, publisher, dead letters);
//! - [`checker`]: the order checker (violations, losses, duplicates, overlaps);
//! - [`probe`]: probe messages and the fault-injecting handler that records into the checker;
//! - [`conformance`]: the suite every transport must pass, with a macro that makes each case a test;
//! - [`memory`]: the memory transport's conformance target;
//! - [`scenario`]: the benchmark scenario runner (load, latency histogram, order check, baseline).

pub mod broker;
pub mod checker;
pub mod conformance;
pub mod memory;
pub mod partitioner;
pub mod probe;
pub mod scenario;
pub mod transport;

pub use broker::{Faults, MemoryBroker};
pub use checker::{CheckReport, OrderChecker};
pub use probe::{FaultPlan, Latency, ProbeHandler, RecordingSink};
pub use transport::{MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};
