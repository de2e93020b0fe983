//! NATS errors as convoy sees them.

use convoy_core::TransportError;

/// A client error as a transport error. async-nats has one error type per call; what they
/// share is their text, so authorization failures (no retry can fix them) are told apart by it:
/// the server's "Authorization Violation" and JetStream's 10039 "permissions violation". "No
/// stream found for given subject" is an outage too: a stream or bucket just created on a
/// cluster answers so until its replicas elected a leader.
pub fn nats_error<E>(context: &str, e: E) -> TransportError
where
    E: std::error::Error + Send + Sync + 'static,
{
    let text = e.to_string();
    let lower = text.to_ascii_lowercase();
    if lower.contains("authorization violation") || lower.contains("permissions violation") {
        TransportError::Fatal(format!("{context}: {text}"))
    } else if [
        "timed out",
        "no responders",
        "disconnected",
        "no stream found for given subject",
    ]
    .iter()
    .any(|outage| lower.contains(outage))
    {
        TransportError::Unavailable(format!("{context}: {text}"))
    } else {
        TransportError::broker(context.to_owned(), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Text(&'static str);

    #[test]
    fn authorization_is_fatal_and_timeouts_are_retried() {
        assert!(nats_error("x", Text("Authorization Violation")).is_fatal());
        assert!(matches!(
            nats_error("x", Text("timed out: didn't receive ack in time")),
            TransportError::Unavailable(_)
        ));
        assert!(matches!(
            nats_error(
                "x",
                Text("failed getting entry: no stream found for given subject")
            ),
            TransportError::Unavailable(_)
        ));
        assert!(matches!(
            nats_error("x", Text("stream not found")),
            TransportError::Broker { .. }
        ));
    }
}
