//! The `convoy` binary against RabbitMQ (`CONVOY_AMQP_URI`; scripts/test sets it): the scenarios
//! of `scenarios/`, each deleting what it declared (the broker is shared).

#![allow(clippy::unwrap_used)]

mod scenarios;

use scenarios::{unique, CleanUp};

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
