//! `convoy topic create|list|delete`: topics on any broker, with their partitions and (on
//! RabbitMQ, where a group receives only what is published once its queues exist) groups.

use std::process::ExitCode;

use convoy::{ConnectConfig, TopicSpec};

use crate::cli::TopicCommand;
use crate::settings::connect;

pub async fn run(config: &ConnectConfig, command: TopicCommand) -> crate::CliResult {
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
            let spec = TopicSpec {
                partitions,
                groups: groups.clone(),
                replication,
            };
            connection
                .declare_topic(&name, &spec)
                .await
                .map_err(|e| e.to_string())?;
            let groups = match groups.is_empty() {
                true => String::new(),
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
                    println!("{line}");
                } else {
                    let groups = match topic.groups.is_empty() {
                        true => String::new(),
                        false => format!("\tgroups: {}", topic.groups.join(", ")),
                    };
                    println!("{}\t{} partitions{groups}", topic.name, topic.partitions);
                }
            }
            if topics.is_empty() {
                eprintln!("no topics");
            }
        }
        TopicCommand::Delete { name, groups } => {
            connection
                .remove_topic(&name, &groups)
                .await
                .map_err(|e| e.to_string())?;
            eprintln!("topic {name} deleted");
        }
    }
    Ok(ExitCode::SUCCESS)
}
