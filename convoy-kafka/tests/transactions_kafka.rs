//! What exactly-once consume → produce builds on, proven on the project's Apache Kafka: a
//! transactional producer commits outputs together with a consumer group's offsets
//! (`send_offsets_to_transaction` with the group's metadata), an aborted transaction is never
//! seen by a `read_committed` reader, and a second producer with the same `transactional.id`
//! fences the first (a zombie cannot commit).

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

const TIMEOUT: Duration = Duration::from_secs(30);

fn producer(bootstrap: &str, transactional_id: &str) -> ThreadedProducer<DefaultProducerContext> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("transactional.id", transactional_id)
        .create()
        .unwrap()
}

/// Every payload of `topic`'s partition 0 a reader with `isolation` sees, to the end.
fn read_all(bootstrap: &str, topic: &str, isolation: &str) -> Vec<String> {
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", common::unique("convoy-txn-reader"))
        .set("isolation.level", isolation)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning).unwrap();
    reader.assign(&tpl).unwrap();
    // The end a read_committed reader may reach is the last stable offset; both readers stop
    // once their position passes every record and marker written so far.
    let (_, high) = reader.fetch_watermarks(topic, 0, TIMEOUT).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let mut seen = Vec::new();
    loop {
        if let Some(record) = reader.poll(Duration::from_millis(100)) {
            let record = record.unwrap();
            seen.push(String::from_utf8_lossy(record.payload().unwrap_or_default()).into_owned());
        }
        let position = reader.position().unwrap();
        let at = position.elements()[0].offset();
        if matches!(at, Offset::Offset(o) if o >= high) {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "{topic} not read to {high} within {TIMEOUT:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_commit_outputs_with_offsets_abort_and_fence() {
    common::init_tracing();
    let Some(bootstrap) = common::bootstrap() else {
        return;
    };
    let input = common::unique("convoy-txn-in");
    let output = common::unique("convoy-txn-out");
    common::create_topic(&bootstrap, &input, 1).await;
    common::create_topic(&bootstrap, &output, 1).await;
    let group = common::unique("convoy-txn-group");
    tokio::task::spawn_blocking(move || {
        // The group whose offsets go into the transaction: its metadata carries the generation,
        // so the broker can refuse a member that is not the group's any more.
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let metadata = consumer.group_metadata().unwrap();

        let transactional_id = common::unique("convoy-txn");
        let first = producer(&bootstrap, &transactional_id);
        first.init_transactions(TIMEOUT).unwrap();

        // Committed: three outputs and the input offset 3, atomically.
        first.begin_transaction().unwrap();
        for i in 0..3 {
            first
                .send(
                    BaseRecord::to(&output)
                        .key("k")
                        .payload(&format!("committed-{i}")),
                )
                .unwrap();
        }
        let mut offsets = TopicPartitionList::new();
        offsets
            .add_partition_offset(&input, 0, Offset::Offset(3))
            .unwrap();
        first
            .send_offsets_to_transaction(&offsets, &metadata, TIMEOUT)
            .unwrap();
        first.commit_transaction(TIMEOUT).unwrap();

        // Aborted: two outputs and the offset 5, neither of which may take effect.
        first.begin_transaction().unwrap();
        for i in 0..2 {
            first
                .send(BaseRecord::to(&output).key("k").payload(&format!("aborted-{i}")))
                .unwrap();
        }
        let mut offsets = TopicPartitionList::new();
        offsets
            .add_partition_offset(&input, 0, Offset::Offset(5))
            .unwrap();
        first
            .send_offsets_to_transaction(&offsets, &metadata, TIMEOUT)
            .unwrap();
        first.flush(TIMEOUT).unwrap();
        first.abort_transaction(TIMEOUT).unwrap();

        let committed = read_all(&bootstrap, &output, "read_committed");
        assert_eq!(committed, ["committed-0", "committed-1", "committed-2"]);
        let uncommitted = read_all(&bootstrap, &output, "read_uncommitted");
        assert_eq!(uncommitted.len(), 5, "{uncommitted:?}");
        let mut ask = TopicPartitionList::new();
        ask.add_partition(&input, 0);
        let group_offsets = consumer.committed_offsets(ask, TIMEOUT).unwrap();
        assert_eq!(
            group_offsets.elements()[0].offset(),
            Offset::Offset(3),
            "only the committed transaction's offset counts"
        );

        // A zombie: a second producer with the same transactional.id fences the first.
        first.begin_transaction().unwrap();
        first
            .send(BaseRecord::to(&output).key("k").payload("zombie"))
            .unwrap();
        let second = producer(&bootstrap, &transactional_id);
        second.init_transactions(TIMEOUT).unwrap();
        let fenced = first.commit_transaction(TIMEOUT).unwrap_err();
        let fatal = matches!(&fenced, KafkaError::Transaction(e) if e.is_fatal())
            || fenced.to_string().to_lowercase().contains("fenced");
        assert!(fatal, "the fenced producer's commit must fail for good: {fenced}");
        assert_eq!(
            read_all(&bootstrap, &output, "read_committed"),
            ["committed-0", "committed-1", "committed-2"],
            "nothing of the zombie's transaction is visible"
        );
    })
    .await
    .unwrap();
}
