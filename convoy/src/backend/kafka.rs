//! `kafka://host:port[,host:port]?…`: convoy-kafka, with the URL's parameters applied to a
//! [`KafkaConfig`] (validated, errors naming the parameter) and the broker's reachability
//! checked before anything else happens.

use convoy_kafka::{admin, KafkaConfig};

use super::Backend;
use crate::error::ConnectError;
use crate::settings::Endpoint;

pub(super) async fn open(endpoint: &Endpoint) -> Result<Backend, ConnectError> {
    let mut config = KafkaConfig::new(endpoint.address.as_str(), endpoint.group.as_str(), &[]);
    for (name, value) in &endpoint.params {
        config.apply_param(name, value)?;
    }
    let config = config_for(&config, endpoint, true)?;
    admin::check_reachable(&config).await?;
    Ok(Backend::Kafka(config))
}

/// The configuration for the endpoint's current group and topics. Tools that only publish or
/// read (`lenient`) may have no topics; a placeholder lets the rest be validated.
pub(crate) fn config_for(
    base: &KafkaConfig,
    endpoint: &Endpoint,
    lenient: bool,
) -> Result<KafkaConfig, ConnectError> {
    let mut config = base.clone();
    config.group_id = endpoint.group.clone();
    config.topics = endpoint.topics.clone();
    config.dlq_topic = endpoint.dlq_topic.clone();
    if lenient && config.topics.is_empty() {
        let mut check = config.clone();
        check.topics = vec!["placeholder".into()];
        check.validate()?;
    } else {
        config.validate()?;
    }
    Ok(config)
}
