//! The rebalance callback: convoy's side of every assignment change.
//!
//! Assign: split each partition's queue off (before librdkafka fetches, so nothing reaches the
//! main queue), read committed offsets and their offset maps, tell the engine, hand the queues
//! to the pollers. Revoke: take the queues from the pollers (no message of the assignment follows),
//! send `Revoked` with its deadline and block until the engine acknowledges — drained, cancelled
//! what still ran, committed — or the deadline passes. Lost: tell the engine, commit nothing.

use std::collections::HashMap;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use convoy_core::transport::{Assignment, RevokeAck, SourceEvent};
use convoy_core::{Offset, SourceId};
use rdkafka::consumer::{Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset as KafkaOffset, TopicPartitionList};

use super::growth;
use super::positions::{self, Restart};
use super::{KafkaConsumer, PartitionQueue, Shared, Tp, BROKER_TIMEOUT};
use crate::convert::source_id;
use convoy_core::offset_map;

/// The librdkafka context: runs convoy's side of every rebalance.
pub struct ConvoyContext {
    pub(super) shared: Arc<Shared>,
}

impl ClientContext for ConvoyContext {}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<Tp> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

fn sources_of(parts: &[Tp]) -> Vec<SourceId> {
    parts.iter().map(|(t, p)| source_id(t, *p)).collect()
}

impl ConvoyContext {
    /// Tells the engine of the assignment; returns the partitions' queues, and where reading
    /// starts instead of the committed position for the partitions that no longer hold it.
    fn on_assign(
        &self,
        consumer: &KafkaConsumer,
        tpl: &TopicPartitionList,
    ) -> (Vec<(Tp, PartitionQueue)>, HashMap<Tp, Restart>) {
        let shared = &self.shared;
        let parts = partitions_of(tpl);
        // A new assignment starts unpaused; the engine re-applies its back-pressure state.
        shared.set_paused(&parts, false);
        let Some(owner) = shared.consumer.get().and_then(Weak::upgrade) else {
            return Default::default();
        };
        // Split before librdkafka starts fetching, so no message of these partitions reaches
        // the main queue.
        let queues: Vec<_> = parts
            .iter()
            .filter_map(|(t, p)| owner.split_partition_queue(t, *p).map(|q| ((t.clone(), *p), q)))
            .collect();
        if queues.len() != parts.len() {
            tracing::error!(
                ?parts,
                "could not split every assigned partition into its own queue"
            );
        }
        let committed = match committed_offsets(consumer, tpl, shared.transactions.is_some()) {
            Ok(c) => c,
            Err(e) if shared.transactions.is_some() => {
                // Staged outputs are pruned by the committed offsets: a transactional member never
                // starts an assignment without them (it would commit outputs another member
                // committed already, or of inputs it dead-letters).
                let error = convoy_core::TransportError::broker(
                    "reading the committed offsets of a transactional member's new assignment",
                    e,
                );
                shared.control(SourceEvent::Failed(error));
                return Default::default();
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading committed offsets failed; starting the tracker without them");
                tpl.clone()
            }
        };
        growth::check(consumer, shared);
        let restarts = positions::check(consumer, &committed, &shared.group);
        let assignments = committed
            .elements()
            .iter()
            .map(|e| {
                let source = source_id(e.topic(), e.partition());
                let restart = restarts.get(&(e.topic().to_owned(), e.partition()));
                match e.offset() {
                    KafkaOffset::Offset(next) if next >= 0 && restart != Some(&Restart::FromBeginning) => {
                        let next = next as Offset;
                        if let Some(transactions) = &shared.transactions {
                            transactions.outbox.assigned(&source, Some(next));
                        }
                        Assignment {
                            finished_above: offset_map::decode(next, e.metadata()),
                            ..Assignment::new(source, next.checked_sub(1))
                        }
                    }
                    _ => {
                        if let Some(transactions) = &shared.transactions {
                            transactions.outbox.assigned(&source, None);
                        }
                        Assignment::new(source, None)
                    }
                }
            })
            .collect();
        shared.control(SourceEvent::Assigned(assignments));
        (queues, restarts)
    }

    fn start_partitions(&self, queues: Vec<(Tp, PartitionQueue)>) {
        for (tp, queue) in queues {
            self.shared.pollers.add(tp, queue, &self.shared);
        }
    }

    fn on_revoke(&self, consumer: &KafkaConsumer, tpl: &TopicPartitionList) {
        let shared = &self.shared;
        let parts = partitions_of(tpl);
        // No message of this assignment may reach the engine after the revoke event.
        shared.stop_partitions(&parts);
        if shared.closing.load(SeqCst) {
            return; // the engine committed before closing
        }
        let sources = sources_of(&parts);
        if consumer.assignment_lost() {
            tracing::warn!(?sources, "assignment lost (session expired); not committing");
            if let Some(transactions) = &shared.transactions {
                transactions.outbox.released(&sources);
            }
            shared.control(SourceEvent::Lost(sources));
            return;
        }
        let deadline = Instant::now() + shared.revoke_timeout;
        let (ack, mut done) = RevokeAck::new();
        // Whatever the engine's final commit did not take goes with the partitions.
        let _release = shared
            .transactions
            .as_ref()
            .map(|t| Release(&t.outbox, sources.clone()));
        let event = SourceEvent::Revoked {
            sources,
            deadline: tokio::time::Instant::from_std(deadline),
            ack,
        };
        if !shared.control(event) {
            return;
        }
        // Block librdkafka's rebalance until the engine drained and committed, or the deadline
        // (by which the engine has cancelled whatever of these partitions still ran).
        let acknowledged = loop {
            match done.try_recv() {
                Ok(()) => break true,
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => break false,
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {
                    // Closing means the engine already made its final commit and is waiting for
                    // this thread to finish: the revoke needs nothing more from it.
                    if shared.closing.load(SeqCst) {
                        break true;
                    }
                    if Instant::now() >= deadline {
                        break false;
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        };
        if !acknowledged {
            tracing::error!(
                timeout = ?shared.revoke_timeout,
                "the engine did not acknowledge the revoke by its deadline; releasing the partitions (the engine cancels their work by then)"
            );
        }
    }
}

/// Releases a revoke's partitions from the transactional outbox once the revoke is over
/// (acknowledged or not).
struct Release<'a>(&'a convoy_core::transform::StagingOutbox, Vec<SourceId>);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.released(&self.1);
    }
}

/// The committed offsets of `tpl`; a transactional member tries a few times before giving up.
fn committed_offsets(
    consumer: &KafkaConsumer,
    tpl: &TopicPartitionList,
    transactional: bool,
) -> rdkafka::error::KafkaResult<TopicPartitionList> {
    let tries = if transactional { 5 } else { 1 };
    let mut last = None;
    for attempt in 0..tries {
        match consumer.committed_offsets(tpl.clone(), BROKER_TIMEOUT) {
            Ok(c) => return Ok(c),
            Err(e) => {
                tracing::warn!(error = %e, attempt, "reading the committed offsets of a new assignment failed");
                last = Some(e);
                if attempt + 1 < tries {
                    std::thread::sleep(Duration::from_millis(200 << attempt));
                }
            }
        }
    }
    Err(last.unwrap_or(rdkafka::error::KafkaError::NoMessageReceived))
}

impl ConsumerContext for ConvoyContext {
    fn rebalance(&self, consumer: &KafkaConsumer, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        let cooperative = matches!(consumer.rebalance_protocol(), RebalanceProtocol::Cooperative);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let (queues, restarts) = self.on_assign(consumer, tpl);
                for ((topic, partition), restart) in restarts {
                    let start = match restart {
                        Restart::At(first) => KafkaOffset::Offset(first),
                        Restart::FromBeginning => KafkaOffset::Beginning,
                    };
                    if let Err(e) = tpl.set_partition_offset(&topic, partition, start) {
                        tracing::error!(error = %e, topic, partition, "setting where a partition's reading starts");
                    }
                }
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = assigned {
                    tracing::error!(error = %e, "assigning partitions failed");
                }
                // librdkafka keeps a paused flag across reassignment: start unpaused, the engine
                // re-applies its own back-pressure state after every assignment.
                if let Err(e) = consumer.resume(tpl) {
                    tracing::debug!(error = %e, "resuming newly assigned partitions");
                }
                self.start_partitions(queues);
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                self.on_revoke(consumer, tpl);
                let released = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = released {
                    tracing::error!(error = %e, "releasing partitions failed");
                }
            }
            other => {
                tracing::error!(error = ?other, "rebalance error; dropping the assignment");
                let all = partitions_of(tpl);
                self.shared.stop_partitions(&all);
                self.shared.control(SourceEvent::Lost(sources_of(&all)));
                // Under an incremental protocol (cooperative-sticky, KIP-848) a plain unassign
                // is refused.
                let released = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = released {
                    tracing::error!(error = %e, "unassigning after a rebalance error failed");
                }
            }
        }
    }
}
