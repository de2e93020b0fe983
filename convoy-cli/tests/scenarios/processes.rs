//! `convoy consume` processes of one group, all appending to one log (each line is written
//! whole, in handling order), replayed through the order checker afterwards: members joining,
//! leaving, killed with SIGKILL, frozen with SIGSTOP.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use convoy_testkit::probe::publish_load;
use convoy_testkit::OrderChecker;

/// A `convoy consume` process appending to a log; SIGKILLed when dropped. What it writes to
/// stderr goes to a file beside the log (shown when it fails to leave; kept when
/// `CONVOY_KEEP_LOGS` is set, with `RUST_LOG` passed on, for a failure to read).
pub struct Member(pub Child, PathBuf);

impl Member {
    /// Starts a member of the group `url` names, appending its lines to `log`.
    pub fn start(url: &str, log: &Path) -> Member {
        Member::start_with(url, log, &[])
    }

    /// The same with more `convoy consume` arguments.
    pub fn start_with(url: &str, log: &Path, extra: &[&str]) -> Member {
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stderr = log.with_extension(format!("member-{n}.err"));
        let mut command = Command::new(env!("CARGO_BIN_EXE_convoy"));
        // A heap profile of the first member (a soak's witness): heaptrack's raw trace, read
        // with `heaptrack_interpret < member-0.raw | gzip > member-0.gz; heaptrack_print`.
        if let Some(dir) = std::env::var_os("CONVOY_HEAPTRACK_DIR").filter(|_| n == 0) {
            command
                .env("LD_PRELOAD", "/usr/lib/heaptrack/libheaptrack_preload.so")
                .env("DUMP_HEAPTRACK_OUTPUT", PathBuf::from(dir).join("member-0.raw"));
        }
        Member(
            command
                .args(["--url", url, "consume", "--create", "--commit-interval-ms", "100"])
                .args(extra)
                .stdout(Stdio::from(out))
                .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
                .spawn()
                .unwrap(),
            stderr,
        )
    }

    /// What the member wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.1).unwrap_or_default()
    }

    /// Waits (at most two minutes) until the member's engine runs — it was given a source, so
    /// it listens for SIGINT and SIGTERM (a process signalled before that just dies).
    pub fn wait_started(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !self.stderr().contains("source assigned") {
            assert!(
                Instant::now() < deadline,
                "the member was given no source within 2 minutes:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (at most a minute) until the process catches `signal` (`INT` or `TERM`), as
    /// `/proc/<pid>/status` says: a member signalled a moment after it was started (a fault
    /// schedule's faults can come back to back) would otherwise end by the signal's default
    /// action, before its handler was installed, and not stop cleanly.
    fn wait_catching(&mut self, signal: &str) {
        let number = match signal {
            "INT" => 2,
            "TERM" => 15,
            _ => return,
        };
        let status = PathBuf::from(format!("/proc/{}/status", self.0.id()));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let caught = std::fs::read_to_string(&status).is_ok_and(|status| {
                status
                    .lines()
                    .find_map(|line| line.strip_prefix("SigCgt:"))
                    .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
                    .is_some_and(|mask| mask & (1 << (number - 1)) != 0)
            });
            // Ended already: what it exited with tells.
            if caught || !matches!(self.0.try_wait(), Ok(None)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the member did not catch SIG{signal} within a minute of its start:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sends a signal (`INT`, `STOP`, `CONT`) to the process.
    pub fn signal(&self, name: &str) {
        let sent = Command::new("kill")
            .args([&format!("-{name}"), &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -{name} failed");
    }

    /// Ctrl-C, then waits (at most two minutes): the member drains, commits and leaves; true if
    /// it exited cleanly (else its stderr is printed).
    pub fn leave(self) -> bool {
        self.stop_with("INT")
    }

    /// SIGSTOP, then waits until every thread of the process is stopped: `kill` returns once
    /// the signal is sent, and a thread running at that moment may still take a few messages
    /// (on a loaded machine, a few milliseconds later).
    pub fn freeze(&self) {
        self.signal("STOP");
        let tasks = PathBuf::from(format!("/proc/{}/task", self.0.id()));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // The state is the field after the command name, which ends with the last ')'.
            let stopped = std::fs::read_dir(&tasks).is_ok_and(|threads| {
                threads.flatten().all(|thread| {
                    std::fs::read_to_string(thread.path().join("stat")).is_ok_and(|stat| {
                        stat.rsplit_once(')').is_some_and(|(_, rest)| {
                            matches!(rest.trim_start().chars().next(), Some('T' | 't'))
                        })
                    })
                })
            });
            if stopped {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the member did not stop within 30 s of SIGSTOP"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The same with SIGTERM (what an orchestrator sends).
    pub fn terminate(self) -> bool {
        self.stop_with("TERM")
    }

    fn stop_with(mut self, signal: &str) -> bool {
        self.wait_catching(signal);
        self.signal(signal);
        let clean = super::wait_exit(&mut self.0).success();
        if !clean {
            eprintln!("a member did not leave cleanly; its stderr:\n{}", self.stderr());
        }
        clean
    }
}

impl Member {
    /// The fault: SIGKILL (no drain, no commit, no leave), waiting until the process is gone.
    /// Fails if it had already exited, so a kill a test counts has happened.
    pub fn kill(mut self) {
        assert!(
            matches!(self.0.try_wait(), Ok(None)),
            "the member to kill had already exited:\n{}",
            self.stderr()
        );
        self.0.kill().expect("SIGKILL sent");
        self.0.wait().expect("the killed member reaped");
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        if std::env::var_os("CONVOY_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_file(&self.1);
        }
    }
}

/// A log file of its own for a scenario, removed when dropped.
pub struct Log(pub PathBuf);

impl Log {
    pub fn new(topic: &str) -> Log {
        let path = std::env::temp_dir().join(format!("{topic}.log"));
        let _ = std::fs::remove_file(&path);
        Log(path)
    }

    /// (key, seq) of every line so far, in order.
    pub fn lines(&self) -> Vec<(String, u64)> {
        read_lines(&self.0)
    }

    /// Waits until `want` distinct (key, seq) were handled.
    pub fn wait_handled(&self, want: usize) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let distinct: HashSet<(String, u64)> = self.lines().into_iter().collect();
            if distinct.len() >= want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "stuck at {} of {want} handled",
                distinct.len()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn read_lines(log: &Path) -> Vec<(String, u64)> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(parse_line)
        .collect()
}

/// The (key, seq) of one line `convoy consume` printed for a probe message.
pub fn parse_line(line: &str) -> Option<(String, u64)> {
    let rest = line.split_once(" key=")?.1;
    let (key, rest) = rest.split_once(' ')?;
    let seq = rest.trim_end().rsplit(' ').next()?.parse().ok()?;
    Some((key.to_owned(), seq))
}

/// Replays the lines through the checker and asserts nothing was lost or out of order.
fn assert_replayed(checker: &OrderChecker, lines: &[(String, u64)], what: &str) {
    for (key, seq) in lines {
        checker.handled(key.as_bytes(), *seq, None);
    }
    let report = checker.report();
    println!(
        "{what}: {} published, {} lines, {} redelivered duplicates, {} lost, {} violations",
        report.published,
        lines.len(),
        report.duplicates,
        report.lost,
        report.order_violations
    );
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.order_violations, 0, "{report:#?}");
    assert_eq!(report.finished, report.published);
}

/// Members join, one leaves gracefully, five are killed with SIGKILL and replaced, while a
/// producer publishes: nothing lost, no per-key order violated; redelivered duplicates are
/// counted. `url` names the group, the topic and fast rebalancing.
pub async fn join_leave_and_survive_kill_9(url: &str, topic: &str) {
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    let log = Log::new(topic);
    let checker = OrderChecker::new();
    let mut members = vec![Member::start(url, &log.0)];
    let (mut kills, mut leaves) = (0, 0);
    for round in 0..8 {
        publish_load(publisher.as_ref(), &checker, "key-", 40, 10)
            .await
            .unwrap();
        let published = checker.published() as usize;
        tokio::task::block_in_place(|| log.wait_handled(published - 200));
        match round {
            0 => members.push(Member::start(url, &log.0)), // a second member joins mid-stream
            3 => {
                // One leaves gracefully: drains and commits, its partitions move.
                let leaving = members.remove(0);
                assert!(leaving.leave(), "graceful leave failed");
                leaves += 1;
                members.push(Member::start(url, &log.0));
            }
            _ if kills < 5 => {
                // A crash: no drain, no commit; its unfinished messages go to the others.
                members.remove(round % members.len()).kill();
                kills += 1;
                members.push(Member::start(url, &log.0));
            }
            _ => {}
        }
    }
    let published = checker.published() as usize;
    tokio::task::block_in_place(|| log.wait_handled(published));
    for member in members {
        assert!(member.leave());
    }
    assert_eq!((kills, leaves), (5, 1));
    assert_replayed(&checker, &log.lines(), "processes: 5 SIGKILLs, 1 graceful leave");
}

/// A member frozen (SIGSTOP) past its leases while another takes its partitions and handles
/// and commits what is published meanwhile, then thawed (SIGCONT): once it reports its leases
/// lost it has handled not one message more — its leases ran out, so the engine starts nothing
/// more of those partitions — and it leaves cleanly. Nothing lost, no order violated. For
/// transports whose ownership is leased; `lease` is how long one lasts.
pub async fn a_frozen_member_handles_nothing_after_its_lease(url: &str, topic: &str, lease: Duration) {
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    let (frozen_log, other_log) = (
        Log::new(&format!("{topic}-frozen")),
        Log::new(&format!("{topic}-other")),
    );
    let checker = OrderChecker::new();
    // The first load is all the first member's; then a second member joins and takes its share
    // by graceful handovers, so every key moves at most once, from the first to the second.
    let frozen = Member::start(url, &frozen_log.0);
    publish_load(publisher.as_ref(), &checker, "key-", 40, 5)
        .await
        .unwrap();
    let first = checker.published() as usize;
    tokio::task::block_in_place(|| frozen_log.wait_handled(first));
    // The other serves its metrics: its lag tells when all it handled is committed.
    let other_metrics = format!("127.0.0.1:{}", convoy_testkit::support::free_port().unwrap());
    let other = Member::start_with(url, &other_log.0, &["--metrics-addr", &other_metrics]);
    // Membership settles (handovers happen within a few balance rounds) while nothing flows:
    // nothing of the first member is in flight when it stops.
    tokio::time::sleep(lease * 2).await;
    tokio::task::block_in_place(|| frozen.freeze());
    let first_frozen_seq = 5; // the second load's sequences per key
    publish_load(publisher.as_ref(), &checker, "key-", 40, 5)
        .await
        .unwrap();
    let published = checker.published() as usize;
    // The second member handles all of it: the frozen member's partitions once their leases
    // expired.
    tokio::task::block_in_place(|| {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let both: HashSet<(String, u64)> =
                frozen_log.lines().into_iter().chain(other_log.lines()).collect();
            if both.len() >= published {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the frozen member's partitions were never taken over"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Everything committed by the new owner (its lag 0 on every partition): whatever the
        // thawed member could take back later holds nothing to handle.
        super::wait_lag_zero(&other_metrics);
    });
    frozen.signal("CONT");
    // The event: the thawed member reports its leases gone (their renewal came far too late).
    tokio::task::block_in_place(|| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let said = frozen.stderr();
            if said.contains("every lease is lost") || said.contains("partitions lost") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the thawed member never reported its leases lost:\n{said}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    // Read before they leave: their stderr files go with them.
    let (frozen_said, other_said) = (frozen.stderr(), other.stderr());
    assert!(frozen.leave(), "the thawed member did not leave cleanly");
    assert!(other.leave());
    // Read after both left (a message it started would be in its log by then): nothing
    // published while it was frozen. (Lines of the first load may be written late.)
    let after: Vec<(String, u64)> = frozen_log
        .lines()
        .into_iter()
        .filter(|(_, seq)| *seq >= first_frozen_seq)
        .collect();
    assert!(
        after.is_empty(),
        "the frozen member handled messages published while it was frozen: {after:?}\nits stderr:\n{frozen_said}\nthe other's stderr:\n{other_said}"
    );
    let lines: Vec<(String, u64)> = frozen_log.lines().into_iter().chain(other_log.lines()).collect();
    assert_replayed(&checker, &lines, "a member frozen past its leases");
}

/// A rolling deploy: two members of one group under a backlog; `restarts` times, one of them
/// is stopped with SIGTERM while its replacement joins (a stop during a rebalance). Every stop is
/// graceful, and each ends with its final commit accepted — a commit the broker refuses while
/// the group rebalances is tried again until the stop's deadline — so nothing a stopped member
/// finished is handled again. Returns the lines handled more than once (the caller decides what
/// its protocol allows).
pub async fn rolling_restarts(url: &str, topic: &str, restarts: usize) -> usize {
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    let checker = OrderChecker::new();
    let (keys, per_key) = (40, 150);
    publish_load(publisher.as_ref(), &checker, "roll-", keys, per_key)
        .await
        .unwrap();
    let log = Log::new(topic);
    // 20 ms a message, 40 keys: about 2,000 a second, 3 s of work for one member.
    let work = ["--work-ms", "20"];
    let mut members = vec![
        Member::start_with(url, &log.0, &work),
        Member::start_with(url, &log.0, &work),
    ];
    let total = keys * per_key;
    for restart in 0..restarts {
        // Each stop comes once the group handled more (the members are running by then: a
        // process signalled before it listens for SIGTERM would just die).
        let step = total / (restarts + 2);
        tokio::task::block_in_place(|| log.wait_handled(step * (restart + 1)));
        // The replacement joins while the stopping member drains: two rebalances overlap.
        let stopping = members.remove(0); // the oldest: running for a while
        tokio::task::block_in_place(|| stopping.wait_started());
        stopping.signal("TERM");
        members.push(Member::start_with(url, &log.0, &work));
        let (status, stderr) = tokio::task::block_in_place(|| {
            let mut stopping = stopping;
            let status = super::wait_exit(&mut stopping.0);
            (status, stopping.stderr())
        });
        assert!(
            status.success(),
            "SIGTERM is a graceful stop: {status:?}\n{stderr}"
        );
        assert!(
            !stderr.contains("handled again by the next owner"),
            "restart {restart}: a stop or a revoke left finished messages uncommitted:\n{stderr}"
        );
    }
    tokio::task::block_in_place(|| log.wait_handled(total));
    for member in members {
        assert!(member.leave());
    }
    let lines = log.lines();
    let distinct: HashSet<&(String, u64)> = lines.iter().collect();
    let again = lines.len() - distinct.len();
    println!(
        "rolling restarts ({restarts}): {} lines for {total} messages, {again} handled again",
        lines.len()
    );
    assert_replayed(&checker, &lines, "rolling restarts");
    again
}

/// A member stopped with SIGTERM mid-run — its handlers busy, a backlog queued — finishes what
/// is in flight, commits and leaves, exit status 0; the next member of the group handles the
/// rest and nothing the first one handled. Then `--max-messages` takes exactly that many.
pub async fn sigterm_hands_over_without_repeats(url: &str, topic: &str) {
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    let checker = OrderChecker::new();
    publish_load(publisher.as_ref(), &checker, "key-", 20, 20)
        .await
        .unwrap();
    let (first_log, next_log) = (
        Log::new(&format!("{topic}-first")),
        Log::new(&format!("{topic}-next")),
    );
    // 50 ms a message: 20 keys of 20 messages take a second, the stop comes halfway.
    let first = Member::start_with(url, &first_log.0, &["--work-ms", "50"]);
    tokio::task::block_in_place(|| first_log.wait_handled(100));
    first.signal("TERM");
    let stopped = tokio::task::block_in_place(|| {
        let mut first = first;
        let status = super::wait_exit(&mut first.0);
        (status, first.stderr())
    });
    assert!(
        stopped.0.success(),
        "SIGTERM is a graceful stop: {:?}\n{}",
        stopped.0,
        stopped.1
    );
    let handled_first: HashSet<(String, u64)> = first_log.lines().into_iter().collect();
    let next = Member::start(url, &next_log.0);
    tokio::task::block_in_place(|| next_log.wait_handled(400 - handled_first.len()));
    assert!(next.leave());
    let handled_next: HashSet<(String, u64)> = next_log.lines().into_iter().collect();
    let again: Vec<&(String, u64)> = handled_first.intersection(&handled_next).collect();
    println!(
        "SIGTERM mid-run: the first member handled {}, the next {}, {} of them again",
        handled_first.len(),
        handled_next.len(),
        again.len()
    );
    assert!(again.is_empty(), "handled again after a SIGTERM: {again:?}");
    assert_eq!(handled_first.len() + handled_next.len(), 400, "nothing lost");
    let lines: Vec<(String, u64)> = first_log.lines().into_iter().chain(next_log.lines()).collect();
    assert_replayed(&checker, &lines, "SIGTERM mid-run");

    // Exactly N: 30 more published, a member told to take 12 prints 12, the next the other 18.
    let checker = OrderChecker::new();
    publish_load(publisher.as_ref(), &checker, "more-", 6, 5)
        .await
        .unwrap();
    let (a, b) = (
        Log::new(&format!("{topic}-max-a")),
        Log::new(&format!("{topic}-max-b")),
    );
    for (log, max) in [(&a, "12"), (&b, "18")] {
        let mut member = Member::start_with(url, &log.0, &["--max-messages", max]);
        let status = tokio::task::block_in_place(|| super::wait_exit(&mut member.0));
        assert!(status.success(), "{}", member.stderr());
    }
    let (a, b) = (a.lines(), b.lines());
    println!("--max-messages 12 then 18: printed {} and {}", a.len(), b.len());
    assert_eq!((a.len(), b.len()), (12, 18), "each took exactly its limit");
    let all: HashSet<(String, u64)> = a.iter().chain(&b).cloned().collect();
    assert_eq!(all.len(), 30, "the second took what the first left, none again");
}

/// Members that park keys (`--park-keys`, a payload text failing terminally) are SIGKILLed and
/// replaced while a producer publishes: a parked key's later messages are never handled — not
/// by the member that parked it, nor by the next owner after a kill — until it is replayed.
/// Then the fix is deployed (members without the poison, one of them killed mid-replay) and
/// each parked key is replayed: its messages run in their original order, it is unparked, and
/// nothing is lost.
pub async fn parked_keys_survive_kill_9(url: &str, topic: &str) {
    const KEYS: usize = 12;
    const PER_KEY: u64 = 10;
    const POISON_SEQ: u64 = 3;
    let poisoned = |k: usize| k.is_multiple_of(4);
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(topic).unwrap();
    let log = Log::new(&format!("{topic}-parked"));
    let checker = OrderChecker::new();
    // 20 ms a message: a kill finds messages in flight.
    let broken = ["--park-keys", "--fail-on", "POISON", "--work-ms", "20"];
    let mut members = vec![
        Member::start_with(url, &log.0, &broken),
        Member::start_with(url, &log.0, &broken),
    ];
    for round in 0..PER_KEY / 2 {
        for _ in 0..2 {
            for k in 0..KEYS {
                let key = bytes::Bytes::from(format!("key-{k}"));
                let seq = checker.expect(&key);
                let payload = match poisoned(k) && seq == POISON_SEQ {
                    true => format!("POISON {seq}"),
                    false => seq.to_string(),
                };
                publisher
                    .publish(convoy::OutgoingMessage::new(key, payload))
                    .await
                    .unwrap();
            }
        }
        // Mid-stream (the previous rounds handled, this one under way): no drain, no commit;
        // the next owner reads the parking back.
        let healthy_so_far = (0..KEYS).filter(|k| !poisoned(*k)).count() * (round as usize * 2);
        tokio::task::block_in_place(|| log.wait_handled(healthy_so_far));
        if round < 4 {
            members.remove(0).kill();
            members.push(Member::start_with(url, &log.0, &broken));
        }
    }
    let healthy = (0..KEYS).filter(|k| !poisoned(*k)).count() as u64;
    let parked_keys = KEYS as u64 - healthy;
    // Every healthy message, and the poisoned keys' messages before the poison.
    let before = (healthy * PER_KEY + parked_keys * POISON_SEQ) as usize;
    tokio::task::block_in_place(|| log.wait_handled(before));
    let waiting = (PER_KEY - POISON_SEQ) as usize;
    let parked = wait_parked(&connection, |p| {
        p.len() == parked_keys as usize && p.iter().all(|(_, n)| *n >= waiting)
    })
    .await;
    let lines = log.lines();
    let early: Vec<&(String, u64)> = lines
        .iter()
        .filter(|(key, seq)| is_poisoned(key, KEYS, &poisoned) && *seq >= POISON_SEQ)
        .collect();
    println!(
        "parked keys under kill -9: {} lines before the replay, parked {parked:?}",
        lines.len()
    );
    assert!(
        early.is_empty(),
        "a parked key's message ran before its replay: {early:?}"
    );
    if !(parked.len() == parked_keys as usize && parked.iter().all(|(_, n)| *n == waiting)) {
        // What the destination holds, for the failure's reader.
        let dlq = connection.dlq_topic().unwrap();
        for m in connection.read_topic(&dlq).await.unwrap() {
            let h = |name: &str| m.headers.get_str(name).unwrap_or("-").to_owned();
            eprintln!(
                "{}@{} key={} cause={} park-id={} from={}@{} payload={}",
                m.source,
                m.offset,
                m.key_display(),
                h(convoy::dead_letter::DL_CAUSE),
                h(convoy::parking::DL_PARK_ID),
                h(convoy::dead_letter::DL_SOURCE),
                h(convoy::dead_letter::DL_OFFSET),
                String::from_utf8_lossy(&m.payload)
            );
        }
    }
    assert!(
        parked.len() == parked_keys as usize && parked.iter().all(|(_, n)| *n == waiting),
        "each parked key holds its failed message and the {} set aside behind it, once each: {parked:?}",
        waiting - 1
    );

    // The fix: members without the poison; one is killed while the replays run.
    for member in members.drain(..) {
        drop(member);
    }
    let fixed = ["--park-keys"];
    members.push(Member::start_with(url, &log.0, &fixed));
    members.push(Member::start_with(url, &log.0, &fixed));
    // `dlq list` names the parked keys; the first is replayed by `dlq replay --key`, the others
    // by the library call.
    let listed = super::convoy(&["--url", url, "dlq", "list"]);
    let table = String::from_utf8_lossy(&listed.stdout);
    for (key, n) in &parked {
        assert!(table.contains(&format!("  {key}  {n} waiting")), "{table}");
    }
    let replayed = super::convoy(&["--url", url, "dlq", "replay", "--key", &parked[0].0]);
    let stderr = String::from_utf8_lossy(&replayed.stderr);
    assert!(
        replayed.status.success() && stderr.contains(&format!("{waiting} messages in order")),
        "{stderr}"
    );
    for (key, _) in &parked[1..] {
        let replay = convoy::dlq::replay_parked(&connection, key.as_bytes())
            .await
            .unwrap();
        assert_eq!(
            replay.records.len(),
            waiting,
            "the replay of {key} takes all of it"
        );
    }
    members.remove(0).kill();
    members.push(Member::start_with(url, &log.0, &fixed));
    tokio::task::block_in_place(|| log.wait_handled(KEYS * PER_KEY as usize));
    let still = wait_parked(&connection, |p| p.is_empty()).await;
    assert!(still.is_empty(), "replayed keys are unparked: {still:?}");
    // A replay that ended leaves nothing to resume, and says so.
    let resumed = super::convoy(&["--url", url, "dlq", "replay", "--key", &parked[0].0, "--resume"]);
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(
        !resumed.status.success() && stderr.contains("nothing to resume"),
        "{stderr}"
    );
    // The replay command again, now that the key is unparked: every dead letter of the key
    // was replayed (the listing says so), so nothing is published and nothing runs twice.
    let key = &parked[0].0;
    let listed = super::convoy(&["--url", url, "dlq", "list", "--key", key, "--json"]);
    let letters: Vec<serde_json::Value> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert!(
        letters.len() >= waiting && letters.iter().all(|l| l["replays"].as_u64() >= Some(1)),
        "every dead letter of {key} is marked replayed: {letters:?}"
    );
    let again = super::convoy(&["--url", url, "dlq", "replay", "--key", key]);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert!(
        again.status.success()
            && stderr.contains(&format!("skipped {} dead letters replayed before", letters.len()))
            && stderr.contains("nothing to replay"),
        "{stderr}"
    );
    for member in members {
        assert!(member.leave());
    }
    assert_replayed(&checker, &log.lines(), "parked keys under kill -9, then replayed");
}

fn is_poisoned(key: &str, keys: usize, poisoned: &dyn Fn(usize) -> bool) -> bool {
    (0..keys).any(|k| poisoned(k) && key == format!("key-{k}"))
}

/// The group's parked keys and how many messages each holds, once `done` holds for them (waits
/// at most two minutes: the last dead letters and markers may still be on their way).
async fn wait_parked(
    connection: &convoy::Connection,
    done: impl Fn(&[(String, usize)]) -> bool,
) -> Vec<(String, usize)> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let keys = convoy::dlq::parked(connection).await.unwrap();
        let mut parked: Vec<(String, usize)> = keys
            .iter()
            .map(|(k, p)| (String::from_utf8_lossy(k).into_owned(), p.pending()))
            .collect();
        parked.sort();
        if done(&parked) || Instant::now() >= deadline {
            return parked;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How [`forwarding_survives_kill_9`] reads what was forwarded.
pub enum Downstream {
    /// The output topic read whole, without a group: Kafka's reader is `read_committed`
    /// (librdkafka's default), a NATS stream keeps one copy per `Nats-Msg-Id` within its
    /// duplicate window. Every output must be there once.
    Topic,
    /// A `convoy consume` member of `group` on the output topic (`url`): RabbitMQ's queues
    /// cannot be read without consuming, and keep every copy published. Every output must be
    /// handled once: the copies a restarted forwarder published again carry the same event id
    /// (`message_id`) and are skipped.
    Group {
        /// The reader's URL (its group, the output topic).
        url: String,
        /// Its group, declared on the output topic before anything is forwarded.
        group: String,
    },
    /// The control: the output topic read whole, forwarded *without* a transaction. What a
    /// killed member published before its commit is published again by the next one, so the
    /// topic must hold copies (and lose nothing, in order): were none seen, the test could not
    /// tell exactly once from at least once.
    TopicWithCopies,
}

/// A `convoy consume --forward-to` member is SIGKILLed ten times mid-run and restarted
/// (`member_params` added to its URL: on Kafka a transactional id and a static group
/// membership, as a pod would have, so a restart takes its partitions back at once). What the
/// output topic holds is then read as `downstream` says: every input's output once, in per-key
/// order, its id derived from the input's — while the members handled many inputs more than
/// once. `url` names the group and the input topic; the output topic is `out`.
pub async fn forwarding_survives_kill_9(
    url: &str,
    topic: &str,
    out: &str,
    member_params: &str,
    downstream: Downstream,
) {
    const KILLS: usize = 10;
    // The reader's own connection declares its group (on RabbitMQ its queues dead-letter to
    // the reader's dead-letter topic).
    let (declaring, groups) = match &downstream {
        Downstream::Group { url, group } => (url.as_str(), vec![group.clone()]),
        Downstream::Topic | Downstream::TopicWithCopies => (url, Vec::new()),
    };
    let (connection, checker, total) = forwarding_load(url, topic, out, declaring, groups).await;
    let log = Log::new(&format!("{topic}-forward"));
    let member_url = format!("{url}{member_params}");
    // 2 ms a message and a commit every 100 ms: each kill finds handled, uncommitted inputs
    // whose outputs are staged, in a transaction or published.
    let args = ["--forward-to", out, "--work-ms", "2"];
    let mut member = Member::start_with(&member_url, &log.0, &args);
    for kill in 1..=KILLS {
        tokio::task::block_in_place(|| log.wait_handled(total * kill / (KILLS + 2)));
        member.kill();
        member = Member::start_with(&member_url, &log.0, &args);
    }
    // Done when everything is downstream (a member's log is not enough: a restarted member
    // may have handled again only part of what its predecessor handled and never committed).
    let control = matches!(downstream, Downstream::TopicWithCopies);
    let (outputs, seen) = match downstream {
        Downstream::Topic | Downstream::TopicWithCopies => {
            wait_forwarded(&connection, out, total).await;
            assert!(member.leave(), "the last member did not leave cleanly");
            // Read again once it left: nothing may have come since.
            let outputs = connection.read_topic(out).await.unwrap();
            let copies = check_outputs(&checker, &outputs);
            assert!(control || copies == 0, "{copies} outputs share an id");
            (outputs.len(), "read whole".to_owned())
        }
        Downstream::Group { url, .. } => {
            let reader_log = Log::new(&format!("{topic}-reader"));
            let mut reader = Member::start(&url, &reader_log.0);
            tokio::task::block_in_place(|| reader_log.wait_handled(total));
            assert!(member.leave(), "the last member did not leave cleanly");
            reader.signal("INT");
            assert!(super::wait_exit(&mut reader.0).success());
            let summary = reader.stderr();
            let skipped = summary
                .lines()
                .find_map(|l| {
                    l.split_once(" duplicates skipped")?
                        .0
                        .rsplit(' ')
                        .next()?
                        .parse::<u64>()
                        .ok()
                })
                .expect("the reader prints its summary");
            let lines = reader_log.lines();
            for (key, seq) in &lines {
                checker.handled(key.as_bytes(), *seq, None);
            }
            (
                lines.len(),
                format!("handled by a convoy consumer, which skipped {skipped} copies published again"),
            )
        }
    };
    let handled = log.lines().len();
    let report = checker.report();
    println!(
        "forwarding through {KILLS} SIGKILLs: {total} inputs, {handled} handlings (the members \
         handled {} again), {outputs} outputs {seen}, {} duplicates, {} lost, {} order violations",
        handled - total,
        report.duplicates,
        report.lost,
        report.order_violations
    );
    if control {
        assert_eq!(report.lost, 0, "{report:#?}");
        assert_eq!(report.order_violations, 0, "{report:#?}");
        assert!(
            report.duplicates > 0 && outputs > total,
            "forwarding without a transaction through {KILLS} SIGKILLs published nothing twice: \
             the kills did not land on handled, uncommitted inputs, so the exactly-once runs \
             prove nothing ({report:#?})"
        );
    } else {
        assert_once(&report, outputs, total);
    }
}

/// The input `topic` created and loaded with 20 keys × 100 probe messages, the output `out`
/// declared (4 partitions) through a connection to `declaring` with `groups`: the input's
/// connection, the checker that knows what was published, and how many.
async fn forwarding_load(
    url: &str,
    topic: &str,
    out: &str,
    declaring: &str,
    groups: Vec<String>,
) -> (convoy::Connection, OrderChecker, usize) {
    const KEYS: usize = 20;
    const PER_KEY: usize = 100;
    let connection = convoy::connect(url).await.unwrap();
    connection.create_topics().await.unwrap();
    let spec = convoy::TopicSpec {
        partitions: 4,
        groups,
        replication: None,
    };
    convoy::connect(declaring)
        .await
        .unwrap()
        .declare_topic(out, &spec)
        .await
        .unwrap();
    let checker = OrderChecker::new();
    publish_load(
        connection.publisher(topic).unwrap().as_ref(),
        &checker,
        "key-",
        KEYS,
        PER_KEY,
    )
    .await
    .unwrap();
    (connection, checker, KEYS * PER_KEY)
}

/// Every output came once (`outputs` of `total`), nothing lost, in per-key order.
fn assert_once(report: &convoy_testkit::CheckReport, outputs: usize, total: usize) {
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.duplicates, 0, "an output came twice: {report:#?}");
    assert_eq!(report.order_violations, 0, "{report:#?}");
    assert_eq!(outputs, total);
}

/// Reads `out` whole until it holds `total` distinct outputs (by event id; at most two minutes).
async fn wait_forwarded(connection: &convoy::Connection, out: &str, total: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let outputs = connection.read_topic(out).await.unwrap();
        let distinct = outputs
            .iter()
            .filter_map(|o| o.headers.get_str(convoy::EVENT_ID_HEADER))
            .collect::<HashSet<_>>()
            .len();
        if distinct >= total {
            return;
        }
        assert!(Instant::now() < deadline, "{distinct} of {total} outputs arrived");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Records each output (its payload is its input's sequence number) with the checker, checks
/// its id derives from its input's, and returns how many outputs repeat an id already seen.
fn check_outputs(checker: &OrderChecker, outputs: &[convoy::Message]) -> usize {
    let mut ids = HashSet::new();
    for output in outputs {
        let key = output.key.clone().expect("outputs keep their input's key");
        let seq: u64 = std::str::from_utf8(&output.payload).unwrap().parse().unwrap();
        checker.handled(&key, seq, None);
        let id = output.headers.get_str(convoy::EVENT_ID_HEADER).unwrap();
        assert!(
            id.ends_with("/out/0"),
            "an output's id derives from its input's: {id}"
        );
        ids.insert(id.to_owned());
    }
    outputs.len() - ids.len()
}

/// Kafka: a forwarding member with a transactional id is frozen (SIGSTOP) with inputs handled
/// and not committed — their outputs staged, perhaps in an open transaction — while a second
/// member, with an id of its own, takes its partitions once its session expired and forwards
/// everything; then it is thawed (SIGCONT). Whatever the zombie still tries fails: its group
/// generation is stale (`send_offsets_to_transaction` carries it) and a transaction it had open
/// was aborted by the broker's timeout, which also held the new owner's committed offsets until
/// then. A `read_committed` reader finds every output once, in per-key order.
pub async fn a_frozen_forwarder_commits_nothing_after_thawing(url: &str, topic: &str) {
    let out = format!("{topic}-out");
    let (connection, checker, total) = forwarding_load(url, topic, &out, url, Vec::new()).await;
    let (zombie_log, other_log) = (
        Log::new(&format!("{topic}-zombie")),
        Log::new(&format!("{topic}-other")),
    );
    let args = ["--forward-to", out.as_str(), "--work-ms", "5"];
    let zombie = Member::start_with(&format!("{url}&transactional_id={topic}-a"), &zombie_log.0, &args);
    tokio::task::block_in_place(|| zombie_log.wait_handled(total / 4));
    zombie.signal("STOP");
    let other = Member::start_with(&format!("{url}&transactional_id={topic}-b"), &other_log.0, &args);
    wait_forwarded(&connection, &out, total).await;
    zombie.signal("CONT");
    // The zombie finds out: its session is gone (the assignment is lost, nothing committed) or
    // a commit it tries is refused and its transaction aborted.
    let deadline = Instant::now() + Duration::from_secs(60);
    let said = loop {
        let err = zombie.stderr();
        let telling: Vec<&str> = err
            .lines()
            .filter(|l| {
                ["assignment lost", "aborted", "fatal", "fenced"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .collect();
        if !telling.is_empty() {
            break telling.join("\n");
        }
        assert!(
            Instant::now() < deadline,
            "the thawed member never noticed:\n{err}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = zombie.leave(); // it may have ended by itself, fenced
    assert!(other.leave());
    let outputs = connection.read_topic(&out).await.unwrap();
    assert_eq!(check_outputs(&checker, &outputs), 0, "outputs share an id");
    let report = checker.report();
    println!(
        "a frozen forwarder: it handled {} inputs, the other {}; {} outputs read committed, {} duplicates, {} lost, {} order violations; the zombie said:\n{said}",
        zombie_log.lines().len(),
        other_log.lines().len(),
        outputs.len(),
        report.duplicates,
        report.lost,
        report.order_violations
    );
    assert_once(&report, outputs.len(), total);
}
