//! The `convoy` binary against NATS JetStream (`CONVOY_NATS_URL`; scripts/test sets it): the
//! scenarios of `scenarios/`, each deleting what it created (the server is shared), and a
//! member frozen past its leases.

#![allow(clippy::unwrap_used)]

mod scenarios;

use std::time::Duration;

use std::sync::{Arc, Mutex};

use convoy_testkit::nodes::tls::TestCa;
use convoy_testkit::nodes::{nats::NatsServer, NodeError};
use scenarios::failover::{failover, Producer};
use scenarios::{unique, CleanUp};

/// Leases of these tests: short, so takeovers are quick.
const LEASE: Duration = Duration::from_secs(3);

fn server() -> Option<String> {
    convoy_testkit::support::required("CONVOY_NATS_URL")
}

fn url(server: &str, group: &str, topic: &str) -> String {
    format!(
        "{server}?group={group}&topics={topic}&partitions=4&lease_ttl_ms={}&balance_interval_ms=100",
        LEASE.as_millis()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replayed_after_the_fix_is_handled_in_order() {
    let Some(server) = server() else { return };
    let topic = unique("replay");
    let url = url(&server, &unique("replay-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::dead_letter_replay(&url, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpark_passes_over_a_failed_message_and_purge_hides_dead_letters() {
    let Some(server) = server() else { return };
    let topic = unique("unpark");
    let url = url(&server, &unique("unpark-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::unpark_and_purge(&url, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_key_holding_thousands_replays_whole() {
    let Some(server) = server() else { return };
    let topic = unique("park-big");
    let url = url(&server, &unique("park-big-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::a_parked_key_holding_thousands_replays_whole(&url, &topic).await;
}

#[test]
fn bench_runs_the_seed_scenario_on_nats() {
    let Some(server) = server() else { return };
    scenarios::bench_seed(&server, "nats");
}

#[test]
fn consume_prints_lanes_and_serves_prometheus_metrics() {
    let Some(server) = server() else { return };
    let topic = unique("consume");
    let url = url(&server, &unique("consume-group"), &topic);
    let _clean = CleanUp(url.clone(), topic);
    scenarios::consume_prints_and_serves_metrics(&url);
}

#[test]
fn a_paused_key_waits_until_resumed() {
    let Some(server) = server() else { return };
    let topic = unique("pause");
    let url = url(&server, &unique("pause-group"), &topic);
    let _clean = CleanUp(url.clone(), topic);
    scenarios::pause_and_resume(&url);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_aborts_the_drain_and_payloads_print_on_one_line() {
    let Some(server) = server() else { return };
    let topic = unique("consume-abort");
    let url = url(&server, &unique("consume-abort-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::second_ctrl_c(&url, &topic).await;
}

/// `convoy consume` processes of one group join, leave and are SIGKILLed while a producer
/// publishes (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_processes_join_leave_and_survive_kill_9() {
    let Some(server) = server() else { return };
    let topic = unique("procs");
    let url = format!(
        "{server}?group={}&topics={topic}&partitions=8&lease_ttl_ms={}&balance_interval_ms=100",
        unique("procs-group"),
        LEASE.as_millis()
    );
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::processes::join_leave_and_survive_kill_9(&url, &topic).await;
}

/// A member frozen with SIGSTOP past its leases never handles a message after another member
/// took its partitions, once thawed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_frozen_past_its_leases_handles_nothing_after_thawing() {
    let Some(server) = server() else { return };
    let topic = unique("frozen");
    let url = url(&server, &unique("frozen-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::processes::a_frozen_member_handles_nothing_after_its_lease(&url, &topic, LEASE).await;
}

/// The crash loop of issue 25 with a foreign producer: nats-py publishing without any stamp (no
/// event id, no `Nats-Msg-Id`: a re-sent message is stored twice) to a private nats-server, and
/// two `convoy consume` members; ten members killed with SIGKILL (each replaced; its leases
/// expire on the server) and the server killed with SIGKILL and restarted twice, mid-stream.
/// Every confirmed message is handled, in per-key order (scenarios/failover.rs asserts it), and
/// each fault's time to recover is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_under_a_foreign_producer_loses_nothing() {
    let (Some(_), Some(python)) = (server(), scenarios::python()) else {
        return;
    };
    let server = match tokio::task::spawn_blocking(NatsServer::start).await.unwrap() {
        Ok(server) => server,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let address = server.address();
    let server = Arc::new(Mutex::new(server));
    let topic = unique("crashloop");
    let url = url(&format!("nats://{address}"), &unique("crashloop-group"), &topic);
    let nats_py = vec![
        python,
        scenarios::interop_script("nats_rounds.py"),
        format!("nats://{address}"),
        topic.clone(),
        "4".to_owned(),
    ];
    // The server outlives the faults: the load's end still needs it.
    let broker = server.clone();
    let report = failover(&url, &topic, Producer::Foreign(nats_py), move |progress| {
        for fault in 0..12 {
            if fault == 3 || fault == 8 {
                progress.fault("the NATS server killed (SIGKILL) and restarted", || {
                    let mut server = broker.lock().unwrap();
                    server.kill().expect("the server was killed");
                    server.restart().unwrap();
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
    drop(server);
    assert_eq!(report.faults.len(), 12);
}

/// The CLI over NATS with TLS and a login (a private server, a CA made by the test,
/// `tls_ca_file`): produces and consumes; a wrong password ends at once.
#[test]
fn produce_and_consume_over_tls() {
    if server().is_none() {
        return;
    }
    let ca = match TestCa::new() {
        Ok(ca) => ca,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let server = NatsServer::start_tls(&ca, "alice", "alice-secret").unwrap();
    let topic = unique("tls");
    let secured = |password: &str| {
        format!(
            "nats://alice:{password}@{}?topics={topic}&group={topic}-g&partitions=4&tls_required=true&tls_ca_file={}",
            server.address(),
            ca.ca_pem().display()
        )
    };
    scenarios::secured_produce_and_consume(
        &secured("alice-secret"),
        &secured("wrong"),
        "authorization violation",
    );
}

/// SIGTERM mid-run hands over without repeats; `--max-messages` takes exactly that many
/// (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_over_without_repeats_and_max_messages_is_exact() {
    let Some(server) = server() else { return };
    let topic = unique("term");
    let url = url(&server, &unique("term-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::processes::sigterm_hands_over_without_repeats(&url, &topic).await;
}

#[test]
fn topics_are_created_listed_and_deleted() {
    let Some(server) = server() else { return };
    scenarios::topic_commands(&server, &unique("topics"), false);
}

/// A NATS outage under `convoy consume` is said once, and its end too.
#[test]
fn a_broker_outage_is_logged_and_its_end_too() {
    if server().is_none() {
        return;
    }
    let server = match NatsServer::start() {
        Ok(server) => Mutex::new(server),
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let address = server.lock().unwrap().address();
    let topic = unique("outage");
    let url = url(&format!("nats://{address}"), &format!("{topic}-g"), &topic);
    scenarios::an_outage_is_logged(
        &url,
        "NATS connection lost",
        "NATS connection back",
        || server.lock().unwrap().kill().expect("the server was killed"),
        || server.lock().unwrap().restart().unwrap(),
    );
}

/// Members that park keys are SIGKILLed and replaced mid-stream; no parked key's message runs
/// before its replay, and after the replay each runs in order (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_keys_survive_kill_9_and_replay_in_order() {
    let Some(server) = server() else { return };
    let topic = unique("parked");
    let url = url(&server, &unique("parked-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::processes::parked_keys_survive_kill_9(&url, &topic).await;
}

/// Forwarding on NATS: a member SIGKILLed ten times mid-run publishes outputs again with the
/// same `Nats-Msg-Id`; the output stream keeps each once, in per-key order
/// (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_survives_ten_kill_9_deduplicated_by_msg_id() {
    let Some(server) = server() else { return };
    let topic = unique("forward");
    let out = format!("{topic}-out");
    let url = url(&server, &unique("forward-group"), &topic);
    let _clean = (
        CleanUp(url.clone(), topic.clone()),
        CleanUp(url.clone(), out.clone()),
    );
    scenarios::processes::forwarding_survives_kill_9(
        &url,
        &topic,
        &out,
        "",
        scenarios::processes::Downstream::Topic,
    )
    .await;
}

/// `convoy consume | head -1` stops the consumer, which commits only what it printed (exit 0);
/// nothing is dead-lettered, and the next consumer prints the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_stops_consume_committing_only_what_was_printed() {
    let Some(server) = server() else { return };
    let topic = unique("pipe");
    let url = url(&server, &unique("pipe-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::closed_stdout(&url, &topic).await;
}

/// `convoy topic list | head -0` and `convoy dlq list | head -0` end quietly, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_to_a_closed_stdout_end_quietly() {
    let Some(server) = server() else { return };
    let topic = unique("listing");
    let url = url(&server, &unique("listing-group"), &topic);
    let _clean = CleanUp(url.clone(), topic.clone());
    scenarios::listings_to_a_closed_stdout(&url).await;
}

#[test]
fn operator_mistakes_are_named() {
    let Some(server) = server() else { return };
    let topic = unique("mistakes");
    scenarios::operator_mistakes(&format!("{server}?topics={topic}"), &topic);
}

/// The soak (scenarios/soak.rs) on a private NATS server over 16 partitions: 200,000 messages
/// in CI (`scripts/soak` runs it long), members killed, stopped, frozen past their leases and
/// the server restarted on a seeded schedule, every sequence verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soak_under_seeded_faults_verifies_every_sequence() {
    let (Some(_), Some(python)) = (server(), scenarios::python()) else {
        return;
    };
    let server = match tokio::task::spawn_blocking(NatsServer::start).await.unwrap() {
        Ok(server) => server,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let address = server.address();
    let topic = unique("soak");
    let partitions = scenarios::soak::partitions(16);
    let url = format!(
        "nats://{address}?group={}&topics={topic}&partitions={partitions}&lease_ttl_ms={}&balance_interval_ms=100",
        unique("soak-group"),
        LEASE.as_millis()
    );
    let nats_py = vec![
        python,
        scenarios::interop_script("nats_rounds.py"),
        format!("nats://{address}"),
        topic.clone(),
        partitions.to_string(),
    ];
    let server = Arc::new(Mutex::new(server));
    let broker = server.clone();
    let plan = scenarios::soak::SoakPlan::from_env(LEASE + Duration::from_secs(2));
    scenarios::soak::soak(&url, &topic, plan, nats_py, move || {
        let mut server = broker.lock().unwrap();
        server.kill().expect("the server was killed");
        server.restart().unwrap();
    })
    .await;
    drop(server);
}
