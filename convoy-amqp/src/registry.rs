//! The topics convoy declared on a RabbitMQ broker, and the groups that receive each. AMQP can
//! list neither exchanges nor queues, so every declare that makes a topic or a group new — and
//! every deletion — appends a record to the stream queue `convoy.topics` (read without being
//! consumed, like the dead-letter streams); [`list`] folds the records. Topics declared by other
//! tools are not in it.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use convoy_core::TransportError;
use lapin::Connection;
use serde::{Deserialize, Serialize};

use crate::config::AmqpConfig;
use crate::error::{answered, broker};
use crate::topology;

/// The registry stream.
pub const REGISTRY: &str = "convoy.topics";

/// How long reading the registry waits for one more record (a stream has no end marker).
const READ_IDLE: Duration = Duration::from_millis(500);

/// One change to what is declared.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// The topic.
    pub topic: String,
    /// Its partition count.
    pub partitions: u32,
    /// The group whose queues were declared (none: the topic itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// The topic (or only the group's queues, with `group`) was deleted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleted: bool,
}

impl Record {
    /// A topic declared.
    pub fn topic(topic: &str, partitions: u32) -> Record {
        Record {
            topic: topic.to_owned(),
            partitions,
            group: None,
            deleted: false,
        }
    }

    /// A group's queues of a topic declared.
    pub fn group(topic: &str, partitions: u32, group: &str) -> Record {
        Record {
            group: Some(group.to_owned()),
            ..Record::topic(topic, partitions)
        }
    }

    /// This record as a deletion.
    pub fn deleted(self) -> Record {
        Record {
            deleted: true,
            ..self
        }
    }
}

/// A topic as the registry knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topic {
    /// The topic.
    pub name: String,
    /// Its partition count.
    pub partitions: u32,
    /// The groups whose queues receive it (each receives what was published after its queues
    /// were declared).
    pub groups: Vec<String>,
}

/// Appends `record` to the registry (declared on first use), confirmed.
pub async fn note(connection: &Connection, record: &Record) -> Result<(), TransportError> {
    topology::declare_stream(connection, REGISTRY).await?;
    let channel = answered("opening a channel", connection.create_channel())
        .await?
        .map_err(|e| broker("opening a channel", e))?;
    let body =
        serde_json::to_vec(record).map_err(|e| TransportError::broker("encoding a registry record", e))?;
    topology::publish_confirmed(&channel, REGISTRY, &body, "recording the topic").await?;
    let _ = answered("closing a channel", channel.close(200, "recorded".into())).await;
    Ok(())
}

/// Declares `topic` for `config.group` (see [`topology::declare_topic`]) and records what was
/// new.
pub async fn declare_recorded(
    connection: &Connection,
    topic: &str,
    config: &AmqpConfig,
    partitions: u32,
) -> Result<topology::Declared, TransportError> {
    let declared = topology::declare_topic(connection, topic, config, partitions).await?;
    if declared.topic_new {
        note(connection, &Record::topic(topic, partitions)).await?;
    }
    if declared.group_new {
        note(connection, &Record::group(topic, partitions, &config.group)).await?;
    }
    Ok(declared)
}

/// Tells a consumer whose group is new on a topic that existed before (a warning) that it
/// receives only what is published from now on. Not said when groups are declared ahead of
/// their consumers (`convoy topic create --for-group`): that is the way to avoid it.
pub fn tell_if_new_group(topic: &str, group: &str, declared: &topology::Declared) {
    if declared.group_new && !declared.topic_new {
        tracing::warn!(
            topic,
            group,
            "group {group} is new on topic {topic}: it receives what is published from now on, not \
             what was published before its queues existed (that went to the groups that existed \
             then); declare groups before publishing with `convoy topic create --for-group`"
        );
    }
}

/// Every topic the registry knows, by name.
pub async fn list(config: &AmqpConfig) -> Result<Vec<Topic>, TransportError> {
    let records = crate::stream::read_stream(config, REGISTRY, READ_IDLE).await?;
    Ok(fold(records.iter().map(|m| &m.payload)))
}

/// What the records say now: a topic's deletion forgets it and its groups; a group's, the group.
fn fold<'a>(records: impl Iterator<Item = &'a Bytes>) -> Vec<Topic> {
    let mut topics: BTreeMap<String, Topic> = BTreeMap::new();
    for record in records.filter_map(|r| serde_json::from_slice::<Record>(r).ok()) {
        match (record.group, record.deleted) {
            (None, true) => {
                topics.remove(&record.topic);
            }
            (group, deleted) => {
                let topic = topics.entry(record.topic.clone()).or_insert_with(|| Topic {
                    name: record.topic.clone(),
                    partitions: record.partitions,
                    groups: Vec::new(),
                });
                topic.partitions = record.partitions;
                if let Some(group) = group {
                    topic.groups.retain(|g| *g != group);
                    if !deleted {
                        topic.groups.push(group);
                    }
                }
            }
        }
    }
    let mut topics: Vec<Topic> = topics.into_values().collect();
    for topic in &mut topics {
        topic.groups.sort();
    }
    topics
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(topic: &str, group: Option<&str>, deleted: bool) -> Bytes {
        let record = Record {
            topic: topic.into(),
            partitions: 4,
            group: group.map(Into::into),
            deleted,
        };
        Bytes::from(serde_json::to_vec(&record).unwrap_or_default())
    }

    #[test]
    fn records_fold_into_topics_and_their_groups() {
        let records = [
            record("orders", None, false),
            record("orders", Some("billing"), false),
            record("orders", Some("audit"), false),
            record("orders", Some("billing"), false), // two members declared it at once
            record("ledger", Some("g"), false),
            record("ledger", None, true),
            record("orders", Some("audit"), true),
            Bytes::from_static(b"not json"),
        ];
        let topics = fold(records.iter());
        assert_eq!(
            topics,
            [Topic {
                name: "orders".into(),
                partitions: 4,
                groups: vec!["billing".into()],
            }]
        );
    }
}
