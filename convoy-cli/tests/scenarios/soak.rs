//! The soak: a long load under a seeded schedule of faults, every sequence verified.
//!
//! - **Load**: convoy's publisher sends probe messages over Zipf-skewed keys (s = 1.0, `z-<i>`)
//!   in stamped batches at a held rate, and a foreign client's rounds (no convoy stamps, keys
//!   `key-<k>`) add about a tenth more.
//! - **Members**: four `convoy consume --park-keys` processes of one group, all appending to one
//!   log. Their handler fails 1 % of the messages transiently on the first attempt (retried in
//!   the lane) and 0.01 % terminally, chosen from the seed, key and sequence number
//!   (`FaultPlan`), so the verifier knows which. A terminal failure parks its key: the message
//!   is dead-lettered and every later one of the key set aside, until a replay (which the
//!   handler no longer fails terminally: the cause counts as fixed).
//! - **Faults**, from the seed, each once the load has moved on (by messages published): a
//!   member killed with SIGKILL and replaced, stopped with SIGTERM and replaced, frozen
//!   (SIGSTOP) past its session and thawed, the broker restarted (the test's closure), and
//!   `convoy dlq replay --key …` of the keys parked then. Each kind happens at least once when
//!   there are five faults or more. The first member is the *witness*: it is frozen like any
//!   other but never killed or stopped, so one process lives through the whole load.
//! - **The end**: once the load is published, `convoy dlq replay` of the keys still parked,
//!   again until every message was handled and no key is parked.
//! - **The verifier** replays the log: every published (key, seq) handled at least once — the
//!   seed's failed messages and those set aside behind them through their replays — and no
//!   key's order violated. The dead-letter topic holds every message the seed fails, failed
//!   (`terminal`, the handler's error) or set aside behind its parked key (`parked`), nothing
//!   else but what was set aside behind a parked key, and each of them replayed exactly once.
//!   Then a fresh member is given one more message on every key and must handle those and
//!   nothing else: the group's commits had reached the end of every partition.
//! - **Memory**: every member's RSS is sampled throughout, into a CSV under `CONVOY_SOAK_OUT`
//!   when it is set, and summarised in the report, with the witness's RSS once a tenth of the
//!   load was handled beside its RSS at the end (flat: within 10 %).
//!
//! CI runs 200,000 messages per broker; `scripts/soak` runs it long (RELIABILITY.md).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use convoy_testkit::probe::{decode_seq, probe_batch_spread};
use convoy_testkit::{FaultPlan, KeySpread, OrderChecker};

use super::failover::{foreign_producer, Handled, Rounds};
use super::processes::{Log, Member};

/// Fraction of messages failing transiently on their first attempt.
const TRANSIENT_RATE: f64 = 0.01;
/// Fraction of messages failing terminally.
const TERMINAL_RATE: f64 = 0.0001;
/// Keys of the foreign producer's rounds.
const FOREIGN_KEYS: usize = 40;
/// The foreign producer's share of the load.
const FOREIGN_SHARE: f64 = 0.1;
/// Messages per batch of convoy's publisher.
const BATCH: usize = 500;
/// Longest the handled messages may stay the same while some are due, before the soak fails.
const STALL_LIMIT: Duration = Duration::from_secs(180);
/// How often progress is read and RSS sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// The member never killed or stopped (the first started).
const WITNESS: usize = 0;
/// Most keys one `convoy dlq replay` names.
const KEYS_PER_REPLAY: usize = 100;
/// How often the end of the soak replays the keys still parked.
const REPLAY_EVERY: Duration = Duration::from_secs(2);

/// The size and seed of a soak.
#[derive(Clone, Debug)]
pub struct SoakPlan {
    /// Messages from convoy's publisher.
    pub messages: u64,
    /// Zipf-skewed keys of convoy's publisher.
    pub keys: usize,
    /// Members of the group.
    pub members: usize,
    /// Faults injected.
    pub faults: usize,
    /// Seed of the faults' schedule and of the handler's failures.
    pub seed: u64,
    /// convoy's publisher's rate (messages per second).
    pub rate: u64,
    /// How long a frozen member stays frozen: past its session or lease.
    pub freeze_for: Duration,
    /// Where the RSS samples go (`soak-<topic>.csv`), if anywhere.
    pub out: Option<PathBuf>,
    /// How often an operator replays the keys parked then while the load runs (besides the
    /// schedule's replays), if at all: a parked key's backlog, held by every member, then
    /// stays bounded as it does where someone watches the parked keys — what lets the RSS
    /// say whether anything else grows.
    pub replay_every: Option<Duration>,
}

impl SoakPlan {
    /// CI's size (200,000 messages over 10,000 keys, 8 faults, 5,000 msg/s, seed 38, an
    /// operator's replays every 60 s), each overridden by `CONVOY_SOAK_MESSAGES`, `_KEYS`,
    /// `_FAULTS`, `_RATE`, `_SEED` and `_REPLAY_EVERY` (seconds; 0 for none);
    /// `CONVOY_SOAK_OUT` names the samples' directory.
    pub fn from_env(freeze_for: Duration) -> SoakPlan {
        let var = |name: &str, default: u64| {
            std::env::var(name).map_or(default, |v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
            })
        };
        SoakPlan {
            messages: var("CONVOY_SOAK_MESSAGES", 200_000),
            keys: var("CONVOY_SOAK_KEYS", 10_000) as usize,
            members: 4,
            faults: var("CONVOY_SOAK_FAULTS", 8) as usize,
            seed: var("CONVOY_SOAK_SEED", 38),
            rate: var("CONVOY_SOAK_RATE", 5_000).max(1),
            freeze_for,
            out: std::env::var_os("CONVOY_SOAK_OUT").map(PathBuf::from),
            replay_every: Some(var("CONVOY_SOAK_REPLAY_EVERY", 60))
                .filter(|&s| s > 0)
                .map(Duration::from_secs),
        }
    }

    fn handler_faults(&self) -> FaultPlan {
        FaultPlan {
            seed: self.seed,
            transient_rate: TRANSIENT_RATE,
            transient_attempts: 1,
            terminal_rate: TERMINAL_RATE,
            ..FaultPlan::default()
        }
    }

    fn member_args(&self) -> Vec<String> {
        vec![
            "--transient-rate".into(),
            TRANSIENT_RATE.to_string(),
            "--terminal-rate".into(),
            TERMINAL_RATE.to_string(),
            "--fault-seed".into(),
            self.seed.to_string(),
            "--park-keys".into(),
        ]
    }
}

/// The topic's partitions: `CONVOY_SOAK_PARTITIONS`, else `default`.
pub fn partitions(default: u32) -> u32 {
    std::env::var("CONVOY_SOAK_PARTITIONS").map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("CONVOY_SOAK_PARTITIONS={v:?} is not a number"))
    })
}

/// One kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SoakFault {
    /// A member killed with SIGKILL (no drain, no commit, no leave) and replaced.
    Kill,
    /// A member stopped with SIGTERM (drain, commit, leave) and replaced.
    Terminate,
    /// A member frozen with SIGSTOP past its session, then thawed.
    Freeze,
    /// The broker (or the cluster's node) restarted.
    BrokerRestart,
    /// `convoy dlq replay` of the keys parked then (waiting for one if none is).
    Replay,
}

/// The seed's schedule: each kind once (in a seeded order) when `n` ≥ 5, then kills most
/// often, restarts and replays least.
pub fn schedule(seed: u64, n: usize) -> Vec<SoakFault> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut kinds = vec![
        SoakFault::Kill,
        SoakFault::Terminate,
        SoakFault::Freeze,
        SoakFault::BrokerRestart,
        SoakFault::Replay,
    ];
    rng.shuffle(&mut kinds);
    while kinds.len() < n {
        kinds.push(match rng.u32(0..20) {
            0..=7 => SoakFault::Kill,
            8..=12 => SoakFault::Terminate,
            13..=15 => SoakFault::Freeze,
            16..=17 => SoakFault::BrokerRestart,
            _ => SoakFault::Replay,
        });
    }
    kinds.truncate(n);
    kinds
}

/// What a soak saw.
#[derive(Debug)]
pub struct SoakReport {
    /// Messages published by convoy's publisher and by the foreign one (confirmed).
    pub published: (u64, u64),
    /// Lines the members printed, duplicates included.
    pub handled_lines: usize,
    /// Messages handled more than once (re-handled after a fault).
    pub handled_again: usize,
    /// Messages the seed fails, and the distinct ones found in the dead-letter topic.
    pub dead_letters: (usize, usize),
    /// Keys parked (a terminal failure's), and the distinct messages set aside behind them.
    pub parked: (usize, usize),
    /// Keys replayed by `convoy dlq replay` during the load and after it (a key replayed twice
    /// counts twice).
    pub replayed_keys: (usize, usize),
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, usize>,
    /// Per member started (in start order): RSS in MiB when first and last sampled, and its
    /// peak.
    pub rss_mib: Vec<(f64, f64, f64)>,
    /// The witness's RSS in MiB once a tenth of the load was handled, and at the end.
    pub witness_mib: (f64, f64),
    /// From the first message published until the last verification.
    pub wall: Duration,
}

/// A member and its RSS samples.
struct Tracked {
    member: Member,
    index: usize,
}

/// The run in progress, shared with the fault thread.
struct Run {
    url: String,
    log: PathBuf,
    plan: SoakPlan,
    members: Mutex<Vec<Tracked>>,
    handled: Mutex<Handled>,
    /// Per member started (its index is its start order): (first, last, peak) RSS in KiB.
    rss: Mutex<Vec<(u64, u64, u64)>>,
    /// The witness's RSS in KiB once a tenth of the load was handled (as many messages as a
    /// tenth of convoy's publisher's).
    witness_at_tenth: Mutex<Option<u64>>,
    csv: Mutex<Option<std::fs::File>>,
    began: Instant,
    /// Messages convoy's publisher has sent (confirmed).
    sent: Arc<AtomicU64>,
    /// Keys replayed during the load and after it.
    replayed: (AtomicUsize, AtomicUsize),
    /// The test's runtime, for the dead-letter topic's reads from blocking threads.
    runtime: tokio::runtime::Handle,
}

impl Run {
    fn start_member(&self) -> Tracked {
        let args = self.plan.member_args();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let member = Member::start_with(&self.url, &self.log, &args);
        let mut rss = self.rss.lock().unwrap();
        rss.push((0, 0, 0));
        Tracked {
            member,
            index: rss.len() - 1,
        }
    }

    /// Reads the log, samples every member's RSS; returns the distinct messages handled.
    fn sample(&self) -> usize {
        let handled = {
            let mut handled = self.handled.lock().unwrap();
            handled.read();
            handled.distinct.len()
        };
        let elapsed = self.began.elapsed().as_secs_f64();
        let members = self.members.lock().unwrap();
        let mut rss = self.rss.lock().unwrap();
        let mut csv = self.csv.lock().unwrap();
        for tracked in members.iter() {
            // Nothing mapped yet right after the spawn: no sample.
            let Some(kib) = rss_kib(tracked.member.0.id()).filter(|&kib| kib > 0) else {
                continue;
            };
            let entry = &mut rss[tracked.index];
            if entry.0 == 0 {
                entry.0 = kib;
            }
            entry.1 = kib;
            entry.2 = entry.2.max(kib);
            if tracked.index == WITNESS && handled as u64 >= self.plan.messages / 10 {
                self.witness_at_tenth.lock().unwrap().get_or_insert(kib);
            }
            if let Some(file) = csv.as_mut() {
                let _ = writeln!(file, "{elapsed:.2},{handled},{},{kib}", tracked.index);
            }
        }
        handled
    }

    /// Blocks until `done` (given the distinct messages handled) holds, sampling, and running
    /// `meanwhile` every [`REPLAY_EVERY`] if given; fails after a stall of what was handled.
    fn wait_until(&self, what: &str, done: impl Fn(usize) -> bool, meanwhile: Option<&dyn Fn()>) {
        let (mut last, mut since) = (0, Instant::now());
        let mut ran = Instant::now();
        loop {
            let handled = self.sample();
            if done(handled) {
                return;
            }
            if handled > last {
                (last, since) = (handled, Instant::now());
            }
            assert!(
                since.elapsed() < STALL_LIMIT,
                "the soak stalled at {handled} handled ({what}); members' stderr:\n{}",
                self.stderr()
            );
            if let Some(meanwhile) = meanwhile.filter(|_| ran.elapsed() >= REPLAY_EVERY) {
                meanwhile();
                ran = Instant::now();
            }
            std::thread::sleep(SAMPLE_EVERY);
        }
    }

    /// The keys parked now with no replay under way, as the dead-letter topic records them
    /// (read again through a broker's restart).
    fn parked_keys(&self) -> Vec<String> {
        self.parked(|parking| parking.replaying().is_none())
    }

    /// The keys parked now that `pick` picks.
    fn parked(&self, pick: impl Fn(&convoy::parking::KeyParking) -> bool) -> Vec<String> {
        self.read_parked()
            .iter()
            .filter(|(_, parking)| parking.is_parked() && pick(parking))
            .map(|(key, _)| String::from_utf8_lossy(key).into_owned())
            .collect()
    }

    /// The operator's replay, if one is due (`last` is when the one before ran): the keys
    /// parked now with no replay under way, each replayed; logs how many records waited.
    fn replay_if_due(&self, last: &Mutex<Instant>) {
        let Some(every) = self.plan.replay_every else {
            return;
        };
        if last.lock().unwrap().elapsed() < every {
            return;
        }
        let parked = self.read_parked();
        let idle: Vec<_> = parked
            .iter()
            .filter(|(_, p)| p.is_parked() && p.replaying().is_none())
            .collect();
        let waiting: usize = idle.iter().map(|(_, p)| p.pending()).sum();
        let keys: Vec<String> = idle
            .iter()
            .map(|(key, _)| String::from_utf8_lossy(key).into_owned())
            .collect();
        let n = self.replay(&keys);
        self.replayed.0.fetch_add(n, SeqCst);
        eprintln!(
            "soak: an operator replayed {n} parked keys ({waiting} records waiting) at {:.1?}",
            self.began.elapsed()
        );
        *last.lock().unwrap() = Instant::now();
    }

    /// The group's parked keys as the dead-letter topic records them (read again through a
    /// broker's restart).
    fn read_parked(&self) -> convoy::parking::ParkedKeys {
        let read = || async {
            let connection = convoy::connect(&self.url).await?;
            convoy::dlq::parked(&connection).await
        };
        let mut attempts = 0;
        let keys = loop {
            match self.runtime.block_on(read()) {
                Ok(keys) => break keys,
                Err(e) if attempts < 30 => {
                    attempts += 1;
                    eprintln!("soak: the parked keys not read ({e}); reading again");
                    std::thread::sleep(Duration::from_secs(1));
                }
                Err(e) => panic!("the parked keys could not be read: {e}"),
            }
        };
        keys
    }

    /// What the dead-letter topic holds of `keys` and what it says of their parking: what a
    /// failure of the end's replays is read from.
    fn describe(&self, keys: &[String]) -> String {
        use convoy::parking::{DL_PARK_ID, REPLAY, REPLAY_OF, REPLAY_OF_PART, REPLAY_PART};
        let read = async {
            let connection = convoy::connect(&self.url).await?;
            let records = connection.dead_letter_sink()?.read_back().await?;
            Ok::<_, Box<dyn std::error::Error>>((connection.endpoint().group.clone(), records))
        };
        let (group, records) = match self.runtime.block_on(read) {
            Ok(read) => read,
            Err(e) => return format!("(the dead-letter topic could not be read: {e})"),
        };
        let parked = convoy::parking::ParkedKeys::read(&group, &records);
        let mut out = String::new();
        for key in keys {
            let parking = parked.get(key.as_bytes());
            let replaying = parking.and_then(|p| p.replaying());
            out += &format!(
                "\n{key}: pending {:?}, replaying {:?} (topics {:?}, done {:?}), last replay {:?}\n",
                parking.map(|p| p.pending()),
                replaying.map(|r| (&r.id, r.count)),
                replaying.map(|r| r.topics.len()),
                replaying.map(|r| &r.done),
                parking.and_then(|p| p.last_replay()),
            );
            let header = |r: &convoy::Message, name: &str| r.headers.get_str(name).unwrap_or("-").to_owned();
            for r in records
                .iter()
                .filter(|r| r.key.as_deref() == Some(key.as_bytes()))
            {
                let mut of = header(r, REPLAY_OF);
                of.truncate(60);
                out += &format!(
                    "  @{} {} id={} replay={} part={} of_part={} of={of} seq={:?}\n",
                    r.offset,
                    header(r, convoy::dead_letter::DL_CAUSE),
                    header(r, DL_PARK_ID),
                    header(r, REPLAY),
                    header(r, REPLAY_PART),
                    header(r, REPLAY_OF_PART),
                    decode_seq(&r.payload),
                );
            }
        }
        out
    }

    /// `convoy dlq replay --key …` of `keys` (each parked, no replay under way); returns how
    /// many it replayed.
    fn replay(&self, keys: &[String]) -> usize {
        for chunk in keys.chunks(KEYS_PER_REPLAY) {
            let mut args = vec!["--url", self.url.as_str(), "dlq", "replay"];
            for key in chunk {
                args.extend(["--key", key.as_str()]);
            }
            let out = super::convoy(&args);
            assert!(
                out.status.success(),
                "`convoy dlq replay` of {} keys failed: {}",
                chunk.len(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        keys.len()
    }

    fn stderr(&self) -> String {
        let members = self.members.lock().unwrap();
        members
            .iter()
            .map(|t| format!("--- member {}:\n{}", t.index, tail(&t.member.stderr(), 15)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Runs one fault on a seeded member (never the witness, unless frozen).
    fn inject(&self, fault: SoakFault, rng: &mut fastrand::Rng, broker: &mut dyn FnMut()) {
        let target = match fault {
            SoakFault::Kill | SoakFault::Terminate => {
                let members = self.members.lock().unwrap();
                let others: Vec<usize> = (0..members.len())
                    .filter(|&i| members[i].index != WITNESS)
                    .collect();
                others[rng.usize(..others.len())]
            }
            _ => rng.usize(..self.plan.members),
        };
        eprintln!(
            "soak: {fault:?} at {:.1?} (member slot {target})",
            self.began.elapsed()
        );
        match fault {
            SoakFault::Kill | SoakFault::Terminate => {
                let old = self.members.lock().unwrap().remove(target);
                if fault == SoakFault::Kill {
                    old.member.kill();
                } else {
                    assert!(old.member.terminate(), "a member did not stop cleanly on SIGTERM");
                }
                let new = self.start_member();
                self.members.lock().unwrap().push(new);
            }
            SoakFault::Freeze => {
                let members = self.members.lock().unwrap();
                let frozen = &members[target].member;
                frozen.freeze();
                std::thread::sleep(self.plan.freeze_for);
                frozen.signal("CONT");
            }
            SoakFault::BrokerRestart => broker(),
            SoakFault::Replay => {
                // None parked yet (or each under a replay): the load parks more.
                let began = Instant::now();
                let mut keys = self.parked_keys();
                while keys.is_empty() {
                    assert!(
                        began.elapsed() < STALL_LIMIT,
                        "no key was parked to replay in {STALL_LIMIT:?}"
                    );
                    self.sample();
                    std::thread::sleep(REPLAY_EVERY);
                    keys = self.parked_keys();
                }
                let n = self.replay(&keys);
                self.replayed.0.fetch_add(n, SeqCst);
                eprintln!("soak: replayed {n} parked keys during the load");
            }
        }
    }
}

/// Runs the soak on `url` (naming the group and `topic`), the foreign producer's program
/// `foreign` (as [`super::failover::Producer::Foreign`]), and `broker` restarting the broker;
/// asserts the outcome and returns what it saw.
pub async fn soak(
    url: &str,
    topic: &str,
    plan: SoakPlan,
    foreign: Vec<String>,
    mut broker: impl FnMut() + Send + 'static,
) -> SoakReport {
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let log = Log::new(topic);
    let csv = plan.out.as_ref().map(|dir| {
        std::fs::create_dir_all(dir).unwrap();
        let mut file = std::fs::File::create(dir.join(format!("soak-{topic}.csv"))).unwrap();
        writeln!(file, "elapsed_s,handled,member,rss_kib").unwrap();
        file
    });
    let run = Arc::new(Run {
        url: url.to_owned(),
        log: log.0.clone(),
        plan: plan.clone(),
        members: Mutex::default(),
        handled: Mutex::new(Handled::new(log.0.clone())),
        rss: Mutex::default(),
        witness_at_tenth: Mutex::default(),
        csv: Mutex::new(csv),
        began: Instant::now(),
        sent: Arc::default(),
        replayed: Default::default(),
        runtime: tokio::runtime::Handle::current(),
    });
    for _ in 0..plan.members {
        let member = run.start_member();
        run.members.lock().unwrap().push(member);
    }

    let checker = Arc::new(OrderChecker::with_capacity(plan.keys + FOREIGN_KEYS));
    let spread = KeySpread::zipf(plan.keys, 1.0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let confirms = Arc::new(Mutex::new(Vec::new()));
    let foreign_rate = plan.rate as f64 * FOREIGN_SHARE / (1.0 - FOREIGN_SHARE);
    let rounds = Rounds {
        keys: FOREIGN_KEYS,
        pause: Duration::from_secs_f64(FOREIGN_KEYS as f64 / foreign_rate),
    };
    let foreign = foreign_producer(foreign, rounds, &log.0, &checker, &stop, &confirms);
    let producer = tokio::spawn(produce(
        connection.publisher(topic).unwrap(),
        checker.clone(),
        spread.clone(),
        plan.clone(),
        run.sent.clone(),
    ));

    let faults = {
        let run = run.clone();
        tokio::task::spawn_blocking(move || {
            let mut rng = fastrand::Rng::with_seed(run.plan.seed);
            let kinds = schedule(run.plan.seed, run.plan.faults);
            // By messages published, not handled: a parked key's wait for its replay.
            let step = run.plan.messages / (kinds.len() as u64 + 1);
            let operator = Mutex::new(Instant::now());
            let replay = || run.replay_if_due(&operator);
            for (i, fault) in kinds.iter().enumerate() {
                let due = step * (i as u64 + 1);
                run.wait_until("before a fault", |_| run.sent.load(SeqCst) >= due, Some(&replay));
                run.inject(*fault, &mut rng, &mut broker);
            }
            kinds
        })
    };
    let kinds = match faults.await {
        Ok(kinds) => kinds,
        Err(e) => {
            stop.store(true, SeqCst);
            std::panic::resume_unwind(e.into_panic());
        }
    };
    producer.await.unwrap();
    stop.store(true, SeqCst);
    foreign.await.unwrap();

    // Everything published: convoy's keys by the spread, the foreign keys by confirmed rounds.
    let rounds_confirmed = confirms.lock().unwrap().len() as u64;
    let mut published: HashMap<String, u64> = spread
        .counts(plan.messages)
        .into_iter()
        .enumerate()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| (format!("z-{k}"), n))
        .collect();
    published.extend((0..FOREIGN_KEYS).map(|k| (format!("key-{k}"), rounds_confirmed)));
    let handler_faults = plan.handler_faults();
    let fated: HashSet<(String, u64)> = published
        .iter()
        .flat_map(|(key, n)| (0..*n).map(move |seq| (key.clone(), seq)))
        .filter(|(key, seq)| handler_faults.fails_terminally(key.as_bytes(), *seq))
        .collect();
    let total: u64 = published.values().sum();
    // The keys still parked are replayed until every message was handled and none is parked.
    let end = {
        let run = run.clone();
        tokio::task::spawn_blocking(move || {
            let replay = || {
                let n = run.replay(&run.parked_keys());
                run.replayed.1.fetch_add(n, SeqCst);
            };
            let all = |handled| handled as u64 >= total;
            run.wait_until("the end of the load and its replays", all, Some(&replay));
            let began = Instant::now();
            loop {
                let parked = run.parked(|_| true);
                if parked.is_empty() {
                    break;
                }
                assert!(
                    began.elapsed() < STALL_LIMIT,
                    "every message was handled but keys stay parked: {parked:?}{}",
                    run.describe(&parked)
                );
                std::thread::sleep(REPLAY_EVERY);
                replay();
            }
        })
    };
    if let Err(e) = end.await {
        std::panic::resume_unwind(e.into_panic());
    }
    let members = std::mem::take(&mut *run.members.lock().unwrap());
    for tracked in members {
        assert!(tracked.member.leave(), "a member did not leave cleanly");
    }

    // The log: every message handled (the seed's failed ones and those set aside behind them
    // through their keys' replays), in its key's order.
    let handled = std::mem::replace(&mut *run.handled.lock().unwrap(), Handled::new(PathBuf::new()));
    for (key, seq) in &handled.lines {
        checker.handled(key.as_bytes(), *seq, None);
    }
    let report = checker.report();
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.order_violations, 0, "{report:#?}");
    assert_eq!(report.finished, total, "{report:#?}");

    // The dead-letter topic: every message the seed fails, failed with the handler's error or
    // set aside behind its parked key; nothing else but what was set aside behind a parked
    // key; each replayed exactly once.
    let records = convoy::dlq::all(&connection).await.unwrap();
    let mut failed = HashSet::new();
    let mut set_aside = HashSet::new();
    for r in &records {
        let key = String::from_utf8_lossy(r.message.key.as_deref().unwrap_or_default()).into_owned();
        let seq = decode_seq(&r.message.payload).expect("a dead letter's payload is its probe's");
        let at = format!("dead letter {key}/{seq} ({} {:?})", r.cause, r.error);
        match r.cause.as_str() {
            "terminal" => {
                assert!(
                    r.error.contains("injected terminal failure") && fated.contains(&(key.clone(), seq)),
                    "{at}: the seed does not fail it"
                );
                failed.insert((key, seq));
            }
            "parked" => {
                set_aside.insert((key, seq));
            }
            _ => panic!("{at}: not a failure the seed injects, nor set aside behind a parked key"),
        }
        assert_eq!(r.replays, 1, "{at} was replayed {} times, not once", r.replays);
    }
    let parked_keys: HashSet<&str> = failed.iter().map(|(key, _)| key.as_str()).collect();
    let stray: Vec<_> = set_aside
        .iter()
        .filter(|(key, _)| !parked_keys.contains(key.as_str()))
        .collect();
    assert!(stray.is_empty(), "set aside behind no parked key: {stray:?}");
    let missing: Vec<_> = fated
        .iter()
        .filter(|m| !failed.contains(*m) && !set_aside.contains(*m))
        .collect();
    assert!(
        missing.is_empty(),
        "messages the seed fails are not in the dead-letter topic: {missing:?}"
    );
    let found = fated.len() - missing.len();

    let unhandled_after_end = commits_reached_the_end(url, topic, &published).await;
    assert!(
        unhandled_after_end.is_empty(),
        "a fresh member handled messages of before the end: the group's commits had not reached them: {:?}",
        &unhandled_after_end[..unhandled_after_end.len().min(10)]
    );

    let mut faults = BTreeMap::new();
    for kind in &kinds {
        *faults.entry(format!("{kind:?}")).or_default() += 1;
    }
    let mib = |kib: u64| (kib as f64 / 1024.0 * 10.0).round() / 10.0;
    let witness_at_end = run.rss.lock().unwrap()[WITNESS].1;
    let witness_mib = (
        mib(run.witness_at_tenth.lock().unwrap().unwrap_or_default()),
        mib(witness_at_end),
    );
    let soak = SoakReport {
        published: (plan.messages, rounds_confirmed * FOREIGN_KEYS as u64),
        handled_lines: handled.lines.len(),
        handled_again: handled.lines.len() - handled.distinct.len(),
        dead_letters: (fated.len(), found),
        parked: (parked_keys.len(), set_aside.len()),
        replayed_keys: (run.replayed.0.load(SeqCst), run.replayed.1.load(SeqCst)),
        faults,
        rss_mib: run
            .rss
            .lock()
            .unwrap()
            .iter()
            .map(|(first, last, peak)| (mib(*first), mib(*last), mib(*peak)))
            .collect(),
        witness_mib,
        wall: run.began.elapsed(),
    };
    eprintln!("{soak}");
    soak
}

impl std::fmt::Display for SoakReport {
    /// The report in a few lines, as RELIABILITY.md quotes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (convoy, foreign) = self.published;
        writeln!(
            f,
            "soak: published {} ({convoy} by convoy, {foreign} by the foreign producer); handled lines {}, handled again {}; lost 0, order violations 0",
            convoy + foreign,
            self.handled_lines,
            self.handled_again,
        )?;
        writeln!(
            f,
            "soak: dead letters {} found of {} the seed fails; {} keys parked, {} messages set aside behind them; keys replayed {} during the load, {} after it; every dead letter replayed once and handled",
            self.dead_letters.1,
            self.dead_letters.0,
            self.parked.0,
            self.parked.1,
            self.replayed_keys.0,
            self.replayed_keys.1
        )?;
        writeln!(f, "soak: faults {:?}; wall {:.1?}", self.faults, self.wall)?;
        let members: Vec<String> = self
            .rss_mib
            .iter()
            .enumerate()
            .map(|(i, (first, last, peak))| format!("m{i} {first}/{last}/{peak}"))
            .collect();
        writeln!(
            f,
            "soak: RSS MiB per member, first/last/peak: {}",
            members.join(", ")
        )?;
        let (tenth, end) = self.witness_mib;
        write!(
            f,
            "soak: the witness (m{WITNESS}, never killed or stopped): RSS {tenth} MiB once a tenth of the load was handled, {end} MiB at the end ({:+.1} %)",
            (end / tenth - 1.0) * 100.0
        )
    }
}

/// convoy's publisher: `plan.messages` probe messages over `spread`'s keys (`z-<i>`), in
/// stamped batches (a batch sent again carries the same event ids) held to `plan.rate`,
/// counting in `confirmed` what was confirmed.
async fn produce(
    publisher: Arc<dyn convoy::Publisher>,
    checker: Arc<OrderChecker>,
    spread: KeySpread,
    plan: SoakPlan,
    confirmed: Arc<AtomicU64>,
) {
    let began = tokio::time::Instant::now();
    let mut sent = 0;
    while sent < plan.messages {
        let count = (plan.messages - sent).min(BATCH as u64) as usize;
        let mut batch = probe_batch_spread(&checker, "z-", &spread, sent as usize, count, 0);
        batch.iter_mut().for_each(convoy::OutgoingMessage::stamp);
        let mut attempts = 0;
        while let Err(e) = publisher.publish_all(batch.clone()).await {
            attempts += 1;
            if attempts == 1 || attempts % 50 == 0 {
                eprintln!("soak: a batch not confirmed ({e}); publishing it again");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        sent += count as u64;
        confirmed.store(sent, SeqCst);
        tokio::time::sleep_until(began + Duration::from_secs_f64(sent as f64 / plan.rate as f64)).await;
    }
}

/// Gives a fresh member (no injected failures) one more message on every key of `published`,
/// waits until it handled them all, and returns whatever else it handled: messages of before,
/// which it would read first on their key, had the group's commits not reached them.
async fn commits_reached_the_end(
    url: &str,
    topic: &str,
    published: &HashMap<String, u64>,
) -> Vec<(String, u64)> {
    let log = Log::new(&format!("{topic}-after"));
    let member = Member::start(url, &log.0);
    let connection = convoy::connect(url).await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    let mut markers: Vec<convoy::OutgoingMessage> = published
        .iter()
        .map(|(key, n)| convoy::OutgoingMessage::new(bytes::Bytes::from(key.clone()), n.to_string()))
        .collect();
    markers.iter_mut().for_each(convoy::OutgoingMessage::stamp);
    for chunk in markers.chunks(BATCH) {
        publisher.publish_all(chunk.to_vec()).await.unwrap();
    }
    tokio::task::block_in_place(|| log.wait_handled(published.len()));
    assert!(member.leave(), "the fresh member did not leave cleanly");
    log.lines()
        .into_iter()
        .filter(|(key, seq)| published.get(key) != Some(seq))
        .collect()
}

/// The resident set of process `pid` in KiB, if it still runs.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
