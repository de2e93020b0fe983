//! The brokers a URL can name, each behind its cargo feature.

#[cfg(feature = "amqp")]
pub(crate) mod amqp;
#[cfg(feature = "kafka")]
pub(crate) mod kafka;
#[cfg(feature = "memory")]
pub(crate) mod memory;
#[cfg(feature = "nats")]
pub(crate) mod nats;

use crate::error::ConnectError;
use crate::settings::Endpoint;

/// A connected backend.
pub(crate) enum Backend {
    #[cfg(feature = "memory")]
    Memory(convoy_memory::MemoryBroker),
    #[cfg(feature = "kafka")]
    Kafka(convoy_kafka::KafkaConfig),
    #[cfg(feature = "amqp")]
    Amqp(convoy_amqp::AmqpConfig),
    #[cfg(feature = "nats")]
    Nats(Box<convoy_nats::NatsConfig>),
}

/// Opens the backend an endpoint names, or says which feature or crate provides it.
pub(crate) async fn open(endpoint: &Endpoint) -> Result<Backend, ConnectError> {
    match endpoint.scheme.as_str() {
        #[cfg(feature = "memory")]
        "memory" => memory::open(endpoint),
        #[cfg(not(feature = "memory"))]
        "memory" => Err(ConnectError::NotCompiled {
            scheme: "memory",
            feature: "memory",
        }),
        #[cfg(feature = "kafka")]
        "kafka" => kafka::open(endpoint).await,
        #[cfg(not(feature = "kafka"))]
        "kafka" => Err(ConnectError::NotCompiled {
            scheme: "kafka",
            feature: "kafka",
        }),
        #[cfg(feature = "amqp")]
        "amqp" | "amqps" => amqp::open(endpoint).await,
        #[cfg(not(feature = "amqp"))]
        "amqp" | "amqps" => Err(ConnectError::NotCompiled {
            scheme: "amqp",
            feature: "amqp",
        }),
        #[cfg(feature = "nats")]
        "nats" => nats::open(endpoint).await,
        #[cfg(not(feature = "nats"))]
        "nats" => Err(ConnectError::NotCompiled {
            scheme: "nats",
            feature: "nats",
        }),
        other => Err(ConnectError::UnknownScheme(other.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn refusal(url: &str) -> String {
        match open(&Endpoint::parse(url).unwrap()).await {
            Ok(_) => panic!("{url} should be refused"),
            Err(e) => e.to_string(),
        }
    }

    #[tokio::test]
    async fn schemes_without_a_backend_name_what_provides_them() {
        #[cfg(not(feature = "amqp"))]
        assert!(refusal("amqp://127.0.0.1")
            .await
            .contains("enable the `amqp` feature of the `convoy` crate"));
        #[cfg(not(feature = "nats"))]
        assert!(refusal("nats://127.0.0.1")
            .await
            .contains("enable the `nats` feature of the `convoy` crate"));
        assert!(refusal("mqtt://127.0.0.1")
            .await
            .contains("unknown broker URL scheme `mqtt://`"));
        #[cfg(not(feature = "kafka"))]
        assert!(refusal("kafka://127.0.0.1:9092")
            .await
            .contains("enable the `kafka` feature of the `convoy` crate"));
    }
}
