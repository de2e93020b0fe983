//! Ids derived from a position — (source, offset) — held per source: a bitmap of its newest
//! offsets and, below it, the runs of finished offsets.
//!
//! A log broker's messages rarely carry an id of their own, so most ids are positions. Kept
//! one by one in a table, each id recorded costs random probes into memory that stays cold
//! (the table holds the newest 100,000), and the oldest id's eviction a third. Per source they
//! are dense instead: the offsets finished lately are a few words of a bitmap, and everything
//! older is a handful of runs (one run for an offset range finished without a gap).

use std::collections::VecDeque;

use hashbrown::HashTable;

use crate::message::{Offset, SourceId};

/// Offsets a source's bitmap covers: the newest offset recorded and the `WINDOW - 1` below it
/// (rounded to whole words). Messages of one source still in flight span far less.
const WINDOW: u64 = 16 * 1024;
const WORDS: usize = (WINDOW / 64) as usize;
/// Runs of finished offsets kept below a source's bitmap; past this the oldest are forgotten.
pub(super) const RUNS: usize = 1024;

/// The finished offsets of one source.
pub(super) struct Finished {
    /// The first offset the bitmap covers (a multiple of 64).
    base: u64,
    /// Offset `o` in `[base, base + WINDOW)` is bit `o % 64` of word `(o / 64) % WORDS`.
    words: Box<[u64]>,
    /// Finished offsets below `base`: sorted, disjoint, half-open runs `(start, end)`.
    below: VecDeque<(Offset, Offset)>,
}

impl Finished {
    /// Offsets of a source whose first finished offset is `first`.
    fn starting_at(first: Offset) -> Self {
        Finished {
            base: first - first % 64,
            words: vec![0; WORDS].into_boxed_slice(),
            below: VecDeque::new(),
        }
    }

    pub(super) fn contains(&self, offset: Offset) -> bool {
        if offset >= self.base {
            return offset - self.base < WINDOW && self.words[word(offset)] & bit(offset) != 0;
        }
        let i = self.below.partition_point(|&(_, end)| end <= offset);
        self.below.get(i).is_some_and(|&(start, _)| start <= offset)
    }

    pub(super) fn insert(&mut self, offset: Offset) {
        if offset < self.base {
            return self.insert_below(offset);
        }
        if offset - self.base >= WINDOW {
            self.slide_to(offset);
        }
        self.words[word(offset)] |= bit(offset);
    }

    /// Moves the bitmap up until it covers `offset`, turning the words it leaves into runs.
    fn slide_to(&mut self, offset: Offset) {
        // The lowest word-aligned base whose window holds `offset` (no overflow: offset ≥ WINDOW).
        let base = offset / 64 * 64 - (WINDOW - 64);
        let leaving = ((base - self.base) / 64).min(WORDS as u64);
        for _ in 0..leaving {
            let at = word(self.base);
            let bits = std::mem::take(&mut self.words[at]);
            self.push_runs(bits, self.base);
            self.base += 64;
        }
        self.base = base;
    }

    /// Appends the runs of set bits of `bits` (offsets from `from`): they lie above every run.
    fn push_runs(&mut self, mut bits: u64, from: Offset) {
        let mut at = 0;
        while bits != 0 {
            let zeros = bits.trailing_zeros();
            bits >>= zeros;
            at += zeros;
            let ones = bits.trailing_ones();
            bits = bits.checked_shr(ones).unwrap_or(0);
            let start = from + u64::from(at);
            let end = start + u64::from(ones);
            at += ones;
            match self.below.back_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => self.below.push_back((start, end)),
            }
        }
        self.forget_oldest_runs();
    }

    /// An offset finished after the bitmap moved past it (a message held far behind its
    /// source, or a source read again from an earlier position).
    fn insert_below(&mut self, offset: Offset) {
        let i = self.below.partition_point(|&(_, end)| end < offset);
        match self.below.get(i).copied() {
            Some((start, end)) if start <= offset && offset < end => {}
            Some((_, end)) if end == offset => {
                let merged = match self.below.get(i + 1) {
                    Some(&(next, next_end)) if next == offset + 1 => {
                        self.below.remove(i + 1);
                        next_end
                    }
                    _ => offset + 1,
                };
                self.below[i].1 = merged;
            }
            Some((start, _)) if start == offset + 1 => self.below[i].0 = offset,
            _ => {
                self.below.insert(i, (offset, offset + 1));
                self.forget_oldest_runs();
            }
        }
    }

    fn forget_oldest_runs(&mut self) {
        while self.below.len() > RUNS {
            self.below.pop_front();
        }
    }
}

fn word(offset: Offset) -> usize {
    (offset / 64) as usize % WORDS
}

fn bit(offset: Offset) -> u64 {
    1 << (offset % 64)
}

/// The sources of one stripe of the store, found by their name's hash; at most `capacity`,
/// the one recorded into longest ago forgotten first.
pub(super) struct Sources {
    table: HashTable<Held>,
    capacity: usize,
    /// Counts records, to tell which source was recorded into longest ago.
    clock: u64,
}

struct Held {
    source: SourceId,
    hash: u64,
    last_record: u64,
    finished: Finished,
}

impl Sources {
    pub(super) fn new(capacity: usize) -> Self {
        Sources {
            table: HashTable::new(),
            capacity: capacity.max(1),
            clock: 0,
        }
    }

    pub(super) fn contains(&self, hash: u64, source: &SourceId, offset: Offset) -> bool {
        self.table
            .find(hash, |h| h.source == *source)
            .is_some_and(|h| h.finished.contains(offset))
    }

    pub(super) fn insert(&mut self, hash: u64, source: &SourceId, offset: Offset) {
        self.clock += 1;
        let clock = self.clock;
        if let Some(held) = self.table.find_mut(hash, |h| h.source == *source) {
            held.last_record = clock;
            return held.finished.insert(offset);
        }
        if self.table.len() >= self.capacity {
            self.forget_least_recent();
        }
        let mut finished = Finished::starting_at(offset);
        finished.insert(offset);
        self.table.insert_unique(
            hash,
            Held {
                source: source.clone(),
                hash,
                last_record: clock,
                finished,
            },
            |h| h.hash,
        );
    }

    fn forget_least_recent(&mut self) {
        let oldest = self.table.iter().map(|h| h.last_record).min();
        self.table.retain(|h| Some(h.last_record) != oldest);
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    /// Compares at every recorded offset and its neighbours, and at every 61st offset.
    fn assert_same(finished: &Finished, model: &BTreeSet<u64>, upto: u64) {
        let near = model.iter().flat_map(|&o| [o.saturating_sub(1), o, o + 1]);
        for o in near.chain((0..upto).step_by(61)) {
            assert_eq!(finished.contains(o), model.contains(&o), "offset {o}");
        }
    }

    proptest! {
        /// Offsets finished in any order, with the bitmap sliding over them many times: the
        /// set answers exactly as the set of everything recorded (while runs stay under
        /// their bound).
        #[test]
        fn answers_as_the_set_of_recorded_offsets(
            steps in prop::collection::vec((0u64..3, 0u64..200), 1..400),
            first in 0u64..100_000,
        ) {
            let mut finished = Finished::starting_at(first);
            let mut model = BTreeSet::new();
            let mut head = first;
            for (kind, n) in steps {
                let offset = match kind {
                    // Mostly near the head, a little out of order.
                    0 => { head += 1 + n % 4; head.saturating_sub(n % 7) }
                    // Jumps ahead, often past the whole bitmap.
                    1 => { head += n * 211; head }
                    // Far behind: below the bitmap once it moved.
                    _ => head.saturating_sub(n * 97),
                };
                finished.insert(offset);
                finished.insert(offset);
                model.insert(offset);
            }
            prop_assert!(finished.below.len() <= RUNS);
            assert_same(&finished, &model, head + WINDOW + 64);
            // Runs are sorted, disjoint and never touching (each merge happened).
            for pair in finished.below.iter().collect::<Vec<_>>().windows(2) {
                prop_assert!(pair[0].1 < pair[1].0, "{:?}", pair);
            }
        }
    }

    #[test]
    fn a_gapless_source_is_one_run_below_its_bitmap() {
        let mut finished = Finished::starting_at(5);
        for o in 5..1_000_000 {
            finished.insert(o);
        }
        assert_eq!(finished.below.len(), 1);
        assert!(finished.contains(5) && finished.contains(999_999));
        assert!(!finished.contains(4) && !finished.contains(1_000_000));
    }

    #[test]
    fn past_its_bound_the_oldest_runs_are_forgotten() {
        let mut finished = Finished::starting_at(0);
        // Every other offset: one run each once the bitmap moved past them.
        let count = (RUNS as u64 + 100) * 2;
        for o in (0..count).step_by(2) {
            finished.insert(o);
        }
        finished.insert(count + WINDOW * 2);
        assert_eq!(finished.below.len(), RUNS);
        assert!(!finished.contains(0), "the oldest run is forgotten");
        assert!(finished.contains(count - 2), "the newest is held");
        assert!(!finished.contains(count - 1));
    }

    #[test]
    fn sources_forget_the_one_recorded_into_longest_ago() {
        let mut sources = Sources::new(2);
        let (a, b, c) = (SourceId::new("a"), SourceId::new("b"), SourceId::new("c"));
        sources.insert(1, &a, 10);
        sources.insert(2, &b, 10);
        sources.insert(1, &a, 11);
        sources.insert(3, &c, 10);
        assert_eq!(sources.len(), 2);
        assert!(sources.contains(1, &a, 10) && sources.contains(1, &a, 11));
        assert!(!sources.contains(2, &b, 10), "b was recorded into longest ago");
        assert!(sources.contains(3, &c, 10));
        assert!(!sources.contains(3, &c, 9));
    }
}
