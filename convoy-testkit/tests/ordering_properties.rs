//! Property test of the ordering invariant through the whole engine: for any mix of keys,
//! partitions, shard counts, fetch sizes, offset holes and transient/terminal failures, every
//! message is finished exactly in per-key order and nothing is lost — with a per-message handler,
//! and with a batch handler of any batch and run size.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::Arc;
use std::time::Duration;

use convoy_core::{BatchConfig, Engine, EngineBuilder};
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::MemoryTarget;
use convoy_testkit::probe::{
    publish_load, BatchLog, BatchProbe, FaultPlan, Latency, ProbeHandler, RecordingSink,
};
use convoy_testkit::{CheckReport, MemoryBroker, OrderChecker};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    keys: usize,
    per_key: usize,
    partitions: u32,
    shards: usize,
    batch: usize,
    gap_every: Option<u64>,
    transient: f64,
    terminal: f64,
    seed: u64,
}

/// How the engine calls the handler: per message, or in batches of at most `max_messages`
/// holding runs of at most `per_key` messages of a key.
#[derive(Debug, Clone, Copy)]
enum Calls {
    PerMessage,
    Batches { max_messages: usize, per_key: usize },
}

fn run(case: &Case, calls: Calls) -> (CheckReport, u64, Option<Arc<BatchLog>>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let broker = MemoryBroker::new();
        broker.set_faults(|f| {
            f.max_batch = case.batch;
            f.offset_gap_every = case.gap_every;
        });
        let bed = MemoryTarget::on(broker).memory_bed(case.partitions);
        let checker = Arc::new(OrderChecker::new());
        let plan = FaultPlan {
            seed: case.seed,
            transient_rate: case.transient,
            transient_attempts: 2,
            terminal_rate: case.terminal,
            latency: Latency::Uniform(Duration::ZERO, Duration::from_millis(3)),
            ..FaultPlan::default()
        };
        publish_load(bed.publisher().as_ref(), &checker, "k", case.keys, case.per_key)
            .await
            .unwrap();
        let mut config = test_config(bed.group());
        config.shards = case.shards;
        let probe = ProbeHandler::with_faults(checker.clone(), plan);
        let (builder, log): (EngineBuilder, _) = match calls {
            Calls::PerMessage => (Engine::builder(probe), None),
            Calls::Batches {
                max_messages,
                per_key,
            } => {
                let log = Arc::new(BatchLog::default());
                let handler = BatchProbe::new(Arc::new(probe)).logging(log.clone());
                let batch = BatchConfig::new(max_messages, Duration::from_millis(2)).per_key(per_key);
                (Engine::batch_builder(handler, batch).unwrap(), Some(log))
            }
        };
        let engine = builder
            .config(config)
            .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
            .build()
            .unwrap()
            .spawn(bed.subscribe().await.unwrap());
        checker.wait_complete(Duration::from_secs(3600)).await;
        let report = engine.stop().await.unwrap();
        (checker.report(), report.stats.dead_lettered, log)
    })
}

fn cases() -> impl Strategy<Value = Case> {
    (
        (1usize..12, 1usize..30, 1u32..5, 1usize..6),
        (1usize..16, prop::option::of(2u64..6)),
        (0.0f64..0.4, 0.0f64..0.1, any::<u64>()),
    )
        .prop_map(
            |((keys, per_key, partitions, shards), (batch, gap_every), (transient, terminal, seed))| Case {
                keys,
                per_key,
                partitions,
                shards,
                batch,
                gap_every,
                transient,
                terminal,
                seed,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_message_finishes_in_per_key_order(case in cases()) {
        let (report, dead_lettered, _) = run(&case, Calls::PerMessage);
        prop_assert!(report.is_clean(), "{case:?}: {report:#?}");
        prop_assert_eq!(report.finished, (case.keys * case.per_key) as u64);
        prop_assert_eq!(report.duplicates, 0, "no crash, so no redelivery");
        prop_assert_eq!(report.dead_lettered, dead_lettered);
    }
}

fn batches() -> impl Strategy<Value = Calls> {
    (1usize..20, 1usize..8).prop_map(|(max_messages, per_key)| Calls::Batches {
        max_messages,
        per_key: per_key.min(max_messages),
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_batch_handler_finishes_every_message_in_per_key_order(case in cases(), calls in batches()) {
        let (report, dead_lettered, log) = run(&case, calls);
        prop_assert!(report.is_clean(), "{case:?} {calls:?}: {report:#?}");
        prop_assert_eq!(report.finished, (case.keys * case.per_key) as u64);
        prop_assert_eq!(report.duplicates, 0, "no crash, so no redelivery");
        prop_assert_eq!(report.dead_lettered, dead_lettered);
        let log = log.unwrap();
        prop_assert_eq!(log.broken_runs(), 0, "a key's messages in a call are together, consecutive, in order");
        if let Calls::Batches { max_messages, per_key } = calls {
            prop_assert!(log.sizes().iter().all(|&n| (1..=max_messages).contains(&n)));
            prop_assert!(log.longest_run() <= per_key);
        }
    }
}
