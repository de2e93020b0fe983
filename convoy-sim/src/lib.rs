//! # convoy-sim
//!
//! A deterministic simulator for convoy, in the spirit of FoundationDB's simulation testing and
//! TigerBeetle's VOPR: several engines of one consumer group run against the memory broker in
//! one thread, on a virtual clock, and a seed decides every event and fault — producers (with
//! and without event ids, keyless and empty keys, duplicates), members joining, stopping,
//! crashing and losing their connection, revokes with deadlines, commits that fail or hang,
//! slow partitions, a dead-letter destination whose publishes and read-backs fail or hang,
//! handlers that fail, panic or hang, and an operator replaying parked keys (and dying
//! part-way). After every step the invariants are checked; at the end the world heals and must
//! settle. The same seed gives the same run, byte for byte: a failing seed is a one-line
//! reproduction (`scripts/sim --seed N`).
//!
//! By job:
//! - [`plan`]: what a seed decides up front (the world's shape, swarm-chosen faults);
//! - [`world`]: the world and its steps;
//! - [`faults`]: the handler's faults;
//! - [`sink`]: the dead-letter destination under faults;
//! - [`shared`]: what members' handlers and sinks share (the ledger, the faults, the broker);
//! - [`handler`]: the simulated handler, recording every call;
//! - [`ledger`]: what happened, and the invariants checked as it happens;
//! - [`oracle`]: the invariants checked against the broker after each step and at the end;
//! - [`trace`]: the run's events with virtual timestamps, and their hash;
//! - [`logs`]: the engine's log lines in a kept trace;
//! - [`run()`]: one seed on a fresh paused runtime.

#![allow(missing_docs)] // a test tool, not a published crate: its items are documented where it helps

pub mod faults;
pub mod handler;
pub mod ledger;
pub mod logs;
pub mod oracle;
pub mod plan;
pub mod run;
pub mod shared;
pub mod sink;
pub mod trace;
pub mod world;

pub use plan::Plan;
pub use run::{run, Outcome};
