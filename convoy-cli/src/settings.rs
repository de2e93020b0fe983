//! The connection settings of a command: flags over `CONVOY_*` variables over the config file.

use std::future::Future;
use std::time::Duration;

use convoy::transport::{wait_out_outage, JOIN_WITHIN};
use convoy::{ConnectConfig, ConnectError, TransportError};

use crate::cli::Cli;

/// How long a command started during a broker outage (a node restarting, a cluster electing a
/// leader) waits it out before giving up: as long as a member waits to join.
pub const OUTAGE_WAIT: Duration = JOIN_WITHIN;

/// Runs `attempt` again while the broker is unavailable, for up to [`OUTAGE_WAIT`]
/// ([`wait_out_outage`]): a member started in an outage waits it out, as a running one does,
/// instead of exiting. Any other error returns at once.
pub async fn through_outage<T, F, Fut>(what: &str, mut attempt: F) -> Result<T, ConnectError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ConnectError>>,
{
    // Only an outage goes round again; every other answer is carried out as it is.
    let answer = wait_out_outage(OUTAGE_WAIT, what, || {
        let attempt = attempt();
        async move {
            match attempt.await {
                Err(ConnectError::Transport(e @ TransportError::Unavailable(_))) => Err(e),
                other => Ok(other),
            }
        }
    })
    .await;
    answer.unwrap_or_else(|outage| Err(outage.into()))
}

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
    let listed = through_outage("reading the topics", || connection.list_topics())
        .await
        .map_err(|e| e.to_string())?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_waited_out_and_other_errors_are_not() {
        let mut calls = 0;
        let answer = through_outage("reading", || {
            calls += 1;
            let failing = calls < 4;
            async move {
                match failing {
                    true => Err(ConnectError::Transport(TransportError::Unavailable(
                        "reset".into(),
                    ))),
                    false => Ok(calls),
                }
            }
        })
        .await;
        assert_eq!(answer.ok(), Some(4));

        let mut calls = 0;
        let refused = through_outage("reading", || {
            calls += 1;
            async { Err::<(), _>(ConnectError::Transport(TransportError::Fatal("refused".into()))) }
        })
        .await;
        assert!(refused.is_err());
        assert_eq!(calls, 1, "a fatal error is not tried again");

        let started = tokio::time::Instant::now();
        let gone = through_outage("reading", || async {
            Err::<(), _>(ConnectError::Transport(TransportError::Unavailable(
                "down".into(),
            )))
        })
        .await;
        assert!(gone.is_err());
        assert!(
            started.elapsed() <= OUTAGE_WAIT,
            "gives up within {OUTAGE_WAIT:?}"
        );
        assert!(started.elapsed() >= OUTAGE_WAIT - Duration::from_secs(2));
    }
}
