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

/// What finishing a message changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Nothing (a sequence number finished before, never received, or truncated away).
    Nothing,
    /// The message finished above an unfinished one: the finished set grew, the watermark
    /// stayed.
    Above,
    /// The watermark moved.
    Watermark,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Unfinished,
    Finished,
    /// Received, then truncated away by a position reset: never counts for the watermark.
    Gone,
}

/// Tracks received and finished offsets of one source and yields the watermark.
#[derive(Clone, Debug, Default)]
pub struct WatermarkTracker {
    /// Offsets from the lowest unfinished one to the newest received, with their state.
    window: VecDeque<(Offset, Entry)>,
    /// Sequence number of `window[0]`.
    head_seq: Seq,
    /// Entries of `window` that are finished (all above the watermark): every commit asks for
    /// them, and most often there are none.
    finished: usize,
    watermark: Option<Offset>,
    last_received: Option<Offset>,
}

impl WatermarkTracker {
    /// A tracker starting after `committed` (the transport's committed watermark, if any).
    pub fn new(committed: Option<Offset>) -> Self {
        WatermarkTracker {
            window: VecDeque::new(),
            head_seq: 0,
            finished: 0,
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
        self.window.push_back((offset, Entry::Unfinished));
        Ok(seq)
    }

    /// Marks a received message finished.
    /// Finishing a sequence number twice, one never received, or one truncated away changes
    /// nothing.
    pub fn finish(&mut self, seq: Seq) -> Progress {
        let Some(index) = seq.checked_sub(self.head_seq) else {
            return Progress::Nothing;
        };
        match self.window.get_mut(index as usize) {
            Some(entry) if entry.1 == Entry::Unfinished => entry.1 = Entry::Finished,
            _ => return Progress::Nothing,
        }
        self.finished += 1;
        if self.advance() {
            Progress::Watermark
        } else {
            Progress::Above
        }
    }

    /// Pops the finished (or truncated) prefix; true when the watermark moved.
    fn advance(&mut self) -> bool {
        let mut moved = false;
        while let Some(&(offset, state)) = self.window.front() {
            match state {
                Entry::Unfinished => break,
                Entry::Finished => {
                    self.watermark = Some(offset);
                    self.finished -= 1;
                    moved = true;
                }
                Entry::Gone => {}
            }
            self.window.pop_front();
            self.head_seq += 1;
        }
        moved
    }

    /// A position reset: the source's log was truncated at `offset` and is delivered again
    /// from there (Kafka after an unclean leader election). Offsets received at or above it are
    /// forgotten (their completions change nothing), the watermark moves back below it if it
    /// had passed it, and `offset` may be received again. Returns the sequence number of the
    /// first forgotten message, if any was (later ones are forgotten too).
    pub fn truncate(&mut self, offset: Offset) -> Option<Seq> {
        let mut first_gone = None;
        for (index, entry) in self.window.iter_mut().enumerate() {
            if entry.0 >= offset {
                first_gone.get_or_insert(self.head_seq + index as Seq);
                if entry.1 == Entry::Finished {
                    self.finished -= 1;
                }
                entry.1 = Entry::Gone;
            }
        }
        let below = offset.checked_sub(1);
        if self.watermark.is_some_and(|w| w >= offset) {
            self.watermark = below;
        }
        self.last_received = below;
        self.advance();
        first_gone
    }

    /// The highest offset W with every received offset ≤ W finished (or the initial
    /// committed position); `None` before anything finished.
    pub fn watermark(&self) -> Option<Offset> {
        self.watermark
    }

    /// The position to commit: every offset below it is finished. The watermark plus one; before
    /// anything finished, the lowest offset received (nothing below it was ever delivered).
    pub fn next(&self) -> Option<Offset> {
        match self.watermark {
            Some(w) => Some(w + 1),
            None => self.window.front().map(|&(offset, _)| offset),
        }
    }

    /// The lowest unfinished message: its sequence number and offset.
    pub fn lowest_unfinished(&self) -> Option<(Seq, Offset)> {
        self.window
            .iter()
            .position(|(_, state)| *state == Entry::Unfinished)
            .map(|i| (self.head_seq + i as Seq, self.window[i].0))
    }

    /// Offsets above the watermark that are already finished (for commit metadata).
    pub fn finished_above(&self) -> Vec<Offset> {
        let mut above = Vec::with_capacity(self.finished);
        if self.finished > 0 {
            above.extend(
                self.window
                    .iter()
                    .filter(|(_, state)| *state == Entry::Finished)
                    .map(|(offset, _)| *offset),
            );
        }
        debug_assert_eq!(above.len(), self.finished);
        above
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
        assert_eq!(t.finish(s104), Progress::Above);
        assert_eq!(
            t.watermark(),
            None,
            "104 done but 100 still running: commit nothing"
        );
        assert_eq!(
            t.next(),
            Some(100),
            "below the first offset received nothing is ours"
        );
        assert_eq!(t.finish(s100), Progress::Watermark);
        assert_eq!(t.watermark(), Some(100));
        assert_eq!(t.next(), Some(101));
        assert_eq!(t.finished_above(), vec![104]);
        assert_eq!(t.finish(s102), Progress::Watermark);
        assert_eq!(t.watermark(), Some(104));
        assert_eq!(t.window_len(), 0);
    }

    #[test]
    fn starts_from_the_committed_position_and_rejects_going_back() {
        let mut t = WatermarkTracker::new(Some(41));
        assert_eq!(t.watermark(), Some(41));
        assert_eq!(t.receive(41), Err(OutOfOrder { offset: 41, last: 41 }));
        let s = t.receive(42).unwrap();
        assert_eq!(
            t.finish(s + 1),
            Progress::Nothing,
            "unknown sequence numbers are ignored"
        );
        assert_eq!(t.finish(s), Progress::Watermark);
        assert_eq!(t.finish(s), Progress::Nothing, "finishing twice changes nothing");
        assert_eq!(t.watermark(), Some(42));
    }

    #[test]
    fn a_truncated_log_is_received_again_and_the_watermark_moves_back() {
        let mut t = WatermarkTracker::new(Some(99));
        let seqs: Vec<Seq> = (100..110).map(|o| t.receive(o).unwrap()).collect();
        for &s in &seqs[..8] {
            t.finish(s);
        }
        assert_eq!(t.watermark(), Some(107));
        // The log was truncated at 105 and rewritten: 105.. are new messages. 105..107 had
        // finished and left the window; 108 and 109 are forgotten.
        assert_eq!(t.truncate(105), Some(seqs[8]));
        assert_eq!(t.watermark(), Some(104), "the rewritten offsets are not finished");
        assert_eq!(
            t.finish(seqs[9]),
            Progress::Nothing,
            "a forgotten message finishing changes nothing"
        );
        let again: Vec<Seq> = (105..108).map(|o| t.receive(o).unwrap()).collect();
        assert!(again[0] > seqs[9], "sequence numbers are never reused");
        assert_eq!(t.finish(again[1]), Progress::Above);
        assert_eq!(t.finished_above(), vec![106]);
        assert_eq!(t.finish(again[0]), Progress::Watermark);
        assert_eq!(t.watermark(), Some(106));
        assert_eq!(t.lowest_unfinished(), Some((again[2], 107)));
    }

    #[test]
    fn truncation_below_an_unfinished_head_keeps_the_head() {
        let mut t = WatermarkTracker::new(None);
        let a = t.receive(0).unwrap();
        let b = t.receive(1).unwrap();
        t.receive(2).unwrap();
        t.finish(b);
        assert_eq!(t.truncate(2), Some(2));
        assert_eq!(t.lowest_unfinished(), Some((a, 0)));
        assert_eq!(t.finish(a), Progress::Watermark);
        assert_eq!(t.watermark(), Some(1));
        assert_eq!(
            t.window_len(),
            0,
            "the forgotten tail is dropped with the finished prefix"
        );
        assert!(t.receive(2).is_ok());
    }

    #[test]
    fn a_finished_offset_truncated_away_is_no_longer_reported_above() {
        let mut t = WatermarkTracker::new(None);
        t.receive(0).unwrap();
        t.receive(1).unwrap();
        let c = t.receive(2).unwrap();
        assert_eq!(t.finish(c), Progress::Above);
        assert_eq!(t.finished_above(), vec![2]);
        t.truncate(1);
        assert!(t.finished_above().is_empty());
        let again = t.receive(1).unwrap();
        assert_eq!(t.finish(again), Progress::Above);
        assert_eq!(t.finished_above(), vec![1]);
    }

    proptest! {
        /// Random offsets (with gaps) finished in a random order: the watermark never passes
        /// an unfinished offset, always equals the end of the finished prefix, and reaches the
        /// last offset once all finish; the finished offsets above it are exactly those.
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
                prop_assert_ne!(t.finish(seqs[i]), Progress::Nothing);
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
                let above: Vec<Offset> = (prefix..offsets.len())
                    .filter(|&j| finished[j])
                    .map(|j| offsets[j])
                    .collect();
                prop_assert_eq!(t.finished_above(), above);
            }
            prop_assert_eq!(t.watermark(), offsets.last().copied());
            prop_assert!(t.finished_above().is_empty());
        }
    }
}
