//! Kafka configuration: a serde struct validated at startup, with errors that name the field.
//! Secrets given as extra librdkafka properties never appear in `Debug` output or logs.

use std::collections::BTreeMap;
use std::fmt;

use convoy_core::config::redacted;
use convoy_core::ConfigError;
use rdkafka::ClientConfig;
use serde::Deserialize;

/// Which partition assignor the group uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Assignor {
    /// Incremental (cooperative-sticky): only moving partitions are revoked.
    #[default]
    CooperativeSticky,
    /// Eager range assignment: every rebalance revokes everything first.
    Range,
    /// Eager round-robin assignment.
    RoundRobin,
}

impl Assignor {
    fn strategy(self) -> &'static str {
        match self {
            Assignor::CooperativeSticky => "cooperative-sticky",
            Assignor::Range => "range",
            Assignor::RoundRobin => "roundrobin",
        }
    }
}

fn default_commit_interval_ms() -> u64 {
    500
}

fn default_session_timeout_ms() -> u64 {
    10_000
}

/// Everything convoy-kafka needs to consume and publish.
///
/// `enable.auto.commit` is always `false`: convoy commits the contiguous watermark itself
/// (`W + 1`, Kafka's "next offset to read"), so an offset is never committed before every
/// message at or below it finished.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `host:port[,host:port…]`.
    pub bootstrap_servers: String,
    /// Consumer group id.
    pub group_id: String,
    /// Topics to consume.
    pub topics: Vec<String>,
    /// Dead-letter topic; defaults to `<first topic>.dlq`.
    #[serde(default)]
    pub dlq_topic: Option<String>,
    /// Group session timeout (a member's crash is noticed after this long).
    #[serde(default = "default_session_timeout_ms")]
    pub session_timeout_ms: u64,
    /// Partition assignor.
    #[serde(default)]
    pub assignor: Assignor,
    /// How often the engine commits while there is progress (also on revoke and shutdown).
    #[serde(default = "default_commit_interval_ms")]
    pub commit_interval_ms: u64,
    /// Extra librdkafka properties (TLS, SASL, tuning), passed through as given.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

/// Properties convoy sets itself; overriding them would break its guarantees.
const RESERVED: [&str; 4] = [
    "enable.auto.commit",
    "enable.auto.offset.store",
    "group.id",
    "bootstrap.servers",
];

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let properties = redacted(&self.properties);
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("dlq_topic", &self.dlq_topic)
            .field("session_timeout_ms", &self.session_timeout_ms)
            .field("assignor", &self.assignor)
            .field("commit_interval_ms", &self.commit_interval_ms)
            .field("properties", &properties)
            .finish()
    }
}

impl KafkaConfig {
    /// A configuration with defaults for everything but the essentials.
    pub fn new(bootstrap_servers: impl Into<String>, group_id: impl Into<String>, topics: &[&str]) -> Self {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            group_id: group_id.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            dlq_topic: None,
            session_timeout_ms: default_session_timeout_ms(),
            assignor: Assignor::default(),
            commit_interval_ms: default_commit_interval_ms(),
            properties: BTreeMap::new(),
        }
    }

    /// Sets one field or librdkafka property by name, as a URL parameter gives it:
    /// `session_timeout_ms`, `assignor`, `commit_interval_ms`, or any name with a dot (a
    /// librdkafka property such as `security.protocol` or `fetch.wait.max.ms`).
    pub fn apply_param(&mut self, name: &str, value: &str) -> Result<(), ConfigError> {
        let number = |field: &str| {
            value
                .parse::<u64>()
                .map_err(|_| ConfigError::invalid(field, format!("expected a number, got {value:?}")))
        };
        match name {
            "session_timeout_ms" => self.session_timeout_ms = number(name)?,
            "commit_interval_ms" => self.commit_interval_ms = number(name)?,
            "assignor" => {
                self.assignor = match value {
                    "cooperative-sticky" => Assignor::CooperativeSticky,
                    "range" => Assignor::Range,
                    "roundrobin" | "round-robin" => Assignor::RoundRobin,
                    other => {
                        return Err(ConfigError::invalid(
                            "assignor",
                            format!("expected cooperative-sticky, range or roundrobin, got {other:?}"),
                        ))
                    }
                }
            }
            property if property.contains('.') => {
                self.properties.insert(property.to_owned(), value.to_owned());
            }
            other => {
                return Err(ConfigError::invalid(
                    other,
                    "unknown Kafka setting: use session_timeout_ms, assignor, commit_interval_ms, \
                     or a librdkafka property (its name contains a dot)",
                ))
            }
        }
        Ok(())
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let servers: Vec<&str> = self.bootstrap_servers.split(',').map(str::trim).collect();
        if servers.iter().any(|s| {
            s.rsplit_once(':')
                .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        }) {
            return Err(ConfigError::invalid(
                "bootstrap_servers",
                format!(
                    "expected host:port[,host:port…], got {:?}",
                    self.bootstrap_servers
                ),
            ));
        }
        if self.group_id.trim().is_empty() {
            return Err(ConfigError::invalid("group_id", "must not be empty"));
        }
        if self.topics.is_empty() {
            return Err(ConfigError::invalid(
                "topics",
                "name at least one topic to consume",
            ));
        }
        if let Some(bad) = self.topics.iter().find(|t| !valid_topic(t)) {
            return Err(ConfigError::invalid(
                "topics",
                format!("{bad:?} is not a valid topic name (1–249 of [A-Za-z0-9._-])"),
            ));
        }
        if let Some(dlq) = &self.dlq_topic {
            if !valid_topic(dlq) {
                return Err(ConfigError::invalid(
                    "dlq_topic",
                    format!("{dlq:?} is not a valid topic name"),
                ));
            }
            if self.topics.contains(dlq) {
                return Err(ConfigError::invalid(
                    "dlq_topic",
                    "must differ from the consumed topics",
                ));
            }
        }
        if !(1_000..=3_600_000).contains(&self.session_timeout_ms) {
            return Err(ConfigError::invalid(
                "session_timeout_ms",
                "must be between 1000 and 3600000",
            ));
        }
        if self.commit_interval_ms == 0 {
            return Err(ConfigError::invalid("commit_interval_ms", "must be > 0"));
        }
        if let Some(reserved) = self.properties.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(ConfigError::invalid(
                format!("properties.{reserved}"),
                "is set by convoy (use the dedicated field, or leave it: auto commit must stay off)",
            ));
        }
        Ok(())
    }

    /// The dead-letter topic in use.
    pub fn dlq_topic(&self) -> String {
        self.dlq_topic
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.topics.first().map_or("convoy", String::as_str)))
    }

    /// Bootstrap servers and the extra properties (TLS, SASL): what every client shares.
    pub(crate) fn base(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap_servers);
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        c
    }

    /// librdkafka settings for the consumer.
    pub fn consumer_config(&self) -> ClientConfig {
        let mut c = self.base();
        c.set("group.id", &self.group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("session.timeout.ms", self.session_timeout_ms.to_string())
            .set("partition.assignment.strategy", self.assignor.strategy());
        if !self.properties.contains_key("auto.offset.reset") {
            c.set("auto.offset.reset", "earliest");
        }
        c
    }

    /// librdkafka settings for the producer: idempotent, Java-compatible key partitioning.
    pub fn producer_config(&self) -> ClientConfig {
        let mut c = self.base();
        c.set("enable.idempotence", "true")
            .set("partitioner", "murmur2_random");
        if !self.properties.contains_key("linger.ms") {
            c.set("linger.ms", "1");
        }
        c
    }
}

fn valid_topic(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 249
        && t != "."
        && t != ".."
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid() -> KafkaConfig {
        KafkaConfig::new("127.0.0.1:9092", "g", &["orders"])
    }

    #[test]
    fn defaults_are_valid_and_auto_commit_is_off() {
        let c = valid();
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.dlq_topic(), "orders.dlq");
        let consumer = c.consumer_config();
        assert_eq!(consumer.get("enable.auto.commit"), Some("false"));
        assert_eq!(
            consumer.get("partition.assignment.strategy"),
            Some("cooperative-sticky")
        );
        let producer = c.producer_config();
        assert_eq!(producer.get("enable.idempotence"), Some("true"));
        assert_eq!(producer.get("partitioner"), Some("murmur2_random"));
    }

    #[test]
    fn bad_fields_are_named() {
        type Change = Box<dyn Fn(&mut KafkaConfig)>;
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|c| c.bootstrap_servers = "localhost".into()),
                "bootstrap_servers",
            ),
            (Box::new(|c| c.group_id = "".into()), "group_id"),
            (Box::new(|c| c.topics.clear()), "topics"),
            (Box::new(|c| c.topics = vec!["bad topic".into()]), "topics"),
            (Box::new(|c| c.dlq_topic = Some("orders".into())), "dlq_topic"),
            (Box::new(|c| c.session_timeout_ms = 10), "session_timeout_ms"),
            (Box::new(|c| c.commit_interval_ms = 0), "commit_interval_ms"),
            (
                Box::new(|c| {
                    c.properties.insert("enable.auto.commit".into(), "true".into());
                }),
                "properties.enable.auto.commit",
            ),
        ];
        for (change, field) in cases {
            let mut c = valid();
            change(&mut c);
            assert_eq!(c.validate().unwrap_err().field(), field);
        }
    }

    #[test]
    fn secrets_never_reach_debug_output() {
        let mut c = valid();
        c.properties.insert("sasl.password".into(), "hunter2".into());
        c.properties.insert("ssl.key.password".into(), "s3cret".into());
        c.properties.insert("security.protocol".into(), "SASL_SSL".into());
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("SASL_SSL"));
    }

    #[test]
    fn deserializes_with_defaults_and_rejects_unknown_fields() {
        let c: KafkaConfig = serde_json::from_str(
            r#"{"bootstrap_servers":"127.0.0.1:9092","group_id":"g","topics":["t"],"assignor":"range"}"#,
        )
        .unwrap();
        assert_eq!(c.assignor, Assignor::Range);
        assert_eq!(c.session_timeout_ms, 10_000);
        let err = serde_json::from_str::<KafkaConfig>(
            r#"{"bootstrap_servers":"x:1","group_id":"g","topics":["t"],"grup":1}"#,
        );
        assert!(err.unwrap_err().to_string().contains("grup"));
    }
}
