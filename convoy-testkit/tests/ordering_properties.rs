//! Property test of the ordering invariant through the whole engine: for any mix of keys,
//! partitions, shard counts, fetch sizes, offset holes and transient/terminal failures, every
//! message is finished exactly in per-key order and nothing is lost.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

use std::sync::Arc;
use std::time::Duration;

use convoy_core::Engine;
use convoy_testkit::conformance::{test_config, TestBed};
use convoy_testkit::memory::MemoryTarget;
use convoy_testkit::probe::{publish_load, FaultPlan, Latency, ProbeHandler, RecordingSink};
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

fn run(case: &Case) -> (CheckReport, u64) {
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
        let engine = Engine::builder(ProbeHandler::with_faults(checker.clone(), plan))
            .config(config)
            .dead_letter_sink(RecordingSink::new(bed.dead_letter_sink(), checker.clone()))
            .build()
            .unwrap()
            .spawn(bed.subscribe().await.unwrap());
        checker.wait_complete(Duration::from_secs(3600)).await;
        let report = engine.stop().await.unwrap();
        (checker.report(), report.stats.dead_lettered)
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
        let (report, dead_lettered) = run(&case);
        prop_assert!(report.is_clean(), "{case:?}: {report:#?}");
        prop_assert_eq!(report.finished, (case.keys * case.per_key) as u64);
        prop_assert_eq!(report.duplicates, 0, "no crash, so no redelivery");
        prop_assert_eq!(report.dead_lettered, dead_lettered);
    }
}
