//! The connection settings of a command: flags over `CONVOY_*` variables over the config file.

use convoy::ConnectConfig;

use crate::cli::Cli;

/// The merged settings (not yet connected).
pub fn connect_config(cli: &Cli) -> Result<ConnectConfig, String> {
    let file = match &cli.config {
        Some(path) => ConnectConfig::from_file(path).map_err(|e| e.to_string())?,
        None => ConnectConfig::default(),
    };
    let env = ConnectConfig::from_env().map_err(|e| e.to_string())?;
    let flags = ConnectConfig {
        url: cli.url.clone(),
        group: cli.group.clone(),
        topics: (!cli.topics.is_empty()).then(|| cli.topics.clone()),
        dlq_topic: cli.dlq_topic.clone(),
        ..ConnectConfig::default()
    };
    let merged = flags.over(env.over(file));
    // Resolving early reports a bad URL or setting before anything else happens.
    merged.resolve().map_err(|e| e.to_string())?;
    Ok(merged)
}

/// Connects, turning the error into its one line.
pub async fn connect(config: &ConnectConfig) -> Result<convoy::Connection, String> {
    config.connect().await.map_err(|e| e.to_string())
}

/// True when the consumer group was named — by `--group`, `CONVOY_GROUP`, the config file or
/// the URL's `group` parameter — rather than left to the default.
pub fn group_named(config: &ConnectConfig) -> bool {
    config.group.is_some() || url_names(config, "group")
}

/// True when the partition count was named — by `CONVOY_PARTITIONS`, the config file or the
/// URL's `partitions` parameter — rather than left to the default.
pub fn partitions_named(config: &ConnectConfig) -> bool {
    config.partitions.is_some() || url_names(config, "partitions")
}

/// The connection for a command on its topics as they exist on the broker: their partition
/// count is read from there (a named count must agree with it), and a topic that does not exist
/// is an error unless `create` (then it is created with the connection's count). memory:// is
/// left as it is: its topics are made on first use, inside the process.
pub async fn fit_to_topics(
    connection: convoy::Connection,
    config: &ConnectConfig,
    create: bool,
) -> Result<convoy::Connection, String> {
    let endpoint = connection.endpoint();
    if endpoint.scheme == "memory" || endpoint.topics.is_empty() {
        return Ok(connection);
    }
    let listed = connection.list_topics().await.map_err(|e| e.to_string())?;
    let mut counts = Vec::new();
    for topic in &endpoint.topics {
        match listed.iter().find(|t| &t.name == topic) {
            Some(found) => counts.push((topic, found.partitions)),
            None if create => {}
            None => {
                return Err(format!(
                    "topic {topic} does not exist on this broker (`convoy topic list` shows what does): \
                     create it with `convoy topic create {topic} --partitions N`, or pass --create"
                ))
            }
        }
    }
    let Some(&(first, partitions)) = counts.first() else {
        return Ok(connection);
    };
    if let Some((other, theirs)) = counts.iter().find(|(_, p)| *p != partitions) {
        return Err(format!(
            "topics {first} ({partitions} partitions) and {other} ({theirs}) differ: use them in separate commands"
        ));
    }
    if partitions_named(config) && endpoint.partitions != partitions {
        return Err(format!(
            "topic {first} has {partitions} partitions, but partitions = {} was set: set {partitions}, \
             or leave the setting out (the count is read from the topic)",
            endpoint.partitions
        ));
    }
    Ok(match endpoint.partitions == partitions {
        true => connection,
        false => connection.with_partitions(partitions),
    })
}

/// True when the URL has the parameter `name`.
fn url_names(config: &ConnectConfig, name: &str) -> bool {
    config
        .url
        .as_deref()
        .and_then(|url| url.split_once('?'))
        .is_some_and(|(_, query)| query.split('&').any(|pair| pair.split('=').next() == Some(name)))
}
