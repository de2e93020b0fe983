//! Exactly once from Kafka to Kafka: a member with a transactional id commits through a
//! transactional producer of its own.
//!
//! A transform's outputs are *staged* per input partition and offset by convoy-core's
//! [`StagingOutbox`] (the rules — what a transaction carries, replacing and discarding, release
//! with ownership, the bound — live there, where the simulator drives them). A commit of
//! watermarks runs the outbox's transactions, one Kafka transaction each: its staged outputs in
//! partition and offset order, then its offsets (`send_offsets_to_transaction` with the
//! consumer's group metadata, so a member fenced by a rebalance cannot commit), then
//! `commit_transaction`. A backlog goes as several such transactions, each within the outbox's
//! byte bound, so none outgrows `transaction.timeout.ms`. What a `read_committed` reader sees
//! always matches what the group committed: a crash before a commit aborts both, and the next
//! owner handles those inputs again from the committed offsets.

use std::sync::Arc;
use std::time::{Duration, Instant};

use convoy_core::transform::{Output, StagingOutbox, Transaction, DEFAULT_MAX_TRANSACTION_BYTES};
use convoy_core::transport::Commit;
use convoy_core::TransportError;
use rdkafka::consumer::Consumer;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::TopicPartitionList;

use super::KafkaConsumer;
use crate::config::KafkaConfig;
use crate::convert::{to_kafka_headers, topic_partition};
use crate::fatal;

/// How long one transactional call (init, offsets, commit, abort) may wait for the broker.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long sending the staged outputs may wait for room in librdkafka's queue.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(30);
/// A `commit_transaction` that timed out (retriable) is called again this many times before
/// the transaction is aborted.
const COMMIT_TRIES: usize = 3;

/// The member's transactional producer and the outputs waiting for a commit.
pub(crate) struct Transactions {
    producer: FutureProducer,
    id: String,
    pub outbox: Arc<StagingOutbox>,
}

impl Transactions {
    /// Creates the producer and registers its transactional id with the broker, which fences
    /// (and aborts the open transaction of) an earlier producer with the same id — a member
    /// that crashed, or one still alive and frozen. Blocking.
    pub fn init(config: &KafkaConfig, id: &str) -> Result<Self, TransportError> {
        let producer: FutureProducer = config
            .transactional_producer_config(id)
            .create()
            .map_err(|e| TransportError::broker("creating the transactional producer", e))?;
        producer.init_transactions(CALL_TIMEOUT).map_err(|e| {
            let context = format!("registering transactional id {id:?} with the broker");
            fatal::classify(&e, &context).unwrap_or_else(|| TransportError::broker(context, e))
        })?;
        Ok(Transactions {
            producer,
            id: id.to_owned(),
            outbox: Arc::new(StagingOutbox::new(DEFAULT_MAX_TRANSACTION_BYTES)),
        })
    }

    /// Commits the watermarks of `commits` with the outputs staged below them, in as many
    /// transactions as the outbox's bound asks. Blocking. On an error the open transaction is
    /// aborted and its outputs stay staged for the next commit (the transactions before it went
    /// through); a fatal error (fenced by a newer producer with this id, not authorized) ends
    /// the engine.
    pub fn commit(&self, consumer: &KafkaConsumer, commits: &[Commit]) -> Result<(), TransportError> {
        let group = consumer
            .group_metadata()
            .ok_or_else(|| TransportError::Unavailable("the consumer has not joined its group yet".into()))?;
        for transaction in self.outbox.transactions(commits) {
            let offsets = offsets_of(&transaction)?;
            match self.run(&transaction.outputs, &offsets, &group) {
                Ok(()) => self.outbox.committed(&transaction),
                Err(e) => return Err(self.abort(e)),
            }
        }
        Ok(())
    }

    fn run(
        &self,
        outputs: &[Arc<Vec<Output>>],
        offsets: &TopicPartitionList,
        group: &rdkafka::consumer::ConsumerGroupMetadata,
    ) -> Result<(), KafkaError> {
        self.producer.begin_transaction()?;
        let started = Instant::now();
        for output in outputs.iter().flat_map(|o| o.iter()) {
            let mut record = FutureRecord::<[u8], [u8]>::to(&output.topic)
                .payload(output.message.payload.as_ref())
                .headers(to_kafka_headers(&output.message.headers));
            if let Some(key) = &output.message.key {
                record = record.key(key.as_ref());
            }
            loop {
                // A delivery failure fails `commit_transaction`, so the delivery futures are
                // not awaited one by one.
                match self.producer.send_result(record) {
                    Ok(_delivery) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                        if started.elapsed() < QUEUE_TIMEOUT =>
                    {
                        record = back;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err((e, _)) => return Err(e),
                }
            }
        }
        self.producer
            .send_offsets_to_transaction(offsets, group, CALL_TIMEOUT)?;
        let mut tries = 0;
        loop {
            match self.producer.commit_transaction(CALL_TIMEOUT) {
                Err(KafkaError::Transaction(e)) if e.is_retriable() && tries + 1 < COMMIT_TRIES => {
                    tries += 1;
                    tracing::debug!(error = %e, "committing the transaction timed out; trying again");
                }
                other => return other,
            }
        }
    }

    /// Aborts the open transaction after `error`: the error to report (fatal when the producer
    /// can never commit again).
    fn abort(&self, error: KafkaError) -> TransportError {
        let context = format!("committing a transaction (transactional id {:?})", self.id);
        if let Some(fatal) = self.fatal(&error, &context) {
            return fatal;
        }
        for _ in 0..COMMIT_TRIES {
            match self.producer.abort_transaction(CALL_TIMEOUT) {
                Ok(()) => break,
                Err(KafkaError::Transaction(e)) if e.is_retriable() => continue,
                Err(e) => {
                    if let Some(fatal) = self.fatal(&e, "aborting a transaction") {
                        return fatal;
                    }
                    // No transaction was open (`begin_transaction` itself failed): nothing to undo.
                    break;
                }
            }
        }
        tracing::warn!(error = %error, "a transaction was aborted; its outputs and offsets go again with the next commit");
        TransportError::broker(
            format!("{context}: aborted, its outputs and offsets go again with the next commit"),
            error,
        )
    }

    fn fatal(&self, error: &KafkaError, context: &str) -> Option<TransportError> {
        let fenced = matches!(error, KafkaError::Transaction(e) if e.is_fatal())
            || error.rdkafka_error_code() == Some(RDKafkaErrorCode::ProducerFenced);
        if fenced {
            return Some(TransportError::Fatal(format!(
                "{context}: {error} (another producer registered transactional id {:?}: give every member its own id)",
                self.id
            )));
        }
        fatal::client_fatal(self.producer.client(), context).or_else(|| fatal::classify(error, context))
    }
}

/// The offsets a transaction commits, as Kafka takes them.
fn offsets_of(transaction: &Transaction) -> Result<TopicPartitionList, TransportError> {
    let mut offsets = TopicPartitionList::new();
    for commit in &transaction.commits {
        let (topic, partition) = topic_partition(&commit.source).ok_or_else(|| {
            TransportError::Fatal(format!(
                "{} is not a Kafka partition: its outputs cannot join a transaction",
                commit.source
            ))
        })?;
        offsets
            .add_partition_offset(topic, partition, rdkafka::Offset::Offset(commit.next as i64))
            .map_err(|e| TransportError::broker("building a transaction's offsets", e))?;
    }
    Ok(offsets)
}
