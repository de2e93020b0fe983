//! Saying when the brokers are unreachable, once, and when they answer again. librdkafka raises
//! an error for every failed connection attempt — several a second during an outage — which
//! would bury the one fact an operator needs: since when the brokers are gone, and that they
//! came back.

use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::KafkaConsumer;

/// How often, during an outage, the brokers are asked whether they answer again.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The outage seen by the main poll thread, if any.
#[derive(Default)]
pub(super) struct Outage {
    since: Option<Instant>,
    checked: Option<Instant>,
}

/// True for the errors of brokers that cannot be reached (not of requests they refused).
fn unreachable(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::Resolve
                | RDKafkaErrorCode::NetworkException
        )
    )
}

impl Outage {
    /// Takes a consumer error: an unreachable broker starts an outage (said once); returns
    /// false for any other error, which the caller reports.
    pub fn on_error(&mut self, e: &KafkaError) -> bool {
        if !unreachable(e) {
            return false;
        }
        if self.since.is_none() {
            tracing::warn!(error = %e, "Kafka brokers unreachable; retrying (said again when they answer)");
            self.since = Some(Instant::now());
        }
        true
    }

    /// During an outage, asks the brokers (at most every [`CHECK_EVERY`]) and says when they
    /// answer again.
    pub fn check(&mut self, consumer: &KafkaConsumer) {
        let Some(since) = self.since else {
            return;
        };
        if self.checked.is_some_and(|c| c.elapsed() < CHECK_EVERY) {
            return;
        }
        self.checked = Some(Instant::now());
        if consumer.fetch_metadata(None, CHECK_EVERY).is_ok() {
            tracing::info!(unreachable_for = ?since.elapsed(), "Kafka brokers answer again");
            self.since = None;
        }
    }
}
