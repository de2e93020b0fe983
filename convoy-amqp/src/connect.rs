//! Opening a connection: bounded in time (lapin's own connect timeout is ignored on the async
//! path), heartbeats on, lapin's automatic recovery left off — a lost connection's partitions are
//! reported `Lost` and taken again on a new connection, since delivery tags restart with it.

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use convoy_core::config::redact_userinfo;
use convoy_core::TransportError;
use futures_util::StreamExt;
use lapin::{Connection, ConnectionProperties, Event};

use crate::config::AmqpConfig;
use crate::error::broker;

/// Where the next connection starts in a cluster's list of nodes: connections spread over the
/// nodes, and a node that just failed is tried last next time.
static NEXT_NODE: AtomicUsize = AtomicUsize::new(0);

/// Opens a connection named `<connection_name or convoy>-<role>` to one of the URI's nodes:
/// each is tried in turn, bounded by the connect timeout, until one answers.
pub async fn connect(config: &AmqpConfig, role: &str) -> Result<Connection, TransportError> {
    let uris = config
        .parsed_uris()
        .map_err(|e| TransportError::Fatal(e.to_string()))?;
    let name = format!("{}-{role}", config.connection_name.as_deref().unwrap_or("convoy"));
    let timeout = Duration::from_millis(config.connect_timeout_ms);
    let start = NEXT_NODE.fetch_add(1, Relaxed);
    let mut failures = Vec::new();
    let mut last_error = None;
    let mut opened = None;
    for i in 0..uris.len() {
        let uri = uris[(start + i) % uris.len()].clone();
        let node = format!("{}:{}", uri.authority.host, uri.authority.port);
        let properties = ConnectionProperties::default().with_connection_name(name.clone().into());
        match tokio::time::timeout(timeout, Connection::connect_uri(uri, properties)).await {
            Ok(Ok(connection)) => {
                opened = Some(connection);
                break;
            }
            Ok(Err(e)) => {
                failures.push(format!("{node}: {e}"));
                last_error = Some(e);
            }
            Err(_) => failures.push(format!("{node}: no answer within {timeout:?}")),
        }
        NEXT_NODE.fetch_add(1, Relaxed);
    }
    let Some(connection) = opened else {
        let at = redact_userinfo(&config.uri);
        return Err(match last_error {
            // The classification (refused credentials are fatal, I/O errors are an outage)
            // follows the last node's answer; every node's is in the text.
            Some(e) if uris.len() > 1 => broker(
                &format!("connecting to RabbitMQ at {at} ({})", failures.join("; ")),
                e,
            ),
            Some(e) => broker(&format!("connecting to RabbitMQ at {at}"), e),
            None => TransportError::Unavailable(format!(
                "no RabbitMQ answered at {at} within {timeout:?}; is it running and is the address right?"
            )),
        });
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
