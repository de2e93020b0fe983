//! A RabbitMQ conformance target: fresh topics and groups on the broker named by
//! `CONVOY_AMQP_URI` (scripts/test sets it to the machine's RabbitMQ). Everything a bed declared
//! is deleted when it drops, even after a failed assertion: the broker is shared.

#![allow(dead_code, clippy::unwrap_used)] // shared by several test crates, each using a part

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use convoy_amqp::consumer::{EVENT_CAPACITY, MAX_BATCH};
use convoy_amqp::{admin, topology, AmqpConfig, AmqpDeadLetterSink, AmqpPublisher, AmqpTransport};
use convoy_core::{Message, Offset, SourceId, TransportError};
use convoy_testkit::conformance::{BedParts, Capabilities, ConformanceTarget, Positions, TestBed};
pub use convoy_testkit::support::{block_on_side, init_tracing, unique};
use convoy_testkit::support::{read_until, required, setting};

pub const URI_VAR: &str = "CONVOY_AMQP_URI";

/// The broker's URI, or `None` after skipping the test ([`required`]; scripts/test sets it).
pub fn uri() -> Option<String> {
    required(URI_VAR)
}

/// Test settings: fast rebalancing, a revoke timeout above the conformance drain timeout (8 s).
pub fn test_config(uri: &str, group: &str, topic: &str, partitions: u32) -> AmqpConfig {
    let mut c = AmqpConfig::new(uri, group, &[topic]);
    c.partitions = partitions;
    c.balance_interval_ms = 100;
    c.revoke_timeout_ms = 15_000;
    c.heartbeat_s = 5;
    c
}

pub struct AmqpTarget {
    uri: Option<String>,
}

impl AmqpTarget {
    pub fn from_env() -> Self {
        init_tracing();
        AmqpTarget {
            uri: setting(URI_VAR),
        }
    }
}

pub struct AmqpBed {
    pub config: AmqpConfig,
    pub topic: String,
    parts: BedParts,
}

impl AmqpBed {
    pub async fn new(uri: &str, partitions: u32) -> Self {
        let topic = unique("convoy-test");
        let group = unique("g");
        let config = test_config(uri, &group, &topic, partitions);
        admin::create_topics(&config, &[(&topic, partitions)])
            .await
            .unwrap();
        admin::create_stream(&config, &config.dlq_topic()).await.unwrap();
        AmqpBed {
            parts: BedParts {
                publisher: Arc::new(AmqpPublisher::new(&config, &topic)),
                dead_letter_sink: Arc::new(AmqpDeadLetterSink::new(&config)),
                group,
                transport: Arc::new(AmqpTransport::new(config.clone()).unwrap()),
            },
            topic,
            config,
        }
    }

    /// Ready messages left in the group's partition queues.
    pub async fn ready(&self) -> Result<u64, TransportError> {
        let connection = convoy_amqp::connect::connect(&self.config, "test").await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| TransportError::broker("channel", e))?;
        let mut total = 0u64;
        for p in 0..self.config.partitions {
            let queue = topology::partition_queue(&self.topic, &self.config.group, p);
            let (ready, _) = topology::partition_depth(&channel, &queue).await?;
            total += u64::from(ready);
        }
        convoy_amqp::connect::close(&connection, "done").await;
        Ok(total)
    }
}

impl Drop for AmqpBed {
    fn drop(&mut self) {
        let (config, topic) = (self.config.clone(), self.topic.clone());
        block_on_side(async move {
            let dlq = config.dlq_topic();
            if let Err(e) = admin::delete_topic(&config, &topic, Some(&dlq)).await {
                eprintln!("cleaning up {topic} failed: {e}");
            }
        });
    }
}

#[async_trait]
impl TestBed for AmqpBed {
    fn parts(&self) -> &BedParts {
        &self.parts
    }

    async fn dead_letters(&self, expected: usize) -> Result<Vec<Message>, TransportError> {
        let dlq = self.config.dlq_topic();
        read_until(expected, Duration::from_secs(30), || {
            admin::read_stream(&self.config, &dlq, Duration::from_millis(500))
        })
        .await
    }

    async fn committed(&self) -> Result<BTreeMap<SourceId, Offset>, TransportError> {
        Err(TransportError::broker(
            "reading committed positions",
            "RabbitMQ keeps no positions: acknowledged messages are removed",
        ))
    }

    async fn remaining(&self) -> Result<u64, TransportError> {
        self.ready().await
    }
}

#[async_trait]
impl ConformanceTarget for AmqpTarget {
    fn capabilities(&self) -> Capabilities {
        // A paused partition's task stops reading its channel: what may still reach the engine is
        // the batches queued in the event channel plus one per partition task (at most 4 in the
        // suite); after a crash only the unacknowledged window comes back.
        Capabilities {
            max_prefetch: (EVENT_CAPACITY + 4) * MAX_BATCH,
            positions: Positions::Delivery,
            deduplicates_publishes: false,
        }
    }

    fn skip_reason(&self) -> Option<String> {
        self.uri
            .is_none()
            .then(|| format!("{URI_VAR} is not set (scripts/test sets it to the machine's RabbitMQ)"))
    }

    async fn bed(&self, partitions: u32) -> Result<Box<dyn TestBed>, TransportError> {
        let uri = self.uri.as_deref().ok_or(TransportError::Closed)?;
        Ok(Box::new(AmqpBed::new(uri, partitions).await))
    }
}

/// The Python with the interop producers' packages (`CONVOY_PYTHON`; scripts/test sets it).
pub fn python() -> Option<String> {
    required("CONVOY_PYTHON")
}

/// A proxy to the broker `uri` names, and `config` connecting through it.
pub async fn behind_proxy(uri: &str, config: &AmqpConfig) -> (convoy_testkit::proxy::Proxy, AmqpConfig) {
    let broker = uri
        .split_once('@')
        .and_then(|(_, rest)| rest.split('/').next())
        .unwrap()
        .to_owned();
    let proxy = convoy_testkit::proxy::Proxy::start_amqp(&broker).await.unwrap();
    let mut through_proxy = config.clone();
    through_proxy.uri = uri.replacen(&broker, &proxy.address(), 1);
    (proxy, through_proxy)
}
