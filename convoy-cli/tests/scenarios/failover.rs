//! A broker losing nodes, and members killed, under load, the same on every broker: a producer
//! publishing in confirmed rounds (each key once per round, and a round that fails published
//! again — so a key's messages are never reordered), two `convoy consume` processes of one
//! group appending to one log, and the faults run mid-stream by the caller. The producer is
//! convoy's (a round stamped once, so a re-sent round is recognised as duplicates) or a
//! foreign one (a Python client sending no stamps: a re-sent round is handled again). Every confirmed message must be handled, in
//! per-key order; what each fault cost is reported as its time to recover: from the fault's
//! start until each message confirmed before it, and each of the round after, was handled (the
//! very messages, not a count that later ones could fill), beside how long the fault's action
//! took (a kill is instant, a controlled shutdown or a restart takes seconds), and the longest
//! pauses in handling and in the producer's confirmations.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use convoy_testkit::probe::probe_batch;
use convoy_testkit::OrderChecker;

use super::processes::{Log, Member};

/// Keys per round of the producer.
const KEYS: usize = 40;
/// The producer's pause between confirmed rounds: a steady load the loaded 2-core machine
/// carries beside three broker nodes.
const ROUND_PAUSE: Duration = Duration::from_millis(25);
/// Longest a fault may take to recover from before the scenario fails.
const RECOVER_WITHIN: Duration = Duration::from_secs(180);

/// What the scenario saw of the log: every distinct (key, seq) handled and when each round of
/// samples was taken.
pub struct Handled {
    file: PathBuf,
    offset: u64,
    /// Every line's (key, seq), in the log's order.
    pub lines: Vec<(String, u64)>,
    /// The distinct ones.
    pub distinct: HashSet<(String, u64)>,
    /// (when, distinct handled then), one sample per read.
    samples: Vec<(Instant, usize)>,
}

impl Handled {
    /// Nothing read of `file` yet.
    pub fn new(file: PathBuf) -> Handled {
        Handled {
            file,
            offset: 0,
            lines: Vec::new(),
            distinct: HashSet::new(),
            samples: Vec::new(),
        }
    }

    /// Reads what was appended since the last read.
    pub fn read(&mut self) {
        let Ok(mut file) = std::fs::File::open(&self.file) else {
            return;
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut reader = BufReader::new(file);
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
            if !line.ends_with('\n') {
                break; // half written: read it whole next time
            }
            self.offset += line.len() as u64;
            if let Some(entry) = super::processes::parse_line(&line) {
                self.distinct.insert(entry.clone());
                self.lines.push(entry);
            }
            line.clear();
        }
        self.samples.push((Instant::now(), self.distinct.len()));
    }
}

/// One fault: what it was, how long its action took, and how long recovering from it took.
#[derive(Debug, Clone)]
pub struct Fault {
    /// What was done.
    pub what: String,
    /// How long the action itself took (a restart waits for the node to run again).
    pub action: Duration,
    /// From the fault's start until the last of the messages it waited for was handled: each
    /// message confirmed before the fault and not yet handled then, and each of the next round.
    pub recovered_after: Duration,
    /// How many messages that was.
    pub waited_for: usize,
}

/// Who publishes the load.
pub enum Producer {
    /// convoy's publisher, on the scenario's URL.
    Convoy,
    /// A foreign client's program (`scripts/interop/*_rounds.py`) with its first arguments
    /// (broker address, topic, partitions); the scenario adds the keys per round, the pause
    /// between rounds and a stop file, and counts each `round <n>` it prints as confirmed.
    Foreign(Vec<String>),
}

/// What a fault closure can do while the load runs.
pub struct Progress {
    checker: Arc<OrderChecker>,
    handled: Mutex<Handled>,
    faults: Mutex<Vec<Fault>>,
    url: String,
    members: Mutex<Vec<Member>>,
    /// When each round of the producer was confirmed.
    confirms: Arc<Mutex<Vec<Instant>>>,
}

impl Progress {
    fn handled_count(&self) -> usize {
        let mut handled = self.handled.lock().unwrap();
        handled.read();
        handled.distinct.len()
    }

    /// Blocks until `more` further messages were handled (load flows between faults).
    pub fn let_flow(&self, more: usize) {
        let want = self.handled_count() + more;
        let deadline = Instant::now() + RECOVER_WITHIN;
        while self.handled_count() < want {
            assert!(Instant::now() < deadline, "handling stalled below {want}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the longest-running member with SIGKILL (no drain, no commit, no leave) and starts
    /// a new one in its place.
    pub fn kill_a_member(&self) {
        let log = self.handled.lock().unwrap().file.clone();
        let mut members = self.members.lock().unwrap();
        members.remove(0).kill();
        members.push(Member::start(&self.url, &log));
    }

    /// The messages of the rounds before `rounds`, and of that round, not handled yet.
    fn unhandled_up_to(&self, rounds: u64) -> HashSet<(String, u64)> {
        let mut handled = self.handled.lock().unwrap();
        handled.read();
        (0..KEYS)
            .flat_map(|k| (0..=rounds).map(move |seq| (format!("key-{k}"), seq)))
            .filter(|m| !handled.distinct.contains(m))
            .collect()
    }

    /// Runs `fault` (named `what`), then blocks until the cluster recovered from it: each
    /// message confirmed before the fault, and each of the next round, was handled. Records
    /// how long the action took and the time to recover, both from the fault's start.
    pub fn fault(&self, what: &str, fault: impl FnOnce()) {
        let began = Instant::now();
        // Rounds confirmed: each key's messages 0..rounds (its sequence is its round).
        let rounds = self.confirms.lock().unwrap().len() as u64;
        let mut waiting = self.unhandled_up_to(rounds);
        let waited_for = waiting.len();
        eprintln!("failover: {what}");
        fault();
        let action = began.elapsed();
        let deadline = began + RECOVER_WITHIN;
        loop {
            let unhandled = self.unhandled_up_to(rounds);
            waiting.retain(|m| unhandled.contains(m));
            if waiting.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "not recovered from `{what}` within {RECOVER_WITHIN:?}: {} of the {waited_for} messages it waited for are not handled, e.g. {:?}",
                waiting.len(),
                waiting.iter().next()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let fault = Fault {
            what: what.to_owned(),
            action,
            recovered_after: began.elapsed(),
            waited_for,
        };
        eprintln!(
            "failover: {what}: took {:.1?}; the {waited_for} messages it waited for were handled {:.1?} after it began",
            fault.action, fault.recovered_after
        );
        self.faults.lock().unwrap().push(fault);
    }
}

/// What a failover run measured.
#[derive(Debug)]
pub struct FailoverReport {
    /// Messages the producer had confirmed (all handled, in order).
    pub confirmed: u64,
    /// Lines the consumers printed (duplicates included).
    pub handled: usize,
    /// Messages handled more than once.
    pub twice: usize,
    /// Each fault and its time to recover.
    pub faults: Vec<Fault>,
    /// The longest time in which nothing new was handled.
    pub longest_handling_pause: Duration,
    /// The longest time between two confirmed rounds of the producer.
    pub longest_publish_pause: Duration,
}

/// Runs the load on `url` (naming the group, the topic and the broker's nodes) from `producer`,
/// calls `faults` on a thread of its own once the load flows, and checks the outcome when it
/// returns.
pub async fn failover(
    url: &str,
    topic: &str,
    producer: Producer,
    faults: impl FnOnce(&Progress) + Send + 'static,
) -> FailoverReport {
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let log = Log::new(topic);
    let checker = Arc::new(OrderChecker::new());
    let confirms = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let progress = Arc::new(Progress {
        checker: checker.clone(),
        handled: Mutex::new(Handled::new(log.0.clone())),
        faults: Mutex::default(),
        url: url.to_owned(),
        members: Mutex::new(vec![Member::start(url, &log.0), Member::start(url, &log.0)]),
        confirms: confirms.clone(),
    });

    let stop = Arc::new(AtomicBool::new(false));
    let producer = match producer {
        Producer::Convoy => convoy_producer(connection.publisher(topic).unwrap(), &checker, &stop, &confirms),
        Producer::Foreign(command) => {
            let rounds = Rounds {
                keys: KEYS,
                pause: ROUND_PAUSE,
            };
            foreign_producer(command, rounds, &log.0, &checker, &stop, &confirms)
        }
    };

    let run = {
        let progress = progress.clone();
        tokio::task::spawn_blocking(move || {
            progress.let_flow(KEYS * 20);
            faults(&progress);
            progress.let_flow(KEYS * 20);
        })
    };
    let outcome = run.await;
    stop.store(true, SeqCst);
    producer.await.unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
    let confirmed = checker.published() as usize;
    tokio::task::block_in_place(|| log.wait_handled(confirmed));
    let members = std::mem::take(&mut *progress.members.lock().unwrap());
    for member in members {
        assert!(member.leave(), "a member did not leave cleanly");
    }
    report(&progress, &checker, &confirms)
}

/// convoy's publisher sending rounds until `stop`.
fn convoy_producer(
    publisher: Arc<dyn convoy::Publisher>,
    checker: &Arc<OrderChecker>,
    stop: &Arc<AtomicBool>,
    confirms: &Arc<Mutex<Vec<Instant>>>,
) -> tokio::task::JoinHandle<()> {
    {
        let (stop, confirms, checker) = (stop.clone(), confirms.clone(), checker.clone());
        tokio::spawn(async move {
            let mut round = 0;
            while !stop.load(SeqCst) {
                let mut messages = probe_batch(&checker, "key-", KEYS, round * KEYS, KEYS, 0);
                // Stamped once: a round sent again carries the same event ids.
                messages.iter_mut().for_each(convoy::OutgoingMessage::stamp);
                let mut attempts = 0;
                while let Err(e) = publisher.publish_all(messages.clone()).await {
                    attempts += 1;
                    if attempts == 1 || attempts % 20 == 0 {
                        eprintln!("failover: round {round} not confirmed ({e}); publishing it again");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                confirms.lock().unwrap().push(Instant::now());
                round += 1;
                tokio::time::sleep(ROUND_PAUSE).await;
            }
        })
    }
}

/// A foreign producer's rounds: one message to each of `keys` keys (`key-<k>`), then `pause`.
#[derive(Clone, Copy)]
pub struct Rounds {
    /// Keys per round.
    pub keys: usize,
    /// The pause after each confirmed round.
    pub pause: Duration,
}

/// A foreign producer's program sending `rounds` until `stop`: every `round <n>` it prints is
/// a round confirmed, each of its messages registered with `checker`; it stops between
/// rounds once its stop file exists.
pub fn foreign_producer(
    mut command: Vec<String>,
    rounds: Rounds,
    log: &std::path::Path,
    checker: &Arc<OrderChecker>,
    stop: &Arc<AtomicBool>,
    confirms: &Arc<Mutex<Vec<Instant>>>,
) -> tokio::task::JoinHandle<()> {
    let stop_file = log.with_extension("producer-stop");
    let _ = std::fs::remove_file(&stop_file);
    command.extend([
        rounds.keys.to_string(),
        rounds.pause.as_millis().to_string(),
        stop_file.display().to_string(),
    ]);
    let mut child = Command::new(&command[0])
        .args(&command[1..])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("starting the foreign producer {command:?}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let (stop, confirms, checker) = (stop.clone(), confirms.clone(), checker.clone());
    tokio::task::spawn_blocking(move || {
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("round ") {
                    for k in 0..rounds.keys {
                        checker.expect(&bytes::Bytes::from(format!("key-{k}")));
                    }
                    confirms.lock().unwrap().push(Instant::now());
                }
            }
        });
        while !stop.load(SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::fs::write(&stop_file, b"stop").unwrap();
        let status = child.wait().unwrap();
        reader.join().unwrap();
        let _ = std::fs::remove_file(&stop_file);
        assert!(status.success(), "the foreign producer failed: {status}");
    })
}

/// Replays the log through the checker, reports the run and asserts its outcome.
fn report(progress: &Progress, checker: &OrderChecker, confirms: &Mutex<Vec<Instant>>) -> FailoverReport {
    let mut handled = progress.handled.lock().unwrap();
    handled.read();
    for (key, seq) in &handled.lines {
        checker.handled(key.as_bytes(), *seq, None);
    }
    let report = checker.report();
    let pause = |times: &[Instant]| times.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default();
    let progressed: Vec<Instant> = handled
        .samples
        .windows(2)
        .filter(|w| w[1].1 > w[0].1)
        .map(|w| w[1].0)
        .collect();
    let failover = FailoverReport {
        confirmed: report.published,
        handled: handled.lines.len(),
        twice: handled.lines.len() - handled.distinct.len(),
        faults: progress.faults.lock().unwrap().clone(),
        longest_handling_pause: pause(&progressed),
        longest_publish_pause: pause(&confirms.lock().unwrap()),
    };
    eprintln!("failover: {failover:#?}");
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.order_violations, 0, "{report:#?}");
    assert_eq!(report.finished, report.published, "{report:#?}");
    failover
}
