//! Which delivery tags of a channel a commit acknowledges. The watermark goes as one
//! `basic.ack(tag, multiple)`; messages finished above it go one by one, so a stop or a
//! handover that leaves a gap (a queued message not started) does not send them to the next
//! owner. The broker closes a channel that acknowledges a tag twice: a multiple-ack only goes
//! forward, and ends on a tag not already acknowledged on its own.

use std::collections::BTreeSet;

/// What a channel acknowledged so far.
#[derive(Debug, Default)]
pub(super) struct Acked {
    /// Every tag up to it is acknowledged (0: none).
    below: u64,
    /// Tags above `below` acknowledged on their own.
    alone: BTreeSet<u64>,
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

    /// Records a plan carried out.
    pub fn done(&mut self, plan: &AckPlan) {
        self.below = self.below.max(plan.below);
        let below = self.below;
        self.alone.retain(|&tag| tag > below);
        self.alone.extend(plan.single.iter().copied());
    }
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
    fn a_watermark_on_tags_all_acknowledged_alone_sends_no_multiple_ack() {
        let mut acked = Acked::default();
        assert_eq!(run(&mut acked, 0, &[1, 2, 3]), (None, vec![1, 2, 3]));
        assert_eq!(run(&mut acked, 3, &[]), (None, vec![]));
        assert_eq!(run(&mut acked, 4, &[]), (Some(4), vec![]));
    }
}
