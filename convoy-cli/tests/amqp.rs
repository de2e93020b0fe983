//! The `convoy` binary against RabbitMQ (`CONVOY_AMQP_URI`; scripts/test sets it): the scenarios
//! of `scenarios/`, each deleting what it declared (the broker is shared).

#![allow(clippy::unwrap_used)]

mod scenarios;

use std::sync::Arc;

use convoy_testkit::nodes::tls::TestCa;
use convoy_testkit::nodes::{rabbitmq::RabbitNode, NodeError};
use scenarios::failover::{failover, Producer};
use scenarios::{unique, CleanUp};

fn uri() -> Option<String> {
    convoy_testkit::support::required("CONVOY_AMQP_URI")
}

fn url(uri: &str, group: &str, topic: &str) -> String {
    format!("{uri}?group={group}&topics={topic}&partitions=4")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replayed_after_the_fix_is_handled_in_order() {
    let Some(uri) = uri() else { return };
    let topic = unique("replay");
    let url = url(&uri, &unique("replay-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::dead_letter_replay(&url, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpark_passes_over_a_failed_message_and_purge_hides_dead_letters() {
    let Some(uri) = uri() else { return };
    let topic = unique("unpark");
    let url = url(&uri, &unique("unpark-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::unpark_and_purge(&url, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_key_holding_thousands_replays_whole() {
    let Some(uri) = uri() else { return };
    let topic = unique("park-big");
    let url = url(&uri, &unique("park-big-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::a_parked_key_holding_thousands_replays_whole(&url, &topic).await;
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

#[test]
fn a_paused_key_waits_until_resumed() {
    let Some(uri) = uri() else { return };
    let topic = unique("pause");
    let url = url(&uri, &unique("pause-group"), &topic);
    let _clean = CleanUp(url.clone(), topic);
    scenarios::pause_and_resume(&url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_aborts_the_drain_and_payloads_print_on_one_line() {
    let Some(uri) = uri() else { return };
    let topic = unique("consume-abort");
    let url = url(&uri, &unique("consume-abort-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::second_ctrl_c(&url, &topic).await;
}

/// `convoy consume` processes of one group join, leave and are SIGKILLed while a producer
/// publishes (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_processes_join_leave_and_survive_kill_9() {
    let Some(uri) = uri() else { return };
    let topic = unique("procs");
    let url = format!(
        "{uri}?group={}&topics={topic}&partitions=8&balance_interval_ms=100",
        unique("procs-group")
    );
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::processes::join_leave_and_survive_kill_9(&url, &topic).await;
}

/// The crash loop of issue 25 with a foreign producer: pika publishing without any stamp (no
/// event id, no `message_id`: nothing identifies a redelivery) to a private RabbitMQ node, and
/// two `convoy consume` members; ten members killed with SIGKILL (each replaced) and the node
/// killed with SIGKILL and restarted twice, mid-stream. Every confirmed message is handled, in
/// per-key order (scenarios/failover.rs asserts it), and each fault's time to recover is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_under_a_foreign_producer_loses_nothing() {
    let (Some(_), Some(python)) = (uri(), scenarios::python()) else {
        return;
    };
    let node = match tokio::task::spawn_blocking(RabbitNode::start).await.unwrap() {
        Ok(node) => Arc::new(node),
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let topic = unique("crashloop");
    let url = format!(
        "{}?group={}&topics={topic}&partitions=4&heartbeat=3&balance_interval_ms=100",
        node.uri(),
        unique("crashloop-group")
    );
    let pika = vec![
        python,
        scenarios::interop_script("pika_rounds.py"),
        node.uri(),
        topic.clone(),
        "4".to_owned(),
    ];
    // The node outlives the faults: the load's end still needs it.
    let broker = node.clone();
    let report = failover(&url, &topic, Producer::Foreign(pika), move |progress| {
        for fault in 0..12 {
            if fault == 3 || fault == 8 {
                progress.fault("the RabbitMQ node killed (SIGKILL) and restarted", || {
                    broker.kill().expect("the node was killed");
                    broker.boot().unwrap();
                });
            } else {
                progress.fault("a member killed (SIGKILL) and replaced", || {
                    progress.kill_a_member()
                });
            }
            progress.let_flow(200);
        }
    })
    .await;
    drop(node);
    assert_eq!(report.faults.len(), 12);
}

/// The CLI over `amqps://` (a private node, a CA made by the test, `tls_ca_file`): produces and
/// consumes; without the CA it ends at once naming the setting.
#[test]
fn produce_and_consume_over_amqps() {
    if uri().is_none() {
        return;
    }
    let ca = match TestCa::new() {
        Ok(ca) => ca,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let node = match RabbitNode::start_tls(&ca) {
        Ok(node) => node,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let topic = unique("tls");
    let base = format!(
        "{}?topics={topic}&group={topic}-g&partitions=4",
        node.amqps_uri().unwrap()
    );
    let trusted = format!("{base}&tls_ca_file={}", ca.ca_pem().display());
    scenarios::secured_produce_and_consume(&trusted, &base, "tls_ca_file");
}

/// SIGTERM mid-run hands over without repeats; `--max-messages` takes exactly that many
/// (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_over_without_repeats_and_max_messages_is_exact() {
    let Some(uri) = uri() else { return };
    let topic = unique("term");
    let url = url(&uri, &unique("term-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::processes::sigterm_hands_over_without_repeats(&url, &topic).await;
}

#[test]
fn topics_are_created_listed_and_deleted() {
    let Some(uri) = uri() else { return };
    scenarios::topic_commands(&uri, &unique("topics"), true);
}

/// Nothing is published into nowhere (issue 21, item 3): a topic no group receives refuses a
/// publish, saying so; a group declared with `topic create --for-group` receives what is
/// published after; a consumer of a group new on a topic that exists is warned it starts empty.
#[test]
fn nothing_is_published_into_nowhere_and_a_new_group_is_warned() {
    let Some(uri) = uri() else { return };
    let topic = unique("nowhere");
    let url = format!("{uri}?topics={topic}&partitions=4");
    let _clean = CleanUp(url.clone(), topic.clone());
    let produce = |url: &str| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_convoy"))
            .args(["--url", url, "produce"])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"k1\tone\nk2\ttwo\n")
            .unwrap();
        child.wait_with_output().unwrap()
    };
    // No group yet: refused, and said why.
    let refused = produce(&url);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(stderr.contains("reached no consumer group"), "{stderr}");
    assert!(stderr.contains("--for-group"), "{stderr}");
    // With the group declared, it is kept for the group.
    let created = scenarios::convoy(&[
        "--url",
        &url,
        "topic",
        "create",
        &topic,
        "--partitions",
        "4",
        "--for-group",
        "billing",
    ]);
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let published = produce(&url);
    assert!(
        published.status.success(),
        "{}",
        String::from_utf8_lossy(&published.stderr)
    );
    let billing = format!("{url}&group=billing");
    let consumed = scenarios::convoy(&["--url", &billing, "consume", "--max-messages", "2"]);
    assert!(
        consumed.status.success(),
        "{}",
        String::from_utf8_lossy(&consumed.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&consumed.stdout)
            .lines()
            .filter(|l| l.contains(" key="))
            .count(),
        2
    );
    // A group new on this topic: warned that it starts empty (then stopped: nothing comes).
    let audit = format!("{url}&group=audit");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", &audit, "consume"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (found, warned) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let line = std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.contains("is new on topic"));
        let _ = found.send(line);
    });
    // Bounded: a consumer that never warns is killed after a minute and the test fails.
    let line = warned
        .recv_timeout(std::time::Duration::from_secs(60))
        .ok()
        .flatten();
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("the new group was warned");
    assert!(line.contains("receives what is published from now on"), "{line}");
    // Declaring a group ahead of its consumers is the way to avoid it: not warned.
    let ahead = scenarios::convoy(&[
        "--url",
        &url,
        "topic",
        "create",
        &topic,
        "--partitions",
        "4",
        "--for-group",
        "ledger",
    ]);
    let said = String::from_utf8_lossy(&ahead.stderr);
    assert!(
        ahead.status.success() && !said.contains("is new on topic"),
        "{said}"
    );
    let _ = scenarios::convoy(&["--url", &url, "topic", "delete", &topic, "--for-group", "audit"]);
    let _ = scenarios::convoy(&["--url", &url, "topic", "delete", &topic, "--for-group", "ledger"]);
}

/// A RabbitMQ outage under `convoy consume` is said once, and its end too.
#[test]
fn a_broker_outage_is_logged_and_its_end_too() {
    if uri().is_none() {
        return;
    }
    let node = match RabbitNode::start() {
        Ok(node) => node,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let topic = unique("outage");
    let url = format!(
        "{}?topics={topic}&group={topic}-g&partitions=2&heartbeat=3",
        node.uri()
    );
    scenarios::an_outage_is_logged(
        &url,
        "RabbitMQ connection lost",
        "reconnected to RabbitMQ",
        || node.kill().expect("the node was killed"),
        || node.boot().unwrap(),
    );
}

/// Members that park keys are SIGKILLed and replaced mid-stream; no parked key's message runs
/// before its replay, and after the replay each runs in order (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_keys_survive_kill_9_and_replay_in_order() {
    let Some(uri) = uri() else { return };
    let topic = unique("parked");
    let url = url(&uri, &unique("parked-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::processes::parked_keys_survive_kill_9(&url, &topic).await;
}

/// Forwarding on RabbitMQ: a member SIGKILLed ten times mid-run publishes outputs again with
/// the same `message_id`; a convoy consumer of the output handles each once, in per-key order
/// (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_survives_ten_kill_9_deduplicated_by_message_id() {
    let Some(uri) = uri() else { return };
    let topic = unique("forward");
    let out = format!("{topic}-out");
    let url = url(&uri, &unique("forward-group"), &topic);
    let reader = unique("forward-reader");
    let _clean = (
        CleanUp(url.clone(), topic.clone()),
        CleanUp(url.clone(), out.clone()),
    );
    scenarios::processes::forwarding_survives_kill_9(
        &url,
        &topic,
        &out,
        "",
        scenarios::processes::Downstream::Group {
            url: self::url(&uri, &reader, &out),
            group: reader,
        },
    )
    .await;
}

/// `convoy consume | head -1` stops the consumer, which commits only what it printed (exit 0);
/// nothing is dead-lettered, and the next consumer prints the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_stops_consume_committing_only_what_was_printed() {
    let Some(uri) = uri() else { return };
    let topic = unique("pipe");
    let url = url(&uri, &unique("pipe-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::closed_stdout(&url, &topic).await;
}

/// `convoy topic list | head -0` and `convoy dlq list | head -0` end quietly, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_to_a_closed_stdout_end_quietly() {
    let Some(uri) = uri() else { return };
    let topic = unique("listing");
    let url = url(&uri, &unique("listing-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::listings_to_a_closed_stdout(&url).await;
}

#[test]
fn operator_mistakes_are_named() {
    let Some(uri) = uri() else { return };
    let topic = unique("mistakes");
    scenarios::operator_mistakes(&format!("{uri}?topics={topic}"), &topic);
}

/// The soak (scenarios/soak.rs) on a private RabbitMQ node over 16 partitions: 200,000
/// messages in CI (`scripts/soak` runs it long), members killed, stopped, frozen past their
/// heartbeats and the node restarted on a seeded schedule, every sequence verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soak_under_seeded_faults_verifies_every_sequence() {
    let (Some(_), Some(python)) = (uri(), scenarios::python()) else {
        return;
    };
    let node = match tokio::task::spawn_blocking(RabbitNode::start).await.unwrap() {
        Ok(node) => Arc::new(node),
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let topic = unique("soak");
    let partitions = scenarios::soak::partitions(16);
    let url = format!(
        "{}?group={}&topics={topic}&partitions={partitions}&heartbeat=3&balance_interval_ms=100",
        node.uri(),
        unique("soak-group")
    );
    let pika = vec![
        python,
        scenarios::interop_script("pika_rounds.py"),
        node.uri(),
        topic.clone(),
        partitions.to_string(),
    ];
    let broker = node.clone();
    // Two missed heartbeats (3 s each) and a margin: the broker closes the frozen connection.
    let plan = scenarios::soak::SoakPlan::from_env(std::time::Duration::from_secs(9));
    scenarios::soak::soak(&url, &topic, plan, pika, move || {
        broker.kill().expect("the node was killed");
        broker.boot().unwrap();
    })
    .await;
    drop(node);
}
