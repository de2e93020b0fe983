//! Which delivery tags of a channel a commit acknowledges. The watermark goes as one
//! `basic.ack(tag, multiple)`; messages finished above it go one by one when the channel is
//! released, so a stop or a handover that leaves a gap (a queued message not started) does not
//! send them to the next owner. The broker closes a channel that acknowledges a tag twice: a
//! multiple-ack only goes forward, and ends on a tag not already acknowledged on its own.
//!
//! Why only at release, and at most [`RELEASE_SINGLES_MAX`]: each `basic.ack` is one settle
//! command to a quorum queue, and a channel with more than 32 of them unapplied (RabbitMQ's
//! `quorum_commands_soft_limit`) stashes the next ones — which its close then drops, and the
//! queue returns the messages they acknowledged. Measured: single acks of every finished
//! message at each commit, then a stop 8 ms later, left 87 of 120 handled messages in the
//! queue (1 run in 12 under a busy core). A periodic commit sends one command; a release adds
//! at most this many. Finished messages beyond it go to the next owner again (at least once).

use std::collections::BTreeSet;

use lapin::options::BasicAckOptions;
use lapin::Channel;

use crate::error::answered;
use convoy_core::TransportError;

/// Single acks sent when a channel is released: well under the 32 settle commands a quorum
/// queue's channel keeps unapplied before it stashes (and on close drops) the rest.
pub(super) const RELEASE_SINGLES_MAX: usize = 24;

/// What a channel acknowledged so far.
#[derive(Debug, Default)]
pub(super) struct Acked {
    /// Every tag up to it is acknowledged (0: none).
    below: u64,
    /// Tags above `below` acknowledged on their own.
    alone: BTreeSet<u64>,
    /// The latest commit's finished tags above its watermark, acknowledged at release.
    above: Vec<u64>,
}

/// The acknowledgements of one commit.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct AckPlan {
    /// `basic.ack(tag, multiple)`.
    pub multiple: Option<u64>,
    /// `basic.ack(tag)` each.
    pub single: Vec<u64>,
    /// Every tag up to it is acknowledged once the plan is carried out.
    below: u64,
}

impl AckPlan {
    pub fn is_empty(&self) -> bool {
        self.multiple.is_none() && self.single.is_empty()
    }
}

impl Acked {
    /// What acknowledges every tag up to `watermark` and the tags in `finished_above`
    /// (ascending, above the watermark) that are not acknowledged yet.
    pub fn plan(&self, watermark: u64, finished_above: &[u64]) -> AckPlan {
        let below = watermark.max(self.below);
        // The highest tag up to the watermark not acknowledged on its own: a multiple-ack of
        // it covers everything between (the ones acknowledged alone are no longer pending).
        let mut multiple = watermark;
        for &tag in self
            .alone
            .range(self.below + 1..=watermark.max(self.below + 1))
            .rev()
        {
            if tag != multiple {
                break;
            }
            multiple -= 1;
        }
        AckPlan {
            multiple: (multiple > self.below).then_some(multiple),
            single: finished_above
                .iter()
                .copied()
                .filter(|&tag| tag > below && !self.alone.contains(&tag))
                .collect(),
            below,
        }
    }

    /// Keeps the finished tags above the watermark for the release.
    pub fn keep_above(&mut self, finished_above: &[u64]) {
        self.above.clear();
        self.above.extend_from_slice(finished_above);
    }

    /// What to acknowledge when the channel is released: the kept finished tags above the
    /// watermark not acknowledged yet, at most [`RELEASE_SINGLES_MAX`] (the lowest).
    pub fn release_plan(&self) -> AckPlan {
        let mut plan = self.plan(self.below, &self.above);
        plan.single.truncate(RELEASE_SINGLES_MAX);
        plan
    }

    /// Records a plan carried out.
    pub fn done(&mut self, plan: &AckPlan) {
        self.below = self.below.max(plan.below);
        let below = self.below;
        self.alone.retain(|&tag| tag > below);
        self.alone.extend(plan.single.iter().copied());
    }
}

/// Carries out `plan` on `channel` (of `source`), each call bounded.
pub(super) async fn send(channel: &Channel, plan: &AckPlan, source: &str) -> Result<(), TransportError> {
    let what = || format!("acknowledging {source}");
    let tags = plan
        .multiple
        .map(|tag| (tag, true))
        .into_iter()
        .chain(plan.single.iter().map(|&tag| (tag, false)));
    for (tag, multiple) in tags {
        answered(what(), channel.basic_ack(tag, BasicAckOptions { multiple }))
            .await?
            .map_err(|e| crate::error::broker(&what(), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(acked: &mut Acked, watermark: u64, above: &[u64]) -> (Option<u64>, Vec<u64>) {
        let plan = acked.plan(watermark, above);
        acked.done(&plan);
        (plan.multiple, plan.single)
    }

    #[test]
    fn finished_messages_above_the_watermark_are_acknowledged_once() {
        let mut acked = Acked::default();
        assert_eq!(
            run(&mut acked, 0, &[]),
            (None, vec![]),
            "nothing finished: tag 0 would ack all"
        );
        assert_eq!(run(&mut acked, 3, &[5, 6, 9]), (Some(3), vec![5, 6, 9]));
        // 4 finished: the watermark reaches 6, whose tags 5 and 6 were acknowledged alone.
        assert_eq!(run(&mut acked, 6, &[9, 10]), (Some(4), vec![10]));
        // 7 and 8 finished: 9 and 10 were acknowledged alone, the multiple-ack ends on 8.
        assert_eq!(run(&mut acked, 10, &[]), (Some(8), vec![]));
        assert_eq!(run(&mut acked, 10, &[]), (None, vec![]), "never twice");
        assert_eq!(run(&mut acked, 9, &[12]), (None, vec![12]), "never backwards");
    }

    #[test]
    fn the_release_acknowledges_what_finished_above_the_watermark_at_most_the_bound() {
        let mut acked = Acked::default();
        let plan = acked.plan(3, &[]);
        acked.done(&plan);
        let above: Vec<u64> = (5..100).collect();
        acked.keep_above(&above);
        let release = acked.release_plan();
        assert_eq!(release.multiple, None, "the watermark went with the commit");
        assert_eq!(
            release.single,
            (5..5 + RELEASE_SINGLES_MAX as u64).collect::<Vec<_>>()
        );
        acked.keep_above(&[2, 3, 7]);
        assert_eq!(
            acked.release_plan().single,
            vec![7],
            "never what the watermark covers"
        );
    }

    #[test]
    fn a_watermark_on_tags_all_acknowledged_alone_sends_no_multiple_ack() {
        let mut acked = Acked::default();
        assert_eq!(run(&mut acked, 0, &[1, 2, 3]), (None, vec![1, 2, 3]));
        assert_eq!(run(&mut acked, 3, &[]), (None, vec![]));
        assert_eq!(run(&mut acked, 4, &[]), (Some(4), vec![]));
    }
}
