//! Benchmark scenarios on any broker: a [`ScenarioBed`] over a [`Connection`], with a fresh
//! topic (or one filled beforehand), group and dead-letter topic per run.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use convoy::transport::{PrefetchLimit, Subscription};
use convoy::{unique_suffix, ConnectError, Connection, DeadLetterSink, Publisher, Transport, TransportError};
use convoy_bench::scenario::{RecordCheck, ScenarioBed};

/// A benchmark topic on a connection's broker (fresh, or filled beforehand), with a group and a
/// dead-letter topic of its own.
pub struct ConnectionBed {
    connection: Connection,
    topic: String,
    partitions: u32,
    publisher: Arc<dyn Publisher>,
    sink: Arc<dyn DeadLetterSink>,
    /// The run created the topic (and deletes it afterwards).
    owned: bool,
}

impl ConnectionBed {
    /// Creates `convoy-bench-<unique>` with `partitions` partitions and its dead-letter topic.
    pub async fn new(connection: &Connection, partitions: u32) -> Result<Self, ConnectError> {
        let unique = unique_suffix();
        let topic = format!("convoy-bench-{unique}");
        let connection = for_run(connection, &topic, format!("convoy-bench-{unique}"));
        connection.create_topic(&topic, partitions).await?;
        connection.create_topic(&connection.dlq_topic()?, 1).await?;
        connection.prepare_baseline(&topic, partitions).await?;
        ConnectionBed::with(connection, topic, partitions, true)
    }

    /// Joins `topic` as it is, filled beforehand by another process, with a fresh group and
    /// the dead-letter topic `<topic>.dlq`; the topic is left in place afterwards.
    pub async fn prefilled(
        connection: &Connection,
        topic: &str,
        partitions: u32,
    ) -> Result<Self, ConnectError> {
        let connection = for_run(connection, topic, format!("convoy-bench-{}", unique_suffix()));
        connection.create_topic(&connection.dlq_topic()?, 1).await?;
        ConnectionBed::with(connection, topic.to_owned(), partitions, false)
    }

    fn with(
        connection: Connection,
        topic: String,
        partitions: u32,
        owned: bool,
    ) -> Result<Self, ConnectError> {
        Ok(ConnectionBed {
            publisher: connection.publisher(&topic)?,
            sink: connection.dead_letter_sink()?,
            connection,
            topic,
            partitions,
            owned,
        })
    }

    /// Deletes what the run declared, where the broker keeps it (RabbitMQ's queues); a topic
    /// filled beforehand is left alone.
    pub async fn clean_up(&self) -> Result<(), ConnectError> {
        if !self.owned {
            return Ok(());
        }
        self.connection.delete_topic(&self.topic).await
    }
}

/// The connection of one run: `topic`, its dead-letter topic `<topic>.dlq`, and `group`.
fn for_run(connection: &Connection, topic: &str, group: String) -> Connection {
    connection
        .with_topics(&[topic])
        .with_group(group)
        .with_dlq_topic(format!("{topic}.dlq"))
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

    async fn bare_drain(
        &self,
        expected: u64,
        limit: Duration,
        check: RecordCheck,
    ) -> Result<f64, TransportError> {
        self.connection
            .bare_drain(&self.topic, expected, limit, check)
            .await
            .map_err(|e| match e {
                ConnectError::Transport(t) => t,
                other => TransportError::broker("the baseline", other),
            })
    }
}
