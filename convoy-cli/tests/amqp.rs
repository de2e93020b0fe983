//! The `convoy` binary against RabbitMQ (`CONVOY_AMQP_URI`; scripts/test sets it): the scenarios
//! of `scenarios/`, each deleting what it declared (the broker is shared).

#![allow(clippy::unwrap_used)]

mod scenarios;

use scenarios::unique;

fn uri() -> Option<String> {
    let u = std::env::var("CONVOY_AMQP_URI").ok().filter(|u| !u.is_empty());
    if u.is_none() {
        eprintln!("CONVOY_AMQP_URI is not set: skipping (scripts/test sets it)");
    }
    u
}

fn url(uri: &str, group: &str, topic: &str) -> String {
    format!("{uri}?group={group}&topics={topic}&partitions=4")
}

/// Deletes the topic's queues and dead-letter stream when dropped, even after a failure.
struct CleanUp(String, String);

impl Drop for CleanUp {
    fn drop(&mut self) {
        let (url, topic) = (self.0.clone(), self.1.clone());
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Ok(connection) = convoy::connect(&url).await {
                    let _ = connection.delete_topic(&topic).await;
                }
            });
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replayed_after_the_fix_is_handled_in_order() {
    let Some(uri) = uri() else { return };
    let topic = unique("replay");
    let url = url(&uri, &unique("replay-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::dead_letter_replay(&url, &topic).await;
}

#[test]
fn bench_runs_the_seed_scenario_on_rabbitmq() {
    let Some(uri) = uri() else { return };
    scenarios::bench_seed(&uri, "amqp");
}

#[test]
fn consume_prints_lanes_and_serves_prometheus_metrics() {
    let Some(uri) = uri() else { return };
    let topic = unique("consume");
    let url = url(&uri, &unique("consume-group"), &topic);
    let _clean = CleanUp(url.clone(), topic);
    scenarios::consume_prints_and_serves_metrics(&url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_aborts_the_drain_and_payloads_print_on_one_line() {
    let Some(uri) = uri() else { return };
    let topic = unique("consume-abort");
    let url = url(&uri, &unique("consume-abort-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::second_ctrl_c(&url, &topic).await;
}

/// `convoy consume` processes of one group, all writing one append-only log (each line is
/// written whole, in handling order): members join, one leaves gracefully, five are killed with
/// SIGKILL and replaced, while a producer publishes. Replayed through the order checker: nothing
/// lost, no per-key order violated; redelivered duplicates are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_processes_join_leave_and_survive_kill_9() {
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use convoy_testkit::probe::publish_load;
    use convoy_testkit::OrderChecker;

    let Some(uri) = uri() else { return };
    let topic = unique("procs");
    let url = format!(
        "{uri}?group={}&topics={topic}&partitions=8&balance_interval_ms=100",
        unique("procs-group")
    );
    let _clean = CleanUp(url.clone(), topic.clone());
    let connection = convoy::connect(&url).await.unwrap();
    connection.create_topics().await.unwrap();
    let publisher = connection.publisher(&topic).unwrap();
    let log = std::env::temp_dir().join(format!("{topic}.log"));
    let _ = std::fs::remove_file(&log);

    struct Member(Child);
    impl Drop for Member {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let start = || {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        Member(
            Command::new(env!("CARGO_BIN_EXE_convoy"))
                .args(["--url", &url, "consume", "--commit-interval-ms", "100"])
                .stdout(Stdio::from(out))
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    // (key, seq) of every line of the log so far.
    let read_log = || -> Vec<(String, u64)> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let rest = line.split_once(" key=")?.1;
                let (key, rest) = rest.split_once(' ')?;
                let seq = rest.rsplit(' ').next()?.parse().ok()?;
                Some((key.to_owned(), seq))
            })
            .collect()
    };
    let wait_handled = |want: usize| {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let distinct: std::collections::HashSet<(String, u64)> = read_log().into_iter().collect();
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
    };

    let checker = OrderChecker::new();
    let mut members = vec![start()];
    let (mut kills, mut leaves) = (0, 0);
    for round in 0..8 {
        publish_load(publisher.as_ref(), &checker, "key-", 40, 10)
            .await
            .unwrap();
        let published = checker.published() as usize;
        tokio::task::block_in_place(|| wait_handled(published - 200));
        match round {
            0 => members.push(start()), // a second member joins mid-stream
            3 => {
                // One leaves gracefully: drains and commits, its partitions move.
                let leaving = members.remove(0);
                Command::new("kill")
                    .args(["-INT", &leaving.0.id().to_string()])
                    .status()
                    .unwrap();
                let mut leaving = leaving;
                let status = leaving.0.wait().unwrap();
                assert!(status.success(), "graceful leave failed: {status}");
                leaves += 1;
                members.push(start());
            }
            _ if kills < 5 => {
                // A crash: no drain, no commit; its unacknowledged messages go to the others.
                let victim = members.remove(round % members.len());
                drop(victim); // SIGKILL
                kills += 1;
                members.push(start());
            }
            _ => {}
        }
    }
    let published = checker.published() as usize;
    tokio::task::block_in_place(|| wait_handled(published));
    for member in &members {
        Command::new("kill")
            .args(["-INT", &member.0.id().to_string()])
            .status()
            .unwrap();
    }
    for mut member in members {
        assert!(member.0.wait().unwrap().success());
    }
    let lines = read_log();
    for (key, seq) in &lines {
        checker.handled(key.as_bytes(), *seq, None);
    }
    let report = checker.report();
    println!(
        "processes: {kills} SIGKILLs, {leaves} graceful leave, {} published, {} lines, {} redelivered duplicates, {} lost, {} violations",
        report.published,
        lines.len(),
        report.duplicates,
        report.lost,
        report.order_violations
    );
    assert_eq!(kills, 5);
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.order_violations, 0, "{report:#?}");
    assert_eq!(report.finished, report.published);
    let _ = std::fs::remove_file(&log);
}
