//! What tools need besides consuming: declaring topics, reading a dead-letter stream without
//! consuming it, deleting what tests declared.

use convoy_core::TransportError;

use crate::config::AmqpConfig;
use crate::connect::connect;
use crate::error::broker;
use crate::{registry, topology};

pub use crate::stream::read_stream;

/// Checks that RabbitMQ answers (connects and closes at once).
pub async fn check_reachable(config: &AmqpConfig) -> Result<(), TransportError> {
    let connection = connect(config, "check").await?;
    crate::connect::close(&connection, "checked").await;
    Ok(())
}

/// Runs `admin` on a connection of its own, closed afterwards whatever it answered.
async fn on_admin_connection<T>(
    config: &AmqpConfig,
    admin: impl AsyncFnOnce(&lapin::Connection) -> Result<T, TransportError>,
) -> Result<T, TransportError> {
    let connection = connect(config, "admin").await?;
    let result = admin(&connection).await;
    crate::connect::close(&connection, "done").await;
    result
}

/// Declares each `(topic, partitions)` for `config.group` (idempotent; a queue with other
/// arguments is an error naming it), recorded in the topic registry.
pub async fn create_topics(config: &AmqpConfig, topics: &[(&str, u32)]) -> Result<(), TransportError> {
    on_admin_connection(config, async |connection| {
        for (topic, partitions) in topics {
            registry::declare_recorded(connection, topic, config, *partitions).await?;
        }
        Ok(())
    })
    .await
}

/// Declares `topic` with no group: its exchange and partition count, what publishing needs. A
/// message published while no group's queues are bound is returned, and the publisher reports
/// it as an error (nothing would keep it).
pub async fn create_topic_alone(
    config: &AmqpConfig,
    topic: &str,
    partitions: u32,
) -> Result<(), TransportError> {
    on_admin_connection(config, async |connection| {
        if topology::declare_topic_only(connection, topic, partitions).await? {
            registry::note(connection, &registry::Record::topic(topic, partitions)).await?;
        }
        Ok(())
    })
    .await
}

/// The topics convoy declared on this broker and the groups receiving each (the registry).
pub async fn list_topics(config: &AmqpConfig) -> Result<Vec<registry::Topic>, TransportError> {
    registry::list(config).await
}

/// Declares the dead-letter stream `name`.
pub async fn create_stream(config: &AmqpConfig, name: &str) -> Result<(), TransportError> {
    on_admin_connection(config, async |connection| {
        Ok(topology::declare_stream(connection, name).await?)
    })
    .await
}

/// Declares the dead-letter stream `name` for a consumer about to start: one the broker cannot
/// serve now is said in a warning, not an error (see [`topology::declare_dead_letter_stream`]).
pub async fn create_dead_letter_stream(config: &AmqpConfig, name: &str) -> Result<(), TransportError> {
    on_admin_connection(config, async |connection| {
        Ok(topology::declare_dead_letter_stream(connection, name).await?)
    })
    .await
}

/// True if the dead-letter stream `name` exists (the registry lists topics, not these).
pub async fn dead_letter_stream_exists(config: &AmqpConfig, name: &str) -> Result<bool, TransportError> {
    on_admin_connection(config, async |connection| {
        Ok(topology::exists(connection, false, name).await?)
    })
    .await
}

/// Deletes the dead-letter stream `name` and every dead letter in it.
pub async fn delete_dead_letter_stream(config: &AmqpConfig, name: &str) -> Result<(), TransportError> {
    on_admin_connection(config, async |connection| delete_queue_on(connection, name).await).await
}

/// Deletes `group`'s parked keys' checkpoint of the dead-letter stream `stream`, if any: its
/// head and the parts of both its slots (a save writes its slot's parts from the first on, so
/// the odd numbers run without a gap, and the even ones).
pub async fn delete_checkpoint(config: &AmqpConfig, stream: &str, group: &str) -> Result<(), TransportError> {
    on_admin_connection(config, async |connection| {
        let mut slots_ended = [false; 2];
        for part in 0u32.. {
            let queue = crate::checkpoint::queue(stream, group, part);
            if topology::exists(connection, false, &queue).await? {
                delete_queue_on(connection, &queue).await?;
            } else if part > 0 {
                slots_ended[(part % 2) as usize] = true;
                if slots_ended == [true, true] {
                    break;
                }
            }
        }
        Ok(())
    })
    .await
}

/// Deletes the queue `name` on a channel of its own.
async fn delete_queue_on(connection: &lapin::Connection, name: &str) -> Result<(), TransportError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| broker("opening a channel", e))?;
    Ok(topology::delete_queue(&channel, name).await?)
}

/// Deletes `topic`'s exchange and `config.group`'s queues of it, and the queue `also` (a
/// dead-letter stream), if given: for tests that clean up after themselves.
pub async fn delete_topic(
    config: &AmqpConfig,
    topic: &str,
    also: Option<&str>,
) -> Result<(), TransportError> {
    on_admin_connection(config, async |connection| {
        topology::delete_topic(connection, topic, &config.group, config.partitions).await?;
        registry::note(
            connection,
            &registry::Record::topic(topic, config.partitions).deleted(),
        )
        .await?;
        if let Some(queue) = also {
            delete_queue_on(connection, queue).await?;
        }
        Ok(())
    })
    .await
}
