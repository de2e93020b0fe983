//! The invariants checked against the broker: after every step, that no commit passed an
//! unfinished message, that every revoke was acknowledged by its deadline and that members hold
//! no more than their bounds; at the end, that every message was handled or dead-lettered with
//! its reason, no key is left parked and every position is committed.

use convoy_core::dead_letter::DL_ERROR;
use convoy_memory::broker::EVENT_CAPACITY;

use crate::ledger::{show, Identity};
use crate::world::{World, DLQ, GROUP};

/// After a step: commits, revoke deadlines, memory.
pub fn check_step(world: &World, held: &[(usize, usize)]) {
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
    let bound = world.plan.total_high + (EVENT_CAPACITY + 2) * 4 * world.sources().len();
    for &(member, held) in held {
        if held > bound {
            ledger.violation(format!(
                "memory: m{member} holds {held} messages, over its bound of {bound}"
            ));
        }
    }
}

/// A message skipped as a duplicate: one with its id was handled (a producer's retry), or the
/// copy of a resumed replay that ran before.
fn handled_as_duplicate(ledger: &crate::ledger::Ledger, identity: &Identity) -> bool {
    identity.replay.is_none() && ledger.is_handled(&identity.original())
}

/// True once every source's committed position is past its last record.
pub fn committed_everything(world: &World) -> bool {
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
pub fn check_end(world: &World) {
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
    if ledger.running() > 0 {
        let running = ledger.running();
        ledger.violation(format!("liveness: {running} handler calls still run at the end"));
    }
}
