//! # convoy-memory
//!
//! The embedded broker behind `memory://`: a product part (zero-setup runs, demos, handler tests),
//! not only a test fixture. Everything lives in the process:
//! - [`broker`]: [`MemoryBroker`], partitioned topics with Kafka's key partitioning, consumer
//!   groups that revoke before they reassign, committed positions that outlive members, and
//!   fault injection (fetch delays, batch sizes, offset holes, log truncation, failing commits
//!   and dead-letter publishes, dropped connections);
//! - [`transport`]: convoy's transport contract over it ([`MemoryTransport`], [`MemoryPublisher`],
//!   [`MemoryDeadLetterSink`]);
//! - [`baseline`]: a bare group member draining a topic, the benchmark baseline.

pub mod baseline;
pub mod broker;
pub mod transport;

pub use broker::{Faults, MemoryBroker};
pub use transport::{MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};
