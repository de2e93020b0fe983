//! Benchmark scenarios on any broker: a [`ScenarioBed`] over a [`Connection`], with a fresh
//! topic, group and dead-letter topic per run.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use convoy::{
    unique_suffix, ConnectError, Connection, DeadLetterSink, PrefetchLimit, Publisher, Subscription,
    Transport, TransportError,
};
use convoy_testkit::scenario::ScenarioBed;

/// A fresh topic on a connection's broker, with its own group and dead-letter topic.
pub struct ConnectionBed {
    connection: Connection,
    topic: String,
    partitions: u32,
    publisher: Arc<dyn Publisher>,
    sink: Arc<dyn DeadLetterSink>,
}

impl ConnectionBed {
    /// Creates `convoy-bench-<unique>` with `partitions` partitions and its dead-letter topic.
    pub async fn new(connection: &Connection, partitions: u32) -> Result<Self, ConnectError> {
        let unique = unique_suffix();
        let topic = format!("convoy-bench-{unique}");
        let connection = connection
            .with_topics(&[topic.as_str()])
            .with_group(format!("convoy-bench-{unique}"))
            .with_dlq_topic(format!("{topic}.dlq"));
        connection.create_topic(&topic, partitions).await?;
        connection.create_topic(&connection.dlq_topic()?, 1).await?;
        connection.prepare_baseline(&topic, partitions).await?;
        Ok(ConnectionBed {
            publisher: connection.publisher(&topic)?,
            sink: connection.dead_letter_sink()?,
            connection,
            topic,
            partitions,
        })
    }

    /// Deletes what the run declared, where the broker keeps it (RabbitMQ's queues).
    pub async fn clean_up(&self) -> Result<(), ConnectError> {
        self.connection.delete_topic(&self.topic).await
    }
}

#[async_trait]
impl ScenarioBed for ConnectionBed {
    fn transport(&self) -> &str {
        &self.connection.endpoint().scheme
    }

    fn group(&self) -> &str {
        &self.connection.endpoint().group
    }

    fn partitions(&self) -> u32 {
        self.partitions
    }

    fn publisher(&self) -> Arc<dyn Publisher> {
        self.publisher.clone()
    }

    fn dead_letter_sink(&self) -> Arc<dyn DeadLetterSink> {
        self.sink.clone()
    }

    async fn subscribe_with(&self, limit: PrefetchLimit) -> Result<Subscription, TransportError> {
        self.connection.subscribe_with(limit).await
    }

    async fn bare_drain(&self, expected: u64, limit: Duration) -> Result<f64, TransportError> {
        self.connection
            .bare_drain(&self.topic, expected, limit)
            .await
            .map_err(|e| match e {
                ConnectError::Transport(t) => t,
                other => TransportError::broker("the baseline", other),
            })
    }
}
