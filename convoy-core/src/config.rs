//! Engine configuration, validated at startup with errors that name the field.

use std::time::Duration;

use crate::retry::{Backoff, Jitter, RetryPolicy};

/// A configuration value was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration `{field}`: {reason}")]
pub struct ConfigError {
    field: String,
    reason: String,
}

impl ConfigError {
    /// An error for `field` (dotted path, e.g. `retry.backoff.factor`).
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The dotted path of the offending field.
    pub fn field(&self) -> &str {
        &self.field
    }
}

/// True for setting names whose values must never be printed (passwords, secrets, private
/// keys, token configuration), whatever the broker.
pub fn is_secret(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("password")
        || n.contains("secret")
        || n.ends_with(".key.pem")
        || n.contains("oauthbearer.config")
}

/// Name/value settings as `Debug` should show them: secret values replaced by `<redacted>`.
pub fn redacted<'a>(settings: impl IntoIterator<Item = (&'a String, &'a String)>) -> Vec<(&'a str, &'a str)> {
    settings
        .into_iter()
        .map(|(k, v)| (k.as_str(), if is_secret(k) { "<redacted>" } else { v.as_str() }))
        .collect()
}

/// What happens to messages without a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KeylessPolicy {
    /// One lane per source: keyless messages keep their source's order (like a partition).
    #[default]
    PerSource,
    /// Each keyless message is handled independently, in parallel, with no order.
    Unordered,
    /// Keyless messages are poison here: dead-letter them (cause `malformed`) unhandled.
    DeadLetter,
}

/// Bounds on messages held (buffered in lanes + in flight), with hysteresis.
///
/// Over a high-water mark the engine pauses fetching (per source, or every source for the
/// total); it resumes once the count falls to the low-water mark. Nothing is dropped: at most
/// one fetched batch per source may arrive after the pause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackPressure {
    /// Pause a source when it holds this many messages.
    pub source_high: usize,
    /// Resume it at this many.
    pub source_low: usize,
    /// Pause every source when the engine holds this many in total.
    pub total_high: usize,
    /// Resume at this many.
    pub total_low: usize,
}

impl Default for BackPressure {
    fn default() -> Self {
        BackPressure {
            source_high: 4_000,
            source_low: 2_000,
            total_high: 16_000,
            total_low: 8_000,
        }
    }
}

/// Everything the engine needs besides the handler and the transport.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Consumer group name, written into dead-letter reasons and metrics.
    pub group: String,
    /// Number of shards (tasks owning lanes); 0 means four per available CPU (measured best:
    /// smaller lane maps per shard, and completions flow back in smaller, steadier batches).
    pub shards: usize,
    /// Retry policy for transient handler failures.
    pub retry: RetryPolicy,
    /// Backoff between attempts to publish a dead letter when the sink fails
    /// (the lane blocks meanwhile; the message is never dropped).
    pub dead_letter_backoff: Backoff,
    /// Commit watermarks at least this often while there is progress.
    pub commit_interval: Duration,
    /// ... and also after this many finished messages.
    pub commit_every: usize,
    /// How long a revoke or a shutdown waits for in-flight messages before cancelling them.
    pub drain_timeout: Duration,
    /// Dead-letter a source's lowest unfinished message (reason `stuck`) after this long;
    /// `None` (default) disables the check.
    pub stuck_timeout: Option<Duration>,
    /// Back-pressure bounds.
    pub back_pressure: BackPressure,
    /// What to do with keyless messages.
    pub keyless: KeylessPolicy,
    /// Dead-letter (cause `malformed`) payloads larger than this, unhandled; `None`: no limit.
    pub max_payload_bytes: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            group: "convoy".to_owned(),
            shards: 0,
            retry: RetryPolicy::default(),
            dead_letter_backoff: Backoff {
                base: Duration::from_millis(100),
                factor: 2.0,
                cap: Duration::from_secs(10),
                jitter: Jitter::Equal,
            },
            commit_interval: Duration::from_millis(500),
            commit_every: 10_000,
            drain_timeout: Duration::from_secs(30),
            stuck_timeout: None,
            back_pressure: BackPressure::default(),
            keyless: KeylessPolicy::PerSource,
            max_payload_bytes: None,
        }
    }
}

impl EngineConfig {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.group.trim().is_empty() {
            return Err(ConfigError::invalid("group", "must not be empty"));
        }
        self.retry.validate("retry")?;
        self.dead_letter_backoff.validate("dead_letter_backoff")?;
        if self.dead_letter_backoff.base.is_zero() {
            return Err(ConfigError::invalid(
                "dead_letter_backoff.base",
                "must be > 0 so a failing sink is not retried in a busy loop",
            ));
        }
        if self.commit_interval.is_zero() {
            return Err(ConfigError::invalid("commit_interval", "must be > 0"));
        }
        if self.commit_every == 0 {
            return Err(ConfigError::invalid("commit_every", "must be ≥ 1"));
        }
        if self.stuck_timeout == Some(Duration::ZERO) {
            return Err(ConfigError::invalid(
                "stuck_timeout",
                "must be > 0, or None to disable the check",
            ));
        }
        let bp = &self.back_pressure;
        if bp.source_high == 0 || bp.source_low >= bp.source_high {
            return Err(ConfigError::invalid(
                "back_pressure.source_low",
                format!(
                    "need 0 ≤ source_low < source_high with source_high ≥ 1, got low {} high {}",
                    bp.source_low, bp.source_high
                ),
            ));
        }
        if bp.total_high == 0 || bp.total_low >= bp.total_high {
            return Err(ConfigError::invalid(
                "back_pressure.total_low",
                format!(
                    "need 0 ≤ total_low < total_high with total_high ≥ 1, got low {} high {}",
                    bp.total_low, bp.total_high
                ),
            ));
        }
        Ok(())
    }

    /// The shard count after resolving 0 to four per CPU.
    pub fn effective_shards(&self) -> usize {
        match self.shards {
            0 => 4 * std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() {
        assert_eq!(EngineConfig::default().validate(), Ok(()));
    }

    #[test]
    fn bad_fields_are_named() {
        let mut c = EngineConfig {
            group: " ".into(),
            ..EngineConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().field(), "group");
        c.group = "g".into();
        c.back_pressure.source_low = c.back_pressure.source_high;
        assert_eq!(c.validate().unwrap_err().field(), "back_pressure.source_low");
        c.back_pressure = BackPressure::default();
        c.commit_every = 0;
        assert_eq!(c.validate().unwrap_err().field(), "commit_every");
        c.commit_every = 1;
        c.stuck_timeout = Some(Duration::ZERO);
        let err = c.validate().unwrap_err();
        assert_eq!(err.field(), "stuck_timeout");
        assert!(err.to_string().contains("stuck_timeout"));
    }
}
