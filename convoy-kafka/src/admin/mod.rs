//! Broker administration the tools need: reachability, topic creation and deletion, and
//! reading a topic (for dead-letter inspection and parked keys) without joining a group.

mod read;

pub use read::{latest_of_key, read_topic, read_topic_after, read_topic_to_end, ReadAfter};

use std::sync::Mutex;
use std::time::{Duration, Instant};

use convoy_core::TransportError;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::ClientConfig;

use crate::config::KafkaConfig;

/// How long a metadata request may take before the broker counts as unreachable.
pub const REACH_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) fn consumer(config: &KafkaConfig, group: &str) -> Result<BaseConsumer, TransportError> {
    let mut c: ClientConfig = config.consumer_config();
    c.set("group.id", group);
    c.create()
        .map_err(|e| TransportError::broker("creating a Kafka consumer", e))
}

/// What the reachability probe heard from librdkafka besides its answers: a refused SASL login
/// or a failed TLS handshake never reaches a metadata call, which only times out. The error's
/// code comes from polling the probe; librdkafka's words for it, from its log.
#[derive(Default)]
struct ProbeContext {
    last_complaint: Mutex<Option<String>>,
}

impl ClientContext for ProbeContext {
    /// Polled instead (see `check_reachable`): not logged as well.
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::debug!(%error, reason, "librdkafka error while checking the broker");
    }

    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        if (level as i32) <= (RDKafkaLogLevel::Warning as i32) {
            *self.last_complaint.lock().unwrap_or_else(|p| p.into_inner()) = Some(message.to_owned());
        }
        tracing::debug!(facility = fac, "librdkafka: {message}");
    }
}

impl ConsumerContext for ProbeContext {}

impl ProbeContext {
    fn last_complaint(&self) -> Option<String> {
        self.last_complaint
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A refused login or a failed TLS handshake: no retry can fix either, so the probe says what to
/// check at once instead of waiting out [`REACH_TIMEOUT`].
fn refusal(code: RDKafkaErrorCode, reason: &str, servers: &str) -> Option<TransportError> {
    match code {
        RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed => {
            Some(TransportError::Fatal(format!(
                "Kafka at {servers} refused the login: {reason} — check sasl.mechanisms, \
                 sasl.username and sasl.password"
            )))
        }
        RDKafkaErrorCode::SSL => Some(TransportError::Fatal(format!(
            "the TLS handshake with Kafka at {servers} failed: {reason} — check \
             security.protocol, and ssl.ca.location for a broker whose certificate a private CA signed"
        ))),
        _ => None,
    }
}

/// Checks that a broker answers a metadata request within [`REACH_TIMEOUT`]. A login the broker
/// refuses or a TLS handshake that fails ends the check at once, as a fatal error saying which
/// settings to check.
pub async fn check_reachable(config: &KafkaConfig) -> Result<(), TransportError> {
    let mut c: ClientConfig = config.consumer_config();
    c.set("group.id", "convoy-reachability");
    let probe: BaseConsumer<ProbeContext> = c
        .create_with_context(ProbeContext::default())
        .map_err(|e| TransportError::broker("creating a Kafka consumer", e))?;
    let servers = config.bootstrap_servers.clone();
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        loop {
            let answer = probe.fetch_metadata(None, REACH_STEP);
            // Errors the client raised meanwhile (a refused login, a failed handshake).
            while let Some(event) = probe.poll(Duration::ZERO) {
                let Err(e) = event else { continue };
                let Some(code) = e.rdkafka_error_code() else { continue };
                let reason = probe.context().last_complaint().unwrap_or_else(|| e.to_string());
                if let Some(refused) = refusal(code, &reason, &servers) {
                    return Err(refused);
                }
            }
            match answer {
                Ok(_) => return Ok(()),
                Err(_) if started.elapsed() < REACH_TIMEOUT => {}
                Err(e) => {
                    let heard = probe
                        .context()
                        .last_complaint()
                        .map(|said| format!("; the client last said: {said}"))
                        .unwrap_or_default();
                    return Err(TransportError::Unavailable(format!(
                        "no Kafka broker answered at {servers} within {} s ({e}{heard}); is it running and is the address right?",
                        REACH_TIMEOUT.as_secs()
                    )));
                }
            }
        }
    })
    .await
    .map_err(|_| TransportError::Closed)?
}

/// How long each metadata request of the reachability check waits.
const REACH_STEP: Duration = Duration::from_millis(500);

/// Creates topics that do not exist yet (`(name, partitions)`) with the broker's default
/// replication factor; existing ones are left alone.
pub async fn create_topics(config: &KafkaConfig, topics: &[(&str, i32)]) -> Result<(), TransportError> {
    create_topics_replicated(config, topics, None).await
}

/// Creates topics that do not exist yet (`(name, partitions)`), each partition on
/// `replication` brokers (`None`: the broker's `default.replication.factor`); existing ones
/// are left alone.
pub async fn create_topics_replicated(
    config: &KafkaConfig,
    topics: &[(&str, i32)],
    replication: Option<i32>,
) -> Result<(), TransportError> {
    let admin = admin_client(config)?;
    // -1: the broker's `default.replication.factor` (KIP-464), not a single copy.
    let replication = replication.unwrap_or(-1);
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|(name, partitions)| NewTopic::new(name, *partitions, TopicReplication::Fixed(replication)))
        .collect();
    create(&admin, &new).await?;
    let names: Vec<String> = topics.iter().map(|(name, _)| (*name).to_owned()).collect();
    wait_visible(config, names).await
}

/// How long a created topic may take to show in the cluster's metadata.
const VISIBLE_WITHIN: Duration = Duration::from_secs(10);

/// Waits until every one of `topics` shows in the metadata with its partitions and leaders. A
/// consumer that subscribes to a topic before that learns of it only at its next metadata
/// refresh (librdkafka: `topic.metadata.refresh.interval.ms`, five minutes): `convoy consume
/// --create` on a new topic was assigned nothing for that long.
async fn wait_visible(config: &KafkaConfig, topics: Vec<String>) -> Result<(), TransportError> {
    let probe = consumer(config, "convoy-admin")?;
    tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + VISIBLE_WITHIN;
        loop {
            let visible = |name: &String| {
                probe
                    .fetch_metadata(Some(name), REACH_STEP)
                    .ok()
                    .and_then(|m| {
                        let topic = m.topics().first()?;
                        let ready = topic.error().is_none()
                            && !topic.partitions().is_empty()
                            && topic.partitions().iter().all(|p| p.error().is_none() && p.leader() >= 0);
                        Some(ready)
                    })
                    .unwrap_or(false)
            };
            let missing: Vec<&String> = topics.iter().filter(|t| !visible(t)).collect();
            if missing.is_empty() {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                tracing::warn!(topics = ?missing, "created topics do not show in the metadata yet: a consumer may be assigned their partitions only at its next metadata refresh");
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .map_err(|_| TransportError::Closed)?
}

/// Creates the compacted one-partition topic `name` if it does not exist: a store of the latest
/// record per key (a group's parked keys' checkpoint).
pub async fn create_compacted_topic(config: &KafkaConfig, name: &str) -> Result<(), TransportError> {
    let admin = admin_client(config)?;
    // Segments roll hourly, so that compaction (which leaves the active segment alone) keeps the
    // topic near one record per group even when checkpoints are small and frequent.
    let topic = NewTopic::new(name, 1, TopicReplication::Fixed(-1))
        .set("cleanup.policy", "compact")
        .set("segment.ms", "3600000");
    create(&admin, &[topic]).await
}

/// Creates `topics`, leaving those that exist already alone.
async fn create(
    admin: &AdminClient<DefaultClientContext>,
    topics: &[NewTopic<'_>],
) -> Result<(), TransportError> {
    let results = admin
        .create_topics(topics, &admin_options())
        .await
        .map_err(|e| TransportError::broker("creating topics", e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(TransportError::broker(
                    format!("creating topic {topic}"),
                    rdkafka::error::KafkaError::AdminOp(code),
                ))
            }
        }
    }
    Ok(())
}

/// Every topic on the cluster but Kafka's internal ones (`__…`): `(name, partitions)`, by name.
pub async fn list_topics(config: &KafkaConfig) -> Result<Vec<(String, usize)>, TransportError> {
    // An unreachable broker or a refused login is said as such, not as a failed listing.
    check_reachable(config).await?;
    let probe = consumer(config, "convoy-admin")?;
    tokio::task::spawn_blocking(move || {
        let metadata = probe
            .fetch_metadata(None, Duration::from_secs(10))
            .map_err(|e| TransportError::broker("listing the topics", e))?;
        let mut topics: Vec<(String, usize)> = metadata
            .topics()
            .iter()
            .filter(|t| !t.name().starts_with("__"))
            .map(|t| (t.name().to_owned(), t.partitions().len()))
            .collect();
        topics.sort();
        Ok(topics)
    })
    .await
    .map_err(|_| TransportError::Closed)?
}

/// Deletes `topics` (and every message in them); one that does not exist is skipped.
pub async fn delete_topics(config: &KafkaConfig, topics: &[&str]) -> Result<(), TransportError> {
    let admin = admin_client(config)?;
    let results = admin
        .delete_topics(topics, &admin_options())
        .await
        .map_err(|e| TransportError::broker("deleting topics", e))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((topic, code)) => {
                return Err(TransportError::broker(
                    format!("deleting topic {topic}"),
                    rdkafka::error::KafkaError::AdminOp(code),
                ))
            }
        }
    }
    Ok(())
}

fn admin_client(config: &KafkaConfig) -> Result<AdminClient<DefaultClientContext>, TransportError> {
    config
        .base()
        .create()
        .map_err(|e| TransportError::broker("creating a Kafka admin client", e))
}

fn admin_options() -> AdminOptions {
    AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)))
}
