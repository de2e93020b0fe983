//! # convoy-testkit
//!
//! Everything needed to test convoy handlers and transports without a broker process, on the
//! embedded broker of `convoy-memory` (re-exported here: [`MemoryBroker`], [`MemoryTransport`],
//! …):
//! - [`checker`]: the order checker (violations, losses, duplicates, overlaps);
//! - [`probe`]: probe messages and the fault-injecting handler that records into the checker;
//! - [`conformance`]: the suite every transport must pass, with a macro that makes each case a test;
//! - [`dead_letters`]: a dead-letter destination deleted under a running engine, declared again;
//! - [`interop`]: messages another language's client produced, consumed in order from the right partitions;
//! - [`memory`]: the memory transport's conformance target;
//! - [`nodes`]: private broker processes (NATS, RabbitMQ, Kafka; single nodes and clusters) for
//!   the tests that crash and restart them;
//! - [`ownership`]: scenarios for transports whose members balance partitions themselves;
//! - [`parking`]: the conformance case of parked keys (set aside across a restart, replayed in order);
//! - [`readback`]: what a read-back of parked keys costs over a long dead-letter history, beside a whole read;
//! - [`proxy`]: a TCP proxy that cuts or silently stalls a client's connections to its broker;
//! - [`restarts`]: a broker killed and restarted twice under load, nothing lost;
//! - [`scenario`]: the benchmark scenario runner (load, latency histogram, order check, baseline);
//! - [`script`]: a hand-driven subscription, for engine tests that play the transport;
//! - [`transforms`]: the conformance case of transforms (outputs through the outbox, ids derived);
//! - [`support`]: unique names, test logs, clean-up off the test's runtime, waiting for late arrivals;
//! - [`timer`]: an async wait that lasts what it is given, for benchmarks' work.

pub mod checker;
pub mod conformance;
pub mod dead_letters;
pub mod interop;
pub mod memory;
pub mod nodes;
pub mod ownership;
pub mod parking;
pub mod probe;
pub mod proxy;
pub mod readback;
pub mod restarts;
pub mod scenario;
pub mod script;
pub mod support;
pub mod timer;
pub mod transforms;

pub use checker::{CheckReport, OrderChecker};
pub use convoy_memory::{Faults, MemoryBroker, MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};
pub use probe::{FaultPlan, Latency, ProbeHandler, RecordingSink};
