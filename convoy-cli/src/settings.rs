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
    let in_url = config
        .url
        .as_deref()
        .and_then(|url| url.split_once('?'))
        .is_some_and(|(_, query)| {
            query
                .split('&')
                .any(|pair| pair.split('=').next() == Some("group"))
        });
    config.group.is_some() || in_url
}
