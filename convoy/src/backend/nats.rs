//! `nats://[user:password@|token@]host:port[,host:port…]?…`: convoy-nats, with the URL's
//! parameters applied to a [`NatsConfig`] (validated, errors naming the parameter) and the
//! server's JetStream checked before anything else happens. Credentials in the address are
//! taken out of it (async-nats ignores them there) and passed as the client's credentials.

use convoy_nats::{admin, NatsConfig};

use super::Backend;
use crate::error::ConnectError;
use crate::settings::Endpoint;

pub(super) async fn open(endpoint: &Endpoint) -> Result<Backend, ConnectError> {
    let mut config = NatsConfig::new(&[], endpoint.group.as_str(), &[]);
    for server in endpoint.address.split(',').filter(|s| !s.trim().is_empty()) {
        let host = match server.rsplit_once('@') {
            Some((userinfo, host)) => {
                match userinfo.split_once(':') {
                    Some((user, password)) => {
                        config.user = Some(decode(user));
                        config.password = Some(decode(password));
                    }
                    None => config.token = Some(decode(userinfo)),
                }
                host
            }
            None => server,
        };
        config.servers.push(host.trim().to_owned());
    }
    for (name, value) in &endpoint.params {
        config.apply_param(name, value)?;
    }
    let config = config_for(&config, endpoint, false)?;
    admin::check_reachable(&config).await?;
    Ok(Backend::Nats(Box::new(config)))
}

/// Percent-decoding of a URL's user information (`%40` for `@` in a password).
fn decode(text: &str) -> String {
    form_urlencoded::parse(format!("x={text}").as_bytes())
        .next()
        .map_or_else(|| text.to_owned(), |(_, v)| v.into_owned())
}

/// The configuration for the endpoint's current group, topics and partitions; a consumer
/// (`needs_topics`) must name its topics.
pub(crate) fn config_for(
    base: &NatsConfig,
    endpoint: &Endpoint,
    needs_topics: bool,
) -> Result<NatsConfig, ConnectError> {
    let mut config = base.clone();
    config.group = endpoint.group.clone();
    config.topics = endpoint.topics.clone();
    config.dlq_topic = endpoint.dlq_topic.clone();
    config.partitions = endpoint.partitions;
    config.validate(needs_topics)?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_leave_the_address() {
        assert_eq!(decode("p%40ss%2Bword"), "p@ss+word");
        assert_eq!(decode("plain"), "plain");
    }
}
