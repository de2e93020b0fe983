//! Conformance cases on librdkafka's in-process mock cluster, which implements the group
//! protocols where Tansu falls short: the crash case with both assignors (Tansu can keep a
//! departed member as the group's leader; see `conformance_kafka.rs`), the newest offsets (Tansu
//! answers ListOffsets(latest) wrongly), and the other
//! ownership-changing cases with the eager assignor beside it.

mod common;

mod cooperative_sticky {
    use super::common;

    convoy_testkit::conformance_tests!(@cases common::KafkaTarget::on_mock(convoy_kafka::Assignor::CooperativeSticky);
        crash_without_commit_redelivers_from_watermark,
        newest_offsets_cover_what_was_received,
    );
}

mod range {
    use super::common;

    convoy_testkit::conformance_tests!(@cases common::KafkaTarget::on_mock(convoy_kafka::Assignor::Range);
        crash_without_commit_redelivers_from_watermark,
        rebalance_two_consumers_mid_stream,
        restart_redelivers_nothing_committed,
    );
}
