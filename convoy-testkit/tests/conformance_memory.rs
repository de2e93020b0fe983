//! The conformance suite on the memory transport.

convoy_testkit::conformance_tests!(convoy_testkit::memory::MemoryTarget::new());
