//! Why connecting failed, in one line that says what to do.

use convoy_core::{ConfigError, TransportError};

/// Connecting to a broker, or loading the connection's configuration, failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL could not be parsed.
    #[error("invalid broker URL `{url}`: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No backend knows this scheme.
    #[error(
        "unknown broker URL scheme `{0}://`: use memory:// (embedded), kafka://host:port, \
         amqp://user:password@host:port (amqps:// with TLS) or nats://host:port"
    )]
    UnknownScheme(String),
    /// The backend exists but was not compiled into this build.
    #[error("{scheme}:// support is not compiled in: enable the `{feature}` feature of the `convoy` crate")]
    NotCompiled {
        /// The URL scheme.
        scheme: &'static str,
        /// The cargo feature that provides it.
        feature: &'static str,
    },
    /// A setting was rejected; the message names it.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The configuration file could not be read or parsed.
    #[error("config file {path}: {reason}")]
    ConfigFile {
        /// The file.
        path: String,
        /// Where and what.
        reason: String,
    },
    /// The broker is unreachable or refused a request.
    #[error(transparent)]
    Transport(#[from] TransportError),
}
