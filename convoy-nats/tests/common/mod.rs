//! A NATS conformance target: fresh topics and groups on the server named by `CONVOY_NATS_URL`
//! (scripts/test sets it to the machine's nats-server). Everything a bed created is deleted
//! when it drops, even after a failed assertion: the server is shared.

#![allow(dead_code, clippy::unwrap_used)] // shared by several test crates, each using a part

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::{Message, Offset, SourceId, TransportError};
use convoy_nats::consumer::{EVENT_CAPACITY, MAX_BATCH};
use convoy_nats::{admin, NatsConfig, NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::conformance::{BedParts, Capabilities, ConformanceTarget, Positions, TestBed};
pub use convoy_testkit::support::{block_on_side, init_tracing, unique};
use convoy_testkit::support::{read_until, required, setting};

pub const URL_VAR: &str = "CONVOY_NATS_URL";

/// The server address (`host:port`) from `CONVOY_NATS_URL`, or `None` after skipping the test
/// ([`required`]; scripts/test sets it).
pub fn server() -> Option<String> {
    required(URL_VAR).map(|url| address(&url))
}

fn address(url: &str) -> String {
    url.trim_start_matches("nats://").to_owned()
}

/// Test settings: fast rebalancing, short leases, a revoke timeout above the conformance drain
/// timeout (8 s).
pub fn test_config(server: &str, group: &str, topic: &str, partitions: u32) -> NatsConfig {
    let mut c = NatsConfig::new(&[server], group, &[topic]);
    c.partitions = partitions;
    c.balance_interval_ms = 100;
    c.revoke_timeout_ms = 15_000;
    c.lease_ttl_ms = 3_000;
    c.stream_max_age_s = 3600;
    c
}

pub struct NatsTarget {
    server: Option<String>,
}

impl NatsTarget {
    pub fn from_env() -> Self {
        init_tracing();
        NatsTarget {
            server: setting(URL_VAR).map(|url| address(&url)),
        }
    }
}

pub struct NatsBed {
    pub config: NatsConfig,
    pub topic: String,
    parts: BedParts,
}

impl NatsBed {
    pub async fn new(server: &str, partitions: u32) -> Self {
        let topic = unique("convoy-test");
        let group = unique("g");
        let config = test_config(server, &group, &topic, partitions);
        admin::create_topics(&config, &[(&topic, partitions)])
            .await
            .unwrap();
        admin::create_dead_letters(&config, &config.dlq_topic())
            .await
            .unwrap();
        NatsBed {
            parts: BedParts {
                publisher: Arc::new(NatsPublisher::new(&config, &topic)),
                dead_letter_sink: Arc::new(NatsDeadLetterSink::new(&config)),
                group,
                transport: Arc::new(NatsTransport::new(config.clone()).unwrap()),
            },
            topic,
            config,
        }
    }
}

impl Drop for NatsBed {
    fn drop(&mut self) {
        let (config, topic) = (self.config.clone(), self.topic.clone());
        block_on_side(async move {
            let dlq = config.dlq_topic();
            if let Err(e) = admin::delete_topic(&config, &topic, &[&dlq]).await {
                eprintln!("cleaning up {topic} failed: {e}");
            }
        });
    }
}

#[async_trait]
impl TestBed for NatsBed {
    fn parts(&self) -> &BedParts {
        &self.parts
    }

    async fn dead_letters(&self, expected: usize) -> Result<Vec<Message>, TransportError> {
        let dlq = self.config.dlq_topic();
        read_until(expected, Duration::from_secs(30), || {
            admin::read_stream(&self.config, &dlq)
        })
        .await
    }

    async fn committed(&self) -> Result<BTreeMap<SourceId, Offset>, TransportError> {
        Ok(admin::committed(&self.config, &self.topic)
            .await?
            .into_iter()
            .map(|(p, w)| (SourceId::partition(&self.topic, p), w))
            .collect())
    }
}

#[async_trait]
impl ConformanceTarget for NatsTarget {
    fn capabilities(&self) -> Capabilities {
        // A paused partition's reader stops pulling: what may still reach the engine is the
        // batches queued in the event channel plus one per reader (at most 4 in the suite).
        Capabilities {
            max_prefetch: (EVENT_CAPACITY + 4) * MAX_BATCH,
            positions: Positions::Log,
            // Nats-Msg-Id is the event id: the stream stores a re-sent publish once.
            deduplicates_publishes: true,
        }
    }

    fn skip_reason(&self) -> Option<String> {
        self.server
            .is_none()
            .then(|| format!("{URL_VAR} is not set (scripts/test sets it to the machine's nats-server)"))
    }

    async fn bed(&self, partitions: u32) -> Result<Box<dyn TestBed>, TransportError> {
        let server = self.server.as_deref().ok_or(TransportError::Closed)?;
        Ok(Box::new(NatsBed::new(server, partitions).await))
    }
}

/// The Python with the interop producers' packages (`CONVOY_PYTHON`; scripts/test sets it).
pub fn python() -> Option<String> {
    required("CONVOY_PYTHON")
}

/// The last stream sequence stored on each partition subject of `topic` (0 for none).
pub async fn last_sequences(server: &str, topic: &str, partitions: u32) -> Vec<(u32, u64)> {
    let client = async_nats::connect(server).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js
        .get_stream(convoy_nats::topology::stream_name(topic))
        .await
        .unwrap();
    let mut last = Vec::new();
    for p in 0..partitions {
        let subject = convoy_nats::topology::partition_subject(topic, p);
        let sequence = stream
            .get_last_raw_message_by_subject(&subject)
            .await
            .map_or(0, |m| m.sequence);
        last.push((p, sequence));
    }
    last
}

/// Waits until `config.group`'s committed watermarks of `topic` are `expected`.
pub async fn wait_committed(config: &NatsConfig, topic: &str, expected: &[(u32, u64)]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let committed = admin::committed(config, topic).await.unwrap();
        if committed == expected {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "commits stopped: committed {committed:?}, last messages {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
