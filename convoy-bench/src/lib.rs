//! # convoy-bench
//!
//! What `convoy bench` and `convoy produce --probes` are made of, and what the test kit's
//! handlers record into: messages that carry their own sequence, a checker that proves per-key
//! order from them, and the scenario runner that drives a load through an engine beside a bare
//! client's baseline.
//! - [`checker`]: the order checker (violations, losses, duplicates, overlaps) and its latency
//!   histograms;
//! - [`probe`]: probe messages and the fault-injecting handler that records into the checker;
//! - [`scenario`]: the benchmark scenario runner (load, latency histogram, order check, baseline);
//! - [`spread`]: how messages are spread over keys (round-robin or Zipf-skewed);
//! - [`timer`]: an async wait that lasts what it is given, for benchmarks' work.

pub mod checker;
pub mod probe;
pub mod scenario;
pub mod spread;
pub mod timer;

pub use checker::{CheckReport, OrderChecker};
pub use probe::{FaultPlan, Latency, ProbeHandler, RecordingSink};
pub use spread::KeySpread;
