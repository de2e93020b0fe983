//! A connection to the broker a URL names: the same handler code runs on any of them.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::transform::PublishingOutbox;
use convoy_core::transport::{PrefetchLimit, Subscription};
use convoy_core::{DeadLetterSink, Message, Publisher, Transport, TransportError};

mod topics;

pub use topics::{TopicInfo, TopicSpec};

use crate::backend::{self, Backend};
use crate::engine_settings::EngineSettings;
use crate::error::ConnectError;
use crate::settings::{ConnectConfig, Endpoint};

/// What a benchmark baseline does with each message it reads (key, payload): the benchmark's
/// own bookkeeping, which the engine's side pays for in its handler too.
pub type RecordCheck = Arc<dyn Fn(&[u8], &[u8]) + Send + Sync>;

/// Connects to the broker `url` names (see [`ConnectConfig`] for the URL's parameters).
///
/// ```no_run
/// # async fn demo() -> Result<(), convoy::ConnectError> {
/// let memory = convoy::connect("memory://?topics=ledger").await?;
/// let kafka = convoy::connect("kafka://127.0.0.1:9092?group=billing&topics=ledger").await?;
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<Connection, ConnectError> {
    ConnectConfig::url(url).connect().await
}

impl ConnectConfig {
    /// Connects with these settings.
    pub async fn connect(&self) -> Result<Connection, ConnectError> {
        let endpoint = self.resolve()?;
        let backend = backend::open(&endpoint).await?;
        Ok(Connection {
            endpoint,
            backend,
            engine: self.engine.clone(),
        })
    }
}

/// A connected broker: subscribes (it is a [`Transport`]), publishes, dead-letters, and does
/// what tools need (create and read topics, a bare-client baseline).
pub struct Connection {
    endpoint: Endpoint,
    backend: Backend,
    engine: EngineSettings,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

fn no_topics() -> TransportError {
    TransportError::broker(
        "subscribing",
        "no topics to consume: add ?topics=NAME to the URL (or `topics` in the config file)",
    )
}

impl Connection {
    /// The resolved settings.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The engine's configuration: the defaults, in this connection's group, with the
    /// `[engine]` settings of the config file and `CONVOY_ENGINE_*` applied (an error names a
    /// bad one).
    pub fn engine_config(&self) -> Result<convoy_core::EngineConfig, convoy_core::ConfigError> {
        let mut config = convoy_core::EngineConfig::for_group(self.endpoint.group.clone());
        self.engine.apply(&mut config)?;
        Ok(config)
    }

    /// The same broker with another consumer group.
    pub fn with_group(&self, group: impl Into<String>) -> Connection {
        self.with(|e| e.group = group.into())
    }

    /// The same broker consuming other topics.
    pub fn with_topics(&self, topics: &[&str]) -> Connection {
        self.with(|e| e.topics = topics.iter().map(|t| (*t).to_owned()).collect())
    }

    /// The same broker, for topics of `partitions` partitions: to use topics that exist with
    /// another count than the connection's (see [`Connection::list_topics`]).
    pub fn with_partitions(&self, partitions: u32) -> Connection {
        self.with(|e| e.partitions = partitions)
    }

    /// The same broker with another dead-letter topic.
    pub fn with_dlq_topic(&self, topic: impl Into<String>) -> Connection {
        self.with(|e| e.dlq_topic = Some(topic.into()))
    }

    fn with(&self, change: impl FnOnce(&mut Endpoint)) -> Connection {
        let mut endpoint = self.endpoint.clone();
        change(&mut endpoint);
        let backend = match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(b) => Backend::Memory(b.clone()),
            #[cfg(feature = "kafka")]
            Backend::Kafka(c) => Backend::Kafka(c.clone()),
            #[cfg(feature = "amqp")]
            Backend::Amqp(c) => Backend::Amqp(c.clone()),
            #[cfg(feature = "nats")]
            Backend::Nats(c) => Backend::Nats(c.clone()),
        };
        Connection {
            endpoint,
            backend,
            engine: self.engine.clone(),
        }
    }

    /// The dead-letter topic: the one configured, or `<first topic>.dlq`.
    pub fn dlq_topic(&self) -> Result<String, ConnectError> {
        self.endpoint.dlq_topic().ok_or_else(|| {
            convoy_core::ConfigError::invalid(
                "dlq_topic",
                "no dead-letter topic: add ?dlq=NAME (or ?topics=NAME, whose dead letters go to NAME.dlq)",
            )
            .into()
        })
    }

    /// A confirmed, keyed publisher to `topic`.
    pub fn publisher(&self, topic: &str) -> Result<Arc<dyn Publisher>, ConnectError> {
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(broker) => {
                backend::memory::ensure_topic(broker, topic, self.endpoint.partitions);
                Ok(Arc::new(convoy_memory::MemoryPublisher::new(broker, topic)))
            }
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => Ok(Arc::new(convoy_kafka::KafkaPublisher::new(config, topic)?)),
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let config = backend::amqp::config_for(config, &self.endpoint, false)?;
                Ok(Arc::new(convoy_amqp::AmqpPublisher::new(&config, topic)))
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = backend::nats::config_for(config, &self.endpoint, false)?;
                Ok(Arc::new(convoy_nats::NatsPublisher::new(&config, topic)))
            }
        }
    }

    /// The dead-letter sink writing to [`Connection::dlq_topic`].
    pub fn dead_letter_sink(&self) -> Result<Arc<dyn DeadLetterSink>, ConnectError> {
        let topic = self.dlq_topic()?;
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(broker) => {
                backend::memory::ensure_topic(broker, &topic, 1);
                Ok(Arc::new(convoy_memory::MemoryDeadLetterSink::new(broker, topic)))
            }
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => {
                let mut config = config.clone();
                config.dlq_topic = Some(topic);
                Ok(Arc::new(convoy_kafka::KafkaDeadLetterSink::new(&config)?))
            }
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let mut config = backend::amqp::config_for(config, &self.endpoint, false)?;
                config.dlq_topic = Some(topic);
                Ok(Arc::new(convoy_amqp::AmqpDeadLetterSink::new(&config)))
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let mut config = backend::nats::config_for(config, &self.endpoint, false)?;
                config.dlq_topic = Some(topic);
                Ok(Arc::new(convoy_nats::NatsDeadLetterSink::new(&config)))
            }
        }
    }

    /// Creates `topic` with `partitions` partitions unless it exists. On RabbitMQ: the topic's
    /// exchange and this connection's group's partition queues; the dead-letter topic is a
    /// stream. On NATS: a stream with one subject per partition; the dead-letter topic is a
    /// stream with one subject.
    pub async fn create_topic(&self, topic: &str, partitions: u32) -> Result<(), ConnectError> {
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(broker) => {
                backend::memory::ensure_topic(broker, topic, partitions);
                Ok(())
            }
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => {
                let partitions = i32::try_from(partitions).unwrap_or(i32::MAX);
                Ok(convoy_kafka::admin::create_topics(config, &[(topic, partitions)]).await?)
            }
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let mut config = backend::amqp::config_for(config, &self.endpoint, false)?;
                if self.endpoint.dlq_topic().as_deref() == Some(topic) {
                    return Ok(convoy_amqp::admin::create_stream(&config, topic).await?);
                }
                config.partitions = partitions;
                Ok(convoy_amqp::admin::create_topics(&config, &[(topic, partitions)]).await?)
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = backend::nats::config_for(config, &self.endpoint, false)?;
                if self.endpoint.dlq_topic().as_deref() == Some(topic) {
                    return Ok(convoy_nats::admin::create_dead_letters(&config, topic).await?);
                }
                Ok(convoy_nats::admin::create_topics(&config, &[(topic, partitions)]).await?)
            }
        }
    }

    /// Prepares the benchmark baseline of `topic` before anything is published. RabbitMQ
    /// removes what a consumer acknowledges, so the baseline drains queues of a group of its
    /// own, declared now so they receive every message; log brokers need nothing.
    pub async fn prepare_baseline(&self, topic: &str, partitions: u32) -> Result<(), ConnectError> {
        match &self.backend {
            #[cfg(feature = "amqp")]
            Backend::Amqp(_) => {
                let baseline = self.with_group(backend::amqp::baseline_group(&self.endpoint));
                baseline.create_topic(topic, partitions).await
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = (topic, partitions); // log brokers need nothing
                Ok(())
            }
        }
    }

    /// Deletes what [`Connection::create_topic`] and [`Connection::prepare_baseline`] declared
    /// for `topic`, and the dead-letter topic, where the broker keeps them (RabbitMQ and NATS
    /// are shared by everything on a machine; on NATS also the group's watermark and lease
    /// buckets). On Kafka topics are left alone.
    pub async fn delete_topic(&self, topic: &str) -> Result<(), ConnectError> {
        match &self.backend {
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let config = backend::amqp::config_for(config, &self.endpoint, false)?;
                let dlq = self.endpoint.dlq_topic();
                convoy_amqp::admin::delete_topic(&config, topic, dlq.as_deref()).await?;
                let mut baseline = config.clone();
                baseline.group = backend::amqp::baseline_group(&self.endpoint);
                convoy_amqp::admin::delete_topic(&baseline, topic, None).await?;
                Ok(())
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = backend::nats::config_for(config, &self.endpoint, false)?;
                let dlq = self.endpoint.dlq_topic();
                let also: Vec<&str> = dlq.as_deref().into_iter().collect();
                Ok(convoy_nats::admin::delete_topic(&config, topic, &also).await?)
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = topic; // Kafka topics are left alone; memory:// ones live with the process
                Ok(())
            }
        }
    }

    /// Creates the consumed topics (with the configured partitions) and the dead-letter topic
    /// (one partition) where they do not exist.
    pub async fn create_topics(&self) -> Result<(), ConnectError> {
        for topic in &self.endpoint.topics {
            self.create_topic(topic, self.endpoint.partitions).await?;
        }
        if let Some(dlq) = self.endpoint.dlq_topic() {
            match &self.backend {
                // Consuming goes on while RabbitMQ cannot serve the stream (its node restarting):
                // dead letters wait in their lanes until it can.
                #[cfg(feature = "amqp")]
                Backend::Amqp(config) => {
                    let config = backend::amqp::config_for(config, &self.endpoint, false)?;
                    convoy_amqp::admin::create_dead_letter_stream(&config, &dlq).await?;
                }
                #[allow(unreachable_patterns)]
                _ => self.create_topic(&dlq, 1).await?,
            }
        }
        Ok(())
    }

    /// Every message of `topic`, source by source in offset order, without joining a group.
    pub async fn read_topic(&self, topic: &str) -> Result<Vec<Message>, ConnectError> {
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(broker) => Ok(broker.read_all(topic)),
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => {
                Ok(convoy_kafka::admin::read_topic(config, topic, Duration::from_secs(3)).await?)
            }
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                // Only streams can be read without consuming: dead-letter topics are streams.
                let config = backend::amqp::config_for(config, &self.endpoint, false)?;
                Ok(convoy_amqp::admin::read_stream(&config, topic, Duration::from_secs(1)).await?)
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = backend::nats::config_for(config, &self.endpoint, false)?;
                Ok(convoy_nats::admin::read_stream(&config, topic).await?)
            }
        }
    }

    /// The benchmark baseline: a bare client of the broker drains `expected` messages of
    /// `topic` (own group, no engine), calling `check` with each message's key and payload;
    /// returns messages per second.
    pub async fn bare_drain(
        &self,
        topic: &str,
        expected: u64,
        limit: Duration,
        check: RecordCheck,
    ) -> Result<f64, ConnectError> {
        let check = move |key: &[u8], payload: &[u8]| check(key, payload);
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(broker) => {
                Ok(convoy_memory::baseline::bare_drain_rate(broker, topic, expected, limit, check).await)
            }
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => {
                let config = backend::kafka::config_for(config, &self.endpoint, true)?;
                Ok(convoy_kafka::baseline::bare_drain(&config, topic, expected, limit, check).await?)
            }
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let config = backend::amqp::config_for(config, &self.endpoint, false)?;
                let transport = convoy_amqp::AmqpTransport::new(convoy_amqp::AmqpConfig {
                    topics: vec![topic.to_owned()],
                    ..config.clone()
                })?;
                let prefetch = transport.prefetch(convoy_core::transport::PrefetchLimit::default());
                let group = backend::amqp::baseline_group(&self.endpoint);
                Ok(convoy_amqp::baseline::bare_drain(
                    &config, topic, &group, prefetch, expected, limit, check,
                )
                .await?)
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = backend::nats::config_for(config, &self.endpoint, false)?;
                let transport = convoy_nats::NatsTransport::new(convoy_nats::NatsConfig {
                    topics: vec![topic.to_owned()],
                    ..config.clone()
                })?;
                let batch = transport.fetch_batch(convoy_core::transport::PrefetchLimit::default());
                Ok(convoy_nats::baseline::bare_drain(&config, topic, batch, expected, limit, check).await?)
            }
        }
    }

    /// The embedded broker behind a `memory://` connection.
    #[cfg(feature = "memory")]
    pub fn memory_broker(&self) -> Option<&convoy_memory::MemoryBroker> {
        match &self.backend {
            Backend::Memory(broker) => Some(broker),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

#[async_trait]
impl Transport for Connection {
    /// Joins the group and consumes the configured topics.
    async fn subscribe(&self) -> Result<Subscription, TransportError> {
        self.subscribe_with(PrefetchLimit::default()).await
    }

    /// The connection's group: an engine started on it with no group of its own takes it.
    fn group(&self) -> Option<String> {
        Some(self.endpoint.group.clone())
    }

    /// Joins the group and consumes the configured topics, the broker client prefetching at
    /// most `limit` (what [`convoy_core::Engine::start`] derives from its back-pressure bounds).
    ///
    /// A transform's outputs go through the subscription's own outbox where it has one (Kafka
    /// with a transactional id: exactly once), else through this connection's publishers.
    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        let mut subscription = self.subscribe_backend(limit).await?;
        if subscription.outbox.is_none() {
            let publishing = self.with(|_| {});
            subscription.outbox = Some(Arc::new(PublishingOutbox::new(move |topic| {
                publishing
                    .publisher(topic)
                    .map_err(|e| TransportError::broker(format!("publishing to {topic}"), e))
            })));
        }
        Ok(subscription)
    }
}

impl Connection {
    async fn subscribe_backend(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        if self.endpoint.topics.is_empty() {
            return Err(no_topics());
        }
        match &self.backend {
            #[cfg(feature = "memory")]
            Backend::Memory(broker) => {
                let topics: Vec<&str> = self.endpoint.topics.iter().map(String::as_str).collect();
                for topic in &topics {
                    backend::memory::ensure_topic(broker, topic, self.endpoint.partitions);
                }
                convoy_memory::MemoryTransport::new(broker, self.endpoint.group.as_str(), &topics)
                    .subscribe_with(limit)
                    .await
            }
            #[cfg(feature = "kafka")]
            Backend::Kafka(config) => {
                let config = backend::kafka::config_for(config, &self.endpoint, false)
                    .map_err(|e| TransportError::broker("configuring the Kafka consumer", e))?;
                convoy_kafka::KafkaTransport::new(config)
                    .map_err(|e| TransportError::broker("configuring the Kafka consumer", e))?
                    .subscribe_with(limit)
                    .await
            }
            #[cfg(feature = "amqp")]
            Backend::Amqp(config) => {
                let config = backend::amqp::config_for(config, &self.endpoint, true)
                    .map_err(|e| TransportError::broker("configuring the RabbitMQ consumer", e))?;
                convoy_amqp::AmqpTransport::new(config)
                    .map_err(|e| TransportError::broker("configuring the RabbitMQ consumer", e))?
                    .subscribe_with(limit)
                    .await
            }
            #[cfg(feature = "nats")]
            Backend::Nats(config) => {
                let config = backend::nats::config_for(config, &self.endpoint, true)
                    .map_err(|e| TransportError::broker("configuring the NATS consumer", e))?;
                convoy_nats::NatsTransport::new(config)
                    .map_err(|e| TransportError::broker("configuring the NATS consumer", e))?
                    .subscribe_with(limit)
                    .await
            }
        }
    }
}
