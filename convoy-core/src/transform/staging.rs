//! Exactly-once outputs: a transform's outputs *staged* per input (source and offset) until a
//! commit covers the input, then committed in one broker transaction with the offsets. This is
//! the bookkeeping, apart from any broker: [`StagingOutbox`] is the outbox, and a transport with
//! transactions (Kafka with a transactional id, the memory broker) runs the
//! [`Transaction`]s it hands out.
//!
//! The rules, each a promise to `read_committed` readers:
//! - **What is committed matches what was handled**: a transaction carries the outputs of the
//!   inputs below each source's committed position, and that position; outputs of an input
//!   finished above it wait for a commit that covers it.
//! - **A handling replaces what an earlier one staged**: handled again, an input's outputs are
//!   its latest; dead-lettered, set aside or handled with no outputs, it has none
//!   ([`Outbox::discard`]) — never the outputs of a handling that did not count.
//! - **Staging is tied to ownership**: only the outputs of inputs of sources owned here are
//!   staged; a source's entries go when it is released (its revoke acknowledged, or lost), and
//!   an input delivered again here whose entry is gone runs again ([`Outbox::covers`]) instead
//!   of being skipped as a duplicate with no outputs.
//! - **Bounded**: staged bytes count against the engine's held-bytes bound
//!   ([`Outbox::held_bytes`]), and a backlog is committed as several prefix transactions of at
//!   most `max_transaction_bytes` each, so none outgrows the broker's transaction timeout.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::{Outbox, Output, OutputGuarantee};
use crate::message::{Message, Offset, SourceId};
use crate::transport::{Commit, TransportError};

/// What one broker transaction carries: staged outputs, in source and offset order, and the
/// positions it commits with them.
#[derive(Clone, Debug, Default)]
pub struct Transaction {
    /// The outputs of the covered inputs, input by input.
    pub outputs: Vec<Arc<Vec<Output>>>,
    /// Per source, the position the transaction commits (every input below it is finished and
    /// its outputs are in this or an earlier transaction).
    pub commits: Vec<Commit>,
    /// What the outputs weigh.
    pub bytes: usize,
}

struct Entry {
    outputs: Arc<Vec<Output>>,
    bytes: usize,
}

/// Staged outputs per source and input offset (see this module's documentation).
#[derive(Default)]
pub struct Staging {
    entries: BTreeMap<SourceId, BTreeMap<Offset, Entry>>,
    bytes: usize,
    /// The sources owned here: outputs of any other (a handling that finished after its source
    /// was lost) are never committed by this member, so they are not staged.
    owned: BTreeSet<SourceId>,
}

fn weight(outputs: &[Output]) -> usize {
    outputs
        .iter()
        .map(|o| {
            let m = &o.message;
            let headers: usize = m.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
            o.topic.len() + m.key.as_ref().map_or(0, |k| k.len()) + m.payload.len() + headers
        })
        .sum()
}

impl Staging {
    /// Stages `outputs` as those of the input at `offset` of `source`, replacing what an earlier
    /// handling staged (none: the input has no outputs).
    pub fn stage(&mut self, source: &SourceId, offset: Offset, outputs: Vec<Output>) {
        self.discard(source, offset);
        if outputs.is_empty() || !self.owned.contains(source) {
            return;
        }
        let bytes = weight(&outputs);
        self.bytes += bytes;
        self.entries.entry(source.clone()).or_default().insert(
            offset,
            Entry {
                outputs: Arc::new(outputs),
                bytes,
            },
        );
    }

    /// The input at `offset` of `source` ended without outputs (dead-lettered, set aside).
    pub fn discard(&mut self, source: &SourceId, offset: Offset) {
        let Some(offsets) = self.entries.get_mut(source) else {
            return;
        };
        if let Some(gone) = offsets.remove(&offset) {
            self.bytes -= gone.bytes;
        }
        if offsets.is_empty() {
            self.entries.remove(source);
        }
    }

    /// True if the input at `offset` of `source` has outputs staged.
    pub fn covers(&self, source: &SourceId, offset: Offset) -> bool {
        self.entries
            .get(source)
            .is_some_and(|offsets| offsets.contains_key(&offset))
    }

    /// Drops what is staged for `source` below `next`: committed (with its outputs), by this
    /// member or, when an assignment starts there, by whoever committed it.
    pub fn committed(&mut self, source: &SourceId, next: Offset) {
        let Some(offsets) = self.entries.get_mut(source) else {
            return;
        };
        let kept = offsets.split_off(&next);
        self.bytes -= offsets.values().map(|e| e.bytes).sum::<usize>();
        *offsets = kept;
        if offsets.is_empty() {
            self.entries.remove(source);
        }
    }

    /// An assignment of `source` starts here at `committed` (every input below it committed,
    /// with its outputs, by whoever owned it; `None`: nothing committed yet).
    pub fn assigned(&mut self, source: &SourceId, committed: Option<Offset>) {
        self.owned.insert(source.clone());
        if let Some(next) = committed {
            self.committed(source, next);
        }
    }

    /// `source` is no longer owned here (its revoke was acknowledged, or it was lost): what
    /// is staged for it goes, and what a handling still running stages for it later is not
    /// kept (an input delivered here again runs again).
    pub fn released(&mut self, source: &SourceId) {
        self.owned.remove(source);
        if let Some(offsets) = self.entries.remove(source) {
            self.bytes -= offsets.values().map(|e| e.bytes).sum::<usize>();
        }
    }

    /// Bytes staged now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The transactions that commit `commits` with the outputs staged below them: as many as
    /// it takes for none to carry more than `max_bytes` of outputs (one input's outputs are
    /// never split), each a prefix of what is left, in source and offset order. Nothing is
    /// removed: [`committed`](Self::committed) does that once a transaction went through.
    pub fn transactions(&self, commits: &[Commit], max_bytes: usize) -> Vec<Transaction> {
        let mut done = Vec::new();
        let mut open = Transaction::default();
        for commit in commits {
            let staged = self
                .entries
                .get(&commit.source)
                .map(|offsets| offsets.range(..commit.next))
                .into_iter()
                .flatten();
            for (&offset, entry) in staged {
                if open.bytes > 0 && open.bytes + entry.bytes > max_bytes {
                    // Everything below this input is in: commit up to it, then go on.
                    open.commits.push(Commit {
                        next: offset,
                        finished_above: Vec::new(),
                        ..commit.clone()
                    });
                    done.push(std::mem::take(&mut open));
                }
                open.outputs.push(entry.outputs.clone());
                open.bytes += entry.bytes;
            }
            // Never an offset map: an input finished above the position has outputs of its
            // own, committed only with a position that covers it.
            open.commits.push(Commit {
                finished_above: Vec::new(),
                ..commit.clone()
            });
        }
        if !open.commits.is_empty() {
            done.push(open);
        }
        done
    }
}

/// The outbox of a transport with transactions: stages outputs (see this module's
/// documentation); the transport's commit runs [`StagingOutbox::transactions`] and reports
/// each that went through with [`StagingOutbox::committed`].
pub struct StagingOutbox {
    staging: Mutex<Staging>,
    max_transaction_bytes: usize,
}

/// A transaction carries at most this many bytes of outputs by default (well inside Kafka's
/// default `transaction.timeout.ms` of one minute on any working link).
pub const DEFAULT_MAX_TRANSACTION_BYTES: usize = 16 << 20;

impl StagingOutbox {
    /// An outbox whose transactions carry at most `max_transaction_bytes` of outputs each.
    pub fn new(max_transaction_bytes: usize) -> Self {
        StagingOutbox {
            staging: Mutex::default(),
            max_transaction_bytes: max_transaction_bytes.max(1),
        }
    }

    fn staging(&self) -> std::sync::MutexGuard<'_, Staging> {
        // Every change is one call: a panic elsewhere left a consistent state.
        self.staging.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The transactions that commit `commits` (see [`Staging::transactions`]).
    pub fn transactions(&self, commits: &[Commit]) -> Vec<Transaction> {
        self.staging().transactions(commits, self.max_transaction_bytes)
    }

    /// `transaction` went through: its outputs are published and its positions committed.
    pub fn committed(&self, transaction: &Transaction) {
        let mut staging = self.staging();
        for commit in &transaction.commits {
            staging.committed(&commit.source, commit.next);
        }
    }

    /// An assignment of `source` starts at `committed` (every input below it committed, with
    /// its outputs, by whoever owned it).
    pub fn assigned(&self, source: &SourceId, committed: Option<Offset>) {
        self.staging().assigned(source, committed);
    }

    /// `sources` are no longer owned here (revoke acknowledged, or lost).
    pub fn released<'a>(&self, sources: impl IntoIterator<Item = &'a SourceId>) {
        let mut staging = self.staging();
        for source in sources {
            staging.released(source);
        }
    }
}

#[async_trait]
impl Outbox for StagingOutbox {
    async fn put(&self, input: &Message, mut outputs: Vec<Output>) -> Result<(), TransportError> {
        for output in &mut outputs {
            output.message.stamp();
        }
        self.staging().stage(&input.source, input.offset, outputs);
        Ok(())
    }

    fn guarantee(&self) -> OutputGuarantee {
        OutputGuarantee::ExactlyOnce
    }

    fn discard(&self, input: &Message) {
        self.staging().discard(&input.source, input.offset);
    }

    fn covers(&self, input: &Message) -> bool {
        self.staging().covers(&input.source, input.offset)
    }

    fn held_bytes(&self) -> usize {
        self.staging().bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(p: u32) -> SourceId {
        SourceId::partition("in", p)
    }

    fn outputs(payload: &str) -> Vec<Output> {
        vec![Output::keyed("out", "k", payload.to_owned())]
    }

    fn commit(p: u32, next: Offset) -> Commit {
        Commit {
            source: source(p),
            next,
            token: 0,
            finished_above: Vec::new(),
        }
    }

    fn payloads(t: &Transaction) -> Vec<String> {
        t.outputs
            .iter()
            .flat_map(|o| o.iter())
            .map(|o| String::from_utf8_lossy(&o.message.payload).into_owned())
            .collect()
    }

    /// Staging that owns sources 0 to 3.
    fn owning() -> Staging {
        let mut s = Staging::default();
        for p in 0..4 {
            s.assigned(&source(p), None);
        }
        s
    }

    #[test]
    fn a_commit_takes_what_is_below_each_position_in_offset_order() {
        let mut s = owning();
        for (p, offset) in [(0, 5), (0, 2), (1, 7), (0, 9), (1, 3)] {
            s.stage(&source(p), offset, outputs(&format!("{p}@{offset}")));
        }
        let t = s.transactions(&[commit(0, 6), commit(1, 8)], usize::MAX);
        assert_eq!(t.len(), 1);
        assert_eq!(payloads(&t[0]), ["0@2", "0@5", "1@3", "1@7"]);
        assert_eq!(t[0].commits.iter().map(|c| c.next).collect::<Vec<_>>(), [6, 8]);
        s.committed(&source(0), 6);
        s.committed(&source(1), 8);
        let t = s.transactions(&[commit(0, 100), commit(1, 100)], usize::MAX);
        assert_eq!(payloads(&t[0]), ["0@9"]);
    }

    #[test]
    fn a_handling_replaces_and_an_ending_without_outputs_clears() {
        let mut s = owning();
        s.stage(&source(0), 4, outputs("first"));
        s.stage(&source(0), 4, outputs("again"));
        assert_eq!(
            payloads(&s.transactions(&[commit(0, 5)], usize::MAX)[0]),
            ["again"]
        );
        s.stage(&source(0), 4, Vec::new());
        assert!(
            !s.covers(&source(0), 4),
            "no outputs the second time: none staged"
        );
        s.stage(&source(0), 6, outputs("x"));
        s.discard(&source(0), 6);
        assert_eq!(s.bytes(), 0, "dead-lettered: its earlier outputs go");
        assert!(s.transactions(&[commit(0, 7)], usize::MAX)[0].outputs.is_empty());
    }

    #[test]
    fn a_backlog_goes_in_prefix_transactions_within_the_bound() {
        let mut s = owning();
        for offset in 0..10 {
            s.stage(&source(0), offset, outputs("0123456789"));
        }
        let one = weight(&outputs("0123456789"));
        let t = s.transactions(&[commit(0, 10), commit(1, 3)], 3 * one);
        assert_eq!(t.len(), 4, "3 + 3 + 3 + 1 inputs");
        let positions: Vec<Vec<(String, Offset)>> = t
            .iter()
            .map(|t| t.commits.iter().map(|c| (c.source.to_string(), c.next)).collect())
            .collect();
        assert_eq!(positions[0], [("in/0".to_owned(), 3)]);
        assert_eq!(positions[1], [("in/0".to_owned(), 6)]);
        assert_eq!(positions[2], [("in/0".to_owned(), 9)]);
        assert_eq!(
            positions[3],
            [("in/0".to_owned(), 10), ("in/1".to_owned(), 3)],
            "the last one commits every position asked"
        );
        assert!(t.iter().all(|t| t.bytes <= 3 * one));
    }

    #[test]
    fn releasing_a_source_forgets_its_outputs_and_assignments_prune_what_is_committed() {
        let mut s = owning();
        s.stage(&source(2), 10, outputs("committed by another member"));
        s.stage(&source(2), 30, outputs("not yet"));
        s.assigned(&source(2), Some(20));
        assert!(!s.covers(&source(2), 10) && s.covers(&source(2), 30));
        s.released(&source(2));
        assert!(!s.covers(&source(2), 30));
        assert_eq!(s.bytes(), 0);
        s.stage(&source(2), 31, outputs("a handling that ended after the loss"));
        assert_eq!(s.bytes(), 0, "not owned: not staged");
    }
}
