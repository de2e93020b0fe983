//! The invariants checked against the broker: after every step, that no commit passed an
//! unfinished message, that every revoke was acknowledged by its deadline and that members hold
//! no more than their bounds; at the end, that every message was handled or dead-lettered with
//! its reason, no key is left parked and every position is committed.

use std::collections::{BTreeMap, BTreeSet};

use convoy_core::dead_letter::{DL_CAUSE, DL_ERROR, DL_OFFSET, DL_SOURCE};
use convoy_core::StatsSnapshot;
use convoy_memory::broker::EVENT_CAPACITY;

use convoy_core::SourceId;
use convoy_memory::MemoryBroker;

use crate::ledger::{show, Identity, Ledger};
use crate::plan::{Plan, DLQ, GROUP, OUT};
use crate::shared::Shared;

/// What the oracle looks at: the world's plan, its broker, and what its members recorded.
pub struct Scene<'a> {
    pub plan: &'a Plan,
    pub broker: &'a MemoryBroker,
    pub shared: &'a Shared,
}

impl Scene<'_> {
    fn sources(&self) -> Vec<SourceId> {
        self.plan.sources()
    }
}

/// After a step: commits, revoke deadlines, memory, exactly-once outputs.
pub fn check_step(world: &Scene<'_>, members: &[(usize, StatsSnapshot)]) {
    let dead_letters = world.broker.read_all(DLQ);
    let mut ledger = world.shared.ledger();
    ledger.read_dead_letters(&dead_letters);
    // No commit past an unfinished message: every record below a committed position was handled
    // or dead-lettered (set aside included).
    for source in world.sources() {
        let Some((next, above)) = world.broker.committed_position(GROUP, &source) else {
            continue;
        };
        let Some((topic, partition)) = source.topic_partition() else {
            continue;
        };
        let records = world.broker.read_all(topic);
        for record in records.iter().filter(|r| {
            r.source.topic_partition() == Some((topic, partition))
                && (r.offset < next || above.contains(&r.offset))
        }) {
            let Some(identity) = Identity::of(record) else {
                continue;
            };
            if !ledger.is_handled(&identity)
                && ledger.dead_letters(&identity).is_empty()
                && !handled_as_duplicate(&ledger, &identity)
            {
                ledger.violation(format!(
                    "watermark: {source} is committed at {next} (above: {above:?}) but {identity} at offset {} was never finished",
                    record.offset
                ));
            }
        }
    }
    let missed = world.broker.missed_revokes();
    if missed > 0
        && !ledger
            .violations
            .iter()
            .any(|v| v.starts_with("deadline: a revoke"))
    {
        ledger.violation(format!(
            "deadline: a revoke was not acknowledged by its deadline ({missed} so far)"
        ));
    }
    // What a member holds stays within its bound, give or take what the broker had fetched for
    // it before a pause took effect (its queued batches and the one it was sending, per source).
    let slack = (EVENT_CAPACITY + 2) * 4 * world.sources().len();
    let bound = world.plan.total_high + slack;
    for (member, stats) in members {
        if stats.held > bound {
            let held = stats.held;
            ledger.violation(format!(
                "memory: m{member} holds {held} messages, over its bound of {bound}"
            ));
        }
        // Staged outputs count against the bytes bound (a message and its output weigh a few
        // hundred bytes at most here).
        let bytes_bound = world.plan.bytes_high + slack * 600;
        let bytes = stats.held_bytes + stats.staged_bytes;
        if world.plan.transform && bytes > bytes_bound {
            ledger.violation(format!(
                "memory: m{member} holds {bytes} bytes ({} staged outputs), over its bound of {bytes_bound}",
                stats.staged_bytes
            ));
        }
    }
    if world.plan.transform {
        check_outputs(world, &dead_letters, &mut ledger);
    }
}

/// Exactly-once outputs: every input record's output committed at most once, and none for an
/// input record that was dead-lettered or set aside.
fn check_outputs(world: &Scene<'_>, dead_letters: &[convoy_core::Message], ledger: &mut Ledger) {
    let mut per_record: BTreeMap<String, usize> = BTreeMap::new();
    for output in world.broker.read_all(OUT) {
        let text = String::from_utf8_lossy(&output.payload).into_owned();
        let record = text.split_once('|').map_or(text.clone(), |(_, r)| r.to_owned());
        *per_record.entry(record).or_default() += 1;
    }
    for (record, count) in &per_record {
        if *count > 1 {
            ledger.violation(format!(
                "exactly once: the input at {record} has {count} committed outputs"
            ));
        }
    }
    // A dead letter is published outside the transaction: a handling dead-lettered and then
    // (after a crash before its commit) handled again is fine. What must not be is an output
    // committed for an input whose latest handling was dead-lettered.
    for dead in dead_letters
        .iter()
        .filter(|r| !convoy_core::parking::is_marker(r))
    {
        let (Some(source), Some(offset)) = (dead.headers.get_str(DL_SOURCE), dead.headers.get_str(DL_OFFSET))
        else {
            continue;
        };
        let record = format!("{source}@{offset}");
        if per_record.contains_key(&record) && ledger.last_dead_lettered(&record) {
            let cause = dead.headers.get_str(DL_CAUSE).unwrap_or("?");
            ledger.violation(format!(
                "exactly once: the input at {record} was dead-lettered ({cause}) yet its output was committed"
            ));
        }
    }
}

/// At the end of a transforming world: every message handled has its output committed (as
/// itself or as a replay's copy).
fn check_outputs_complete(world: &Scene<'_>, ledger: &mut Ledger) {
    let with_output: BTreeSet<u64> = world
        .broker
        .read_all(OUT)
        .iter()
        .filter_map(|o| {
            let text = String::from_utf8_lossy(&o.payload).into_owned();
            text.split_once('|')?.0.parse().ok()
        })
        .collect();
    let missing: Vec<u64> = ledger
        .produced_messages()
        .map(|p| p.n)
        .filter(|&n| ledger.handled_any(n) && !ledger.dead_for_good(n) && !with_output.contains(&n))
        .collect();
    if !missing.is_empty() {
        let shown: Vec<String> = missing.iter().take(10).map(|n| format!("#{n}")).collect();
        ledger.violation(format!(
            "exactly once: {} messages were handled but no output of theirs was committed: {}",
            missing.len(),
            shown.join(" ")
        ));
    }
}

/// A message skipped as a duplicate: one with its id was handled (a producer's retry), or the
/// copy of a resumed replay that ran before.
fn handled_as_duplicate(ledger: &crate::ledger::Ledger, identity: &Identity) -> bool {
    identity.replay.is_none() && ledger.is_handled(&identity.original())
}

/// True once every source's committed position is past its last record.
pub fn committed_everything(world: &Scene<'_>) -> bool {
    let sources = world.sources();
    let last = world.broker.last_offsets(&sources);
    sources.iter().zip(last).all(|(source, last)| match last {
        None => true,
        Some(last) => world
            .broker
            .committed_position(GROUP, source)
            .is_some_and(|(next, _)| next > last),
    })
}

/// At the end, once the world healed and settled.
pub fn check_end(world: &Scene<'_>) {
    let dead_letters = world.broker.read_all(DLQ);
    let parked = convoy_core::parking::ParkedKeys::read(GROUP, &dead_letters);
    let committed = committed_everything(world);
    let mut ledger = world.shared.ledger();
    ledger.read_dead_letters(&dead_letters);
    if !committed {
        let sources: Vec<String> = world
            .sources()
            .iter()
            .map(|s| {
                let last = world.broker.last_offsets(std::slice::from_ref(s))[0];
                let committed = world.broker.committed_position(GROUP, s).map(|(n, _)| n);
                format!("{s}: last {last:?}, committed {committed:?}")
            })
            .collect();
        ledger.violation(format!(
            "liveness: the world healed but not everything was committed within 300 s: {}",
            sources.join("; ")
        ));
    }
    let mut keys: Vec<String> = parked.iter().map(|(k, _)| show(&Some(k.clone()))).collect();
    keys.sort();
    for (key, parking) in parked.iter() {
        ledger.trace.event(format_args!(
            "parked at the end: {}: replaying {:?}, {} pending",
            show(&Some(key.clone())),
            parking.replaying(),
            parking.pending()
        ));
    }
    if !keys.is_empty() {
        ledger.violation(format!(
            "liveness: keys still parked after every replay: {}",
            keys.join(", ")
        ));
    }
    let missing: Vec<u64> = ledger
        .produced_messages()
        .map(|p| p.n)
        .filter(|&n| !ledger.handled_any(n) && !ledger.dead_for_good(n))
        .collect();
    if !missing.is_empty() {
        let shown: Vec<String> = missing.iter().take(10).map(|n| format!("#{n}")).collect();
        ledger.violation(format!(
            "liveness: {} messages were neither handled nor dead-lettered for good: {}{}",
            missing.len(),
            shown.join(" "),
            if missing.len() > 10 { " …" } else { "" }
        ));
    }
    // Every dead letter says why.
    let unexplained = dead_letters
        .iter()
        .filter(|r| Identity::of(r).is_some() && r.headers.get_str(DL_ERROR).is_none())
        .count();
    if unexplained > 0 {
        ledger.violation(format!("dead letters without a reason: {unexplained}"));
    }
    if world.plan.transform {
        check_outputs_complete(world, &mut ledger);
    }
    if ledger.running() > 0 {
        let running = ledger.running();
        ledger.violation(format!("liveness: {running} handler calls still run at the end"));
    }
}

/// Traces every record of the dead-letter destination (with `SIMDLQ` set): for a reader of a
/// failing seed.
pub fn dump_dead_letters(world: &Scene<'_>) {
    if std::env::var("SIMDLQ").is_err() {
        return;
    }
    let dead_letters = world.broker.read_all(DLQ);
    let mut ledger = world.shared.ledger();
    for r in &dead_letters {
        ledger.trace.event(format_args!(
            "dlq {}@{} key {} {:?} cause {:?} parks {:?} from {:?}@{:?} replay {:?}",
            r.source,
            r.offset,
            show(&r.key),
            Identity::of(r),
            r.headers.get_str(DL_CAUSE),
            r.headers.get_str(convoy_core::parking::DL_PARKS),
            r.headers.get_str(DL_SOURCE),
            r.headers.get_str(DL_OFFSET),
            r.headers.get_str(convoy_core::parking::REPLAY)
        ));
    }
}
