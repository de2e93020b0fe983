//! Counters the code under test recorded, read through one debugging recorder per test binary
//! (a global recorder can be set only once).

use std::sync::OnceLock;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // Fails only if another recorder was set first; the counters then read 0.
        let _ = metrics::set_global_recorder(recorder);
        snapshotter
    })
}

/// Installs the recorder: call it before anything counts.
pub fn record() {
    snapshotter();
}

/// The counter `name` summed over the series that carry all of `labels`.
pub fn counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| key.key().name() == name)
        .filter(|(key, _, _, _)| {
            let have: Vec<_> = key.key().labels().map(|l| (l.key(), l.value())).collect();
            labels.iter().all(|l| have.contains(l))
        })
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}
