//! RabbitMQ errors as convoy sees them.

use std::future::Future;
use std::time::Duration;

use convoy_core::TransportError;
use lapin::ErrorKind;

/// The longest one broker call may take: a declare, a lock, a delete, a channel opened or
/// closed. lapin waits for an answer as long as the socket stays open, and a broker whose
/// answers are lost (a half-broken network, a node stuck electing a queue's leader) would hold
/// the member there — unable even to notice its lease ran out.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A broker call that got no answer within [`CALL_TIMEOUT`].
#[derive(Debug, thiserror::Error)]
#[error(
    "RabbitMQ did not answer {what} within {CALL_TIMEOUT:?} (an unreachable or overloaded node, or a \
     queue whose leader is being elected?)"
)]
pub struct NoAnswer {
    what: String,
}

/// Awaits `call`, for at most [`CALL_TIMEOUT`]; `what` names it in the error.
pub async fn answered<T>(what: impl Into<String>, call: impl Future<Output = T>) -> Result<T, NoAnswer> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(answer) => Ok(answer),
        Err(_) => Err(NoAnswer { what: what.into() }),
    }
}

impl From<NoAnswer> for TransportError {
    fn from(e: NoAnswer) -> Self {
        TransportError::Unavailable(e.to_string())
    }
}

/// The reply code and text of an error the broker sent (e.g. `406, "PRECONDITION_FAILED - …"`).
pub fn amqp_error(e: &lapin::Error) -> Option<(u16, &str)> {
    match e.kind() {
        ErrorKind::ProtocolError(err) => Some((err.get_id(), err.get_message().as_str())),
        _ => None,
    }
}

/// True if the broker's answer is RabbitMQ's 404 for a queue that exists but whose home node
/// cannot serve it now ("home node … of durable queue … is down or inaccessible"): after a node
/// restart, until the queue is back (for a stream declared moments before a crash, RabbitMQ 3.10
/// may keep saying so). The queue is not missing.
pub fn home_node_down(e: &lapin::Error) -> bool {
    amqp_error(e).is_some_and(|(code, text)| code == 404 && text.contains("down or inaccessible"))
}

/// Declaring the topology failed.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A queue or exchange exists with other arguments than convoy declares.
    #[error(
        "{queue} already exists with other arguments ({server}); use the settings it was declared \
         with (partitions), or another topic or group name: convoy never falls back to a queue it \
         did not declare"
    )]
    Mismatch {
        /// What was declared.
        queue: String,
        /// The broker's words.
        server: String,
    },
    /// The topic exists with another partition count than configured.
    #[error(
        "topic {topic} was declared with another partition count than the {partitions} configured \
         here ({server}): every member and publisher of a topic must agree on it — set partitions \
         to the count the topic was declared with"
    )]
    Partitions {
        /// The topic.
        topic: String,
        /// The count configured here.
        partitions: u32,
        /// The broker's words (they name the declared count).
        server: String,
    },
    /// Any other broker or connection error.
    #[error("{0}")]
    Broker(lapin::Error),
    /// The broker did not answer in time.
    #[error(transparent)]
    NoAnswer(#[from] NoAnswer),
}

impl From<TopologyError> for TransportError {
    fn from(e: TopologyError) -> Self {
        match e {
            TopologyError::Mismatch { .. } | TopologyError::Partitions { .. } => {
                TransportError::Fatal(e.to_string())
            }
            TopologyError::Broker(e) => broker("declaring the topology", e),
            TopologyError::NoAnswer(e) => e.into(),
        }
    }
}

/// A lapin error as a transport error: access refusals are fatal (no retry can fix them), a lost
/// connection is an outage, the rest may be retried.
pub fn broker(context: &str, e: lapin::Error) -> TransportError {
    match amqp_error(&e) {
        // ACCESS_REFUSED, NOT_ALLOWED (no such vhost, or not permitted).
        Some((403 | 530, text)) => TransportError::Fatal(format!("{context}: {text}")),
        // CONNECTION_FORCED: the node is shutting down.
        Some((320, text)) => TransportError::Unavailable(format!("{context}: {text}")),
        // The queue's home node is down or restarting: waited out like a lost connection.
        Some((404, text)) if home_node_down(&e) => TransportError::Unavailable(format!("{context}: {text}")),
        // The connection is gone (reset, closed under the call, heartbeats missed): an outage,
        // waited out and reconnected, never a reason to stop.
        _ if matches!(
            e.kind(),
            ErrorKind::IOError(_) | ErrorKind::InvalidConnectionState(_) | ErrorKind::MissingHeartbeatError
        ) =>
        {
            TransportError::Unavailable(format!("{context}: {e}"))
        }
        _ => TransportError::broker(context.to_owned(), e),
    }
}

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPSoftError};
    use lapin::ConnectionState;

    use super::*;

    #[test]
    fn a_lost_connection_is_an_outage() {
        for kind in [
            ErrorKind::InvalidConnectionState(ConnectionState::Error),
            ErrorKind::InvalidConnectionState(ConnectionState::Closed),
            ErrorKind::MissingHeartbeatError,
            ErrorKind::IOError(std::sync::Arc::new(std::io::Error::from(
                std::io::ErrorKind::ConnectionReset,
            ))),
        ] {
            let e = broker("declaring the topology", lapin::Error::from(kind));
            assert!(matches!(e, TransportError::Unavailable(_)), "{e}");
        }
        let down = lapin::Error::from(ErrorKind::ProtocolError(AMQPError::new(
            AMQPSoftError::NOTFOUND.into(),
            "NOT_FOUND - home node 'rabbit@localhost' of durable queue 'orders.dlq' in vhost '/' is \
             down or inaccessible"
                .into(),
        )));
        assert!(home_node_down(&down));
        let e = broker("declaring the topology", down);
        assert!(matches!(e, TransportError::Unavailable(_)), "{e}");
        let e = broker("declaring", lapin::Error::from(ErrorKind::ChannelsLimitReached));
        assert!(
            !matches!(e, TransportError::Unavailable(_)) && !e.is_fatal(),
            "{e}"
        );
    }
}
