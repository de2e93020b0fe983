//! The `convoy` binary against the Kafka-protocol broker named by `CONVOY_KAFKA_BOOTSTRAP`
//! (scripts/test starts Tansu and sets it): the scenarios of `scenarios/`.

#![allow(clippy::unwrap_used)]

mod scenarios;

use scenarios::unique;

fn bootstrap() -> Option<String> {
    let b = std::env::var("CONVOY_KAFKA_BOOTSTRAP")
        .ok()
        .filter(|b| !b.is_empty());
    if b.is_none() {
        eprintln!("CONVOY_KAFKA_BOOTSTRAP is not set: skipping (scripts/test sets it)");
    }
    b
}

/// A URL with fast group joins (Tansu takes half the session timeout per join).
fn url(bootstrap: &str, group: &str, topic: &str) -> String {
    format!(
        "kafka://{bootstrap}?group={group}&topics={topic}&session_timeout_ms=6000&heartbeat.interval.ms=500"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replayed_after_the_fix_is_handled_in_order() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("replay");
    scenarios::dead_letter_replay(&url(&bootstrap, &unique("replay-group"), &topic), &topic).await;
}

#[test]
fn bench_runs_the_seed_scenario_on_kafka() {
    let Some(bootstrap) = bootstrap() else { return };
    let url = format!("kafka://{bootstrap}?session_timeout_ms=6000&heartbeat.interval.ms=500");
    scenarios::bench_seed(&url, "kafka");
}

#[test]
fn consume_prints_lanes_and_serves_prometheus_metrics() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("consume");
    scenarios::consume_prints_and_serves_metrics(&url(&bootstrap, &unique("consume-group"), &topic));
}

/// A second Ctrl-C aborts a drain that would otherwise wait for its timeout (30 s) behind
/// messages taking a minute; and one message is one output line whatever its payload holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_aborts_the_drain_and_payloads_print_on_one_line() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("consume-abort");
    scenarios::second_ctrl_c(&url(&bootstrap, &unique("consume-abort-group"), &topic), &topic).await;
}
