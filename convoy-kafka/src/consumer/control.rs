//! Pause, resume, commit and close for one member.
//!
//! A synchronous commit in librdkafka waits without bound while the group coordinator is
//! unknown; it runs on a blocking thread, and while one is still waiting no other is started
//! (the engine's timeout gives up on it, retries later, and nothing piles up).

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use convoy_core::transport::{Commit, SourceControl};
use convoy_core::{Offset, SourceId, TransportError};
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};

use super::{KafkaConsumer, Shared, Tp};
use crate::convert::topic_partition;
use crate::fatal;
use convoy_core::offset_map;

pub(super) struct KafkaControl {
    consumer: Mutex<Option<Arc<KafkaConsumer>>>,
    shared: Arc<Shared>,
    main: Mutex<Option<JoinHandle<()>>>,
    /// Set while a commit is running on a blocking thread.
    committing: Arc<AtomicBool>,
}

/// Clears the commit flag when the blocking commit returns, however it returns.
struct Committing(Arc<AtomicBool>);

impl Drop for Committing {
    fn drop(&mut self) {
        self.0.store(false, SeqCst);
    }
}

impl KafkaControl {
    pub fn new(consumer: Arc<KafkaConsumer>, shared: Arc<Shared>, main: JoinHandle<()>) -> Self {
        KafkaControl {
            consumer: Mutex::new(Some(consumer)),
            shared,
            main: Mutex::new(Some(main)),
            committing: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Each source's high watermark, asked off the runtime's threads (`None` where unknown):
    /// what both the newest offsets and the lag derive from.
    async fn high_watermarks(&self, sources: Vec<SourceId>) -> Vec<Option<Offset>> {
        let count = sources.len();
        let Ok(consumer) = self.consumer() else {
            return vec![None; count];
        };
        let timeout = self.shared.newest_offset_timeout;
        tokio::task::spawn_blocking(move || high_watermarks(&consumer, &sources, timeout))
            .await
            .unwrap_or_else(|_| vec![None; count])
    }

    fn consumer(&self) -> Result<Arc<KafkaConsumer>, TransportError> {
        self.consumer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(TransportError::Closed)
    }

    fn partitions(sources: &[SourceId]) -> Vec<Tp> {
        sources
            .iter()
            .filter_map(|s| topic_partition(s).map(|(t, p)| (t.to_owned(), p)))
            .collect()
    }

    /// The commit as librdkafka takes it, with offset maps up to `map_limit` bytes (0: none).
    fn commit_list(commits: &[Commit], map_limit: usize) -> Result<TopicPartitionList, TransportError> {
        let mut tpl = TopicPartitionList::new();
        for c in commits {
            let Some((topic, partition)) = topic_partition(&c.source) else {
                return Err(TransportError::NotOwner(c.source.clone()));
            };
            let mut e = tpl.add_partition(topic, partition);
            e.set_offset(KafkaOffset::Offset(c.next as i64))
                .map_err(|err| TransportError::broker("building the commit", err))?;
            if map_limit > 0 {
                if let Some(metadata) = offset_map::encode(c.next, &c.finished_above, map_limit) {
                    e.set_metadata(metadata);
                }
            }
        }
        Ok(tpl)
    }

    /// Leaves the group, stops every thread and drops the consumer, off the runtime.
    fn shut(&self) -> Option<std::thread::JoinHandle<()>> {
        self.shared.closing.store(true, SeqCst);
        let consumer = self.consumer.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        let main = self.main.lock().unwrap_or_else(|p| p.into_inner()).take();
        let shared = self.shared.clone();
        std::thread::Builder::new()
            .name("convoy-kafka-close".into())
            .spawn(move || {
                tracing::debug!("leaving the Kafka group");
                // Unsubscribe while the main thread still polls: it serves the revoke callback
                // and librdkafka sends LeaveGroup, so the others rebalance at once instead of
                // waiting for this member to rejoin or its session to expire.
                consumer.unsubscribe();
                let deadline = Instant::now() + Duration::from_secs(10);
                while consumer.assignment().is_ok_and(|a| a.count() > 0) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                shared.stop_partitions(&shared.pollers.partitions());
                shared.pollers.shutdown();
                shared.stopped.store(true, SeqCst);
                if let Some(main) = main {
                    let _ = main.join();
                }
                // Short-lived blocking calls (commit, watermarks) may still hold the consumer: let
                // them finish, so librdkafka's close runs here, now.
                while Arc::strong_count(&consumer) > 1 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                drop(consumer);
                tracing::debug!("Kafka consumer closed");
            })
            .ok()
    }
}

#[async_trait]
impl SourceControl for KafkaControl {
    fn pause(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.shared.set_paused(&Self::partitions(sources), true);
        Ok(())
    }

    fn resume(&self, sources: &[SourceId]) -> Result<(), TransportError> {
        self.shared.set_paused(&Self::partitions(sources), false);
        Ok(())
    }

    async fn commit(&self, commits: &[Commit]) -> Result<(), TransportError> {
        let consumer = self.consumer()?;
        let map_limit = self.shared.offset_map_max.load(SeqCst);
        let with_maps = Self::commit_list(commits, map_limit)?;
        let plain = Self::commit_list(commits, 0)?;
        if self.committing.swap(true, SeqCst) {
            return Err(TransportError::Unavailable(
                "an earlier commit is still waiting for the group coordinator".into(),
            ));
        }
        let committing = Committing(self.committing.clone());
        let shared = self.shared.clone();
        if let Some(transactions) = shared.transactions.clone() {
            let commits = commits.to_vec();
            return tokio::task::spawn_blocking(move || {
                let _committing = committing;
                transactions.commit(&consumer, &commits)
            })
            .await
            .map_err(|e| TransportError::broker("commit task", e))?;
        }
        let result = tokio::task::spawn_blocking(move || {
            let _committing = committing;
            match consumer.commit(&with_maps, CommitMode::Sync) {
                Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::OffsetMetadataTooLarge)) if map_limit > 0 => {
                    // The broker's offset.metadata.max.bytes is below ours: commit watermarks
                    // only from now on (nothing is lost; finished offsets are handled again).
                    tracing::warn!(
                        map_limit,
                        "the broker refused the offset map as too large; committing watermarks only from now on (set offset_map_max_bytes to the broker's offset.metadata.max.bytes)"
                    );
                    shared.offset_map_max.store(0, SeqCst);
                    consumer.commit(&plain, CommitMode::Sync)
                }
                other => other,
            }
        })
        .await
        .map_err(|e| TransportError::broker("commit task", e))?;
        match result {
            Ok(()) => Ok(()),
            Err(e) => Err(
                fatal::classify(&e, "committing offsets").unwrap_or_else(|| match e {
                    KafkaError::ConsumerCommit(code) => TransportError::broker(
                        "committing offsets",
                        format!("{code} (the partitions may have been rebalanced away)"),
                    ),
                    other => TransportError::broker("committing offsets", other),
                }),
            ),
        }
    }

    async fn last_offsets(&self, sources: &[SourceId]) -> Vec<Option<Offset>> {
        self.high_watermarks(sources.to_vec())
            .await
            .into_iter()
            .map(|high| high.and_then(|high| high.checked_sub(1)))
            .collect()
    }

    /// The high watermark minus the committed position: Kafka's consumer lag (0 on an empty
    /// partition, where there is no newest offset).
    async fn backlogs(&self, sources: &[(SourceId, Option<Offset>)]) -> Vec<Option<u64>> {
        let highs = self
            .high_watermarks(sources.iter().map(|(id, _)| id.clone()).collect())
            .await;
        sources
            .iter()
            .zip(highs)
            .map(|((_, committed), high)| {
                high.map(|high| high.saturating_sub(committed.map_or(0, |c| c + 1)))
            })
            .collect()
    }

    fn wants_finished_above(&self) -> bool {
        self.shared.offset_map_max.load(SeqCst) > 0
    }

    fn revoke_timeout(&self) -> Option<Duration> {
        Some(self.shared.revoke_timeout)
    }

    async fn close(&self) -> Result<(), TransportError> {
        if let Some(closer) = self.shut() {
            tokio::task::spawn_blocking(move || closer.join())
                .await
                .map_err(|e| TransportError::broker("closing the consumer", e))?
                .map_err(|_| TransportError::broker("closing the consumer", "close thread panicked"))?;
        }
        Ok(())
    }
}

/// The newest offset of each source (`None` where it is unknown or empty), in one ListOffsets
/// request per partition leader: asked one partition after another, each answer came behind the
/// fetch the broker was holding on that connection, and a member of 256 partitions refreshed its
/// lag about every two minutes.
/// Each partition's high watermark (the offset its next record gets; 0 when empty), `None`
/// where the broker did not say.
fn high_watermarks(consumer: &KafkaConsumer, sources: &[SourceId], timeout: Duration) -> Vec<Option<Offset>> {
    let mut latest = TopicPartitionList::with_capacity(sources.len());
    for (topic, partition) in sources.iter().filter_map(topic_partition) {
        // The "timestamp" END asks for the partition's high watermark.
        let _ = latest.add_partition_offset(topic, partition, KafkaOffset::End);
    }
    let answered = match consumer.offsets_for_times(latest, timeout) {
        Ok(answered) => answered,
        Err(e) => {
            tracing::debug!(error = %e, "the newest offsets could not be read; lag is not reported this time");
            return vec![None; sources.len()];
        }
    };
    sources
        .iter()
        .map(|source| {
            let (topic, partition) = topic_partition(source)?;
            let element = answered.find_partition(topic, partition)?;
            element.error().ok()?;
            match element.offset() {
                KafkaOffset::Offset(high) if high >= 0 => Some(high as Offset),
                _ => None,
            }
        })
        .collect()
}

impl Drop for KafkaControl {
    fn drop(&mut self) {
        // Dropped without close (a crash of the engine): leave without committing, in the
        // background so a runtime thread never blocks on the network.
        let _ = self.shut();
    }
}
