//! Where to connect and what to consume: a URL, a TOML file and `CONVOY_*` environment
//! variables, merged (flags over environment over file; explicit fields over URL parameters).
//!
//! ```toml
//! url = "kafka://127.0.0.1:9092"
//! group = "billing"
//! topics = ["ledger"]
//! dlq_topic = "ledger.dlq"
//! partitions = 8              # for topics convoy creates
//! [properties]                # backend settings, e.g. librdkafka's
//! "fetch.wait.max.ms" = "5"
//! [engine]                    # the engine's settings: see `EngineSettings`
//! max_in_flight = 512
//! [engine.retry]
//! max_attempts = 5
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use convoy_core::config::{has_unescaped_password, is_secret, redact_userinfo, redacted, UNESCAPED_PASSWORD};
use convoy_core::ConfigError;
use serde::Deserialize;

use crate::engine_settings::EngineSettings;
use crate::error::ConnectError;

/// Partitions of topics convoy creates when nothing says otherwise.
pub const DEFAULT_PARTITIONS: u32 = 8;
/// The consumer group when nothing says otherwise.
pub const DEFAULT_GROUP: &str = "convoy";

/// Connection settings before they are resolved against the URL.
#[derive(Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ConnectConfig {
    /// `memory://[name]` or `kafka://host:port[,host:port]`, with optional `?key=value` parameters.
    pub url: Option<String>,
    /// Consumer group.
    pub group: Option<String>,
    /// Topics to consume.
    pub topics: Option<Vec<String>>,
    /// Dead-letter topic (default `<first topic>.dlq`).
    pub dlq_topic: Option<String>,
    /// Partitions of topics convoy creates.
    pub partitions: Option<u32>,
    /// Backend properties (for Kafka: any librdkafka property).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// The engine's settings (`[engine]`; `CONVOY_ENGINE_*`), applied by
    /// [`crate::Connection::engine_config`].
    #[serde(default)]
    pub engine: EngineSettings,
}

impl fmt::Debug for ConnectConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let properties = redacted(&self.properties);
        f.debug_struct("ConnectConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("dlq_topic", &self.dlq_topic)
            .field("partitions", &self.partitions)
            .field("properties", &properties)
            .field("engine", &self.engine)
            .finish()
    }
}

/// Schemes whose URL carries credentials in its address (`user:password@host`), as their own
/// clients expect.
const CREDENTIALS_IN_ADDRESS: [&str; 3] = ["amqp", "amqps", "nats"];

/// The URL with the password of its address and the values of secret parameters replaced.
pub fn redact_url(url: &str) -> String {
    let url = redact_userinfo(url);
    let Some((base, query)) = url.split_once('?') else {
        return url;
    };
    let params: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _)) if is_secret(k) => format!("{k}=<redacted>"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
}

impl ConnectConfig {
    /// Settings for a URL alone.
    pub fn url(url: impl Into<String>) -> Self {
        ConnectConfig {
            url: Some(url.into()),
            ..ConnectConfig::default()
        }
    }

    /// Reads a TOML file; unknown keys and wrong types are errors naming the line and key.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConnectError> {
        let path = path.as_ref();
        let file_error = |reason: String| ConnectError::ConfigFile {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
        toml::from_str(&text).map_err(|e| {
            let message = crate::engine_settings::in_words(e.message());
            match e.span() {
                Some(span) => {
                    let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                    let snippet = text.lines().nth(line - 1).unwrap_or("").trim();
                    file_error(format!("line {line} (`{snippet}`): {message}"))
                }
                None => file_error(message),
            }
        })
    }

    /// Reads `CONVOY_URL`, `CONVOY_GROUP`, `CONVOY_TOPICS` (comma-separated),
    /// `CONVOY_DLQ_TOPIC`, `CONVOY_PARTITIONS` and the engine's `CONVOY_ENGINE_*`.
    pub fn from_env() -> Result<Self, ConnectError> {
        let mut config = Self::from_vars(|name| std::env::var(name).ok())?;
        config.engine = EngineSettings::from_vars(std::env::vars())?;
        Ok(config)
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, ConnectError> {
        let var = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let partitions = match var("CONVOY_PARTITIONS") {
            Some(p) => Some(p.trim().parse().map_err(|_| {
                ConfigError::invalid(
                    "CONVOY_PARTITIONS",
                    format!("expected a positive number, got {p:?}"),
                )
            })?),
            None => None,
        };
        Ok(ConnectConfig {
            url: var("CONVOY_URL"),
            group: var("CONVOY_GROUP"),
            topics: var("CONVOY_TOPICS").map(|t| split_list(&t)),
            dlq_topic: var("CONVOY_DLQ_TOPIC"),
            partitions,
            properties: BTreeMap::new(),
            engine: EngineSettings::default(),
        })
    }

    /// These settings over `lower`: every field set here wins, properties are merged. The
    /// parameters of a URL set here (`group=`, `topics=`, `dlq=`, `partitions=`) count as
    /// set here too: a `--url` flag's `group=` beats `CONVOY_GROUP`.
    pub fn over(self, lower: ConnectConfig) -> ConnectConfig {
        let this = self.with_url_parameters_pinned();
        let mut properties = lower.properties;
        properties.extend(this.properties.clone());
        let this = ConnectConfig {
            properties: BTreeMap::new(),
            ..this
        };
        ConnectConfig {
            url: this.url.or(lower.url),
            group: this.group.or(lower.group),
            topics: this.topics.or(lower.topics),
            dlq_topic: this.dlq_topic.or(lower.dlq_topic),
            partitions: this.partitions.or(lower.partitions),
            properties,
            engine: this.engine.over(lower.engine),
        }
    }

    /// The fields this layer's URL names as parameters, set where this layer sets none (a field
    /// set beside the URL still beats its parameter). A URL that does not parse is left to
    /// [`resolve`](Self::resolve) to report.
    fn with_url_parameters_pinned(mut self) -> ConnectConfig {
        let Some(url) = self.url.as_deref() else {
            return self;
        };
        let Ok(endpoint) = Endpoint::parse(url) else {
            return self;
        };
        let query = url.split_once('?').map_or("", |(_, q)| q);
        let named = |names: &[&str]| {
            form_urlencoded::parse(query.as_bytes()).any(|(key, _)| names.contains(&key.as_ref()))
        };
        if self.group.is_none() && named(&["group"]) {
            self.group = Some(endpoint.group);
        }
        if self.topics.is_none() && named(&["topics", "topic"]) {
            self.topics = Some(endpoint.topics);
        }
        if self.dlq_topic.is_none() && named(&["dlq", "dlq_topic"]) {
            self.dlq_topic = endpoint.dlq_topic;
        }
        if self.partitions.is_none() && named(&["partitions"]) {
            self.partitions = Some(endpoint.partitions);
        }
        self
    }

    /// Parses the URL and applies the explicit fields over its parameters.
    pub fn resolve(&self) -> Result<Endpoint, ConnectError> {
        let url = self.url.as_deref().unwrap_or("memory://");
        let mut endpoint = Endpoint::parse(url)?;
        if let Some(group) = &self.group {
            endpoint.group = group.clone();
        }
        if let Some(topics) = &self.topics {
            endpoint.topics = topics.clone();
        }
        if let Some(dlq) = &self.dlq_topic {
            endpoint.dlq_topic = Some(dlq.clone());
        }
        if let Some(p) = self.partitions {
            endpoint.partitions = p;
        }
        endpoint
            .params
            .extend(self.properties.iter().map(|(k, v)| (k.clone(), v.clone())));
        endpoint.validate()?;
        Ok(endpoint)
    }
}

fn split_list(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A broker URL resolved: which backend, its address, the consumer settings, and the
/// backend's own parameters (checked by the backend).
#[derive(Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The URL scheme, lower case.
    pub scheme: String,
    /// What follows `scheme://` up to `?`: Kafka's bootstrap servers, a memory broker's name.
    pub address: String,
    /// Consumer group.
    pub group: String,
    /// Topics to consume (may be empty for tools that only publish or read).
    pub topics: Vec<String>,
    /// Dead-letter topic, if given.
    pub dlq_topic: Option<String>,
    /// Partitions of topics convoy creates.
    pub partitions: u32,
    /// Other parameters, in order, for the backend.
    pub params: Vec<(String, String)>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let params = redacted(self.params.iter().map(|(k, v)| (k, v)));
        f.debug_struct("Endpoint")
            .field("scheme", &self.scheme)
            .field(
                "address",
                &redact_userinfo(&format!("{}://{}", self.scheme, self.address)),
            )
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("dlq_topic", &self.dlq_topic)
            .field("partitions", &self.partitions)
            .field("params", &params)
            .finish()
    }
}

impl Endpoint {
    /// Parses `scheme://address?key=value&…` (values percent-decoded). `topics` takes a comma
    /// list and may repeat; `topic` is its synonym; `dlq` is `dlq_topic`'s.
    pub fn parse(url: &str) -> Result<Endpoint, ConnectError> {
        let bad = |reason: &str| ConnectError::BadUrl {
            url: redact_url(url),
            reason: reason.to_owned(),
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected scheme://address, e.g. memory:// or kafka://127.0.0.1:9092"))?;
        if scheme.is_empty() || !scheme.chars().all(|c| c.is_ascii_alphanumeric() || c == '+') {
            return Err(bad("the scheme must be letters, e.g. kafka"));
        }
        if has_unescaped_password(url) {
            return Err(bad(UNESCAPED_PASSWORD));
        }
        let (address, query) = rest.split_once('?').unwrap_or((rest, ""));
        if address.contains('@') && !CREDENTIALS_IN_ADDRESS.contains(&scheme.to_ascii_lowercase().as_str()) {
            return Err(bad(
                "credentials do not go in the address: pass them as parameters (e.g. sasl.username, sasl.password)",
            ));
        }
        let mut endpoint = Endpoint {
            scheme: scheme.to_ascii_lowercase(),
            address: address.trim_end_matches('/').to_owned(),
            group: DEFAULT_GROUP.to_owned(),
            topics: Vec::new(),
            dlq_topic: None,
            partitions: DEFAULT_PARTITIONS,
            params: Vec::new(),
        };
        for (key, value) in form_urlencoded::parse(query.as_bytes()) {
            match key.as_ref() {
                "group" => endpoint.group = value.into_owned(),
                "topics" | "topic" => endpoint.topics.extend(split_list(&value)),
                "dlq" | "dlq_topic" => endpoint.dlq_topic = Some(value.into_owned()),
                "partitions" => {
                    endpoint.partitions = value.parse().map_err(|_| {
                        ConfigError::invalid(
                            "partitions",
                            format!("expected a positive number, got {value:?}"),
                        )
                    })?
                }
                _ => endpoint.params.push((key.into_owned(), value.into_owned())),
            }
        }
        Ok(endpoint)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.group.trim().is_empty() {
            return Err(ConfigError::invalid("group", "must not be empty"));
        }
        if self.partitions == 0 {
            return Err(ConfigError::invalid("partitions", "must be at least 1"));
        }
        if let Some(dlq) = &self.dlq_topic {
            if self.topics.contains(dlq) {
                return Err(ConfigError::invalid(
                    "dlq_topic",
                    "must differ from the consumed topics",
                ));
            }
        }
        Ok(())
    }

    /// The dead-letter topic in use: the one given, or `<first topic>.dlq`.
    pub fn dlq_topic(&self) -> Option<String> {
        self.dlq_topic
            .clone()
            .or_else(|| self.topics.first().map(|t| format!("{t}.dlq")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kafka_url_carries_group_topics_dlq_and_client_properties() {
        let e = Endpoint::parse(
            "kafka://127.0.0.1:9092,127.0.0.1:9093?group=billing&topics=a,b&topic=c&dlq=a.dead&fetch.wait.max.ms=5&sasl.password=p%26w",
        )
        .unwrap();
        assert_eq!(e.scheme, "kafka");
        assert_eq!(e.address, "127.0.0.1:9092,127.0.0.1:9093");
        assert_eq!(e.group, "billing");
        assert_eq!(e.topics, ["a", "b", "c"]);
        assert_eq!(e.dlq_topic(), Some("a.dead".into()));
        assert_eq!(e.params[1], ("sasl.password".into(), "p&w".into()));
        assert!(!format!("{e:?}").contains("p&w"), "secrets never print");
    }

    #[test]
    fn defaults_and_the_memory_url() {
        let e = Endpoint::parse("memory://").unwrap();
        assert_eq!((e.scheme.as_str(), e.address.as_str()), ("memory", ""));
        assert_eq!(
            (e.group.as_str(), e.partitions),
            (DEFAULT_GROUP, DEFAULT_PARTITIONS)
        );
        assert_eq!(e.dlq_topic(), None);
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        let msg = |url: &str| Endpoint::parse(url).unwrap_err().to_string();
        assert!(msg("127.0.0.1:9092").contains("expected scheme://address"));
        assert!(msg("kafka://user:pw@host:9092").contains("credentials"));
        assert!(!msg("kafka://user:pw@host:9092?sasl.password=x").contains("sasl.password=x"));
        assert!(msg("memory://?partitions=many").contains("`partitions`"));
    }

    #[test]
    fn an_amqp_url_keeps_its_credentials_and_never_prints_the_password() {
        let e =
            Endpoint::parse("amqp://app:s3cret@127.0.0.1:5672/%2f?topics=t&group=g&partitions=4&prefetch=50")
                .unwrap();
        assert_eq!(e.address, "app:s3cret@127.0.0.1:5672/%2f");
        assert_eq!((e.group.as_str(), e.partitions), ("g", 4));
        assert_eq!(e.params, [("prefetch".to_owned(), "50".to_owned())]);
        assert!(!format!("{e:?}").contains("s3cret"));
        let shown = redact_url("amqp://app:s3cret@127.0.0.1:5672/%2f?topics=t");
        assert_eq!(shown, "amqp://app:<redacted>@127.0.0.1:5672/%2f?topics=t");
        // A password with an unescaped `/` or `?`: still never printed.
        for url in [
            "amqp://app:s3/cret@127.0.0.1:5672/%2f?topics=t",
            "amqp://app:s3?cret@127.0.0.1:5672/%2f?topics=t",
        ] {
            assert_eq!(
                redact_url(url),
                "amqp://app:<redacted>@127.0.0.1:5672/%2f?topics=t"
            );
            let refused = Endpoint::parse(url).unwrap_err().to_string();
            assert!(
                refused.contains("percent-encode") && !refused.contains("cret"),
                "{refused}"
            );
        }
    }

    #[test]
    fn a_nats_token_or_password_is_never_printed() {
        assert_eq!(
            redact_url("nats://s3cret@127.0.0.1:4222?topics=t"),
            "nats://<redacted>@127.0.0.1:4222?topics=t"
        );
        assert_eq!(
            redact_url("nats://127.0.0.1:4222?token=s3cret&nkey=SUAB"),
            "nats://127.0.0.1:4222?token=<redacted>&nkey=<redacted>"
        );
        let e = Endpoint::parse("nats://app:s3cret@127.0.0.1:4222?topics=t").unwrap();
        assert!(!format!("{e:?}").contains("s3cret"));
    }

    #[test]
    fn explicit_fields_win_over_url_parameters_and_env_over_file() {
        let file = ConnectConfig {
            url: Some("kafka://h:1?group=from-url&topics=t".into()),
            group: Some("from-file".into()),
            partitions: Some(3),
            ..ConnectConfig::default()
        };
        let env = ConnectConfig::from_vars(|n| (n == "CONVOY_GROUP").then(|| "from-env".to_owned())).unwrap();
        let e = env.over(file).resolve().unwrap();
        assert_eq!((e.group.as_str(), e.partitions), ("from-env", 3));
        assert_eq!(e.topics, ["t"]);
    }

    #[test]
    fn a_url_s_parameters_beat_lower_layers_as_its_layer_does() {
        let flags = ConnectConfig {
            url: Some("nats://h:4222?group=from-url&topics=t".into()),
            ..ConnectConfig::default()
        };
        let env = ConnectConfig::from_vars(|n| match n {
            "CONVOY_GROUP" => Some("from-env".to_owned()),
            "CONVOY_PARTITIONS" => Some("4".to_owned()),
            _ => None,
        })
        .unwrap();
        let e = flags.clone().over(env.clone()).resolve().unwrap();
        assert_eq!(e.group, "from-url", "the --url flag's group= beats CONVOY_GROUP");
        assert_eq!(e.partitions, 4, "what the URL does not name comes from below");
        let beside = ConnectConfig {
            group: Some("from-flag".into()),
            ..flags
        };
        assert_eq!(
            beside.over(env).resolve().unwrap().group,
            "from-flag",
            "--group beats --url's group="
        );
    }

    #[test]
    fn bad_environment_and_files_name_the_setting() {
        let err = ConnectConfig::from_vars(|n| (n == "CONVOY_PARTITIONS").then(|| "eight".to_owned()));
        assert!(err.unwrap_err().to_string().contains("`CONVOY_PARTITIONS`"));
        let dir = std::env::temp_dir().join(format!("convoy-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.toml");
        std::fs::write(&path, "url = \"memory://\"\npartitions = \"eight\"\n").unwrap();
        let text = ConnectConfig::from_file(&path).unwrap_err().to_string();
        assert!(text.contains("line 2") && text.contains("partitions"), "{text}");
        std::fs::write(&path, "url = \"memory://\"\ngrup = \"x\"\n").unwrap();
        let text = ConnectConfig::from_file(&path).unwrap_err().to_string();
        assert!(text.contains("unknown field `grup`"), "{text}");
        assert_eq!(text.lines().count(), 1, "{text}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
