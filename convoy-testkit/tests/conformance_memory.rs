//! The conformance suite on the memory transport.

convoy_testkit::conformance_tests!(convoy_testkit::memory::MemoryTarget::new());

/// The case of a replay's end on offsets with a hole before every message (as Kafka's
/// transaction markers, or NATS partitions sharing one stream's sequence, leave them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_one_message_ends_on_a_quiet_source_with_offset_gaps() {
    let target = convoy_testkit::memory::MemoryTarget::new();
    target.broker().set_faults(|f| f.offset_gap_every = Some(1));
    convoy_testkit::conformance::a_replay_of_one_message_ends_on_a_quiet_source(&target).await;
}
