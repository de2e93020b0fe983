//! `memory://[name]`: the embedded broker of convoy-memory. Brokers are shared by name within
//! the process (so a producer and a consumer connected separately meet), topics are created on
//! first use with the endpoint's partition count.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use convoy_core::ConfigError;
use convoy_memory::MemoryBroker;

use super::Backend;
use crate::error::ConnectError;
use crate::settings::Endpoint;

/// The broker called `name` in this process (`""` is the default one), created on first use.
pub fn broker(name: &str) -> MemoryBroker {
    static BROKERS: OnceLock<Mutex<HashMap<String, MemoryBroker>>> = OnceLock::new();
    let mut brokers = BROKERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    brokers.entry(name.to_owned()).or_default().clone()
}

pub(super) fn open(endpoint: &Endpoint) -> Result<Backend, ConnectError> {
    if let Some((name, _)) = endpoint.params.first() {
        return Err(ConfigError::invalid(
            name.as_str(),
            "unknown memory:// parameter: use group, topics, dlq_topic or partitions",
        )
        .into());
    }
    Ok(Backend::Memory(broker(&endpoint.address)))
}

/// Creates `topic` unless it exists.
pub(crate) fn ensure_topic(broker: &MemoryBroker, topic: &str, partitions: u32) {
    if broker.partitions(topic).is_none() {
        broker.create_topic(topic, partitions);
    }
}
