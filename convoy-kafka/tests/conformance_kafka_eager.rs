//! The ownership-changing conformance cases again, with an eager assignor (range): every
//! rebalance revokes all partitions before reassigning them.

mod common;

convoy_testkit::conformance_tests!(@cases common::KafkaTarget::eager();
    rebalance_two_consumers_mid_stream,
    crash_without_commit_redelivers_from_watermark,
    restart_redelivers_nothing_committed,
);
