//! RabbitMQ configuration: a serde struct validated at startup, with errors that name the field.
//! The password in the URI never appears in `Debug` output or logs.

use std::fmt;
use std::time::Duration;

use convoy_core::config::{has_unescaped_password, redact_userinfo, UNESCAPED_PASSWORD};
use convoy_core::ConfigError;
use lapin::uri::AMQPUri;
use serde::Deserialize;

fn default_partitions() -> u32 {
    8
}

fn default_heartbeat_s() -> u16 {
    10
}

fn default_delivery_limit() -> u32 {
    1_000
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

/// Everything convoy-amqp needs to consume and publish.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmqpConfig {
    /// `amqp://user:password@host:port/vhost` (`%2f` is the `/` vhost); `amqps://` needs the
    /// crate's `tls` feature. The nodes of a cluster may be listed, comma-separated
    /// (`amqp://user:password@host1:5672,host2:5672/vhost`): connections go to one of them and,
    /// when it fails, to the next.
    pub uri: String,
    /// Consumer group: each group has its own partition queues and receives every message.
    pub group: String,
    /// Topics to consume (each is an exchange with `partitions` queues per group).
    #[serde(default)]
    pub topics: Vec<String>,
    /// Dead-letter stream; defaults to `<first topic>.dlq`.
    #[serde(default)]
    pub dlq_topic: Option<String>,
    /// Partitions of each topic: queues per group, and what publishers hash keys over.
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// Unacknowledged messages per partition queue (the broker's prefetch); by default derived
    /// from the engine's prefetch limit divided over the partitions.
    #[serde(default)]
    pub prefetch: Option<u16>,
    /// Heartbeat timeout in seconds: the broker drops a silent connection one to two of these
    /// after its last frame, and a member's lease on its partitions lasts two thirds of it past
    /// each renewal (every fifth of it), so a cut-off member stops first.
    #[serde(default = "default_heartbeat_s")]
    pub heartbeat_s: u16,
    /// Redeliveries of one message by a partition queue (`x-delivery-limit`) before the broker
    /// dead-letters it to the dead-letter stream (with its `x-death` header, reason
    /// `delivery_limit`) instead of delivering it again. convoy retries inside the lane, so a
    /// message is delivered again only when its member crashed, lost its connection or handed
    /// the partition over while it was in hand; RabbitMQ 4 would otherwise apply its default of
    /// 20 and drop what exceeds it.
    #[serde(default = "default_delivery_limit")]
    pub delivery_limit: u32,
    /// Connection name shown by the broker (`rabbitmqctl list_connections`).
    #[serde(default)]
    pub connection_name: Option<String>,
    /// How long a partition being handed over waits for the engine to drain and commit.
    #[serde(default = "default_revoke_timeout_ms")]
    pub revoke_timeout_ms: u64,
    /// How often a member checks membership and rebalances its partitions.
    #[serde(default = "default_balance_interval_ms")]
    pub balance_interval_ms: u64,
    /// Longest wait for a connection to open.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// For `amqps://`: a PEM file of the CA certificates to trust for the broker's certificate
    /// (a private CA), instead of the public web roots.
    #[serde(default)]
    pub tls_ca_file: Option<std::path::PathBuf>,
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("uri", &redact_userinfo(&self.uri))
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("dlq_topic", &self.dlq_topic)
            .field("partitions", &self.partitions)
            .field("prefetch", &self.prefetch)
            .field("heartbeat_s", &self.heartbeat_s)
            .field("delivery_limit", &self.delivery_limit)
            .field("connection_name", &self.connection_name)
            .field("revoke_timeout_ms", &self.revoke_timeout_ms)
            .field("balance_interval_ms", &self.balance_interval_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("tls_ca_file", &self.tls_ca_file)
            .finish()
    }
}

/// Longest AMQP queue or exchange name.
const MAX_NAME: usize = 255;

impl AmqpConfig {
    /// A configuration with defaults for everything but the essentials.
    pub fn new(uri: impl Into<String>, group: impl Into<String>, topics: &[&str]) -> Self {
        AmqpConfig {
            uri: uri.into(),
            group: group.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            dlq_topic: None,
            partitions: default_partitions(),
            prefetch: None,
            heartbeat_s: default_heartbeat_s(),
            delivery_limit: default_delivery_limit(),
            connection_name: None,
            revoke_timeout_ms: default_revoke_timeout_ms(),
            balance_interval_ms: default_balance_interval_ms(),
            connect_timeout_ms: default_connect_timeout_ms(),
            tls_ca_file: None,
        }
    }

    /// Sets one field by name, as a URL parameter gives it: `prefetch`, `heartbeat`,
    /// `connection_name`, `revoke_timeout_ms`, `balance_interval_ms`, `connect_timeout_ms`,
    /// `tls_ca_file`.
    pub fn apply_param(&mut self, name: &str, value: &str) -> Result<(), ConfigError> {
        fn number<T: std::str::FromStr>(field: &str, value: &str) -> Result<T, ConfigError> {
            value
                .parse::<T>()
                .map_err(|_| ConfigError::invalid(field, format!("expected a number, got {value:?}")))
        }
        match name {
            "prefetch" => self.prefetch = Some(number(name, value)?),
            "heartbeat" | "heartbeat_s" => self.heartbeat_s = number(name, value)?,
            "delivery_limit" => self.delivery_limit = number(name, value)?,
            "connection_name" => self.connection_name = Some(value.to_owned()),
            "revoke_timeout_ms" => self.revoke_timeout_ms = number(name, value)?,
            "balance_interval_ms" => self.balance_interval_ms = number(name, value)?,
            "connect_timeout_ms" => self.connect_timeout_ms = number(name, value)?,
            "tls_ca_file" => self.tls_ca_file = Some(value.into()),
            other => {
                return Err(ConfigError::invalid(
                    other,
                    "unknown RabbitMQ setting: use prefetch, heartbeat, delivery_limit, connection_name, \
                     revoke_timeout_ms, balance_interval_ms, connect_timeout_ms or tls_ca_file",
                ))
            }
        }
        Ok(())
    }

    /// The parsed URI of each node listed (heartbeat applied), or an error naming `uri`.
    pub fn parsed_uris(&self) -> Result<Vec<AMQPUri>, ConfigError> {
        let bad = |e: String| ConfigError::invalid("uri", format!("{e} in {}", redact_userinfo(&self.uri)));
        let (scheme, rest) = self
            .uri
            .split_once("://")
            .ok_or_else(|| bad("expected amqp://… or amqps://…".into()))?;
        if has_unescaped_password(&self.uri) {
            return Err(bad(UNESCAPED_PASSWORD.into()));
        }
        let (authority, path) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (format!("{userinfo}@"), hosts),
            None => (String::new(), authority),
        };
        let mut uris = Vec::new();
        for host in hosts.split(',') {
            if host.trim().is_empty() {
                return Err(bad("an empty host in the list".into()));
            }
            let one = format!("{scheme}://{userinfo}{}{path}", host.trim());
            let mut uri: AMQPUri = one.parse().map_err(bad)?;
            if uri.vhost.is_empty() {
                return Err(ConfigError::invalid(
                    "uri",
                    "the vhost is empty (a trailing `/`): use `/%2f` for the default vhost `/`, or name one",
                ));
            }
            if matches!(uri.scheme, lapin::uri::AMQPScheme::AMQPS) && !cfg!(feature = "tls") {
                return Err(ConfigError::invalid(
                    "uri",
                    "amqps:// needs TLS: build convoy-amqp with its `tls` feature (without it the \
                     connection would not be encrypted)",
                ));
            }
            uri.query.heartbeat = Some(self.heartbeat_s);
            uris.push(uri);
        }
        Ok(uris)
    }

    /// Checks every field; the error names the first bad one. `needs_topics`: a consumer must
    /// name its topics, a publisher need not.
    pub fn validate(&self, needs_topics: bool) -> Result<(), ConfigError> {
        self.parsed_uris()?;
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
        for topic in self.topics.iter().chain(self.dlq_topic.iter()) {
            self.check_name("topics", topic)?;
        }
        if self.prefetch == Some(0) {
            return Err(ConfigError::invalid(
                "prefetch",
                "must be ≥ 1 (0 means unlimited to RabbitMQ: no back-pressure at all)",
            ));
        }
        if let Some(ca) = &self.tls_ca_file {
            if !self.uri.starts_with("amqps://") {
                return Err(ConfigError::invalid(
                    "tls_ca_file",
                    "only used with amqps:// (the URI is not a TLS one)",
                ));
            }
            if !ca.is_file() {
                return Err(ConfigError::invalid(
                    "tls_ca_file",
                    format!(
                        "{} is not a readable file (a PEM file of CA certificates)",
                        ca.display()
                    ),
                ));
            }
        }
        if self.heartbeat_s == 0 {
            return Err(ConfigError::invalid(
                "heartbeat",
                "must be ≥ 1 second: without heartbeats a silent network loss is never noticed",
            ));
        }
        if self.delivery_limit == 0 {
            return Err(ConfigError::invalid(
                "delivery_limit",
                "must be ≥ 1 (each message is delivered at least once)",
            ));
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
        Ok(())
    }

    /// Names derived from `topic` (partition queues, owner locks) must stay within AMQP's limit.
    fn check_name(&self, field: &str, topic: &str) -> Result<(), ConfigError> {
        let valid = !topic.is_empty()
            && topic
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b))
            && !topic.starts_with("amq.");
        if !valid {
            return Err(ConfigError::invalid(
                field,
                format!(
                    "{topic:?} is not a valid topic name (letters, digits, . _ - :, not starting with amq.)"
                ),
            ));
        }
        let longest = crate::names::owner_lock(topic, &self.group, self.partitions.saturating_sub(1));
        if longest.len() > MAX_NAME {
            return Err(ConfigError::invalid(
                field,
                format!(
                    "{topic:?} with group {:?} makes queue names over {MAX_NAME} bytes",
                    self.group
                ),
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

    /// How long a revoke waits for the engine.
    pub fn revoke_timeout(&self) -> Duration {
        Duration::from_millis(self.revoke_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> AmqpConfig {
        AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "g", &["orders"])
    }

    #[test]
    fn defaults_are_valid() {
        let c = valid();
        assert_eq!(c.validate(true), Ok(()));
        assert_eq!(c.dlq_topic(), "orders.dlq");
        assert_eq!(c.parsed_uris().unwrap()[0].vhost, "/");
    }

    #[test]
    fn bad_fields_are_named() {
        type Change = Box<dyn Fn(&mut AmqpConfig)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|c| c.uri = "http://x".into()), "uri"),
            (Box::new(|c| c.uri = "amqp://127.0.0.1/".into()), "uri"),
            (Box::new(|c| c.group = " ".into()), "group"),
            (Box::new(|c| c.topics.clear()), "topics"),
            (Box::new(|c| c.topics = vec!["bad topic".into()]), "topics"),
            (Box::new(|c| c.partitions = 0), "partitions"),
            (Box::new(|c| c.prefetch = Some(0)), "prefetch"),
            (Box::new(|c| c.heartbeat_s = 0), "heartbeat"),
            (Box::new(|c| c.delivery_limit = 0), "delivery_limit"),
            (
                Box::new(|c| c.uri = "amqp://u:pa/ss@127.0.0.1:5672/%2f".into()),
                "uri",
            ),
            (Box::new(|c| c.revoke_timeout_ms = 10), "revoke_timeout_ms"),
        ];
        for (change, field) in cases {
            let mut c = valid();
            change(&mut c);
            assert_eq!(c.validate(true).unwrap_err().field(), field);
        }
        #[cfg(not(feature = "tls"))]
        {
            let mut c = valid();
            c.uri = "amqps://guest:guest@127.0.0.1:5671/%2f".into();
            let err = c.validate(true).unwrap_err();
            assert!(err.to_string().contains("tls"), "{err}");
        }
    }

    #[test]
    fn the_password_never_reaches_debug_output() {
        let mut c = valid();
        c.uri = "amqp://app:hunter2@rabbit:5672/%2fprod".into();
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("app:<redacted>@rabbit:5672/%2fprod"), "{shown}");
    }

    #[test]
    fn a_cluster_is_a_list_of_nodes_sharing_credentials_and_vhost() {
        let mut c = valid();
        c.uri = "amqp://app:pw@127.0.0.1:5672,127.0.0.1:5673, 10.0.0.3/%2fprod?frame_max=8192".into();
        let uris = c.parsed_uris().unwrap();
        let hosts: Vec<(String, u16)> = uris
            .iter()
            .map(|u| (u.authority.host.clone(), u.authority.port))
            .collect();
        assert_eq!(
            hosts,
            [
                ("127.0.0.1".to_owned(), 5672),
                ("127.0.0.1".to_owned(), 5673),
                ("10.0.0.3".to_owned(), 5672)
            ]
        );
        assert!(uris
            .iter()
            .all(|u| u.vhost == "/prod" && u.authority.userinfo.password == "pw"));
        assert!(uris
            .iter()
            .all(|u| u.query.frame_max == Some(8192) && u.query.heartbeat == Some(10)));
        c.uri = "amqp://app:pw@127.0.0.1:5672,/%2f".into();
        assert_eq!(c.validate(true).unwrap_err().field(), "uri");
        assert!(!format!("{:?}", c).contains("pw@"));
    }

    #[test]
    fn url_parameters_apply_by_name() {
        let mut c = valid();
        c.apply_param("prefetch", "100").unwrap();
        c.apply_param("heartbeat", "5").unwrap();
        assert_eq!((c.prefetch, c.heartbeat_s), (Some(100), 5));
        assert_eq!(c.apply_param("prefetch", "lots").unwrap_err().field(), "prefetch");
        assert_eq!(c.apply_param("nope", "1").unwrap_err().field(), "nope");
    }
}
