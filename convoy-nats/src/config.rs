//! NATS configuration: a serde struct validated at startup, with errors that name the field.
//! Tokens, passwords and nkey seeds never appear in `Debug` output or logs.

use convoy_core::config::{has_unescaped_password, redact_userinfo, UNESCAPED_PASSWORD};
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use convoy_core::ConfigError;
use serde::Deserialize;

fn default_servers() -> Vec<String> {
    vec!["127.0.0.1:4222".into()]
}

fn default_partitions() -> u32 {
    8
}

fn default_lease_ttl_ms() -> u64 {
    10_000
}

fn default_revoke_timeout_ms() -> u64 {
    60_000
}

fn default_balance_interval_ms() -> u64 {
    500
}

fn default_connect_timeout_ms() -> u64 {
    10_000
}

fn default_stream_max_age_s() -> u64 {
    7 * 24 * 3600
}

fn default_stream_max_bytes() -> i64 {
    -1
}

fn default_duplicate_window_s() -> u64 {
    120
}

fn default_replicas() -> usize {
    1
}

/// Everything convoy-nats needs to consume and publish.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// Server addresses (`host:port`, `nats://host:port`, `tls://host:port`).
    #[serde(default = "default_servers")]
    pub servers: Vec<String>,
    /// Consumer group: its members share the partitions; each group keeps its own watermarks.
    pub group: String,
    /// Topics to consume (each is a stream with one subject per partition).
    #[serde(default)]
    pub topics: Vec<String>,
    /// Dead-letter stream; defaults to `<first topic>.dlq`.
    #[serde(default)]
    pub dlq_topic: Option<String>,
    /// Partitions of each topic: subjects `<topic>.0 …`, and what publishers hash keys over.
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// Authentication token.
    #[serde(default)]
    pub token: Option<String>,
    /// User name (with `password`).
    #[serde(default)]
    pub user: Option<String>,
    /// Password (with `user`).
    #[serde(default)]
    pub password: Option<String>,
    /// A `.creds` file (JWT and nkey seed); needs the crate's `nkeys` feature.
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// An nkey seed; needs the crate's `nkeys` feature.
    #[serde(default)]
    pub nkey: Option<String>,
    /// CA certificate(s) to trust (PEM), besides the system's.
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate (PEM), with `tls_key_file`.
    #[serde(default)]
    pub tls_cert_file: Option<PathBuf>,
    /// Client key (PEM), with `tls_cert_file`.
    #[serde(default)]
    pub tls_key_file: Option<PathBuf>,
    /// Refuse to talk to a server without TLS (implied by `tls://` addresses).
    #[serde(default)]
    pub tls_required: bool,
    /// Connection name shown by the server (`/connz`).
    #[serde(default)]
    pub connection_name: Option<String>,
    /// How long a partition lease lasts without renewal: a member that died is replaced after
    /// about this long, and one that cannot renew stops handling well before it runs out.
    #[serde(default = "default_lease_ttl_ms")]
    pub lease_ttl_ms: u64,
    /// Messages requested per pull from a partition (at most 1.5× this is buffered per
    /// partition); by default derived from the engine's prefetch limit.
    #[serde(default)]
    pub fetch_batch: Option<usize>,
    /// How long a partition being handed over waits for the engine to drain and commit.
    #[serde(default = "default_revoke_timeout_ms")]
    pub revoke_timeout_ms: u64,
    /// How often a member counts the members and rebalances its partitions.
    #[serde(default = "default_balance_interval_ms")]
    pub balance_interval_ms: u64,
    /// Longest wait for the connection to open.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Retention of the streams convoy creates: how long messages are kept (they stay after
    /// they are handled, like a Kafka log).
    #[serde(default = "default_stream_max_age_s")]
    pub stream_max_age_s: u64,
    /// Retention by size of the streams convoy creates (-1: unlimited).
    #[serde(default = "default_stream_max_bytes")]
    pub stream_max_bytes: i64,
    /// The window in which a re-sent publish (same `Nats-Msg-Id`) is dropped as a duplicate.
    #[serde(default = "default_duplicate_window_s")]
    pub duplicate_window_s: u64,
    /// Replicas of every stream and bucket convoy creates (topics, dead letters, the group's
    /// watermarks and leases): 1 on a single server; 3 on a cluster that must go on when one
    /// server is lost. At most 5, and no more than the cluster has servers.
    #[serde(default = "default_replicas")]
    pub replicas: usize,
}

fn secret(value: &Option<String>) -> Option<&'static str> {
    value.as_ref().map(|_| "<redacted>")
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field(
                "servers",
                &self
                    .servers
                    .iter()
                    .map(|s| redact_userinfo(s))
                    .collect::<Vec<_>>(),
            )
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("dlq_topic", &self.dlq_topic)
            .field("partitions", &self.partitions)
            .field("token", &secret(&self.token))
            .field("user", &self.user)
            .field("password", &secret(&self.password))
            .field("credentials_file", &self.credentials_file)
            .field("nkey", &secret(&self.nkey))
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("tls_required", &self.tls_required)
            .field("connection_name", &self.connection_name)
            .field("lease_ttl_ms", &self.lease_ttl_ms)
            .field("fetch_batch", &self.fetch_batch)
            .field("revoke_timeout_ms", &self.revoke_timeout_ms)
            .field("balance_interval_ms", &self.balance_interval_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("stream_max_age_s", &self.stream_max_age_s)
            .field("stream_max_bytes", &self.stream_max_bytes)
            .field("duplicate_window_s", &self.duplicate_window_s)
            .field("replicas", &self.replicas)
            .finish()
    }
}

/// Longest topic name: stream, consumer and key names are derived from it.
const MAX_TOPIC: usize = 200;

impl NatsConfig {
    /// A configuration with defaults for everything but the essentials.
    pub fn new(servers: &[&str], group: impl Into<String>, topics: &[&str]) -> Self {
        NatsConfig {
            servers: servers.iter().map(|s| (*s).to_owned()).collect(),
            group: group.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            dlq_topic: None,
            partitions: default_partitions(),
            token: None,
            user: None,
            password: None,
            credentials_file: None,
            nkey: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_required: false,
            connection_name: None,
            lease_ttl_ms: default_lease_ttl_ms(),
            fetch_batch: None,
            revoke_timeout_ms: default_revoke_timeout_ms(),
            balance_interval_ms: default_balance_interval_ms(),
            connect_timeout_ms: default_connect_timeout_ms(),
            stream_max_age_s: default_stream_max_age_s(),
            stream_max_bytes: default_stream_max_bytes(),
            duplicate_window_s: default_duplicate_window_s(),
            replicas: default_replicas(),
        }
    }

    /// Sets one field by name, as a URL parameter gives it.
    pub fn apply_param(&mut self, name: &str, value: &str) -> Result<(), ConfigError> {
        fn number<T: std::str::FromStr>(field: &str, value: &str) -> Result<T, ConfigError> {
            value
                .parse::<T>()
                .map_err(|_| ConfigError::invalid(field, format!("expected a number, got {value:?}")))
        }
        let text = || Some(value.to_owned());
        match name {
            "token" => self.token = text(),
            "user" => self.user = text(),
            "password" => self.password = text(),
            "credentials_file" => self.credentials_file = Some(value.into()),
            "nkey" => self.nkey = text(),
            "tls_ca_file" => self.tls_ca_file = Some(value.into()),
            "tls_cert_file" => self.tls_cert_file = Some(value.into()),
            "tls_key_file" => self.tls_key_file = Some(value.into()),
            "tls_required" => {
                self.tls_required = value.parse().map_err(|_| {
                    ConfigError::invalid(name, format!("expected true or false, got {value:?}"))
                })?
            }
            "connection_name" => self.connection_name = text(),
            "lease_ttl_ms" => self.lease_ttl_ms = number(name, value)?,
            "fetch_batch" => self.fetch_batch = Some(number(name, value)?),
            "revoke_timeout_ms" => self.revoke_timeout_ms = number(name, value)?,
            "balance_interval_ms" => self.balance_interval_ms = number(name, value)?,
            "connect_timeout_ms" => self.connect_timeout_ms = number(name, value)?,
            "stream_max_age_s" => self.stream_max_age_s = number(name, value)?,
            "stream_max_bytes" => self.stream_max_bytes = number(name, value)?,
            "duplicate_window_s" => self.duplicate_window_s = number(name, value)?,
            "replicas" => self.replicas = number(name, value)?,
            other => {
                return Err(ConfigError::invalid(
                    other,
                    "unknown NATS setting: use token, user, password, credentials_file, nkey, \
                     tls_ca_file, tls_cert_file, tls_key_file, tls_required, connection_name, \
                     lease_ttl_ms, fetch_batch, revoke_timeout_ms, balance_interval_ms, \
                     connect_timeout_ms, stream_max_age_s, stream_max_bytes, duplicate_window_s \
                     or replicas",
                ))
            }
        }
        Ok(())
    }

    /// Checks every field; the error names the first bad one. `needs_topics`: a consumer must
    /// name its topics, a publisher need not.
    pub fn validate(&self, needs_topics: bool) -> Result<(), ConfigError> {
        if self.servers.is_empty() || self.servers.iter().any(|s| s.trim().is_empty()) {
            return Err(ConfigError::invalid(
                "servers",
                "name at least one server, host:port",
            ));
        }
        for server in &self.servers {
            let shown = redact_userinfo(server);
            if has_unescaped_password(server) {
                return Err(ConfigError::invalid(
                    "servers",
                    format!("{shown:?}: {UNESCAPED_PASSWORD}"),
                ));
            }
            server
                .parse::<async_nats::ServerAddr>()
                .map_err(|e| ConfigError::invalid("servers", format!("{shown:?}: {e}")))?;
        }
        if self.group.trim().is_empty() {
            return Err(ConfigError::invalid("group", "must not be empty"));
        }
        if needs_topics && self.topics.is_empty() {
            return Err(ConfigError::invalid(
                "topics",
                "name at least one topic to consume",
            ));
        }
        if !(1..=10_000).contains(&self.partitions) {
            return Err(ConfigError::invalid("partitions", "must be between 1 and 10000"));
        }
        for topic in &self.topics {
            check_topic("topics", topic)?;
        }
        if let Some(dlq) = &self.dlq_topic {
            check_topic("dlq_topic", dlq)?;
        }
        if self.user.is_some() != self.password.is_some() {
            let field = if self.user.is_some() { "password" } else { "user" };
            return Err(ConfigError::invalid(field, "user and password go together"));
        }
        if !cfg!(feature = "nkeys") {
            for (field, set) in [
                ("credentials_file", self.credentials_file.is_some()),
                ("nkey", self.nkey.is_some()),
            ] {
                if set {
                    return Err(ConfigError::invalid(
                        field,
                        "needs convoy-nats' `nkeys` feature (the facade's `nats-nkeys`)",
                    ));
                }
            }
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            let field = if self.tls_cert_file.is_some() {
                "tls_key_file"
            } else {
                "tls_cert_file"
            };
            return Err(ConfigError::invalid(
                field,
                "a client certificate needs its key, and the key its certificate",
            ));
        }
        if !(1_000..=600_000).contains(&self.lease_ttl_ms) {
            return Err(ConfigError::invalid(
                "lease_ttl_ms",
                "must be between 1000 and 600000 (the server expires keys with about a second's precision)",
            ));
        }
        if self.fetch_batch.is_some_and(|b| !(1..=10_000).contains(&b)) {
            return Err(ConfigError::invalid("fetch_batch", "must be between 1 and 10000"));
        }
        if self.revoke_timeout_ms < 1_000 {
            return Err(ConfigError::invalid("revoke_timeout_ms", "must be at least 1000"));
        }
        if self.balance_interval_ms == 0 {
            return Err(ConfigError::invalid("balance_interval_ms", "must be > 0"));
        }
        if self.connect_timeout_ms == 0 {
            return Err(ConfigError::invalid("connect_timeout_ms", "must be > 0"));
        }
        if self.stream_max_bytes == 0 || self.stream_max_bytes < -1 {
            return Err(ConfigError::invalid(
                "stream_max_bytes",
                "must be > 0, or -1 for unlimited",
            ));
        }
        if self.duplicate_window_s == 0 {
            return Err(ConfigError::invalid("duplicate_window_s", "must be > 0"));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(ConfigError::invalid(
                "replicas",
                "must be between 1 and 5 (JetStream's limit; 3 survives the loss of one server)",
            ));
        }
        if self.stream_max_age_s != 0 && self.duplicate_window_s > self.stream_max_age_s {
            return Err(ConfigError::invalid(
                "duplicate_window_s",
                "must not exceed stream_max_age_s (the server refuses such a stream)",
            ));
        }
        Ok(())
    }

    /// The dead-letter stream in use.
    pub fn dlq_topic(&self) -> String {
        self.dlq_topic
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.topics.first().map_or("convoy", String::as_str)))
    }

    /// How long a lease lasts without renewal.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.lease_ttl_ms)
    }

    /// How long a revoke waits for the engine.
    pub fn revoke_timeout(&self) -> Duration {
        Duration::from_millis(self.revoke_timeout_ms)
    }
}

/// A topic is a subject prefix: dot-separated tokens of letters, digits, `-` and `_`.
fn check_topic(field: &str, topic: &str) -> Result<(), ConfigError> {
    let valid = !topic.is_empty()
        && topic.len() <= MAX_TOPIC
        && topic.split('.').all(|token| {
            !token.is_empty()
                && token
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
        });
    if valid {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            format!(
                "{topic:?} is not a valid topic name: dot-separated words of letters, digits, - and _, \
                 at most {MAX_TOPIC} bytes (it becomes the subjects <topic>.<partition>)"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> NatsConfig {
        NatsConfig::new(&["127.0.0.1:4222"], "billing", &["orders"])
    }

    #[test]
    fn defaults_are_valid() {
        valid().validate(true).unwrap();
        assert_eq!(valid().dlq_topic(), "orders.dlq");
    }

    type Breaker = Box<dyn Fn(&mut NatsConfig)>;

    #[test]
    fn bad_fields_are_named() {
        let cases: Vec<(Breaker, &str)> = vec![
            (Box::new(|c| c.servers.clear()), "servers"),
            (
                Box::new(|c| c.servers = vec!["nats://u:pa?ss@127.0.0.1:4222".into()]),
                "servers",
            ),
            (Box::new(|c| c.group = " ".into()), "group"),
            (Box::new(|c| c.topics = vec!["a b".into()]), "topics"),
            (Box::new(|c| c.topics = vec!["orders.".into()]), "topics"),
            (Box::new(|c| c.topics = vec!["orders.*".into()]), "topics"),
            (Box::new(|c| c.dlq_topic = Some(">".into())), "dlq_topic"),
            (Box::new(|c| c.partitions = 0), "partitions"),
            (Box::new(|c| c.user = Some("u".into())), "password"),
            (
                Box::new(|c| c.tls_cert_file = Some("c.pem".into())),
                "tls_key_file",
            ),
            (Box::new(|c| c.lease_ttl_ms = 10), "lease_ttl_ms"),
            (Box::new(|c| c.fetch_batch = Some(0)), "fetch_batch"),
            (Box::new(|c| c.revoke_timeout_ms = 5), "revoke_timeout_ms"),
            (Box::new(|c| c.stream_max_bytes = 0), "stream_max_bytes"),
            (
                Box::new(|c| c.duplicate_window_s = 10 * 24 * 3600),
                "duplicate_window_s",
            ),
            (Box::new(|c| c.replicas = 0), "replicas"),
            (Box::new(|c| c.replicas = 7), "replicas"),
        ];
        for (break_it, field) in cases {
            let mut c = valid();
            break_it(&mut c);
            assert_eq!(c.validate(true).unwrap_err().field(), field);
        }
        assert_eq!(
            NatsConfig::new(&["127.0.0.1:4222"], "g", &[])
                .validate(true)
                .unwrap_err()
                .field(),
            "topics"
        );
        NatsConfig::new(&["127.0.0.1:4222"], "g", &[])
            .validate(false)
            .unwrap();
    }

    #[test]
    fn secrets_never_reach_debug_output() {
        let mut c = valid();
        c.token = Some("s3cret-token".into());
        c.user = Some("convoy".into());
        c.password = Some("pa55word".into());
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret-token") && !shown.contains("pa55word"),
            "{shown}"
        );
        assert!(shown.contains("convoy"));
    }

    #[test]
    fn url_parameters_apply_by_name() {
        let mut c = valid();
        c.apply_param("lease_ttl_ms", "3000").unwrap();
        c.apply_param("fetch_batch", "100").unwrap();
        c.apply_param("tls_required", "true").unwrap();
        assert_eq!(
            (c.lease_ttl_ms, c.fetch_batch, c.tls_required),
            (3000, Some(100), true)
        );
        assert_eq!(
            c.apply_param("fetch_batch", "lots").unwrap_err().field(),
            "fetch_batch"
        );
        assert_eq!(c.apply_param("colour", "red").unwrap_err().field(), "colour");
    }
}
