//! # convoy-testkit
//!
//! Everything needed to test convoy handlers and transports without a broker process, on the
//! embedded broker of `convoy-memory` (re-exported here: [`MemoryBroker`], [`MemoryTransport`],
//! …):
//! - [`checker`], [`probe`], [`scenario`], [`timer`]: the order checker, probe messages and the
//!   scenario runner, from `convoy-bench` (the product's `convoy bench` uses them too);
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
//! - [`script`]: a hand-driven subscription, for engine tests that play the transport;
//! - [`transforms`]: the conformance case of transforms (outputs through the outbox, ids derived);
//! - [`support`]: unique names, test logs, clean-up off the test's runtime, waiting for late arrivals.

pub mod conformance;
pub mod dead_letters;
pub mod interop;
pub mod memory;
pub mod nodes;
pub mod ownership;
pub mod parking;
pub mod proxy;
pub mod readback;
pub mod recorded;
pub mod restarts;
pub mod script;
pub mod support;
pub mod transforms;

pub use convoy_bench::{checker, probe, scenario, spread, timer};
pub use convoy_bench::{
    CheckReport, FaultPlan, KeySpread, Latency, OrderChecker, ProbeHandler, RecordingSink,
};
pub use convoy_memory::{Faults, MemoryBroker, MemoryDeadLetterSink, MemoryPublisher, MemoryTransport};
