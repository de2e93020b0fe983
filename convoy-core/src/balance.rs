//! Fair shares of a group's partitions among its live members, for transports whose broker does
//! not assign partitions (RabbitMQ, NATS): members count themselves and take or hand over
//! partitions by themselves, with locks or leases the broker arbitrates.
//!
//! With S partitions and M members, every member may hold ⌊S/M⌋, and the holders of one of the
//! `S mod M` *extra tokens* one more. The shares add up to S exactly, so once membership is
//! stable a member under its share always finds a free partition, and every member ends within
//! ±1 of S/M.
//!
//! A partition a member won but could not start is [`Cooling`]: skipped for a while, so one
//! broken partition neither stalls the member nor is hammered.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::message::SourceId;

/// The shares of `sources` partitions among `members` members.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FairShare {
    floor: usize,
    extra: usize,
}

impl FairShare {
    /// Shares for `members` live members (at least one: the one asking).
    pub fn new(sources: usize, members: usize) -> Self {
        let members = members.max(1);
        FairShare {
            floor: sources / members,
            extra: sources % members,
        }
    }

    /// How many extra tokens there are: tokens `0 .. extra_tokens()` each allow one more.
    pub fn extra_tokens(&self) -> usize {
        self.extra
    }

    /// True when token `j` still counts (membership may have changed since it was taken).
    pub fn token_counts(&self, j: u32) -> bool {
        (j as usize) < self.extra
    }

    /// What a member holding `token` (if it counts) may hold.
    pub fn quota(&self, token: Option<u32>) -> usize {
        self.floor + usize::from(token.is_some_and(|j| self.token_counts(j)))
    }
}

/// What a member holding `held` (each with the order it was taken in) hands over to get down
/// to `quota`: the most recently taken first, so long-held partitions stay where they are.
pub fn surplus<T>(mut held: Vec<(u64, T)>, quota: usize) -> Vec<T> {
    if held.len() <= quota {
        return Vec::new();
    }
    held.sort_unstable_by_key(|(taken, _)| std::cmp::Reverse(*taken));
    let excess = held.len() - quota;
    held.into_iter().take(excess).map(|(_, t)| t).collect()
}

/// The order in which a member tries partitions `0 .. total`: every one once, starting at a
/// place derived from `seed` (the member's own), so members rarely race for the same lock.
pub fn rotation(total: usize, seed: u64) -> impl Iterator<Item = usize> {
    let start = if total == 0 {
        0
    } else {
        (seed % total as u64) as usize
    };
    (0..total).map(move |i| (start + i) % total)
}

/// Partitions a member could not start, each skipped until a delay has passed that doubles
/// with every failure in a row (from 500 ms up to 10 s): the member serves the others meanwhile.
#[derive(Debug, Default)]
pub struct Cooling {
    /// Per source: skipped until, and the delay its next failure waits.
    waits: HashMap<SourceId, (Instant, Duration)>,
}

impl Cooling {
    /// The delay after a first failure.
    pub const FIRST: Duration = Duration::from_millis(500);
    /// The longest delay.
    pub const MAX: Duration = Duration::from_secs(10);

    /// True while `source` waits out its delay.
    pub fn is_cooling(&self, source: &SourceId) -> bool {
        self.waits
            .get(source)
            .is_some_and(|(until, _)| Instant::now() < *until)
    }

    /// `source` started: a later failure starts again from the first delay.
    pub fn started(&mut self, source: &SourceId) {
        self.waits.remove(source);
    }

    /// `source` could not be started: it is skipped for the returned delay.
    pub fn failed(&mut self, source: SourceId) -> Duration {
        let wait = self.waits.get(&source).map_or(Self::FIRST, |(_, next)| *next);
        self.waits
            .insert(source, (Instant::now() + wait, (wait * 2).min(Self::MAX)));
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[tokio::test(start_paused = true)]
    async fn a_failing_partition_cools_longer_each_time_until_it_starts() {
        let (mut cooling, p) = (Cooling::default(), SourceId::partition("t", 0));
        assert!(!cooling.is_cooling(&p));
        let waits: Vec<Duration> = (0..7).map(|_| cooling.failed(p.clone())).collect();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            waits,
            [
                ms(500),
                ms(1000),
                ms(2000),
                ms(4000),
                ms(8000),
                ms(10_000),
                ms(10_000)
            ]
        );
        assert!(cooling.is_cooling(&p));
        assert!(
            !cooling.is_cooling(&SourceId::partition("t", 1)),
            "only the failed one"
        );
        tokio::time::advance(ms(9_999)).await;
        assert!(cooling.is_cooling(&p));
        tokio::time::advance(ms(1)).await;
        assert!(!cooling.is_cooling(&p));
        cooling.started(&p);
        assert_eq!(cooling.failed(p), ms(500), "a start resets the delay");
    }

    #[test]
    fn eight_partitions_over_three_members() {
        let share = FairShare::new(8, 3);
        assert_eq!(share.extra_tokens(), 2);
        assert_eq!(share.quota(None), 2);
        assert_eq!(share.quota(Some(1)), 3);
        assert_eq!(share.quota(Some(2)), 2, "token 2 does not count with 2 extra");
    }

    #[test]
    fn the_newest_are_handed_over() {
        let held = vec![(1, "a"), (7, "d"), (3, "b"), (5, "c")];
        assert_eq!(surplus(held.clone(), 2), vec!["d", "c"]);
        assert!(surplus(held, 4).is_empty());
    }

    proptest! {
        #[test]
        fn shares_add_up_and_differ_by_at_most_one(sources in 0usize..300, members in 1usize..40) {
            let share = FairShare::new(sources, members);
            let with_token = share.extra_tokens();
            let quotas: Vec<usize> = (0..members)
                .map(|m| share.quota((m < with_token).then_some(m as u32)))
                .collect();
            prop_assert_eq!(quotas.iter().sum::<usize>(), sources);
            let (min, max) = (quotas.iter().min().copied(), quotas.iter().max().copied());
            prop_assert!(max.zip(min).is_none_or(|(max, min)| max - min <= 1));
        }

        #[test]
        fn a_rotation_visits_every_partition_once(total in 0usize..200, seed in any::<u64>()) {
            let mut seen: Vec<usize> = rotation(total, seed).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..total).collect::<Vec<_>>());
        }
    }
}
