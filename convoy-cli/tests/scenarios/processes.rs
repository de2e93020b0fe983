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
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stderr = log.with_extension(format!("member-{n}.err"));
        Member(
            Command::new(env!("CARGO_BIN_EXE_convoy"))
                .args(["--url", url, "consume", "--commit-interval-ms", "100"])
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
    pub fn leave(mut self) -> bool {
        self.signal("INT");
        let clean = super::wait_exit(&mut self.0).success();
        if !clean {
            eprintln!("a member did not leave cleanly; its stderr:\n{}", self.stderr());
        }
        clean
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
                drop(members.remove(round % members.len())); // SIGKILL
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
/// what is published meanwhile, then thawed (SIGCONT): it never handles another message — its
/// leases ran out, so the engine starts nothing more of those partitions — and leaves cleanly.
/// Nothing lost, no order violated. For transports whose ownership is leased; `lease` is how
/// long one lasts.
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
    let other = Member::start(url, &other_log.0);
    // Membership settles (handovers happen within a few balance rounds) while nothing flows:
    // nothing of the first member is in flight when it stops.
    tokio::time::sleep(lease * 2).await;
    frozen.signal("STOP");
    let handled_before = frozen_log.lines().len();
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
        // Longer than a lease again: the new owner is well established when the old one wakes.
        std::thread::sleep(lease);
    });
    frozen.signal("CONT");
    // Time to wake up, find its leases gone and go on with whatever it still had.
    tokio::time::sleep(lease * 2).await;
    assert_eq!(
        frozen_log.lines().len(),
        handled_before,
        "the frozen member handled messages after its leases ran out"
    );
    assert!(frozen.leave(), "the thawed member did not leave cleanly");
    assert!(other.leave());
    let lines: Vec<(String, u64)> = frozen_log.lines().into_iter().chain(other_log.lines()).collect();
    assert_replayed(&checker, &lines, "a member frozen past its leases");
}
