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
