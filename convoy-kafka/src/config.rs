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

/// Which consumer-group protocol the consumer speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GroupProtocol {
    /// The classic protocol: the group leader assigns with `assignor`, the client's
    /// `session_timeout_ms` bounds a member's silence.
    #[default]
    Classic,
    /// KIP-848 (`group.protocol=consumer`, Kafka 4.0+): the broker assigns partitions and
    /// sets the session timeout (`group.consumer.session.timeout.ms`); rebalances are
    /// incremental. `session_timeout_ms` and `assignor` must be left unset (the property
    /// `group.remote.assignor` chooses the broker's assignor).
    Consumer,
}

impl GroupProtocol {
    fn name(self) -> &'static str {
        match self {
            GroupProtocol::Classic => "classic",
            GroupProtocol::Consumer => "consumer",
        }
    }
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

fn default_revoke_timeout_ms() -> u64 {
    60_000
}

fn default_offset_map_max_bytes() -> usize {
    convoy_core::offset_map::DEFAULT_MAX_METADATA
}

/// convoy's session timeout for the classic protocol: a killed member's partitions move on
/// after 10 s (librdkafka's own default is 45 s; Kafka accepts 6 s and more by default).
const DEFAULT_SESSION_TIMEOUT_MS: u64 = 10_000;

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
    /// The consumer-group protocol: `classic` (default) or `consumer` (KIP-848).
    #[serde(default)]
    pub group_protocol: GroupProtocol,
    /// Group session timeout under the classic protocol (a member's crash is noticed after
    /// this long); unset: 10 s. Under the consumer protocol the broker sets it.
    #[serde(default)]
    pub session_timeout_ms: Option<u64>,
    /// Partition assignor under the classic protocol; unset: cooperative-sticky. Under the
    /// consumer protocol the broker assigns.
    #[serde(default)]
    pub assignor: Option<Assignor>,
    /// How long a revoke waits for the engine to drain and commit before the partitions are
    /// released anyway (the revoke's deadline; the engine cancels their work before it). Must
    /// be below `max.poll.interval.ms`, which bounds the whole rebalance, and above the
    /// engine's drain timeout (checked when the engine starts).
    #[serde(default = "default_revoke_timeout_ms")]
    pub revoke_timeout_ms: u64,
    /// Largest offset map (finished offsets above the watermark) put in commit metadata;
    /// match the broker's `offset.metadata.max.bytes` (4096 by default); 0 turns it off.
    #[serde(default = "default_offset_map_max_bytes")]
    pub offset_map_max_bytes: usize,
    /// Exactly once to Kafka: the id of this member's transactional producer. With it, a
    /// transform's outputs and the commit of the offsets that cover them go into one Kafka
    /// transaction (see `convoy_core::transform`). Give every member its own id that stays the
    /// same across its restarts (a pod name): a restarted member fences its crashed
    /// predecessor and aborts its open transaction at once, where a fresh id leaves that
    /// transaction open for `transaction.timeout.ms`. Turns the offset map off.
    #[serde(default)]
    pub transactional_id: Option<String>,
    /// Extra librdkafka properties (TLS, SASL, tuning), passed through as given.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

/// Properties convoy sets itself, and what to use instead: overriding them would break its
/// guarantees, or be silently ignored.
const RESERVED: [(&str, &str); 14] = [
    (
        "transactional.id",
        "use transactional_id (URL parameter transactional_id)",
    ),
    (
        "enable.auto.commit",
        "auto commit must stay off: convoy commits the contiguous watermark",
    ),
    (
        "enable.auto.offset.store",
        "convoy stores the offsets it commits itself",
    ),
    ("group.id", "use group_id (URL parameter group)"),
    ("bootstrap.servers", "use bootstrap_servers (the URL's address)"),
    ("session.timeout.ms", "use session_timeout_ms"),
    ("group.protocol", "use group_protocol (classic or consumer)"),
    ("partition.assignment.strategy", "use assignor"),
    (
        "queued.min.messages",
        "derived from the engine's back-pressure bounds (BackPressure::total_high)",
    ),
    (
        "queued.max.messages.kbytes",
        "derived from the engine's back-pressure bounds (BackPressure::total_bytes_high)",
    ),
    (
        "fetch.message.max.bytes",
        "derived from the engine's back-pressure bounds",
    ),
    (
        "max.partition.fetch.bytes",
        "derived from the engine's back-pressure bounds",
    ),
    (
        "partitioner",
        "convoy's producer always uses murmur2_random, so every client places a key alike",
    ),
    (
        "enable.idempotence",
        "convoy's producer is always idempotent (per-key order across retries)",
    ),
];

/// librdkafka's default `max.poll.interval.ms`: the group's rebalance timeout.
const DEFAULT_MAX_POLL_INTERVAL_MS: u64 = 300_000;
/// The engine's consumer's `fetch.wait.max.ms` unless set (librdkafka's is 500 ms). With the
/// prefetch bounded per partition, a partition whose queue is full is left out of the next fetch;
/// when the partitions in it have nothing new, the broker holds that fetch for the whole wait, and
/// no partition is fetched meanwhile — however fast the engine drains the full ones. Measured on
/// Apache Kafka draining a 100,000-message backlog (8 partitions): 162 k or 690 k msg/s at 500 ms
/// depending on whether the stall struck, 536–605 k at 50 ms, 439–504 k at 100 ms.
const ENGINE_FETCH_WAIT_MAX_MS: u64 = 50;

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let properties = redacted(&self.properties);
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("dlq_topic", &self.dlq_topic)
            .field("group_protocol", &self.group_protocol)
            .field("session_timeout_ms", &self.session_timeout_ms)
            .field("assignor", &self.assignor)
            .field("revoke_timeout_ms", &self.revoke_timeout_ms)
            .field("offset_map_max_bytes", &self.offset_map_max_bytes)
            .field("transactional_id", &self.transactional_id)
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
            group_protocol: GroupProtocol::default(),
            session_timeout_ms: None,
            assignor: None,
            revoke_timeout_ms: default_revoke_timeout_ms(),
            offset_map_max_bytes: default_offset_map_max_bytes(),
            transactional_id: None,
            properties: BTreeMap::new(),
        }
    }

    /// Sets one field or librdkafka property by name, as a URL parameter gives it:
    /// `group_protocol`, `session_timeout_ms`, `assignor`, `revoke_timeout_ms`,
    /// `offset_map_max_bytes`, `transactional_id`, or any
    /// name with a dot (a librdkafka property such as `security.protocol` or
    /// `fetch.wait.max.ms`).
    pub fn apply_param(&mut self, name: &str, value: &str) -> Result<(), ConfigError> {
        let number = |field: &str| {
            value
                .parse::<u64>()
                .map_err(|_| ConfigError::invalid(field, format!("expected a number, got {value:?}")))
        };
        match name {
            "session_timeout_ms" => self.session_timeout_ms = Some(number(name)?),
            "group_protocol" => {
                self.group_protocol = match value {
                    "classic" => GroupProtocol::Classic,
                    "consumer" => GroupProtocol::Consumer,
                    other => {
                        return Err(ConfigError::invalid(
                            "group_protocol",
                            format!("expected classic or consumer, got {other:?}"),
                        ))
                    }
                }
            }
            "revoke_timeout_ms" => self.revoke_timeout_ms = number(name)?,
            "transactional_id" => self.transactional_id = Some(value.to_owned()),
            "offset_map_max_bytes" => {
                self.offset_map_max_bytes = usize::try_from(number(name)?).unwrap_or(usize::MAX)
            }
            "commit_interval_ms" => {
                return Err(ConfigError::invalid(
                    name,
                    "commits are the engine's: set EngineConfig::commit_interval (convoy consume --commit-interval-ms)",
                ))
            }
            "assignor" => {
                self.assignor = Some(match value {
                    "cooperative-sticky" => Assignor::CooperativeSticky,
                    "range" => Assignor::Range,
                    "roundrobin" | "round-robin" => Assignor::RoundRobin,
                    other => {
                        return Err(ConfigError::invalid(
                            "assignor",
                            format!("expected cooperative-sticky, range or roundrobin, got {other:?}"),
                        ))
                    }
                })
            }
            property if property.contains('.') => {
                self.properties.insert(property.to_owned(), value.to_owned());
            }
            other => {
                return Err(ConfigError::invalid(
                    other,
                    "unknown Kafka setting: use group_protocol, session_timeout_ms, assignor, \
                     revoke_timeout_ms, offset_map_max_bytes, transactional_id, or a librdkafka \
                     property (its name contains a dot)",
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
        if self
            .session_timeout_ms
            .is_some_and(|ms| !(1_000..=3_600_000).contains(&ms))
        {
            return Err(ConfigError::invalid(
                "session_timeout_ms",
                "must be between 1000 and 3600000",
            ));
        }
        if self.group_protocol == GroupProtocol::Consumer {
            self.validate_consumer_protocol()?;
        }
        if let Some(id) = &self.transactional_id {
            if id.trim().is_empty() || id.len() > 249 {
                return Err(ConfigError::invalid(
                    "transactional_id",
                    "must be 1–249 characters: one per member, the same across its restarts",
                ));
            }
        }
        if let Some((name, instead)) = RESERVED
            .iter()
            .find(|(name, _)| self.properties.contains_key(*name))
        {
            return Err(ConfigError::invalid(
                format!("properties.{name}"),
                format!("is set by convoy: {instead}"),
            ));
        }
        let max_poll = match self.properties.get("max.poll.interval.ms") {
            Some(v) => v.parse::<u64>().map_err(|_| {
                ConfigError::invalid(
                    "properties.max.poll.interval.ms",
                    format!("expected a number, got {v:?}"),
                )
            })?,
            None => DEFAULT_MAX_POLL_INTERVAL_MS,
        };
        if self.revoke_timeout_ms < 1_000 || self.revoke_timeout_ms >= max_poll {
            return Err(ConfigError::invalid(
                "revoke_timeout_ms",
                format!(
                    "must be at least 1000 and below max.poll.interval.ms ({max_poll}), the group's rebalance timeout; got {}",
                    self.revoke_timeout_ms
                ),
            ));
        }
        Ok(())
    }

    /// What the consumer protocol (KIP-848) leaves to the broker must not be set: librdkafka
    /// refuses to create such a consumer, with a message that names no convoy setting.
    fn validate_consumer_protocol(&self) -> Result<(), ConfigError> {
        if self.session_timeout_ms.is_some() {
            return Err(ConfigError::invalid(
                "session_timeout_ms",
                "with group_protocol=consumer the broker sets the session timeout \
                 (group.consumer.session.timeout.ms): leave session_timeout_ms unset",
            ));
        }
        if self.assignor.is_some() {
            return Err(ConfigError::invalid(
                "assignor",
                "with group_protocol=consumer the broker assigns partitions: leave assignor \
                 unset (the property group.remote.assignor picks uniform or range)",
            ));
        }
        for property in ["heartbeat.interval.ms", "group.protocol.type"] {
            if self.properties.contains_key(property) {
                return Err(ConfigError::invalid(
                    format!("properties.{property}"),
                    "is the broker's with group_protocol=consumer (group.consumer.*): leave it unset",
                ));
            }
        }
        Ok(())
    }

    /// How long a query of a partition's newest offset (for the lag metric) may take: a second
    /// more than the engine's consumer's `fetch.wait.max.ms`. The query shares the broker connection with the fetches,
    /// and a broker answers one connection's requests in order, so it can wait behind a fetch
    /// held open that long (at librdkafka's default, 500 ms: the old bound, which lost the
    /// figure whenever it did).
    pub fn newest_offset_timeout(&self) -> std::time::Duration {
        let fetch_wait = self
            .properties
            .get("fetch.wait.max.ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(ENGINE_FETCH_WAIT_MAX_MS);
        std::time::Duration::from_millis(fetch_wait + 1_000)
    }

    /// How long a revoke waits for the engine.
    pub fn revoke_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.revoke_timeout_ms)
    }

    /// The offset-map limit in force: none with a transactional id (a message finished above
    /// the watermark has outputs that are not committed yet, so it must be handled again).
    pub fn offset_map_limit(&self) -> usize {
        match self.transactional_id {
            Some(_) => 0,
            None => self.offset_map_max_bytes,
        }
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

    /// librdkafka settings for the consumer, with librdkafka's default prefetch (for tools
    /// that read a topic, not for the engine's subscription: see [`Prefetch`]).
    pub fn consumer_config(&self) -> ClientConfig {
        let mut c = self.base();
        c.set("group.id", &self.group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("group.protocol", self.group_protocol.name());
        if self.group_protocol == GroupProtocol::Classic {
            let session = self.session_timeout_ms.unwrap_or(DEFAULT_SESSION_TIMEOUT_MS);
            let assignor = self.assignor.unwrap_or_default();
            c.set("session.timeout.ms", session.to_string())
                .set("partition.assignment.strategy", assignor.strategy());
        }
        if !self.properties.contains_key("auto.offset.reset") {
            c.set("auto.offset.reset", "earliest");
        }
        c
    }

    /// librdkafka settings for the engine's consumer: every partition's prefetch bounded so
    /// that all of them together stay within `prefetch`.
    pub fn bounded_consumer_config(&self, prefetch: &Prefetch) -> ClientConfig {
        let mut c = self.consumer_config();
        c.set("queued.min.messages", prefetch.partition_messages.to_string())
            .set(
                "queued.max.messages.kbytes",
                prefetch.partition_kbytes.to_string(),
            )
            .set("fetch.message.max.bytes", prefetch.fetch_bytes.to_string());
        if !self.properties.contains_key("fetch.wait.max.ms") {
            c.set("fetch.wait.max.ms", ENGINE_FETCH_WAIT_MAX_MS.to_string());
        }
        if !self.properties.contains_key("fetch.queue.backoff.ms") {
            // A partition at its (now small) queue limit would otherwise wait a whole second
            // before it is fetched again.
            c.set("fetch.queue.backoff.ms", "10");
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

    /// librdkafka settings for a member's transactional producer (see `transactional_id`).
    /// Its transactions last only as long as a commit, so `transaction.timeout.ms` (how long the
    /// broker keeps a crashed member's transaction open when no successor with its id aborts
    /// it) is 10 s unless set.
    pub fn transactional_producer_config(&self, id: &str) -> ClientConfig {
        let mut c = self.producer_config();
        c.set("transactional.id", id);
        if !self.properties.contains_key("transaction.timeout.ms") {
            c.set("transaction.timeout.ms", "10000");
        }
        c
    }
}

/// librdkafka's prefetch per partition, derived from a total budget so that a consumer owning
/// many partitions buffers no more than one owning few. With split partition queues librdkafka
/// applies `queued.min.messages` and `queued.max.messages.kbytes` to *each* partition (64 MiB
/// each by default: 3 GiB for 48 partitions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefetch {
    /// `queued.min.messages` per partition.
    pub partition_messages: usize,
    /// `queued.max.messages.kbytes` per partition.
    pub partition_kbytes: usize,
    /// `fetch.message.max.bytes`: how much one fetch may add beyond a partition's limit.
    pub fetch_bytes: usize,
    /// Most messages per batch a poller hands the engine for one partition.
    pub batch_messages: usize,
    /// Most bytes per batch (the event channel holds a few batches: their size is bounded too).
    pub batch_bytes: usize,
}

impl Prefetch {
    /// Most messages a poller hands the engine for one partition at once.
    pub const MAX_BATCH: usize = 500;

    /// Divides `limit` over `partitions` partitions.
    pub fn divide(limit: convoy_core::transport::PrefetchLimit, partitions: usize) -> Self {
        let partitions = partitions.max(1);
        let partition_messages = (limit.messages / partitions).clamp(1, 10_000_000);
        let partition_bytes = (limit.bytes / partitions).max(1024);
        Prefetch {
            partition_messages,
            partition_kbytes: (partition_bytes / 1024).clamp(1, (i32::MAX / 1024) as usize),
            fetch_bytes: partition_bytes.clamp(64 << 10, 1 << 20),
            batch_messages: partition_messages.min(Self::MAX_BATCH),
            batch_bytes: (limit.bytes / 64).max(64 << 10),
        }
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

    #[test]
    fn a_newest_offset_query_may_outwait_a_held_fetch() {
        let mut c = KafkaConfig::new("127.0.0.1:9092", "g", &["t"]);
        assert_eq!(c.newest_offset_timeout(), std::time::Duration::from_millis(1_050));
        assert_eq!(
            c.bounded_consumer_config(&Prefetch::divide(
                convoy_core::transport::PrefetchLimit {
                    messages: 100,
                    bytes: 1 << 20
                },
                1
            ))
            .get("fetch.wait.max.ms"),
            Some("50")
        );
        c.apply_param("fetch.wait.max.ms", "5").unwrap();
        assert_eq!(c.newest_offset_timeout(), std::time::Duration::from_millis(1_005));
    }

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
        assert_eq!(consumer.get("group.protocol"), Some("classic"));
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
            (
                Box::new(|c| c.session_timeout_ms = Some(10)),
                "session_timeout_ms",
            ),
            (
                Box::new(|c| {
                    c.group_protocol = GroupProtocol::Consumer;
                    c.session_timeout_ms = Some(10_000);
                }),
                "session_timeout_ms",
            ),
            (
                Box::new(|c| {
                    c.group_protocol = GroupProtocol::Consumer;
                    c.assignor = Some(Assignor::Range);
                }),
                "assignor",
            ),
            (
                Box::new(|c| {
                    c.group_protocol = GroupProtocol::Consumer;
                    c.properties.insert("heartbeat.interval.ms".into(), "500".into());
                }),
                "properties.heartbeat.interval.ms",
            ),
            (
                Box::new(|c| {
                    c.properties.insert("group.protocol".into(), "consumer".into());
                }),
                "properties.group.protocol",
            ),
            (
                Box::new(|c| {
                    c.properties.insert("enable.auto.commit".into(), "true".into());
                }),
                "properties.enable.auto.commit",
            ),
            (
                Box::new(|c| {
                    c.properties.insert("session.timeout.ms".into(), "6000".into());
                }),
                "properties.session.timeout.ms",
            ),
            (
                Box::new(|c| {
                    c.properties
                        .insert("partition.assignment.strategy".into(), "range".into());
                }),
                "properties.partition.assignment.strategy",
            ),
            (
                Box::new(|c| {
                    c.properties.insert("queued.min.messages".into(), "1".into());
                }),
                "properties.queued.min.messages",
            ),
            (Box::new(|c| c.revoke_timeout_ms = 300_000), "revoke_timeout_ms"),
            (
                Box::new(|c| {
                    c.properties.insert("max.poll.interval.ms".into(), "30000".into());
                }),
                "revoke_timeout_ms",
            ),
        ];
        for (change, field) in cases {
            let mut c = valid();
            change(&mut c);
            assert_eq!(c.validate().unwrap_err().field(), field);
        }
    }

    #[test]
    fn the_consumer_protocol_leaves_assignment_and_sessions_to_the_broker() {
        let mut c = valid();
        c.apply_param("group_protocol", "consumer").unwrap();
        c.properties
            .insert("group.remote.assignor".into(), "uniform".into());
        assert_eq!(c.validate(), Ok(()));
        let consumer = c.consumer_config();
        assert_eq!(consumer.get("group.protocol"), Some("consumer"));
        assert_eq!(consumer.get("session.timeout.ms"), None);
        assert_eq!(consumer.get("partition.assignment.strategy"), None);
        assert_eq!(consumer.get("group.remote.assignor"), Some("uniform"));
        let err = c.apply_param("group_protocol", "kip848").unwrap_err();
        assert_eq!(err.field(), "group_protocol");
    }

    #[test]
    fn overridden_properties_say_what_to_use_instead() {
        let mut c = valid();
        c.properties.insert("session.timeout.ms".into(), "6000".into());
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("session_timeout_ms"), "{err}");
        let mut c = valid();
        assert!(c
            .apply_param("commit_interval_ms", "100")
            .unwrap_err()
            .to_string()
            .contains("commit_interval"));
        c.apply_param("revoke_timeout_ms", "20000").unwrap();
        assert_eq!(c.revoke_timeout(), std::time::Duration::from_secs(20));
    }

    #[test]
    fn prefetch_follows_the_budget_whatever_the_partition_count() {
        let limit = convoy_core::transport::PrefetchLimit {
            messages: 16_000,
            bytes: 64 << 20,
        };
        let eight = Prefetch::divide(limit, 8);
        assert_eq!((eight.partition_messages, eight.partition_kbytes), (2_000, 8_192));
        assert_eq!(eight.fetch_bytes, 1 << 20);
        let many = Prefetch::divide(limit, 256);
        assert_eq!((many.partition_messages, many.partition_kbytes), (62, 256));
        assert_eq!(many.fetch_bytes, 256 << 10);
        // All partitions together stay within the budget plus one fetch each.
        let total = 256 * (many.partition_kbytes * 1024 + many.fetch_bytes);
        assert!(total <= 2 * limit.bytes, "{total}");
        let consumer = valid().bounded_consumer_config(&many);
        assert_eq!(consumer.get("queued.max.messages.kbytes"), Some("256"));
        assert_eq!(consumer.get("queued.min.messages"), Some("62"));
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
        assert_eq!(c.assignor, Some(Assignor::Range));
        assert_eq!(c.session_timeout_ms, None);
        assert_eq!(c.consumer_config().get("session.timeout.ms"), Some("10000"));
        let err = serde_json::from_str::<KafkaConfig>(
            r#"{"bootstrap_servers":"x:1","group_id":"g","topics":["t"],"grup":1}"#,
        );
        assert!(err.unwrap_err().to_string().contains("grup"));
    }
}
