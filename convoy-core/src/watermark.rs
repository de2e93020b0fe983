//! The contiguous watermark of one source.
//!
//! Offsets are recorded in the order they were received and marked finished in any order;
//! the watermark advances only over a finished prefix, so a commit never passes an
//! unfinished message. Offsets need not be consecutive (Kafka skips offsets for transaction
//! markers and compaction): contiguity is over the offsets *received*.
//!
//! Each received offset gets a sequence number (its index in receive order). Finishing by
//! sequence number is O(1), advancing is O(1) amortised, and memory is the window between
//! the watermark and the newest received offset — which back-pressure bounds.

use std::collections::VecDeque;

use crate::message::Offset;

/// A received message's index in its source's receive order (dense, unlike offsets).
pub type Seq = u64;

/// An offset that cannot be tracked because it does not come after the last one received.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("offset {offset} is not after the last received offset {last}")]
pub struct OutOfOrder {
    /// The offset offered.
    pub offset: Offset,
    /// The last offset received.
    pub last: Offset,
}

/// Tracks received and finished offsets of one source and yields the watermark.
#[derive(Clone, Debug, Default)]
pub struct WatermarkTracker {
    /// Offsets from the lowest unfinished one to the newest received, with a finished flag.
    window: VecDeque<(Offset, bool)>,
    /// Sequence number of `window[0]`.
    head_seq: Seq,
    watermark: Option<Offset>,
    last_received: Option<Offset>,
}

impl WatermarkTracker {
    /// A tracker starting after `committed` (the transport's committed watermark, if any).
    pub fn new(committed: Option<Offset>) -> Self {
        WatermarkTracker {
            window: VecDeque::new(),
            head_seq: 0,
            watermark: committed,
            last_received: committed,
        }
    }

    /// Records a received offset; offsets must increase.
    pub fn receive(&mut self, offset: Offset) -> Result<Seq, OutOfOrder> {
        if let Some(last) = self.last_received {
            if offset <= last {
                return Err(OutOfOrder { offset, last });
            }
        }
        self.last_received = Some(offset);
        let seq = self.head_seq + self.window.len() as Seq;
        self.window.push_back((offset, false));
        Ok(seq)
    }

    /// Marks a received message finished. Returns true when the watermark moved.
    /// Finishing a sequence number twice, or one never received, changes nothing.
    pub fn finish(&mut self, seq: Seq) -> bool {
        let Some(index) = seq.checked_sub(self.head_seq) else {
            return false;
        };
        match self.window.get_mut(index as usize) {
            Some(entry) => entry.1 = true,
            None => return false,
        }
        let mut moved = false;
        while let Some(&(offset, true)) = self.window.front() {
            self.window.pop_front();
            self.head_seq += 1;
            self.watermark = Some(offset);
            moved = true;
        }
        moved
    }

    /// The highest offset W with every received offset ≤ W finished (or the initial
    /// committed position); `None` before anything finished.
    pub fn watermark(&self) -> Option<Offset> {
        self.watermark
    }

    /// The lowest unfinished message: its sequence number and offset.
    pub fn lowest_unfinished(&self) -> Option<(Seq, Offset)> {
        self.window.front().map(|&(offset, _)| (self.head_seq, offset))
    }

    /// Offsets above the watermark that are already finished (for commit metadata).
    pub fn finished_above(&self) -> Vec<Offset> {
        self.window
            .iter()
            .filter(|(_, done)| *done)
            .map(|(offset, _)| *offset)
            .collect()
    }

    /// Messages received and not yet below the watermark.
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    /// The newest offset received.
    pub fn last_received(&self) -> Option<Offset> {
        self.last_received
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn advances_only_over_a_finished_prefix() {
        let mut t = WatermarkTracker::new(None);
        let s100 = t.receive(100).unwrap();
        let s102 = t.receive(102).unwrap(); // 101 was a transaction marker: never received
        let s104 = t.receive(104).unwrap();
        assert!(!t.finish(s104));
        assert_eq!(
            t.watermark(),
            None,
            "104 done but 100 still running: commit nothing"
        );
        assert!(t.finish(s100));
        assert_eq!(t.watermark(), Some(100));
        assert_eq!(t.finished_above(), vec![104]);
        assert!(t.finish(s102));
        assert_eq!(t.watermark(), Some(104));
        assert_eq!(t.window_len(), 0);
    }

    #[test]
    fn starts_from_the_committed_position_and_rejects_going_back() {
        let mut t = WatermarkTracker::new(Some(41));
        assert_eq!(t.watermark(), Some(41));
        assert_eq!(t.receive(41), Err(OutOfOrder { offset: 41, last: 41 }));
        let s = t.receive(42).unwrap();
        assert!(!t.finish(s + 1), "unknown sequence numbers are ignored");
        assert!(t.finish(s));
        assert!(!t.finish(s), "finishing twice changes nothing");
        assert_eq!(t.watermark(), Some(42));
    }

    proptest! {
        /// Random offsets (with gaps) finished in a random order: the watermark never passes
        /// an unfinished offset, always equals the end of the finished prefix, and reaches the
        /// last offset once all finish.
        #[test]
        fn watermark_never_passes_an_unfinished_offset(
            gaps in proptest::collection::vec(1u64..4, 1..300),
            order_seed in any::<u64>(),
            start in proptest::option::of(0u64..1000),
        ) {
            let mut t = WatermarkTracker::new(start);
            let mut offset = start.unwrap_or(0);
            let mut offsets = Vec::new();
            for g in gaps {
                offset += g;
                offsets.push(offset);
            }
            let seqs: Vec<Seq> = offsets.iter().map(|&o| t.receive(o).unwrap()).collect();
            let mut order: Vec<usize> = (0..offsets.len()).collect();
            fastrand::Rng::with_seed(order_seed).shuffle(&mut order);
            let mut finished = vec![false; offsets.len()];
            for i in order {
                t.finish(seqs[i]);
                finished[i] = true;
                let prefix = finished.iter().take_while(|f| **f).count();
                let expected = if prefix == 0 { start } else { Some(offsets[prefix - 1]) };
                prop_assert_eq!(t.watermark(), expected);
                if let Some(w) = t.watermark() {
                    for (j, o) in offsets.iter().enumerate() {
                        if *o <= w { prop_assert!(finished[j], "watermark {} passed unfinished {}", w, o); }
                    }
                }
                prop_assert_eq!(t.window_len(), offsets.len() - prefix);
            }
            prop_assert_eq!(t.watermark(), offsets.last().copied());
        }
    }
}
