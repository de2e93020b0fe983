//! A RabbitMQ conformance target: fresh topics and groups on the broker named by
//! `CONVOY_AMQP_URI` (scripts/test sets it to the machine's RabbitMQ). Everything a bed declared
//! is deleted when it drops, even after a failed assertion: the broker is shared.

#![allow(dead_code, clippy::unwrap_used)] // shared by several test crates, each using a part

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use convoy_amqp::consumer::{EVENT_CAPACITY, MAX_BATCH};
use convoy_amqp::{admin, topology, AmqpConfig, AmqpDeadLetterSink, AmqpPublisher, AmqpTransport};
use convoy_core::{
    DeadLetterSink, Message, Offset, Publisher, SourceId, Subscription, Transport, TransportError,
};
use convoy_testkit::conformance::{Capabilities, ConformanceTarget, Positions, TestBed};

pub const URI_VAR: &str = "CONVOY_AMQP_URI";

/// Logs to the test output when RUST_LOG is set.
pub fn init_tracing() {
    if std::env::var("RUST_LOG").is_ok() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

pub fn uri() -> Option<String> {
    std::env::var(URI_VAR).ok().filter(|s| !s.is_empty())
}

static BEDS: AtomicU64 = AtomicU64::new(0);

/// A unique name per process and call.
pub fn unique(prefix: &str) -> String {
    let n = BEDS.fetch_add(1, Relaxed);
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    format!("{prefix}-{}-{micros:x}-{n}", std::process::id())
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

/// Runs `f` on a runtime of its own on another thread: cleanup from `Drop`, whatever the state
/// of the test's runtime.
pub fn block_on_side<F: std::future::Future<Output = ()> + Send + 'static>(f: F) {
    let _ = std::thread::spawn(move || {
        if let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
            runtime.block_on(f);
        }
    })
    .join();
}

pub struct AmqpTarget {
    uri: Option<String>,
}

impl AmqpTarget {
    pub fn from_env() -> Self {
        init_tracing();
        AmqpTarget { uri: uri() }
    }
}

pub struct AmqpBed {
    pub config: AmqpConfig,
    pub topic: String,
    publisher: Arc<AmqpPublisher>,
    sink: Arc<AmqpDeadLetterSink>,
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
            publisher: Arc::new(AmqpPublisher::new(&config, &topic)),
            sink: Arc::new(AmqpDeadLetterSink::new(&config)),
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
        let _ = connection.close(200, "done".into()).await;
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
    fn publisher(&self) -> Arc<dyn Publisher> {
        self.publisher.clone()
    }

    fn dead_letter_sink(&self) -> Arc<dyn DeadLetterSink> {
        self.sink.clone()
    }

    fn group(&self) -> &str {
        &self.config.group
    }

    async fn subscribe(&self) -> Result<Subscription, TransportError> {
        AmqpTransport::new(self.config.clone())
            .map_err(|e| TransportError::broker("config", e))?
            .subscribe()
            .await
    }

    async fn dead_letters(&self, expected: usize) -> Result<Vec<Message>, TransportError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let all = admin::read_stream(&self.config, &self.config.dlq_topic(), Duration::from_millis(500))
                .await?;
            if all.len() >= expected || Instant::now() >= deadline {
                return Ok(all);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
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
