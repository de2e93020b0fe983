//! `amqp://user:password@host:port/vhost?…` (and `amqps://`): convoy-amqp, with the URL's
//! parameters applied to an [`AmqpConfig`] (validated, errors naming the parameter) and the
//! broker's reachability checked before anything else happens.

use convoy_amqp::{admin, AmqpConfig};

use super::Backend;
use crate::error::ConnectError;
use crate::settings::Endpoint;

pub(super) async fn open(endpoint: &Endpoint) -> Result<Backend, ConnectError> {
    let uri = format!("{}://{}", endpoint.scheme, endpoint.address);
    let mut config = AmqpConfig::new(uri, endpoint.group.as_str(), &[]);
    for (name, value) in &endpoint.params {
        config.apply_param(name, value)?;
    }
    let config = config_for(&config, endpoint, false)?;
    admin::check_reachable(&config).await?;
    Ok(Backend::Amqp(config))
}

/// The configuration for the endpoint's current group, topics and partitions; a consumer
/// (`needs_topics`) must name its topics.
pub(crate) fn config_for(
    base: &AmqpConfig,
    endpoint: &Endpoint,
    needs_topics: bool,
) -> Result<AmqpConfig, ConnectError> {
    let mut config = base.clone();
    config.group = endpoint.group.clone();
    config.topics = endpoint.topics.clone();
    config.dlq_topic = endpoint.dlq_topic.clone();
    config.partitions = endpoint.partitions;
    config.validate(needs_topics)?;
    Ok(config)
}

/// The group whose queues the benchmark baseline drains: declared beside the engine's, so both
/// receive every message (a queue's messages are gone once consumed).
pub(crate) fn baseline_group(endpoint: &Endpoint) -> String {
    format!("{}-baseline", endpoint.group)
}
