//! Connecting: credentials, TLS and reconnection from a [`NatsConfig`].
//!
//! The first connection is one attempt: a refused login or certificate is fatal, a server not
//! answering is [`TransportError::Unavailable`], which a joining member waits out for a bounded
//! time (`wait_out_outage`), never a silent retry loop. After that the client reconnects
//! forever, every 100 ms more up to a second, and requests made meanwhile wait for it within
//! their timeouts.
//! async-nats ignores credentials written in a server URL, so they come from the config only.

use convoy_core::config::redact_userinfo;
use std::time::Duration;

use async_nats::jetstream::{self, Context};
use async_nats::{Client, ConnectOptions, Event, ServerAddr};
use convoy_core::TransportError;

use crate::config::NatsConfig;
use crate::error::nats_error;

/// Longest wait between reconnection attempts.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);

/// How long a JetStream request (and a publish acknowledgement) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection and its JetStream context.
#[derive(Clone)]
pub struct Connected {
    /// The client.
    pub client: Client,
    /// JetStream on it.
    pub js: Context,
}

/// Connects for `purpose` (shown in the connection's name).
pub async fn connect(config: &NatsConfig, purpose: &str) -> Result<Connected, TransportError> {
    let servers: Vec<ServerAddr> = config
        .servers
        .iter()
        .map(|s| {
            s.parse::<ServerAddr>()
                .map_err(|e| TransportError::Fatal(format!("server address {:?}: {e}", redact_userinfo(s))))
        })
        .collect::<Result<_, _>>()?;
    let tls = config.tls_required || servers.iter().any(|s| s.tls_required());
    let name = config
        .connection_name
        .clone()
        .unwrap_or_else(|| format!("convoy-{purpose}-{}", config.group));
    // Since when the connection is lost (said once, and again when it is back).
    let lost: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>> = Default::default();
    let mut options = ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_millis(config.connect_timeout_ms))
        .request_timeout(Some(REQUEST_TIMEOUT))
        .max_reconnects(None)
        .reconnect_delay_callback(|attempt| {
            Duration::from_millis(100 * attempt as u64).min(MAX_RECONNECT_DELAY)
        })
        .event_callback(move |event| {
            let lost = lost.clone();
            async move {
                match event {
                    Event::Disconnected => {
                        let mut since = lost.lock().unwrap_or_else(|p| p.into_inner());
                        if since.is_none() {
                            tracing::warn!("NATS connection lost; reconnecting (said again when it is back)");
                            *since = Some(std::time::Instant::now());
                        }
                    }
                    Event::Connected => match lost.lock().unwrap_or_else(|p| p.into_inner()).take() {
                        Some(since) => tracing::info!(lost_for = ?since.elapsed(), "NATS connection back"),
                        None => tracing::debug!("NATS connected"),
                    },
                    Event::SlowConsumer(sid) => {
                        tracing::warn!(sid, "NATS subscription too slow: the client dropped messages")
                    }
                    other => tracing::debug!(%other, "NATS event"),
                }
            }
        })
        .require_tls(tls);
    if let Some(token) = &config.token {
        options = options.token(token.clone());
    }
    if let (Some(user), Some(password)) = (&config.user, &config.password) {
        options = options.user_and_password(user.clone(), password.clone());
    }
    options = with_nkeys(options, config).await?;
    if let Some(ca) = &config.tls_ca_file {
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&config.tls_cert_file, &config.tls_key_file) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    let client = options
        .connect(servers)
        .await
        .map_err(|e| connect_error(config, e))?;
    let js = jetstream::ContextBuilder::new()
        .timeout(REQUEST_TIMEOUT)
        .build(client.clone());
    Ok(Connected { client, js })
}

#[cfg(feature = "nkeys")]
async fn with_nkeys(
    mut options: ConnectOptions,
    config: &NatsConfig,
) -> Result<ConnectOptions, TransportError> {
    if let Some(seed) = &config.nkey {
        options = options.nkey(seed.clone());
    }
    if let Some(path) = &config.credentials_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| TransportError::Fatal(format!("credentials_file {}: {e}", path.display())))?;
    }
    Ok(options)
}

#[cfg(not(feature = "nkeys"))]
async fn with_nkeys(options: ConnectOptions, _config: &NatsConfig) -> Result<ConnectOptions, TransportError> {
    Ok(options) // `validate` refused nkeys settings without the feature
}

fn connect_error(config: &NatsConfig, e: async_nats::ConnectError) -> TransportError {
    use async_nats::ConnectErrorKind;
    let servers = config
        .servers
        .iter()
        .map(|s| redact_userinfo(s))
        .collect::<Vec<_>>()
        .join(",");
    match e.kind() {
        ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => TransportError::Fatal(
            format!("connecting to NATS at {servers}: {e}; check token, user/password or credentials"),
        ),
        ConnectErrorKind::Tls => TransportError::Fatal(format!(
            "the TLS handshake with NATS at {servers} failed: {e} — for a server whose certificate a \
             private CA signed, set tls_ca_file to that CA's PEM file"
        )),
        _ if e.to_string().to_ascii_lowercase().contains("certificate") => TransportError::Fatal(format!(
            "the TLS handshake with NATS at {servers} failed: {e} — for a server whose certificate a \
             private CA signed, set tls_ca_file to that CA's PEM file"
        )),
        ConnectErrorKind::Io | ConnectErrorKind::TimedOut | ConnectErrorKind::Dns => {
            TransportError::Unavailable(format!(
                "connecting to NATS at {servers}: {e}; is the server running?"
            ))
        }
        _ => nats_error(&format!("connecting to NATS at {servers}"), e),
    }
}
