//! The `convoy` binary against NATS JetStream (`CONVOY_NATS_URL`; scripts/test sets it): the
//! scenarios of `scenarios/`, each deleting what it created (the server is shared), and a
//! member frozen past its leases.

#![allow(clippy::unwrap_used)]

mod scenarios;

use std::time::Duration;

use scenarios::{unique, CleanUp};

/// Leases of these tests: short, so takeovers are quick.
const LEASE: Duration = Duration::from_secs(3);

fn server() -> Option<String> {
    let u = std::env::var("CONVOY_NATS_URL").ok().filter(|u| !u.is_empty());
    if u.is_none() {
        eprintln!("CONVOY_NATS_URL is not set: skipping (scripts/test sets it)");
    }
    u
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
