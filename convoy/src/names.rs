//! Names for fresh topics and groups on a shared broker (examples, benchmarks, tests).

/// A suffix unique per process and moment (`<pid>-<micros hex>`).
pub fn unique_suffix() -> String {
    format!(
        "{}-{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros())
    )
}
