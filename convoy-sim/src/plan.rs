//! What a seed decides before anything runs: the shape of the world (members, topics, keys,
//! messages, the engine's settings) and — swarm testing — which fault kinds are on and how
//! often each fires. Rare combinations show up because each seed turns on its own few.

use std::fmt;
use std::time::Duration;

use convoy_core::{Drain, KeylessPolicy, SourceId};

/// The consumer group every member joins.
pub const GROUP: &str = "sim";
/// The dead-letter destination.
pub const DLQ: &str = "sim.dlq";
/// The topic a transforming world's outputs go to.
pub const OUT: &str = "sim.out";

/// A topic of the world.
#[derive(Clone, Debug)]
pub struct TopicPlan {
    pub name: String,
    pub partitions: u32,
}

/// How often each fault fires: per step for the world's faults, per message (or attempt) for
/// the handler's and the producers'. Zero is off.
#[derive(Clone, Debug, Default)]
pub struct Rates {
    /// A member is killed (dropped without a drain, as `kill -9`) and, later, started again.
    pub crash: f64,
    /// A member stops gracefully (SIGTERM), or a new one joins.
    pub stop: f64,
    pub join: f64,
    /// A member's connection drops: its sources are lost, then reassigned after the session
    /// timeout.
    pub lose: f64,
    /// Commits fail, or hang until the engine's commit timeout.
    pub commit_fail: f64,
    pub commit_hang: f64,
    /// A source's fetches are delayed for a while.
    pub fetch_delay: f64,
    /// The dead-letter destination refuses, or hangs, publishes for a while.
    pub sink_fail: f64,
    pub sink_hang: f64,
    /// Reading the dead-letter destination back fails, or hangs, for a while.
    pub read_back_fail: f64,
    pub read_back_hang: f64,
    /// The operator replays a parked key; a replay tool dies part-way (resumed later).
    pub replay: f64,
    pub partial_replay: f64,
    /// An operator pauses a source or a key of one member for a while (resumed later).
    pub operator_pause: f64,
    /// Per attempt: the handler fails transiently, terminally, panics, or hangs (until healed
    /// or cancelled).
    pub transient: f64,
    pub terminal: f64,
    pub panic: f64,
    pub hang: f64,
    /// Per message: published without a key, with the empty key `""`, without an event id (a
    /// foreign producer), or twice with one id (a producer's retry).
    pub keyless: f64,
    pub empty_key: f64,
    pub no_id: f64,
    pub duplicate: f64,
}

/// Everything a seed decides up front.
#[derive(Clone, Debug)]
pub struct Plan {
    pub seed: u64,
    /// Members started at first, and the most alive at once.
    pub members: usize,
    pub max_members: usize,
    pub topics: Vec<TopicPlan>,
    pub keys: usize,
    pub messages: usize,
    /// Steps of the faulty phase (each advances the clock a little and may inject a fault).
    pub steps: usize,
    pub park_keys: bool,
    /// Records a read-back reads past its group's checkpoint before it saves a new one (small
    /// in half of the seeds, so that checkpoints are saved and read back).
    pub park_checkpoint_after: usize,
    /// The members run a transform whose outputs commit in transactions (exactly once); its
    /// transactions carry at most `transaction_bytes`, and what members hold (staged outputs
    /// included) is bounded by `bytes_high`.
    pub transform: bool,
    /// Offsets count deliveries and name no position (an AMQP channel's): no event id derives
    /// from them.
    pub delivery_offsets: bool,
    /// Every this many messages a partition's next offset is skipped (`None`: offsets follow
    /// one another): a Kafka transaction's marker, or NATS, whose partitions share one stream's
    /// sequence — nothing may assume the offset after a message is the next one's.
    pub offset_gap_every: Option<u64>,
    pub transaction_bytes: usize,
    pub bytes_high: usize,
    pub stuck_timeout: Option<Duration>,
    pub keyless: KeylessPolicy,
    pub drain: Drain,
    /// The broker hands a revoked source on this long after asking, acknowledged or not.
    pub rebalance_timeout: Duration,
    /// A lost member's sources are handed on this long after its connection dropped.
    pub session_timeout: Duration,
    /// Back-pressure bounds, small so that pausing happens.
    pub source_high: usize,
    pub total_high: usize,
    pub rates: Rates,
}

impl Plan {
    /// Every source of the consumed topics.
    pub fn sources(&self) -> Vec<SourceId> {
        self.topics
            .iter()
            .flat_map(|t| (0..t.partitions).map(|q| SourceId::partition(&t.name, q)))
            .collect()
    }
}

impl Plan {
    /// The plan of `seed`.
    pub fn of(seed: u64) -> Plan {
        let mut rng = fastrand::Rng::with_seed(seed);
        let topic_count = 1 + usize::from(rng.f64() < 0.35);
        let topics = (0..topic_count)
            .map(|i| TopicPlan {
                name: format!("t{i}"),
                partitions: rng.u32(1..=4),
            })
            .collect();
        // Swarm testing: each kind is on in about half of the seeds, at a rate of its own.
        let mut on = |low: f64, high: f64| -> f64 {
            if rng.bool() {
                low + rng.f64() * (high - low)
            } else {
                0.0
            }
        };
        let rates = Rates {
            crash: on(0.01, 0.06),
            stop: on(0.01, 0.05),
            join: on(0.02, 0.08),
            lose: on(0.01, 0.05),
            commit_fail: on(0.02, 0.1),
            commit_hang: on(0.01, 0.05),
            fetch_delay: on(0.02, 0.1),
            sink_fail: on(0.02, 0.1),
            sink_hang: on(0.01, 0.05),
            read_back_fail: on(0.02, 0.1),
            read_back_hang: on(0.01, 0.05),
            replay: on(0.02, 0.1),
            partial_replay: on(0.01, 0.05),
            transient: on(0.02, 0.2),
            terminal: on(0.01, 0.06),
            panic: on(0.005, 0.03),
            hang: on(0.005, 0.03),
            keyless: on(0.02, 0.15),
            empty_key: on(0.02, 0.15),
            no_id: on(0.05, 0.5),
            duplicate: on(0.02, 0.1),
            operator_pause: 0.0,
        };
        let members = rng.usize(1..=3);
        let transform = rng.f64() < 0.3;
        // Drawn apart, so that adding it left every other choice of a seed as it was.
        let mut apart = fastrand::Rng::with_seed(seed ^ 0x9e37_79b9_7f4a_7c15);
        let park_checkpoint_after = if apart.bool() {
            apart.usize(1..=6)
        } else {
            convoy_core::parking::CHECKPOINT_AFTER
        };
        let operator_pause = if apart.bool() {
            0.02 + apart.f64() * 0.08
        } else {
            0.0
        };
        let rates = Rates {
            operator_pause,
            ..rates
        };
        let offset_gap_every = apart.bool().then(|| apart.u64(1..=4));
        Plan {
            seed,
            members,
            max_members: 4,
            topics,
            keys: rng.usize(1..=10),
            messages: rng.usize(20..=160),
            steps: rng.usize(40..=140),
            // An exactly-once transform does not park keys (refused at start).
            park_keys: rng.f64() < 0.4 && !transform,
            park_checkpoint_after,
            transform,
            delivery_offsets: rng.f64() < 0.2,
            offset_gap_every,
            transaction_bytes: rng.usize(100..=2000),
            bytes_high: rng.usize(2000..=20_000),
            stuck_timeout: rng.bool().then(|| Duration::from_millis(rng.u64(300..=3000))),
            keyless: match rng.u8(0..3) {
                0 => KeylessPolicy::PerSource,
                1 => KeylessPolicy::Unordered,
                _ => KeylessPolicy::DeadLetter,
            },
            drain: if rng.bool() {
                Drain::InFlight
            } else {
                Drain::Buffered
            },
            rebalance_timeout: Duration::from_millis(rng.u64(1500..=6000)),
            session_timeout: Duration::from_millis(rng.u64(200..=1500)),
            source_high: rng.usize(4..=64),
            total_high: rng.usize(16..=256),
            rates,
        }
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let topics: Vec<String> = self
            .topics
            .iter()
            .map(|t| format!("{}×{}", t.name, t.partitions))
            .collect();
        write!(
            f,
            "seed {}: {} members (≤ {}), topics {}, {} keys, {} messages, {} steps, park_keys {} (checkpoint after {}), transform {}, delivery offsets {}, offset gap every {:?}, stuck {:?}, keyless {:?}, drain {:?}, rebalance {:?}, session {:?}, bounds {}/{}",
            self.seed,
            self.members,
            self.max_members,
            topics.join(" "),
            self.keys,
            self.messages,
            self.steps,
            self.park_keys,
            self.park_checkpoint_after,
            self.transform,
            self.delivery_offsets,
            self.offset_gap_every,
            self.stuck_timeout,
            self.keyless,
            self.drain,
            self.rebalance_timeout,
            self.session_timeout,
            self.source_high,
            self.total_high,
        )?;
        write!(f, "\n  faults: {:?}", self.rates)
    }
}
