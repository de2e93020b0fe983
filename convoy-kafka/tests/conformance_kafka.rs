//! The conformance suite on a real Kafka-protocol broker (Tansu), every case but two.
//!
//! Not here: `crash_without_commit_redelivers_from_watermark`. It drops the first member (its
//! LeaveGroup goes out in the background) and subscribes the next one at once; when the join
//! and the leave cross, Tansu can keep the departed member as the group's leader, and the new
//! member never gets an assignment (seen with range about one run in three, and with
//! cooperative-sticky once in a CI run on 2026-11-30; the evidence is in
//! `conformance_kafka_eager.rs`). The case runs on librdkafka's mock cluster with both assignors
//! (`conformance_kafka_mock.rs`), and crashes on Tansu are covered by consumer processes killed
//! with SIGKILL (`processes.rs`), whose sessions expire instead of leaving.
//!
//! Nor `newest_offsets_cover_what_was_received`: Tansu's memory storage answers
//! ListOffsets(latest) wrongly (shared/brokers.md). It runs on the mock cluster.

mod common;

convoy_testkit::conformance_tests!(@cases common::KafkaTarget::from_env();
    per_key_order_under_parallelism,
    transient_retry_without_overtaking,
    terminal_error_dead_letters_and_lane_continues,
    retries_exhausted_dead_letters,
    restart_redelivers_nothing_committed,
    rebalance_two_consumers_mid_stream,
    slow_handler_fast_producer_bounded_memory,
    graceful_shutdown_commits,
    malformed_payload_dead_letters,
    duplicate_delivery_skipped,
    hot_key_does_not_stall_others,
    poison_input_dead_letters_with_reasons,
);
