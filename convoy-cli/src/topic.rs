//! `convoy topic create|list|delete`: topics on any broker, with their partitions and (on
//! RabbitMQ, where a group receives only what is published once its queues exist) groups.

use std::process::ExitCode;

use convoy::{ConnectConfig, TopicSpec};

use crate::cli::TopicCommand;
use crate::out::out;
use crate::settings::connect;

pub async fn run(config: &ConnectConfig, command: TopicCommand) -> crate::outcome::CliResult {
    let connection = connect(config).await?;
    match command {
        TopicCommand::Create {
            name,
            partitions,
            groups,
            replication,
        } => {
            if partitions == 0 {
                return Err("--partitions must be at least 1".into());
            }
            let listed = connection.list_topics().await.map_err(|e| e.to_string())?;
            if let Some(existing) = listed
                .iter()
                .find(|t| t.name == name && t.partitions != partitions)
            {
                return Err(format!(
                    "topic {name} exists with {} partitions, not {partitions}: its count does not change here \
                     (every member and publisher of it uses {}); leave --partitions at {}, or create a topic of \
                     another name",
                    existing.partitions, existing.partitions, existing.partitions
                )
                .into());
            }
            let spec = TopicSpec {
                partitions,
                groups: groups.clone(),
                replication,
            };
            connection
                .declare_topic(&name, &spec)
                .await
                .map_err(|e| e.to_string())?;
            let declares_groups = matches!(connection.endpoint().scheme.as_str(), "amqp" | "amqps");
            let groups = match groups.is_empty() {
                true => String::new(),
                // As `topic list` shows it: only RabbitMQ declares a group's queues.
                false if !declares_groups => {
                    " (--for-group matters only on RabbitMQ: here every group reads the whole topic)"
                        .to_owned()
                }
                false => format!(" for groups {}", groups.join(", ")),
            };
            eprintln!("topic {name}: {partitions} partitions{groups}");
        }
        TopicCommand::List { json } => {
            let topics = connection.list_topics().await.map_err(|e| e.to_string())?;
            for topic in &topics {
                if json {
                    let line = serde_json::json!({
                        "topic": topic.name,
                        "partitions": topic.partitions,
                        "groups": topic.groups,
                    });
                    out!("{line}")?;
                } else {
                    let groups = match topic.groups.is_empty() {
                        true => String::new(),
                        false => format!("\tgroups: {}", topic.groups.join(", ")),
                    };
                    out!("{}\t{} partitions{groups}", topic.name, topic.partitions)?;
                }
            }
            if topics.is_empty() {
                eprintln!("no topics");
            }
        }
        TopicCommand::Delete { name, groups } => {
            let listed = connection.list_topics().await.map_err(|e| e.to_string())?;
            if !listed.iter().any(|t| t.name == name) {
                // On NATS and RabbitMQ a dead-letter topic is a stream that listings leave out.
                if connection
                    .dead_letter_topic_exists(&name)
                    .await
                    .map_err(|e| e.to_string())?
                {
                    connection
                        .remove_dead_letter_topic(&name)
                        .await
                        .map_err(|e| e.to_string())?;
                    eprintln!("dead-letter topic {name} deleted, with the dead letters it held");
                    return Ok(ExitCode::SUCCESS);
                }
                return Err(format!(
                    "topic {name} does not exist on this broker: nothing was deleted (`convoy topic list` shows what does)"
                )
                .into());
            }
            connection
                .remove_topic(&name, &groups)
                .await
                .map_err(|e| e.to_string())?;
            eprintln!("topic {name} deleted");
            // What convoy made for the topic but keeps, and why.
            let dead_letters = format!("{name}.dlq");
            if connection
                .dead_letter_topic_exists(&dead_letters)
                .await
                .map_err(|e| e.to_string())?
            {
                eprintln!(
                    "kept: its dead-letter topic {dead_letters}, with the dead letters it holds \
                     (`convoy topic delete {dead_letters}` deletes it once they are not needed)"
                );
            }
            if connection.endpoint().scheme == "nats" && groups.is_empty() {
                eprintln!(
                    "kept: the state of the groups that read it (their KV_convoy_wm_GROUP and \
                     KV_convoy_leases_GROUP buckets, shared with their other topics): \
                     --for-group GROUP deletes a group's"
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
