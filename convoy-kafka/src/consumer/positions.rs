//! Committed positions the partition no longer holds, found when it is assigned.
//!
//! - **Below the first offset kept**: retention (or `DeleteRecords`) removed messages before
//!   the group consumed them. They are gone from the broker, so reading resumes at the first
//!   offset kept; the hole is said loudly (an error naming the partition and how many messages
//!   it lost) and counted (`convoy_source_holes_total{reason="deleted"}`), never passed over
//!   in silence by `auto.offset.reset`.
//! - **Past the end**: the partition's log was truncated under the group (an unclean leader
//!   election), or the topic was created again on a broker that kept the group's offsets (Apache
//!   Kafka deletes them with the topic). The position means nothing there: kept, it would pass
//!   over the partition's first messages as if finished. The assignment starts without it, from
//!   the beginning, and that is said and counted too (`reason="past_end"`).
//!
//! One `ListOffsets` round trip per end for the whole assignment (`offsets_for_times` with the
//! earliest and latest markers), only for partitions with a committed position.

use std::collections::HashMap;

use convoy_core::metrics::{source_hole, HoleReason};
use rdkafka::consumer::Consumer;
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};

use super::{KafkaConsumer, Tp, BROKER_TIMEOUT};
use crate::convert::source_id;

/// Where an assigned partition's reading starts, when its committed position is not held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Restart {
    /// At this first offset kept: the messages between the committed position and it are gone.
    At(i64),
    /// From the beginning, without the committed position (it is past the partition's end).
    FromBeginning,
}

/// Compares each committed position of `committed` with the partition's first and end offsets,
/// reports what does not fit, and returns where those partitions' reading starts instead.
/// A failed query is a warning and leaves every position as it is.
pub(super) fn check(
    consumer: &KafkaConsumer,
    committed: &TopicPartitionList,
    group: &str,
) -> HashMap<Tp, Restart> {
    let positions: Vec<(Tp, i64)> = committed
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            KafkaOffset::Offset(next) if next >= 0 => Some(((e.topic().to_owned(), e.partition()), next)),
            _ => None,
        })
        .collect();
    if positions.is_empty() {
        return HashMap::new();
    }
    let (Some(first), Some(end)) = (
        query(consumer, &positions, KafkaOffset::Beginning),
        query(consumer, &positions, KafkaOffset::End),
    ) else {
        return HashMap::new();
    };
    let mut restarts = HashMap::new();
    for (tp, next) in positions {
        let (Some(&first), Some(&end)) = (first.get(&tp), end.get(&tp)) else {
            continue;
        };
        let source = source_id(&tp.0, tp.1);
        if let Some(restart) = judge(next, first, end) {
            match restart {
                Restart::At(first) => {
                    tracing::error!(
                        %source, committed = next, first_kept = first, lost = first - next,
                        "messages {next}..{first} of {source} were deleted (retention or delete-records) before this group consumed them: {} lost; reading resumes at {first}",
                        first - next
                    );
                    source_hole(group, &source, HoleReason::Deleted);
                }
                Restart::FromBeginning => {
                    tracing::error!(
                        %source, committed = next, end,
                        "the committed position {next} of {source} is past its end {end}: its log was truncated, or the topic created again while the group's offsets were kept; reading it from the beginning, so none of its messages is passed over"
                    );
                    source_hole(group, &source, HoleReason::PastEnd);
                }
            }
            restarts.insert(tp, restart);
        }
    }
    restarts
}

/// What a committed position `next` means in a partition holding offsets `first..end`.
fn judge(next: i64, first: i64, end: i64) -> Option<Restart> {
    if next > end {
        Some(Restart::FromBeginning)
    } else if next < first {
        Some(Restart::At(first))
    } else {
        None
    }
}

/// The first (`Beginning`) or end (`End`) offset of each partition, in one request per leader.
fn query(consumer: &KafkaConsumer, positions: &[(Tp, i64)], which: KafkaOffset) -> Option<HashMap<Tp, i64>> {
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), _) in positions {
        // `offsets_for_times` reads each element's offset as the timestamp to look up; the
        // earliest and latest markers ask for the first and the end offset.
        if let Err(e) = tpl.add_partition_offset(topic, *partition, which) {
            tracing::warn!(error = %e, "checking the committed positions against the partitions' offsets");
            return None;
        }
    }
    match consumer.offsets_for_times(tpl, BROKER_TIMEOUT) {
        Ok(found) => Some(
            found
                .elements()
                .iter()
                .filter_map(|e| match e.offset() {
                    KafkaOffset::Offset(o) if e.error().is_ok() => {
                        Some(((e.topic().to_owned(), e.partition()), o))
                    }
                    _ => None,
                })
                .collect(),
        ),
        Err(e) => {
            tracing::warn!(error = %e, "reading the partitions' first and end offsets failed; committed positions not checked");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_inside_the_partition_or_at_its_end_is_kept() {
        assert_eq!(judge(5, 0, 10), None);
        assert_eq!(judge(10, 0, 10), None);
        assert_eq!(judge(3, 3, 3), None);
    }

    #[test]
    fn a_position_below_the_first_offset_resumes_there_and_one_past_the_end_restarts() {
        assert_eq!(judge(2, 6, 10), Some(Restart::At(6)));
        assert_eq!(judge(5000, 0, 3), Some(Restart::FromBeginning));
    }
}
