//! Exactly once from Kafka to Kafka: a member with a transactional id commits through a
//! transactional producer of its own.
//!
//! A transform's outputs are *staged* here per input partition and offset (the [`KafkaOutbox`])
//! instead of being sent. A commit of watermarks then runs one transaction: every staged output
//! of an offset below its partition's `next`, in partition and offset order, then the offsets
//! themselves (`send_offsets_to_transaction` with the consumer's group metadata, so a member
//! fenced by a rebalance cannot commit), then `commit_transaction`. Outputs of a message
//! finished above the watermark wait for a commit that covers it, so what a `read_committed`
//! reader sees always matches what the group committed: a crash before the commit aborts
//! both, and the next owner handles those inputs again from the committed offsets.
//!
//! Staged outputs leave only with a successful commit. An aborted transaction keeps them for the
//! next commit; an assignment drops those of offsets below its committed position (whoever
//! committed that published them). They survive a revoke: a message handled before it and
//! redelivered after it may be skipped as a duplicate by event id, and its outputs must still go
//! out with the commit that covers it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use convoy_core::transform::{Outbox, Output, OutputGuarantee};
use convoy_core::{Commit, Message, TransportError};
use rdkafka::consumer::Consumer;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::TopicPartitionList;

use super::{KafkaConsumer, Tp};
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

/// Staged outputs: per input partition, per input offset.
#[derive(Default)]
struct Staged(HashMap<Tp, BTreeMap<i64, Arc<Vec<Output>>>>);

impl Staged {
    /// The outputs of `offset` of `tp` (replacing what an earlier handling of it staged).
    fn stage(&mut self, tp: Tp, offset: i64, outputs: Vec<Output>) {
        self.0.entry(tp).or_default().insert(offset, Arc::new(outputs));
    }

    /// What is staged below each partition's `next`, in partition and offset order.
    fn below(&self, covered: &[(Tp, i64)]) -> Vec<Arc<Vec<Output>>> {
        covered
            .iter()
            .filter_map(|(tp, next)| self.0.get(tp).map(|s| s.range(..*next)))
            .flatten()
            .map(|(_, outputs)| outputs.clone())
            .collect()
    }

    /// Drops what is staged for `tp` below `next`.
    fn prune(&mut self, tp: &Tp, next: i64) {
        if let Some(offsets) = self.0.get_mut(tp) {
            *offsets = offsets.split_off(&next);
            if offsets.is_empty() {
                self.0.remove(tp);
            }
        }
    }
}

/// The member's transactional producer and the outputs waiting for a commit.
pub(crate) struct Transactions {
    producer: FutureProducer,
    id: String,
    staged: Mutex<Staged>,
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
            staged: Mutex::new(Staged::default()),
        })
    }

    fn staged(&self) -> std::sync::MutexGuard<'_, Staged> {
        self.staged.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops what is staged for `tp` below `next`: the group committed it (with its outputs).
    pub fn prune(&self, tp: &Tp, next: i64) {
        self.staged().prune(tp, next);
    }

    /// Commits `offsets` (the watermarks of `commits`) with the outputs staged below them, in
    /// one transaction. Blocking. On an error the transaction is aborted and the outputs stay
    /// staged for the next commit; a fatal error (fenced by a newer producer with this id, not
    /// authorized) ends the engine.
    pub fn commit(
        &self,
        consumer: &KafkaConsumer,
        offsets: &TopicPartitionList,
        commits: &[Commit],
    ) -> Result<(), TransportError> {
        let covered: Vec<(Tp, i64)> = commits
            .iter()
            .filter_map(|c| {
                let (topic, partition) = topic_partition(&c.source)?;
                Some(((topic.to_owned(), partition), c.next as i64))
            })
            .collect();
        let outputs = self.staged().below(&covered);
        let group = consumer
            .group_metadata()
            .ok_or_else(|| TransportError::Unavailable("the consumer has not joined its group yet".into()))?;
        match self.run(&outputs, offsets, &group) {
            Ok(()) => {
                for (tp, next) in &covered {
                    self.prune(tp, *next);
                }
                Ok(())
            }
            Err(e) => Err(self.abort(e)),
        }
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

/// The outbox of a member with a transactional id: stages outputs for the commit that covers
/// their input.
pub(crate) struct KafkaOutbox(pub Arc<Transactions>);

#[async_trait]
impl Outbox for KafkaOutbox {
    async fn put(&self, input: &Message, mut outputs: Vec<Output>) -> Result<(), TransportError> {
        let Some((topic, partition)) = topic_partition(&input.source) else {
            return Err(TransportError::Fatal(format!(
                "{} is not a Kafka partition: its outputs cannot join a transaction",
                input.source
            )));
        };
        for output in &mut outputs {
            output.message.stamp();
        }
        self.0
            .staged()
            .stage((topic.to_owned(), partition), input.offset as i64, outputs);
        Ok(())
    }

    fn guarantee(&self) -> OutputGuarantee {
        OutputGuarantee::ExactlyOnce
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> Tp {
        ("in".to_owned(), p)
    }

    fn outputs(payload: &str) -> Vec<Output> {
        vec![Output::keyed("out", "k", payload.to_owned())]
    }

    fn payloads(staged: &[Arc<Vec<Output>>]) -> Vec<String> {
        staged
            .iter()
            .flat_map(|o| o.iter())
            .map(|o| String::from_utf8_lossy(&o.message.payload).into_owned())
            .collect()
    }

    #[test]
    fn a_commit_takes_what_is_below_each_watermark_in_offset_order() {
        let mut staged = Staged::default();
        // Finished out of order, as lanes finish.
        for (p, offset) in [(0, 5), (0, 2), (1, 7), (0, 9), (1, 3)] {
            staged.stage(tp(p), offset, outputs(&format!("{p}@{offset}")));
        }
        // Partition 0 committed up to 6 (9 is finished above the watermark), 1 up to 8.
        let covered = [(tp(0), 6), (tp(1), 8)];
        assert_eq!(payloads(&staged.below(&covered)), ["0@2", "0@5", "1@3", "1@7"]);
        for (tp, next) in &covered {
            staged.prune(tp, *next);
        }
        assert_eq!(payloads(&staged.below(&[(tp(0), 100), (tp(1), 100)])), ["0@9"]);
    }

    #[test]
    fn handling_an_offset_again_replaces_its_outputs() {
        let mut staged = Staged::default();
        staged.stage(tp(0), 4, outputs("first"));
        staged.stage(tp(0), 4, outputs("again"));
        assert_eq!(payloads(&staged.below(&[(tp(0), 5)])), ["again"]);
    }

    #[test]
    fn an_assignment_drops_what_its_committed_position_covers() {
        let mut staged = Staged::default();
        staged.stage(tp(2), 10, outputs("committed by another member"));
        staged.stage(tp(2), 30, outputs("not yet"));
        staged.prune(&tp(2), 20);
        assert_eq!(payloads(&staged.below(&[(tp(2), 31)])), ["not yet"]);
        staged.prune(&tp(2), 31);
        assert!(staged.0.is_empty(), "an emptied partition leaves no entry");
    }
}
