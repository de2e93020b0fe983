//! Topics as an operator manages them, on every broker: create one (partitions, the groups to
//! receive it, replication), list them, delete one.
//!
//! A group's place differs by broker. On Kafka and NATS a topic is a log every group reads from
//! its start, so groups need nothing declared. On RabbitMQ each group has queues of its own,
//! and a group receives only what is published once its queues exist: declare the groups when
//! the topic is created (a publish no group receives is refused, never kept for no one).

use super::Connection;
use crate::backend::Backend;
use crate::error::ConnectError;
#[cfg(feature = "amqp")]
use convoy_core::ConfigError;

/// What a topic is created with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicSpec {
    /// Partitions (every member and publisher of the topic must agree on it).
    pub partitions: u32,
    /// Consumer groups to declare (RabbitMQ: their queues, which receive what is published
    /// from then on; Kafka and NATS need none).
    pub groups: Vec<String>,
    /// Copies of each partition: Kafka's replication factor, NATS's stream replicas (RabbitMQ's
    /// quorum queues replicate over the cluster's nodes by themselves). `None`: the broker's
    /// default (Kafka) or the connection's setting (NATS).
    pub replication: Option<u16>,
}

/// A topic as [`Connection::list_topics`] finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicInfo {
    /// The topic.
    pub name: String,
    /// Its partitions.
    pub partitions: u32,
    /// The groups whose queues receive it (RabbitMQ); empty where every group reads the whole
    /// log (Kafka, NATS, memory).
    pub groups: Vec<String>,
}

/// Topics of a log broker, where every group reads the whole log (no groups to list).
#[cfg(any(feature = "memory", feature = "kafka", feature = "nats"))]
fn listed(topics: Vec<(String, usize)>) -> Vec<TopicInfo> {
    topics
        .into_iter()
        .map(|(name, partitions)| TopicInfo {
            name,
            partitions: u32::try_from(partitions).unwrap_or(u32::MAX),
            groups: Vec::new(),
        })
        .collect()
}

impl Connection {
    /// Creates `topic` as `spec` says, unless it exists (RabbitMQ declares the groups' queues
    /// either way; a topic declared with another partition count is refused, naming both).
    pub async fn declare_topic(&self, topic: &str, spec: &TopicSpec) -> Result<(), ConnectError> {
        let partitions = spec.partitions.max(1);
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(broker) => {
                crate::backend::memory::ensure_topic(broker, topic, partitions);
                Ok(())
            }
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => {
                let partitions = i32::try_from(partitions).unwrap_or(i32::MAX);
                let replication = spec.replication.map(i32::from);
                Ok(
                    convoy_kafka::admin::create_topics_replicated(
                        config,
                        &[(topic, partitions)],
                        replication,
                    )
                    .await?,
                )
            }
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                if let Some(copies) = spec.replication {
                    return Err(ConfigError::invalid(
                        "replication",
                        format!(
                            "RabbitMQ's quorum queues replicate over the cluster's nodes by themselves ({copies} copies asked): leave --replication out on amqp://"
                        ),
                    )
                    .into());
                }
                // The groups' queues dead-letter where a consumer of `topic` will: the named
                // dead-letter topic, the first consumed topic's, or else `topic`'s own.
                let mut endpoint = self.endpoint.clone();
                if endpoint.dlq_topic.is_none() && !endpoint.topics.iter().any(|t| t == topic) {
                    endpoint.topics = vec![topic.to_owned()];
                }
                let mut config = crate::backend::amqp::config_for(config, &endpoint, false)?;
                config.partitions = partitions;
                convoy_amqp::admin::create_topic_alone(&config, topic, partitions).await?;
                for group in &spec.groups {
                    config.group = group.clone();
                    convoy_amqp::admin::create_topics(&config, &[(topic, partitions)]).await?;
                }
                Ok(())
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let mut config = crate::backend::nats::config_for(config, &self.endpoint, false)?;
                if let Some(replicas) = spec.replication {
                    config.replicas = usize::from(replicas);
                }
                Ok(convoy_nats::admin::create_topics(&config, &[(topic, partitions)]).await?)
            }
        }
    }

    /// The topics on the broker, by name. RabbitMQ cannot list exchanges: the topics listed
    /// there are the ones convoy declared (its registry), with their groups.
    pub async fn list_topics(&self) -> Result<Vec<TopicInfo>, ConnectError> {
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(broker) => Ok(listed(
                broker
                    .topics()
                    .into_iter()
                    .map(|(name, partitions)| (name, partitions as usize))
                    .collect(),
            )),
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => Ok(listed(convoy_kafka::admin::list_topics(config).await?)),
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let config = crate::backend::amqp::config_for(config, &self.endpoint, false)?;
                let topics = convoy_amqp::admin::list_topics(&config).await?;
                Ok(topics
                    .into_iter()
                    .map(|t| TopicInfo {
                        name: t.name,
                        partitions: t.partitions,
                        groups: t.groups,
                    })
                    .collect())
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = crate::backend::nats::config_for(config, &self.endpoint, false)?;
                Ok(listed(convoy_nats::admin::list_topics(&config).await?))
            }
        }
    }

    /// True if the dead-letter topic `name` exists. On Kafka it is a topic like any other
    /// ([`list_topics`](Self::list_topics) shows it); on NATS and RabbitMQ it is a stream that
    /// listings leave out.
    pub async fn dead_letter_topic_exists(&self, name: &str) -> Result<bool, ConnectError> {
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(_) => {
                let _ = name;
                Ok(false)
            }
            #[cfg(feature = "kafka")]
            Backend::Kafka(_) => Ok(self.list_topics().await?.iter().any(|t| t.name == name)),
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let config = crate::backend::amqp::config_for(config, &self.endpoint, false)?;
                Ok(convoy_amqp::admin::dead_letter_stream_exists(&config, name).await?)
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = crate::backend::nats::config_for(config, &self.endpoint, false)?;
                Ok(convoy_nats::admin::stream_exists(&config, name).await?)
            }
        }
    }

    /// Deletes the dead-letter topic `name` and every dead letter in it (parked keys' records
    /// included: their keys are then no longer parked), with the parked keys' checkpoints of it
    /// that live beside it (Kafka's `<name>.parking`; on RabbitMQ the connection's group's).
    pub async fn remove_dead_letter_topic(&self, name: &str) -> Result<(), ConnectError> {
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(_) => self.remove_topic(name, &[]).await,
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => kafka_delete_with_checkpoints(config, name).await,
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let config = crate::backend::amqp::config_for(config, &self.endpoint, false)?;
                convoy_amqp::admin::delete_dead_letter_stream(&config, name).await?;
                Ok(convoy_amqp::admin::delete_checkpoint(&config, name, &self.endpoint.group).await?)
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = crate::backend::nats::config_for(config, &self.endpoint, false)?;
                Ok(convoy_nats::admin::delete_stream_of(&config, name).await?)
            }
        }
    }

    /// Deletes `topic` and every message in it. On RabbitMQ also the queues of every group it
    /// had (what convoy's registry knows, and `groups`); on NATS the watermark and lease buckets
    /// of `groups` — a group's buckets hold its state for every topic it reads, so they go only
    /// when named.
    pub async fn remove_topic(&self, topic: &str, groups: &[String]) -> Result<(), ConnectError> {
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(_) => {
                let _ = (topic, groups);
                Err(convoy_core::ConfigError::invalid(
                    "topic",
                    "memory:// topics live as long as the process: there is nothing to delete",
                )
                .into())
            }
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => {
                // A group's offsets go with the topic; a dead-letter topic is a topic like any
                // on Kafka, and its checkpoints go with it.
                let _ = groups;
                kafka_delete_with_checkpoints(config, topic).await
            }
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let mut config = crate::backend::amqp::config_for(config, &self.endpoint, false)?;
                let known = convoy_amqp::admin::list_topics(&config)
                    .await?
                    .into_iter()
                    .find(|t| t.name == topic);
                let mut all: Vec<String> = groups.to_vec();
                if let Some(known) = &known {
                    config.partitions = known.partitions;
                    all.extend(known.groups.iter().cloned());
                }
                all.push(self.endpoint.group.clone());
                all.sort();
                all.dedup();
                for group in all {
                    config.group = group;
                    convoy_amqp::admin::delete_topic(&config, topic, None).await?;
                }
                Ok(())
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let mut config = crate::backend::nats::config_for(config, &self.endpoint, false)?;
                convoy_nats::admin::delete_stream_of(&config, topic).await?;
                for group in groups {
                    config.group = group.clone();
                    convoy_nats::admin::delete_topic(&config, topic, &[]).await?;
                }
                Ok(())
            }
        }
    }
}

/// Deletes the Kafka topic `name` and, when there is one, the checkpoint topic of parked keys
/// beside it (`<name>.parking`, which only a dead-letter topic has).
#[cfg(feature = "kafka")]
async fn kafka_delete_with_checkpoints(
    config: &convoy_kafka::KafkaConfig,
    name: &str,
) -> Result<(), ConnectError> {
    let checkpoints = convoy_kafka::producer::checkpoint_topic(name);
    let listed = convoy_kafka::admin::list_topics(config).await?;
    let mut doomed = vec![name];
    if listed.iter().any(|(t, _)| *t == checkpoints) {
        doomed.push(&checkpoints);
    }
    Ok(convoy_kafka::admin::delete_topics(config, &doomed).await?)
}
