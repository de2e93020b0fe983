//! Opening a connection: bounded in time (lapin's own connect timeout is ignored on the async
//! path), heartbeats on, lapin's automatic recovery left off — a lost connection's partitions are
//! reported `Lost` and taken again on a new connection, since delivery tags restart with it.

use std::time::Duration;

use convoy_core::TransportError;
use futures_util::StreamExt;
use lapin::{Connection, ConnectionProperties, Event};

use crate::config::{redact_uri, AmqpConfig};
use crate::error::broker;

/// Opens a connection named `<connection_name or convoy>-<role>`.
pub async fn connect(config: &AmqpConfig, role: &str) -> Result<Connection, TransportError> {
    let uri = config
        .parsed_uri()
        .map_err(|e| TransportError::Fatal(e.to_string()))?;
    let name = format!("{}-{role}", config.connection_name.as_deref().unwrap_or("convoy"));
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let timeout = Duration::from_millis(config.connect_timeout_ms);
    let connection = match tokio::time::timeout(timeout, Connection::connect_uri(uri, properties)).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(e)) => {
            return Err(broker(
                &format!("connecting to RabbitMQ at {}", redact_uri(&config.uri)),
                e,
            ))
        }
        Err(_) => {
            return Err(TransportError::Unavailable(format!(
                "no RabbitMQ answered at {} within {timeout:?}; is it running and is the address right?",
                redact_uri(&config.uri)
            )))
        }
    };
    // Events are only queued while someone listens: log them, so nothing piles up unread.
    let mut events = connection.events_listener();
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            match event {
                Event::Error(e) => tracing::debug!(error = %e, "RabbitMQ connection or channel error"),
                Event::ConnectionBlocked(reason) => {
                    tracing::warn!(%reason, "RabbitMQ blocked the connection (a memory or disk alarm)")
                }
                other => tracing::trace!(event = ?other, "RabbitMQ event"),
            }
        }
    });
    Ok(connection)
}

/// How long a goodbye may take. lapin can leave `close` waiting forever when the socket goes
/// first (seen once in CI: the broker logged "client unexpectedly closed TCP connection" and the
/// dead-letter read's close never returned); what the connection was for is done by then.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Closes `connection` with `reason`, giving up after [`CLOSE_TIMEOUT`].
pub async fn close(connection: &Connection, reason: &str) {
    match tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, reason.into())).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "closing the RabbitMQ connection"),
        Err(_) => tracing::debug!("closing the RabbitMQ connection took over {CLOSE_TIMEOUT:?}; leaving it"),
    }
}
