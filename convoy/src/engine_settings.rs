//! The engine's settings as a config file's `[engine]` table or `CONVOY_ENGINE_*` variables give
//! them: every field optional, each one set replacing the engine's default (or the
//! application's own value) and nothing else.
//!
//! ```toml
//! [engine]
//! max_in_flight = 512
//! drain = "in-flight"          # or "buffered"
//! drain_timeout_ms = 15000
//! shutdown_timeout_ms = 25000
//! stuck_timeout_ms = 300000    # the default; "unlimited" lets a hung handler hold its key
//! keyless = "per-source"       # "unordered", "dead-letter"
//! [engine.retry]
//! max_attempts = 10           # the default; "unlimited" retries until it works
//! base_ms = 100
//! factor = 2.0
//! cap_ms = 30000
//! jitter = "full"              # "equal", "none"
//! on_exhausted = "dead-letter" # "block-lane"
//! [engine.back_pressure]
//! source_high = 4000
//! source_low = 2000
//! ```
//!
//! The same from the environment: `CONVOY_ENGINE_MAX_IN_FLIGHT=512`,
//! `CONVOY_ENGINE_RETRY_MAX_ATTEMPTS=10`, `CONVOY_ENGINE_BACK_PRESSURE_SOURCE_HIGH=4000`.

use std::time::Duration;

use convoy_core::{ConfigError, Drain, EngineConfig, Jitter, KeylessPolicy, OnExhausted};
use serde::Deserialize;

/// What a shutdown drains.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum DrainSetting {
    /// [`Drain::InFlight`].
    InFlight,
    /// [`Drain::Buffered`].
    Buffered,
}

/// A [`KeylessPolicy`] by name.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum KeylessSetting {
    /// [`KeylessPolicy::PerSource`].
    PerSource,
    /// [`KeylessPolicy::Unordered`].
    Unordered,
    /// [`KeylessPolicy::DeadLetter`].
    DeadLetter,
}

/// A [`Jitter`] by name.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum JitterSetting {
    /// [`Jitter::Full`].
    Full,
    /// [`Jitter::Equal`].
    Equal,
    /// [`Jitter::None`].
    None,
}

/// An [`OnExhausted`] by name.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum OnExhaustedSetting {
    /// [`OnExhausted::DeadLetter`].
    DeadLetter,
    /// [`OnExhausted::BlockLane`].
    BlockLane,
}

/// `[engine.retry]`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RetrySettings {
    /// Attempts in total (first included), or `"unlimited"`.
    pub max_attempts: Option<Limit>,
    /// Give up this long after the first failure (ms).
    pub max_elapsed_ms: Option<u64>,
    /// Each attempt's time limit (ms).
    pub attempt_timeout_ms: Option<u64>,
    /// The first retry's delay (ms).
    pub base_ms: Option<u64>,
    /// Each retry's delay times this.
    pub factor: Option<f64>,
    /// The longest delay (ms).
    pub cap_ms: Option<u64>,
    /// Randomisation of the delay.
    pub jitter: Option<JitterSetting>,
    /// What a message that exhausted its retries does.
    pub on_exhausted: Option<OnExhaustedSetting>,
}

/// A limit that can be lifted: a number, or the word `"unlimited"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// This many (milliseconds, attempts: as the setting says).
    At(u64),
    /// No limit.
    Unlimited,
}

impl Limit {
    /// The number, or `None` when unlimited.
    pub fn number(self) -> Option<u64> {
        match self {
            Limit::At(n) => Some(n),
            Limit::Unlimited => None,
        }
    }
}

impl<'de> Deserialize<'de> for Limit {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Limit;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number, or \"unlimited\"")
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Limit, E> {
                Ok(Limit::At(n))
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Limit, E> {
                u64::try_from(n)
                    .map(Limit::At)
                    .map_err(|_| E::custom(format!("{n} is negative: give a number ≥ 0, or \"unlimited\"")))
            }

            fn visit_str<E: serde::de::Error>(self, word: &str) -> Result<Limit, E> {
                match word {
                    "unlimited" => Ok(Limit::Unlimited),
                    other => Err(E::custom(format!(
                        "{other:?} is not a limit: give a number, or \"unlimited\""
                    ))),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// `[engine.back_pressure]`: the high and low water marks.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct BackPressureSettings {
    /// Messages held per source: pause above.
    pub source_high: Option<usize>,
    /// … and resume below.
    pub source_low: Option<usize>,
    /// Messages held in total: pause above.
    pub total_high: Option<usize>,
    /// … and resume below.
    pub total_low: Option<usize>,
    /// Bytes held in total: pause above.
    pub total_bytes_high: Option<usize>,
    /// … and resume below.
    pub total_bytes_low: Option<usize>,
    /// A source's watermark window (offsets): wait for its head above.
    pub window_high: Option<usize>,
    /// … and go on below.
    pub window_low: Option<usize>,
}

/// `[engine]`: the engine's settings; each one set replaces what the application configured.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct EngineSettings {
    /// Consumer group for dead-letter reasons and metrics (default: the connection's).
    pub group: Option<String>,
    /// Shards (0: four per CPU).
    pub shards: Option<usize>,
    /// Handler calls at once over all lanes (0: no limit).
    pub max_in_flight: Option<usize>,
    /// What a shutdown drains.
    pub drain: Option<DrainSetting>,
    /// How long a revoke or shutdown drains (ms).
    pub drain_timeout_ms: Option<u64>,
    /// The whole shutdown's limit (ms).
    pub shutdown_timeout_ms: Option<u64>,
    /// Dead-letter a message unfinished longer than this (ms) as stuck, or `"unlimited"`.
    pub stuck_timeout_ms: Option<Limit>,
    /// Commit at least this often (ms).
    pub commit_interval_ms: Option<u64>,
    /// … and after this many finished messages.
    pub commit_every: Option<usize>,
    /// A commit not confirmed within this long failed (ms).
    pub commit_timeout_ms: Option<u64>,
    /// Take this many messages, then stop.
    pub max_messages: Option<u64>,
    /// Keyless messages.
    pub keyless: Option<KeylessSetting>,
    /// Dead-letter larger payloads unhandled (bytes).
    pub max_payload_bytes: Option<usize>,
    /// Park a key whose message is dead-lettered until it is replayed.
    pub park_keys: Option<bool>,
    /// `[engine.retry]`.
    #[serde(default)]
    pub retry: RetrySettings,
    /// `[engine.back_pressure]`.
    #[serde(default)]
    pub back_pressure: BackPressureSettings,
}

/// Sets `target` to `value` when the setting is given.
fn set<T, V>(target: &mut T, value: Option<V>, into: impl FnOnce(V) -> T) {
    if let Some(v) = value {
        *target = into(v);
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

macro_rules! over_fields {
    ($high:expr, $low:expr, [$($field:ident),* $(,)?]) => {
        $( if $high.$field.is_none() { $high.$field = $low.$field.clone(); } )*
    };
}

impl EngineSettings {
    /// These settings over `lower`: every field set here wins.
    pub fn over(mut self, lower: EngineSettings) -> EngineSettings {
        over_fields!(
            self,
            lower,
            [
                group,
                shards,
                max_in_flight,
                drain,
                drain_timeout_ms,
                shutdown_timeout_ms,
                stuck_timeout_ms,
                commit_interval_ms,
                commit_every,
                commit_timeout_ms,
                max_messages,
                keyless,
                max_payload_bytes,
                park_keys
            ]
        );
        over_fields!(
            self.retry,
            lower.retry,
            [
                max_attempts,
                max_elapsed_ms,
                attempt_timeout_ms,
                base_ms,
                factor,
                cap_ms,
                jitter,
                on_exhausted
            ]
        );
        over_fields!(
            self.back_pressure,
            lower.back_pressure,
            [
                source_high,
                source_low,
                total_high,
                total_low,
                total_bytes_high,
                total_bytes_low,
                window_high,
                window_low
            ]
        );
        self
    }

    /// Applies every setting given to `config`, then validates it (the error names the
    /// setting).
    pub fn apply(&self, config: &mut EngineConfig) -> Result<(), ConfigError> {
        set(&mut config.group, self.group.clone(), |g| g);
        set(&mut config.shards, self.shards, |n| n);
        set(&mut config.max_in_flight, self.max_in_flight, |n| {
            (n > 0).then_some(n)
        });
        set(&mut config.drain, self.drain, |d| match d {
            DrainSetting::InFlight => Drain::InFlight,
            DrainSetting::Buffered => Drain::Buffered,
        });
        set(&mut config.drain_timeout, self.drain_timeout_ms, ms);
        set(&mut config.shutdown_timeout, self.shutdown_timeout_ms, ms);
        set(&mut config.stuck_timeout, self.stuck_timeout_ms, |v| {
            v.number().map(ms)
        });
        set(&mut config.commit_interval, self.commit_interval_ms, ms);
        set(&mut config.commit_every, self.commit_every, |n| n);
        set(&mut config.commit_timeout, self.commit_timeout_ms, ms);
        set(&mut config.max_messages, self.max_messages, Some);
        set(&mut config.keyless, self.keyless, |k| match k {
            KeylessSetting::PerSource => KeylessPolicy::PerSource,
            KeylessSetting::Unordered => KeylessPolicy::Unordered,
            KeylessSetting::DeadLetter => KeylessPolicy::DeadLetter,
        });
        set(&mut config.max_payload_bytes, self.max_payload_bytes, Some);
        set(&mut config.park_keys, self.park_keys, |p| p);
        let r = &self.retry;
        let retry = &mut config.retry;
        if let Some(Limit::At(n)) = r.max_attempts {
            if u32::try_from(n).is_err() {
                return Err(ConfigError::invalid(
                    "retry.max_attempts",
                    format!("{n} is too many: at most {}, or \"unlimited\"", u32::MAX),
                ));
            }
        }
        set(&mut retry.max_attempts, r.max_attempts, |v| {
            v.number().map(|n| u32::try_from(n).unwrap_or(u32::MAX))
        });
        set(&mut retry.max_elapsed, r.max_elapsed_ms, |v| Some(ms(v)));
        set(&mut retry.attempt_timeout, r.attempt_timeout_ms, |v| Some(ms(v)));
        set(&mut retry.backoff.base, r.base_ms, ms);
        set(&mut retry.backoff.factor, r.factor, |f| f);
        set(&mut retry.backoff.cap, r.cap_ms, ms);
        set(&mut retry.backoff.jitter, r.jitter, |j| match j {
            JitterSetting::Full => Jitter::Full,
            JitterSetting::Equal => Jitter::Equal,
            JitterSetting::None => Jitter::None,
        });
        set(&mut retry.on_exhausted, r.on_exhausted, |o| match o {
            OnExhaustedSetting::DeadLetter => OnExhausted::DeadLetter,
            OnExhaustedSetting::BlockLane => OnExhausted::BlockLane,
        });
        let b = &self.back_pressure;
        let bp = &mut config.back_pressure;
        set(&mut bp.source_high, b.source_high, |n| n);
        set(&mut bp.source_low, b.source_low, |n| n);
        set(&mut bp.total_high, b.total_high, |n| n);
        set(&mut bp.total_low, b.total_low, |n| n);
        set(&mut bp.total_bytes_high, b.total_bytes_high, |n| n);
        set(&mut bp.total_bytes_low, b.total_bytes_low, |n| n);
        set(&mut bp.window_high, b.window_high, |n| n);
        set(&mut bp.window_low, b.window_low, |n| n);
        config.validate()
    }

    /// `CONVOY_ENGINE_<FIELD>`, `CONVOY_ENGINE_RETRY_<FIELD>` and
    /// `CONVOY_ENGINE_BACK_PRESSURE_<FIELD>` from `vars` (name, value); a bad value or an
    /// unknown name is an error naming the variable.
    pub fn from_vars(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<EngineSettings, ConfigError> {
        let mut table = toml::Table::new();
        for (name, value) in vars {
            // Each variable alone first, so that an error names the one to fix.
            let mut alone = toml::Table::new();
            Self::merge(&mut alone, name.clone(), value.clone())?;
            toml::Value::Table(alone)
                .try_into::<EngineSettings>()
                .map_err(|e| ConfigError::invalid(name.as_str(), in_words(e.message())))?;
            Self::merge(&mut table, name, value)?;
        }
        toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::invalid("CONVOY_ENGINE_*", in_words(e.message())))
    }

    /// Adds variable `name` to `table`, if it is one of the engine's.
    fn merge(table: &mut toml::Table, name: String, value: String) -> Result<(), ConfigError> {
        let Some(field) = name.strip_prefix("CONVOY_ENGINE_") else {
            return Ok(());
        };
        let field = field.to_ascii_lowercase();
        let (section, key) = match (field.strip_prefix("retry_"), field.strip_prefix("back_pressure_")) {
            (Some(key), _) => (Some("retry"), key.to_owned()),
            (_, Some(key)) => (Some("back_pressure"), key.to_owned()),
            _ => (None, field),
        };
        let value = value.trim();
        let parsed = if let Ok(b) = value.parse::<bool>() {
            toml::Value::Boolean(b)
        } else if let Ok(n) = value.parse::<i64>() {
            toml::Value::Integer(n)
        } else if let Ok(f) = value.parse::<f64>() {
            toml::Value::Float(f)
        } else {
            toml::Value::String(value.to_owned())
        };
        let target = match section {
            Some(section) => table
                .entry(section)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .ok_or_else(|| ConfigError::invalid(name.as_str(), "conflicts with another variable"))?,
            None => table,
        };
        target.insert(key, parsed);
        Ok(())
    }
}

/// A parser's message with Rust's type names in words (`expected usize` → `expected a whole
/// number`), on one line.
pub(crate) fn in_words(message: &str) -> String {
    let mut text = message.trim().replace('\n', " ");
    for (rust, words) in [
        ("usize", "a whole number"),
        ("u64", "a whole number"),
        ("u32", "a whole number"),
        ("u16", "a whole number"),
        ("u8", "a whole number"),
        ("i64", "a whole number"),
        ("f64", "a number"),
    ] {
        text = text.replace(&format!("expected {rust}"), &format!("expected {words}"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_sets_only_what_it_names() {
        let settings: EngineSettings = toml::from_str(
            "max_in_flight = 64\ndrain = \"buffered\"\nstuck_timeout_ms = 60000\n[retry]\nmax_attempts = 3\njitter = \"none\"\n[back_pressure]\nsource_high = 100\nsource_low = 50\n",
        )
        .unwrap();
        let mut config = EngineConfig::for_group("billing");
        config.commit_every = 7; // the application's own value, not named by the table: kept
        settings.apply(&mut config).unwrap();
        assert_eq!(config.max_in_flight, Some(64));
        assert_eq!(config.drain, Drain::Buffered);
        assert_eq!(config.stuck_timeout, Some(Duration::from_secs(60)));
        assert_eq!(config.retry.max_attempts, Some(3));
        assert_eq!(config.retry.backoff.jitter, Jitter::None);
        assert_eq!(
            (config.back_pressure.source_high, config.back_pressure.source_low),
            (100, 50)
        );
        assert_eq!(config.commit_every, 7);
        assert_eq!(config.group, "billing");
    }

    #[test]
    fn limits_take_a_number_or_unlimited() {
        let settings: EngineSettings =
            toml::from_str("stuck_timeout_ms = \"unlimited\"\n[retry]\nmax_attempts = \"unlimited\"\n")
                .unwrap();
        let mut config = EngineConfig::for_group("billing");
        assert!(config.stuck_timeout.is_some() && config.retry.max_attempts.is_some());
        settings.apply(&mut config).unwrap();
        assert_eq!((config.stuck_timeout, config.retry.max_attempts), (None, None));

        let vars = [("CONVOY_ENGINE_RETRY_MAX_ATTEMPTS".into(), "unlimited".into())];
        let settings = EngineSettings::from_vars(vars).unwrap();
        assert_eq!(settings.retry.max_attempts, Some(Limit::Unlimited));

        let typo = toml::from_str::<EngineSettings>("[retry]\nmax_attempts = \"infinite\"\n").unwrap_err();
        assert!(typo.to_string().contains("\"unlimited\""), "{typo}");
        let zero: EngineSettings = toml::from_str("[retry]\nmax_attempts = 0\n").unwrap();
        let error = zero.apply(&mut EngineConfig::for_group("billing")).unwrap_err();
        assert_eq!(error.field(), "retry.max_attempts", "{error}");
        assert!(error.to_string().contains("unlimited"), "{error}");
    }

    #[test]
    fn variables_set_the_same_and_bad_ones_are_named() {
        let vars = [
            ("CONVOY_ENGINE_MAX_IN_FLIGHT", "8"),
            ("CONVOY_ENGINE_RETRY_FACTOR", "1.5"),
            ("CONVOY_ENGINE_BACK_PRESSURE_TOTAL_HIGH", "900"),
            ("CONVOY_ENGINE_DRAIN", "in-flight"),
            ("CONVOY_ENGINE_PARK_KEYS", "true"),
            ("CONVOY_URL", "ignored here"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let settings = EngineSettings::from_vars(vars).unwrap();
        assert_eq!(settings.max_in_flight, Some(8));
        assert_eq!(settings.retry.factor, Some(1.5));
        assert_eq!(settings.back_pressure.total_high, Some(900));
        assert_eq!(settings.drain, Some(DrainSetting::InFlight));
        assert_eq!(settings.park_keys, Some(true));

        let unknown =
            EngineSettings::from_vars([("CONVOY_ENGINE_MAX_INFLIGHT".into(), "8".into())]).unwrap_err();
        assert!(unknown.to_string().contains("max_inflight"), "{unknown}");
        assert!(
            unknown.to_string().contains("CONVOY_ENGINE_MAX_INFLIGHT"),
            "{unknown}"
        );
        let bad = EngineSettings::from_vars([
            ("CONVOY_ENGINE_MAX_IN_FLIGHT".into(), "8".into()),
            ("CONVOY_ENGINE_DRAIN".into(), "all".into()),
        ])
        .unwrap_err();
        assert!(bad.to_string().contains("all"), "{bad}");
        assert!(bad.to_string().contains("CONVOY_ENGINE_DRAIN"), "{bad}");
    }

    #[test]
    fn settings_over_others_win_field_by_field_and_a_bad_result_is_refused() {
        let file: EngineSettings = toml::from_str("max_in_flight = 1\n[retry]\nbase_ms = 5\n").unwrap();
        let env: EngineSettings = toml::from_str("[retry]\ncap_ms = 7\n").unwrap();
        let merged = env.over(file);
        assert_eq!(
            (merged.max_in_flight, merged.retry.base_ms, merged.retry.cap_ms),
            (Some(1), Some(5), Some(7))
        );
        let refused: EngineSettings =
            toml::from_str("[back_pressure]\nsource_high = 10\nsource_low = 20\n").unwrap();
        let error = refused.apply(&mut EngineConfig::default()).unwrap_err();
        assert!(error.to_string().contains("source_low"), "{error}");
    }
}
