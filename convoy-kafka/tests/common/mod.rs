//! A Kafka conformance target: fresh topics and groups on the broker named by
//! `CONVOY_KAFKA_BOOTSTRAP` (scripts/test starts Apache Kafka and sets it), in one of the group
//! protocols.

#![allow(dead_code, clippy::unwrap_used)] // shared by several test crates, each using a part

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use convoy_core::{Message, Offset, SourceId, TransportError};
use convoy_kafka::convert::source_id;
use convoy_kafka::{
    Assignor, GroupProtocol, KafkaConfig, KafkaDeadLetterSink, KafkaPublisher, KafkaTransport,
};
use convoy_testkit::conformance::{BedParts, Capabilities, ConformanceTarget, TestBed};
pub use convoy_testkit::support::{init_tracing, unique};
use convoy_testkit::support::{read_until, required, setting};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset as KafkaOffset, TopicPartitionList};

pub const BOOTSTRAP_VAR: &str = "CONVOY_KAFKA_BOOTSTRAP";

/// The broker's address, or `None` after skipping the test ([`required`]; scripts/test sets it).
pub fn bootstrap() -> Option<String> {
    required(BOOTSTRAP_VAR)
}

/// A group protocol and, for the classic one, its assignor.
#[derive(Clone, Copy, Debug)]
pub enum Protocol {
    /// Classic, cooperative-sticky (incremental): convoy's default.
    Cooperative,
    /// Classic, range (eager): every rebalance revokes every partition first.
    Eager,
    /// KIP-848 (`group.protocol=consumer`): the broker assigns.
    Consumer,
}

impl Protocol {
    /// Applies the protocol to a configuration.
    pub fn apply(self, c: &mut KafkaConfig) {
        match self {
            Protocol::Cooperative => c.assignor = Some(Assignor::CooperativeSticky),
            Protocol::Eager => c.assignor = Some(Assignor::Range),
            Protocol::Consumer => c.group_protocol = GroupProtocol::Consumer,
        }
    }

    /// As URL parameters (`convoy` URLs, the probe consumer's `PROBE_KAFKA_PARAMS`).
    pub fn params(self) -> &'static str {
        match self {
            Protocol::Cooperative => "assignor=cooperative-sticky",
            Protocol::Eager => "assignor=range",
            Protocol::Consumer => "group_protocol=consumer",
        }
    }
}

/// Test settings: librdkafka's defaults, but for the revoke timeout.
pub fn test_config(bootstrap: &str, group: &str, topic: &str) -> KafkaConfig {
    let mut c = KafkaConfig::new(bootstrap, group, &[topic]);
    // Above the conformance drain timeout (8 s), so revokes drain fully in tests.
    c.revoke_timeout_ms = 15_000;
    if let Ok(debug) = std::env::var("CONVOY_KAFKA_DEBUG") {
        c.properties.insert("debug".into(), debug);
    }
    c
}

pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) {
    let config = KafkaConfig::new(bootstrap, "convoy-test-admin", &[topic]);
    convoy_kafka::admin::create_topics(&config, &[(topic, partitions)])
        .await
        .unwrap_or_else(|e| panic!("creating topic {topic}: {e}"));
}

/// Creates a topic with a number of partitions (on brokers without the CreateTopics API).
pub type TopicCreator = Arc<dyn Fn(&str, i32) + Send + Sync>;

pub struct KafkaTarget {
    bootstrap: Option<String>,
    protocol: Protocol,
}

/// What the mock cluster's thread is asked to do.
enum MockRequest {
    CreateTopic(String, i32),
    /// Fail the next requests of an API with these errors, in order.
    RequestErrors(rdkafka::types::RDKafkaApiKey, Vec<rdkafka::types::RDKafkaRespErr>),
    /// Forget the errors still queued for an API.
    ClearErrors(rdkafka::types::RDKafkaApiKey),
}

/// librdkafka's in-process mock cluster (one per test binary), kept alive on its own thread (it
/// is not `Send`) and listening on the loopback like a broker. It keeps commit metadata and
/// implements the group protocols fully, but has no CreateTopics: topics are created through
/// the returned function.
pub fn mock_cluster() -> (String, TopicCreator) {
    let (bootstrap, requests) = mock();
    let create: TopicCreator = Arc::new(move |topic: &str, partitions: i32| {
        let (done, wait) = std::sync::mpsc::channel();
        requests
            .send((MockRequest::CreateTopic(topic.to_owned(), partitions), done))
            .unwrap();
        wait.recv().unwrap();
    });
    (bootstrap, create)
}

/// Forgets the errors still queued for `api` on the mock cluster.
pub fn mock_clear_errors(api: rdkafka::types::RDKafkaApiKey) {
    let (_, requests) = mock();
    let (done, wait) = std::sync::mpsc::channel();
    requests.send((MockRequest::ClearErrors(api), done)).unwrap();
    wait.recv().unwrap();
}

/// Makes the mock cluster fail the next requests of `api` with `errors` (in order).
pub fn mock_request_errors(api: rdkafka::types::RDKafkaApiKey, errors: &[rdkafka::types::RDKafkaRespErr]) {
    let (_, requests) = mock();
    let (done, wait) = std::sync::mpsc::channel();
    requests
        .send((MockRequest::RequestErrors(api, errors.to_vec()), done))
        .unwrap();
    wait.recv().unwrap();
}

type Mock = (
    String,
    std::sync::mpsc::Sender<(MockRequest, std::sync::mpsc::Sender<()>)>,
);

fn mock() -> Mock {
    static MOCK: std::sync::OnceLock<Mock> = std::sync::OnceLock::new();
    MOCK.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        let (req_tx, req_rx) = std::sync::mpsc::channel::<(MockRequest, std::sync::mpsc::Sender<()>)>();
        std::thread::spawn(move || {
            let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
            tx.send(mock.bootstrap_servers()).unwrap();
            for (request, done) in req_rx {
                match request {
                    MockRequest::CreateTopic(topic, partitions) => {
                        mock.create_topic(&topic, partitions, 1).unwrap()
                    }
                    MockRequest::RequestErrors(api, errors) => mock.request_errors(api, &errors),
                    MockRequest::ClearErrors(api) => mock.clear_request_errors(api),
                }
                let _ = done.send(());
            }
        });
        (rx.recv().unwrap(), req_tx)
    })
    .clone()
}

impl KafkaTarget {
    /// The broker of `CONVOY_KAFKA_BOOTSTRAP`, groups speaking `protocol`.
    pub fn from_env(protocol: Protocol) -> Self {
        init_tracing();
        KafkaTarget {
            bootstrap: setting(BOOTSTRAP_VAR),
            protocol,
        }
    }
}

pub struct KafkaBed {
    pub config: KafkaConfig,
    pub topic: String,
    pub partitions: i32,
    parts: BedParts,
}

impl KafkaBed {
    pub async fn new(bootstrap: &str, partitions: u32, protocol: Protocol) -> Self {
        let topic = unique("convoy-test");
        let group = unique("convoy-group");
        let mut config = test_config(bootstrap, &group, &topic);
        protocol.apply(&mut config);
        create_topic(bootstrap, &topic, partitions as i32).await;
        create_topic(bootstrap, &config.dlq_topic(), 1).await;
        KafkaBed {
            parts: BedParts {
                publisher: Arc::new(KafkaPublisher::new(&config, &topic).unwrap()),
                dead_letter_sink: Arc::new(KafkaDeadLetterSink::new(&config).unwrap()),
                group,
                transport: Arc::new(KafkaTransport::new(config.clone()).unwrap()),
            },
            topic,
            partitions: partitions as i32,
            config,
        }
    }
}

/// The group's committed watermarks (`next - 1`) per partition.
pub fn committed(config: &KafkaConfig, topic: &str, partitions: i32) -> BTreeMap<SourceId, Offset> {
    committed_with_map(config, topic, partitions)
        .into_iter()
        .filter_map(|(source, (watermark, _))| Some((source, watermark?)))
        .collect()
}

/// The group's committed state per partition: the watermark (if any) and the offsets above it
/// recorded as finished in the commit metadata (the offset map).
pub fn committed_with_map(
    config: &KafkaConfig,
    topic: &str,
    partitions: i32,
) -> BTreeMap<SourceId, (Option<Offset>, Vec<Offset>)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &config.bootstrap_servers)
        .set("group.id", &config.group_id)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let got = consumer.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
    got.elements()
        .iter()
        .filter_map(|e| match e.offset() {
            KafkaOffset::Offset(next) if next >= 0 => {
                let watermark = (next > 0).then(|| (next - 1) as Offset);
                let above = convoy_core::offset_map::decode(next as Offset, e.metadata());
                Some((source_id(e.topic(), e.partition()), (watermark, above)))
            }
            _ => None,
        })
        .collect()
}

#[async_trait]
impl TestBed for KafkaBed {
    fn parts(&self) -> &BedParts {
        &self.parts
    }

    async fn dead_letters(&self, expected: usize) -> Result<Vec<Message>, TransportError> {
        // Dead letters may still be on their way: read the topic again until they are all there.
        let dlq = self.config.dlq_topic();
        read_until(expected, Duration::from_secs(30), || {
            convoy_kafka::admin::read_topic(&self.config, &dlq, Duration::from_secs(3))
        })
        .await
    }

    async fn committed(&self) -> Result<BTreeMap<SourceId, Offset>, TransportError> {
        let (config, topic, partitions) = (self.config.clone(), self.topic.clone(), self.partitions);
        tokio::task::spawn_blocking(move || committed(&config, &topic, partitions))
            .await
            .map_err(|e| TransportError::broker("reading committed offsets", e))
    }
}

#[async_trait]
impl ConformanceTarget for KafkaTarget {
    fn capabilities(&self) -> Capabilities {
        // A paused partition's thread stops taking from librdkafka: what may still reach the
        // engine is the batches queued in the event channel plus one batch per partition thread
        // (the suite's beds have at most 4 partitions).
        Capabilities {
            max_prefetch: (convoy_kafka::consumer::EVENT_CAPACITY + 4) * convoy_kafka::Prefetch::MAX_BATCH,
            positions: convoy_testkit::conformance::Positions::Log,
            deduplicates_publishes: false,
        }
    }

    fn skip_reason(&self) -> Option<String> {
        self.bootstrap
            .is_none()
            .then(|| format!("{BOOTSTRAP_VAR} is not set (scripts/test sets it after starting Kafka)"))
    }

    async fn bed(&self, partitions: u32) -> Result<Box<dyn TestBed>, TransportError> {
        let bootstrap = self.bootstrap.as_deref().ok_or(TransportError::Closed)?;
        Ok(Box::new(
            KafkaBed::new(bootstrap, partitions, self.protocol).await,
        ))
    }
}

/// The Python with the interop producers' packages (`CONVOY_PYTHON`; scripts/test sets it).
pub fn python() -> Option<String> {
    required("CONVOY_PYTHON")
}
