//! Engine configuration, validated at startup with errors that name the field.

use std::time::Duration;

use crate::retry::{Backoff, Jitter, RetryPolicy};
use crate::transport::PrefetchLimit;

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
        || n == "token"
        || n == "nkey"
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

/// `scheme://user:password@host…` with the password replaced by `<redacted>` (a NATS token
/// alone, `nats://token@host`, too), for every broker's URLs in logs, errors and `Debug`.
///
/// The password is what a URL parser takes for one: the userinfo before the last `@` of the
/// authority (which ends at the first `/`, `?` or `#`). A password with an unescaped `/` or `?`
/// ends the authority early, so the parser finds no password at all (it then refuses the URL,
/// or reads `user:pass` as a host and port) — but the secret is still in the text: then
/// everything from the first `:` after the user to the next `@` is redacted, conservatively.
pub fn redact_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = split_authority(rest);
    if let Some((userinfo, host)) = authority.rsplit_once('@') {
        return match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:<redacted>@{host}{tail}"),
            None if scheme.eq_ignore_ascii_case("nats") => format!("{scheme}://<redacted>@{host}{tail}"),
            None => url.to_owned(),
        };
    }
    match unescaped_password(rest) {
        Some((user, after)) => format!("{scheme}://{user}:<redacted>@{after}"),
        None => url.to_owned(),
    }
}

/// Why a URL with [`has_unescaped_password`] is refused, for every broker's configuration.
pub const UNESCAPED_PASSWORD: &str =
    "the password holds an unescaped '/', '?' or '#', which ends the address early: percent-encode them (%2F, %3F, %23)";

/// True when `url`'s password holds an unescaped `/`, `?` or `#`, which ends the authority
/// early: no parser reads the intended password, and a URL like that is refused at startup
/// (percent-encode them: `%2F`, `%3F`, `%23`).
pub fn has_unescaped_password(url: &str) -> bool {
    url.split_once("://")
        .is_some_and(|(_, rest)| !split_authority(rest).0.contains('@') && unescaped_password(rest).is_some())
}

/// What follows `scheme://`, split where its authority ends (the first `/`, `?` or `#`).
fn split_authority(rest: &str) -> (&str, &str) {
    rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()))
}

/// In an address whose authority holds no `@`: `user:` followed, past a `/`, `?` or `#`, by
/// `…@` — a password that an unescaped character cut short. The user and what follows the `@`.
fn unescaped_password(rest: &str) -> Option<(&str, &str)> {
    let user_end = rest.find([':', '/', '?', '#', '@']).unwrap_or(rest.len());
    if !rest[user_end..].starts_with(':') {
        return None;
    }
    let at = rest[user_end..].find('@')?;
    Some((&rest[..user_end], &rest[user_end + at + 1..]))
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

/// Bounds on what the engine holds, each with hysteresis: over a high-water mark the engine
/// pauses fetching (per source, or every source for a total); it resumes once the count falls
/// to the low-water mark. Nothing is dropped: what the transport had already fetched still
/// arrives and is kept.
///
/// - *Held* messages are buffered in lanes or in flight: they bound the engine's memory, in
///   messages per source and in total, and in bytes (keys, payloads, header values) in total,
///   so memory follows this configuration whatever the payload size.
/// - The *window* of a source is every offset received from its lowest unfinished one to the
///   newest, finished or not: what the watermark tracker remembers and what a restart would
///   replay. One key blocked at the head of a busy source (a hung handler, a lane blocked by
///   `OnExhausted::BlockLane`) keeps its window growing while few messages are held; at
///   `window_high` the source stops fetching and **waits for its head** — its other keys wait
///   too — until the head finishes (or the stuck-gap timeout dead-letters it). Raise it to let
///   other keys run further ahead of a stuck one, at the price of memory and of replay after a
///   crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackPressure {
    /// Pause a source when it holds this many messages.
    pub source_high: usize,
    /// Resume it at this many.
    pub source_low: usize,
    /// Pause every source when the engine holds this many messages in total.
    pub total_high: usize,
    /// Resume at this many.
    pub total_low: usize,
    /// Pause every source when the messages held weigh this many bytes in total.
    pub total_bytes_high: usize,
    /// Resume at this many bytes.
    pub total_bytes_low: usize,
    /// Pause a source when its watermark window spans this many received offsets.
    pub window_high: usize,
    /// Resume it at this many.
    pub window_low: usize,
}

impl Default for BackPressure {
    fn default() -> Self {
        BackPressure {
            source_high: 4_000,
            source_low: 2_000,
            total_high: 16_000,
            total_low: 8_000,
            total_bytes_high: 64 << 20,
            total_bytes_low: 32 << 20,
            window_high: 20_000,
            window_low: 10_000,
        }
    }
}

/// By default a transport buffers what the default back-pressure holds.
impl Default for PrefetchLimit {
    fn default() -> Self {
        BackPressure::default().prefetch_limit()
    }
}

impl BackPressure {
    /// What a transport may buffer ahead of the engine: as much again as the engine holds at
    /// most, so the client's buffers follow the same configuration.
    pub fn prefetch_limit(&self) -> PrefetchLimit {
        PrefetchLimit {
            messages: self.total_high,
            bytes: self.total_bytes_high,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let marks = [
            ("source", self.source_low, self.source_high),
            ("total", self.total_low, self.total_high),
            ("total_bytes", self.total_bytes_low, self.total_bytes_high),
            ("window", self.window_low, self.window_high),
        ];
        for (name, low, high) in marks {
            if high == 0 || low >= high {
                return Err(ConfigError::invalid(
                    format!("back_pressure.{name}_low"),
                    format!(
                        "need 0 ≤ {name}_low < {name}_high with {name}_high ≥ 1, got low {low} high {high}"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// What a graceful shutdown waits for before it commits and closes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Drain {
    /// The messages being handled (each lane's current one, retries included) finish; what is
    /// queued behind them is dropped uncommitted, for the next consumer. The default: a stop
    /// takes as long as one message, not as long as the whole buffer.
    #[default]
    InFlight,
    /// Everything the engine holds finishes (bounded by the drain timeout): fewer messages go
    /// to the next consumer, a stop takes longer.
    Buffered,
}

/// Everything the engine needs besides the handler and the transport.
///
/// Start from [`EngineConfig::default`] (or [`EngineConfig::for_group`]) and set the fields
/// you need: the struct may gain fields in any release (`#[non_exhaustive]`), which then keep
/// their defaults in code written before them. A config file's `[engine]` table sets the same
/// fields (see `convoy::settings`).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Consumer group name, written into dead-letter reasons and metrics. Empty (the default):
    /// the transport's group when the engine is started on one ([`crate::Transport::group`]),
    /// else `convoy`.
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
    /// A commit not confirmed within this long counts as failed (and is retried later).
    /// Commits never block the engine: one runs at a time, beside message intake.
    pub commit_timeout: Duration,
    /// ... and also after this many finished messages.
    pub commit_every: usize,
    /// How long a revoke or a shutdown waits for in-flight messages before cancelling them.
    pub drain_timeout: Duration,
    /// What a shutdown drains: the messages in flight (default) or everything held.
    pub drain: Drain,
    /// The whole of a graceful shutdown — drain, final commit, leaving the group — ends within
    /// this (default 25 s: inside Kubernetes' 30 s grace period; lower it for `docker stop`'s
    /// 10 s). The drain ends early enough to leave a third of it for the commit and the leave.
    pub shutdown_timeout: Duration,
    /// Take at most this many messages, then stop once they are finished: the first ones each
    /// source delivers (a prefix of it, in offset order), all handled and committed; nothing
    /// after them is taken or committed, so the next consumer starts right there. `None`
    /// (default): no limit.
    pub max_messages: Option<u64>,
    /// Dead-letter a source's lowest unfinished message (reason `stuck`) after this long, so
    /// a handler that hangs holds neither its key nor the commit forever: its key goes on with
    /// the next message (the hung call is left to finish, detached; its result is ignored).
    /// Default 5 minutes; `None` keeps waiting (a lane that blocks on purpose, with
    /// [`OnExhausted::BlockLane`](crate::OnExhausted::BlockLane), wants that).
    pub stuck_timeout: Option<Duration>,
    /// Back-pressure bounds.
    pub back_pressure: BackPressure,
    /// What to do with keyless messages.
    pub keyless: KeylessPolicy,
    /// Dead-letter (cause `malformed`) payloads larger than this, unhandled; `None`: no limit.
    pub max_payload_bytes: Option<usize>,
    /// At most this many handler calls run at once, over all lanes (a downstream service sees
    /// no more concurrent requests than this); `None`: one per active lane. Independent of
    /// back-pressure, which bounds what is held, not what runs.
    pub max_in_flight: Option<usize>,
    /// Park a key whose message is dead-lettered: its later messages are set aside, in order,
    /// to the dead-letter destination until the key is replayed (see
    /// [`parking`](crate::parking)). Needs a dead-letter sink that reads back.
    pub park_keys: bool,
    /// With `park_keys`: a read-back of the dead-letter destination that read this many
    /// records past its group's checkpoint saves a new one, and an engine that wrote this many
    /// records reads back; so an assignment reads about this many records, not the
    /// destination's whole history. Default [`CHECKPOINT_AFTER`](crate::parking::CHECKPOINT_AFTER).
    pub park_checkpoint_after: usize,
}

/// How long a source's lowest unfinished message may stay unfinished by default.
pub const DEFAULT_STUCK_TIMEOUT: Duration = Duration::from_secs(300);

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            group: String::new(),
            shards: 0,
            retry: RetryPolicy::default(),
            dead_letter_backoff: Backoff {
                base: Duration::from_millis(100),
                factor: 2.0,
                cap: Duration::from_secs(10),
                jitter: Jitter::Equal,
            },
            commit_interval: Duration::from_millis(500),
            commit_timeout: Duration::from_secs(10),
            commit_every: 10_000,
            drain_timeout: Duration::from_secs(15),
            drain: Drain::InFlight,
            shutdown_timeout: Duration::from_secs(25),
            max_messages: None,
            stuck_timeout: Some(DEFAULT_STUCK_TIMEOUT),
            back_pressure: BackPressure::default(),
            keyless: KeylessPolicy::PerSource,
            max_payload_bytes: None,
            max_in_flight: Some(1_024),
            park_keys: false,
            park_checkpoint_after: crate::parking::CHECKPOINT_AFTER,
        }
    }
}

impl EngineConfig {
    /// The defaults, for consumer group `group`.
    pub fn for_group(group: impl Into<String>) -> Self {
        EngineConfig {
            group: group.into(),
            ..EngineConfig::default()
        }
    }

    /// The group named, or `convoy` when none is.
    pub fn group_or_default(&self) -> &str {
        match self.group.is_empty() {
            true => "convoy",
            false => &self.group,
        }
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.group.is_empty() && self.group.trim().is_empty() {
            return Err(ConfigError::invalid(
                "group",
                "must not be blank (leave it empty to take the transport's)",
            ));
        }
        validate_retry(&self.retry, "retry")?;
        validate_backoff(&self.dead_letter_backoff, "dead_letter_backoff")?;
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
        if self.park_checkpoint_after == 0 {
            return Err(ConfigError::invalid("park_checkpoint_after", "must be ≥ 1"));
        }
        if self.stuck_timeout == Some(Duration::ZERO) {
            return Err(ConfigError::invalid(
                "stuck_timeout",
                "must be > 0 (unset, or \"unlimited\" in settings, disables the check)",
            ));
        }
        if self.commit_timeout.is_zero() {
            return Err(ConfigError::invalid("commit_timeout", "must be > 0"));
        }
        if self.drain_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "drain_timeout",
                "must be > 0 (a revoke or shutdown would cancel every message in flight at once)",
            ));
        }
        if self.shutdown_timeout < Duration::from_secs(1) {
            return Err(ConfigError::invalid(
                "shutdown_timeout",
                "must be at least 1 s: the final commit and leaving the group need time",
            ));
        }
        if self.max_messages == Some(0) {
            return Err(ConfigError::invalid(
                "max_messages",
                "must be at least 1 (leave it unset for no limit)",
            ));
        }
        if self.max_in_flight == Some(0) {
            return Err(ConfigError::invalid(
                "max_in_flight",
                "must be ≥ 1 (unset, or 0 in settings, for one handler call per active lane)",
            ));
        }
        self.back_pressure.validate()
    }

    /// Checks the drain timeout against the transport's revoke timeout: a revoke must be able
    /// to drain for the whole drain timeout and still commit before the transport gives up.
    pub fn validate_for_revoke_timeout(&self, revoke_timeout: Duration) -> Result<(), ConfigError> {
        if self.drain_timeout >= revoke_timeout {
            return Err(ConfigError::invalid(
                "drain_timeout",
                format!(
                    "must be shorter than the transport's revoke timeout ({revoke_timeout:?}), got {:?}: \
                     lower drain_timeout or raise the transport's revoke timeout",
                    self.drain_timeout
                ),
            ));
        }
        Ok(())
    }

    /// The shard count after resolving 0 to four per CPU, never more than `max_in_flight`
    /// (more shards than handler calls could run at once buy nothing).
    pub fn effective_shards(&self) -> usize {
        let shards = match self.shards {
            0 => 4 * std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        self.max_in_flight.map_or(shards, |max| shards.min(max))
    }
}

/// Checks a backoff; the error names `field`'s bad part.
fn validate_backoff(backoff: &Backoff, field: &str) -> Result<(), ConfigError> {
    if !(backoff.factor.is_finite() && backoff.factor >= 1.0) {
        return Err(ConfigError::invalid(
            format!("{field}.factor"),
            format!("must be a finite number ≥ 1, got {}", backoff.factor),
        ));
    }
    if backoff.cap < backoff.base {
        return Err(ConfigError::invalid(
            format!("{field}.cap"),
            format!("must be ≥ base ({:?}), got {:?}", backoff.base, backoff.cap),
        ));
    }
    Ok(())
}

/// Checks a retry policy; the error names `field`'s bad part.
fn validate_retry(policy: &RetryPolicy, field: &str) -> Result<(), ConfigError> {
    validate_backoff(&policy.backoff, &format!("{field}.backoff"))?;
    if policy.max_attempts == Some(0) {
        return Err(ConfigError::invalid(
            format!("{field}.max_attempts"),
            "must be ≥ 1 (the first try counts); for no limit, None (in settings: \"unlimited\")",
        ));
    }
    if policy.attempt_timeout == Some(Duration::ZERO) {
        return Err(ConfigError::invalid(
            format!("{field}.attempt_timeout"),
            "must be > 0, or None for no timeout",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_is_redacted_in_every_form() {
        let cases = [
            (
                "amqp://app:s3cret@127.0.0.1:5672/%2f",
                "amqp://app:<redacted>@127.0.0.1:5672/%2f",
            ),
            // An `@` in the password: the authority's last `@` ends the userinfo.
            ("amqp://app:s3@cret@h:5672/v", "amqp://app:<redacted>@h:5672/v"),
            // Unescaped `/` and `?`: no parser reads a password here, but it is still in the text.
            (
                "amqp://app:pa/ss@h:5672/%2f?topics=t",
                "amqp://app:<redacted>@h:5672/%2f?topics=t",
            ),
            (
                "amqp://app:pa?ss@h:5672/%2f?topics=t",
                "amqp://app:<redacted>@h:5672/%2f?topics=t",
            ),
            (
                "nats://u:a/b?c@127.0.0.1:4222",
                "nats://u:<redacted>@127.0.0.1:4222",
            ),
            (
                "nats://s3cret@127.0.0.1:4222?topics=t",
                "nats://<redacted>@127.0.0.1:4222?topics=t",
            ),
            // Nothing secret: left alone.
            (
                "amqp://127.0.0.1:5672/%2f?topics=t",
                "amqp://127.0.0.1:5672/%2f?topics=t",
            ),
            (
                "kafka://127.0.0.1:9092?topics=t",
                "kafka://127.0.0.1:9092?topics=t",
            ),
        ];
        assert!(has_unescaped_password("amqp://app:pa/ss@h:5672/%2f"));
        assert!(has_unescaped_password("nats://u:a?b@h:4222"));
        assert!(!has_unescaped_password("amqp://app:pa%2Fss@h:5672/%2f"));
        assert!(!has_unescaped_password("amqp://app:s3@cret@h:5672/v"));
        for (url, shown) in cases {
            assert_eq!(redact_userinfo(url), shown, "{url}");
            assert!(!redact_userinfo(url).contains("ss@"), "{url}");
        }
    }

    #[test]
    fn retry_validation_names_the_field() {
        let p = RetryPolicy {
            backoff: Backoff {
                factor: 0.5,
                ..Backoff::default()
            },
            ..RetryPolicy::default()
        };
        let err = validate_retry(&p, "retry").unwrap_err();
        assert_eq!(err.field(), "retry.backoff.factor");
        let p = RetryPolicy {
            max_attempts: Some(0),
            ..RetryPolicy::default()
        };
        assert_eq!(
            validate_retry(&p, "retry").unwrap_err().field(),
            "retry.max_attempts"
        );
    }

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
        c.back_pressure.window_high = 0;
        assert_eq!(c.validate().unwrap_err().field(), "back_pressure.window_low");
        c.back_pressure = BackPressure::default();
        c.commit_every = 0;
        assert_eq!(c.validate().unwrap_err().field(), "commit_every");
        c.commit_every = 1;
        c.stuck_timeout = Some(Duration::ZERO);
        let err = c.validate().unwrap_err();
        assert_eq!(err.field(), "stuck_timeout");
        assert!(err.to_string().contains("stuck_timeout"));
        c.stuck_timeout = None;
        c.max_in_flight = Some(0);
        assert_eq!(c.validate().unwrap_err().field(), "max_in_flight");
    }

    #[test]
    fn drain_timeout_must_be_shorter_than_the_revoke_timeout() {
        let c = EngineConfig {
            drain_timeout: Duration::from_secs(90),
            ..EngineConfig::default()
        };
        let err = c
            .validate_for_revoke_timeout(Duration::from_secs(60))
            .unwrap_err();
        assert_eq!(err.field(), "drain_timeout");
        assert!(err.to_string().contains("revoke timeout"), "{err}");
        assert!(EngineConfig::default()
            .validate_for_revoke_timeout(Duration::from_secs(60))
            .is_ok());
    }

    #[test]
    fn shards_never_exceed_the_call_limit() {
        let few = EngineConfig {
            shards: 8,
            max_in_flight: Some(3),
            ..EngineConfig::default()
        };
        assert_eq!(few.effective_shards(), 3);
    }
}
