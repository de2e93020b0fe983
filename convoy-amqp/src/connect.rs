//! Opening a connection: bounded in time (lapin's own connect timeout is ignored on the async
//! path), heartbeats on, lapin's automatic recovery left off — a lost connection's partitions are
//! reported `Lost` and taken again on a new connection, since delivery tags restart with it.

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use convoy_core::config::redact_userinfo;
use convoy_core::TransportError;
use futures_util::StreamExt;
use lapin::tcp::OwnedTLSConfig;
use lapin::uri::AMQPUri;
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
    let trust = trusted_cas(config)?;
    let start = NEXT_NODE.fetch_add(1, Relaxed);
    let mut failures = Vec::new();
    let mut last_error = None;
    let mut opened = None;
    for i in 0..uris.len() {
        let uri = uris[(start + i) % uris.len()].clone();
        let node = format!("{}:{}", uri.authority.host, uri.authority.port);
        let properties = ConnectionProperties::default().with_connection_name(name.clone().into());
        match tokio::time::timeout(timeout, open(uri, properties, trust.clone())).await {
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
        if let Some(e) = last_error.as_ref().filter(|e| is_certificate_error(e)) {
            return Err(TransportError::Fatal(format!(
                "the TLS handshake with RabbitMQ at {at} failed: {e} — for a broker whose \
                 certificate a private CA signed, set tls_ca_file to that CA's PEM file"
            )));
        }
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

/// True for a broker certificate the client does not trust (rustls's words): no retry fixes it.
fn is_certificate_error(e: &lapin::Error) -> bool {
    let text = e.to_string().to_ascii_lowercase();
    text.contains("certificate") || text.contains("unknownissuer")
}

/// The CA certificates to trust (`tls_ca_file`), read once per connect.
fn trusted_cas(config: &AmqpConfig) -> Result<Option<String>, TransportError> {
    let Some(file) = &config.tls_ca_file else {
        return Ok(None);
    };
    std::fs::read_to_string(file).map(Some).map_err(|e| {
        TransportError::Fatal(format!(
            "reading tls_ca_file {}: {e} (a PEM file of CA certificates)",
            file.display()
        ))
    })
}

/// Opens one connection, trusting `cas` (PEM) for `amqps://` when given.
async fn open(
    uri: AMQPUri,
    properties: ConnectionProperties,
    cas: Option<String>,
) -> lapin::Result<Connection> {
    match cas {
        None => Connection::connect_uri(uri, properties).await,
        Some(cert_chain) => {
            let tls = OwnedTLSConfig {
                identity: None,
                cert_chain: Some(cert_chain),
            };
            Connection::connect_uri_with_config(uri, properties, tls, lapin::runtime::default_runtime()?)
                .await
        }
    }
}

/// How long a goodbye may take. lapin can leave `close` waiting forever when the socket goes
/// first (seen once in CI: the broker logged "client unexpectedly closed TCP connection" and the
/// dead-letter read's close never returned); what the connection was for is done by then.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Closes `connection` with `reason`, giving up after `CLOSE_TIMEOUT`.
pub async fn close(connection: &Connection, reason: &str) {
    match tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, reason.into())).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "closing the RabbitMQ connection"),
        Err(_) => tracing::debug!("closing the RabbitMQ connection took over {CLOSE_TIMEOUT:?}; leaving it"),
    }
}
