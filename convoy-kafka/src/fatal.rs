//! Which Kafka errors no retry can fix. They end the engine with the error instead of being
//! logged while the consumer idles forever: a fenced member, missing authorization, failed
//! authentication, and whatever librdkafka itself calls fatal (e.g. the idempotent producer's).

use convoy_core::TransportError;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// Codes that are fatal for convoy even where librdkafka would keep retrying.
fn fatal_code(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::Fatal
            | RDKafkaErrorCode::FencedInstanceId
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::GroupAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::TransactionalIdAuthorizationFailed
            | RDKafkaErrorCode::SaslAuthenticationFailed
            | RDKafkaErrorCode::Authentication
    )
}

/// The error as a [`TransportError::Fatal`] if nothing retried can fix it; `context` says what
/// was being done.
pub fn classify(error: &KafkaError, context: &str) -> Option<TransportError> {
    let fatal = match error {
        KafkaError::MessageConsumptionFatal(_) => true,
        other => other.rdkafka_error_code().is_some_and(fatal_code),
    };
    fatal.then(|| TransportError::Fatal(format!("{context}: {error}")))
}

/// The client's own fatal error, if librdkafka raised one (it then refuses every request).
pub fn client_fatal<C: rdkafka::ClientContext>(
    client: &rdkafka::client::Client<C>,
    context: &str,
) -> Option<TransportError> {
    client
        .fatal_error()
        .map(|(code, reason)| TransportError::Fatal(format!("{context}: {code}: {reason}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fencing_and_authorization_are_fatal_transient_errors_are_not() {
        let fenced = KafkaError::MessageConsumption(RDKafkaErrorCode::FencedInstanceId);
        let denied = KafkaError::MessageConsumption(RDKafkaErrorCode::GroupAuthorizationFailed);
        let fatal = KafkaError::MessageConsumptionFatal(RDKafkaErrorCode::InvalidProducerEpoch);
        let down = KafkaError::MessageConsumption(RDKafkaErrorCode::BrokerTransportFailure);
        for e in [&fenced, &denied, &fatal] {
            let classified = classify(e, "consuming").expect("fatal");
            assert!(classified.is_fatal());
            assert!(classified.to_string().contains("consuming"), "{classified}");
        }
        assert!(classify(&down, "consuming").is_none());
        assert!(classify(&KafkaError::PartitionEOF(3), "consuming").is_none());
    }
}
