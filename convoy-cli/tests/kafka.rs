//! The `convoy` binary against the Kafka-protocol broker named by `CONVOY_KAFKA_BOOTSTRAP`
//! (scripts/test starts Apache Kafka and sets it): the scenarios of `scenarios/`.

#![allow(clippy::unwrap_used)]

mod scenarios;

use convoy_testkit::nodes::kafka::{SecuredKafka, SCRAM};
use convoy_testkit::nodes::tls::TestCa;
use convoy_testkit::nodes::NodeError;
use scenarios::unique;

fn bootstrap() -> Option<String> {
    convoy_testkit::support::required("CONVOY_KAFKA_BOOTSTRAP")
}

/// A URL naming the group and the topic.
fn url(bootstrap: &str, group: &str, topic: &str) -> String {
    format!("kafka://{bootstrap}?group={group}&topics={topic}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_replayed_after_the_fix_is_handled_in_order() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("replay");
    let url = format!(
        "{}&partitions=4",
        url(&bootstrap, &unique("replay-group"), &topic)
    );
    scenarios::dead_letter_replay(&url, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpark_passes_over_a_failed_message_and_purge_hides_dead_letters() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("unpark");
    let url = url(&bootstrap, &unique("unpark-group"), &topic);
    scenarios::unpark_and_purge(&url, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_key_holding_thousands_replays_whole() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("park-big");
    let url = url(&bootstrap, &unique("park-big-group"), &topic);
    scenarios::a_parked_key_holding_thousands_replays_whole(&url, &topic).await;
}

#[test]
fn bench_runs_the_seed_scenario_on_kafka() {
    let Some(bootstrap) = bootstrap() else { return };
    let url = format!("kafka://{bootstrap}");
    scenarios::bench_seed(&url, "kafka");
}

/// `convoy produce --probes` fills a topic once; each `bench --prefilled-topic` run drains all
/// of it with a fresh group, in per-key order, and leaves it for the next one.
#[test]
fn bench_drains_a_prefilled_topic_with_a_fresh_group_each_run() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("prefilled");
    let url = format!("kafka://{bootstrap}?topics={topic}&partitions=4");
    let produced = scenarios::convoy(&[
        "--url",
        &url,
        "produce",
        "--generate",
        "3000",
        "--keys",
        "30",
        "--probes",
    ]);
    assert!(
        produced.status.success(),
        "{}",
        String::from_utf8_lossy(&produced.stderr)
    );
    for _ in 0..2 {
        let out = scenarios::convoy(&[
            "--url",
            &url,
            "bench",
            "--scenario",
            "custom",
            "--prefilled-topic",
            &topic,
            "--messages",
            "3000",
            "--keys",
            "30",
            "--partitions",
            "4",
            "--json",
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            (report["messages"].as_u64(), report["completed"].as_bool()),
            (Some(3000), Some(true))
        );
        assert_eq!(
            (report["order_violations"].as_u64(), report["lost"].as_u64()),
            (Some(0), Some(0))
        );
        assert!(report["baseline_throughput_msg_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn consume_prints_lanes_and_serves_prometheus_metrics() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("consume");
    scenarios::consume_prints_and_serves_metrics(&url(&bootstrap, &unique("consume-group"), &topic));
}

#[test]
fn a_paused_key_waits_until_resumed() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("pause");
    scenarios::pause_and_resume(&url(&bootstrap, &unique("pause-group"), &topic));
}

/// A second Ctrl-C aborts a drain that would otherwise wait for its timeout (30 s) behind
/// messages taking a minute; and one message is one output line whatever its payload holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_ctrl_c_aborts_the_drain_and_payloads_print_on_one_line() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("consume-abort");
    scenarios::second_ctrl_c(&url(&bootstrap, &unique("consume-abort-group"), &topic), &topic).await;
}

/// The CLI over Kafka's SASL_SSL (SCRAM-SHA-512, a CA made by the test) with zstd: produces and
/// consumes; a wrong password ends at once naming the settings to check.
#[test]
fn produce_and_consume_over_sasl_ssl() {
    if bootstrap().is_none() {
        return;
    }
    let ca = match TestCa::new() {
        Ok(ca) => ca,
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let node = SecuredKafka::start(&ca, &[("alice", "alice-secret")]).unwrap();
    let topic = unique("tls");
    let secured = |password: &str| {
        format!(
            "kafka://{}?topics={topic}&group={topic}-g&partitions=4&security.protocol=SASL_SSL\
             &sasl.mechanisms={SCRAM}&sasl.username=alice&sasl.password={password}\
             &ssl.ca.location={}&compression.type=zstd",
            node.sasl_ssl_address(),
            ca.ca_pem().display()
        )
    };
    scenarios::secured_produce_and_consume(&secured("alice-secret"), &secured("wrong"), "sasl.password");
}

/// SIGTERM mid-run hands over without repeats; `--max-messages` takes exactly that many
/// (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_over_without_repeats_and_max_messages_is_exact() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("term");
    let url = format!("{}&partitions=4", url(&bootstrap, &unique("term-group"), &topic));
    scenarios::processes::sigterm_hands_over_without_repeats(&url, &topic).await;
}

/// A rolling deploy on Apache Kafka, in each group protocol: a member stopped with SIGTERM while
/// its replacement joins, ten times; nothing may be handled twice. A stop whose final commit is
/// refused while the group rebalances (IllegalGeneration) tries it again until its deadline.
/// With the bundled librdkafka 2.12 this test also passed on the code before that retry, so the
/// retry itself is proved by the simulator (`convoy-sim/power/7-final-commit-not-retried.patch`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restarts_handle_nothing_twice() {
    let Some(bootstrap) = bootstrap() else { return };
    for protocol in [
        "group_protocol=classic&assignor=cooperative-sticky",
        "group_protocol=consumer",
    ] {
        let topic = unique("roll");
        let url = format!(
            "{}&partitions=6&{protocol}",
            url(&bootstrap, &unique("roll-group"), &topic)
        );
        let again = scenarios::processes::rolling_restarts(&url, &topic, 10).await;
        assert_eq!(again, 0, "{protocol}: handled again after graceful stops");
    }
}

#[test]
fn topics_are_created_listed_and_deleted() {
    let Some(bootstrap) = bootstrap() else { return };
    scenarios::topic_commands(&format!("kafka://{bootstrap}"), &unique("topics"), false);
}

/// A Kafka outage under `convoy consume` is said once, and its end too (librdkafka's own
/// repeated connection errors are not shown).
#[test]
fn a_broker_outage_is_logged_and_its_end_too() {
    if bootstrap().is_none() {
        return;
    }
    let cluster = match convoy_testkit::nodes::kafka::KafkaCluster::start(1) {
        Ok(cluster) => std::sync::Mutex::new(cluster),
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let bootstrap = cluster.lock().unwrap().bootstrap();
    let topic = unique("outage");
    let url = format!("{}&partitions=2", url(&bootstrap, &format!("{topic}-g"), &topic));
    // The topic exists before the consumer joins.
    let created = scenarios::convoy(&["--url", &url, "topic", "create", &topic, "--partitions", "2"]);
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    scenarios::an_outage_is_logged(
        &url,
        "Kafka brokers unreachable",
        "Kafka brokers answer again",
        || {
            cluster
                .lock()
                .unwrap()
                .node(1)
                .unwrap()
                .kill()
                .expect("the node was killed")
        },
        || cluster.lock().unwrap().node(1).unwrap().restart().unwrap(),
    );
}

/// Members that park keys are SIGKILLed and replaced mid-stream; no parked key's message runs
/// before its replay, and after the replay each runs in order (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_keys_survive_kill_9_and_replay_in_order() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("parked");
    let url = format!(
        "{}&partitions=4",
        url(&bootstrap, &unique("parked-group"), &topic)
    );
    scenarios::processes::parked_keys_survive_kill_9(&url, &topic).await;
}

/// Exactly once to Kafka: a forwarding member with a transactional id SIGKILLed ten times
/// mid-run; a read_committed reader sees every output once, in per-key order
/// (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_forwarding_survives_ten_kill_9() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("eos");
    let url = format!("{}&partitions=4", url(&bootstrap, &unique("eos-group"), &topic));
    let member = format!("&transactional_id={topic}-member&group.instance.id={topic}-member");
    scenarios::processes::forwarding_survives_kill_9(
        &url,
        &topic,
        &format!("{topic}-out"),
        &member,
        scenarios::processes::Downstream::Topic,
    )
    .await;
}

/// The control of the test above: the same kills without a transactional id must leave copies
/// in the output (nothing lost, in order), or the exactly-once runs would prove nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_without_a_transaction_publishes_copies_through_kill_9() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("alo");
    let url = format!("{}&partitions=4", url(&bootstrap, &unique("alo-group"), &topic));
    scenarios::processes::forwarding_survives_kill_9(
        &url,
        &topic,
        &format!("{topic}-out"),
        &format!("&group.instance.id={topic}-member"),
        scenarios::processes::Downstream::TopicWithCopies,
    )
    .await;
}

/// Exactly once to Kafka: a forwarding member frozen with uncommitted work while another takes
/// its partitions, then thawed, commits nothing (scenarios/processes.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_forwarder_commits_nothing_after_thawing() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("zombie");
    let url = format!(
        "{}&partitions=4",
        url(&bootstrap, &unique("zombie-group"), &topic)
    );
    scenarios::processes::a_frozen_forwarder_commits_nothing_after_thawing(&url, &topic).await;
}

/// `convoy consume | head -1` stops the consumer, which commits only what it printed (exit 0);
/// nothing is dead-lettered, and the next consumer prints the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_stops_consume_committing_only_what_was_printed() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("pipe");
    let url = url(&bootstrap, &unique("pipe-group"), &topic);
    scenarios::closed_stdout(&url, &topic).await;
}

/// `convoy topic list | head -0` and `convoy dlq list | head -0` end quietly, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_to_a_closed_stdout_end_quietly() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("listing");
    let url = url(&bootstrap, &unique("listing-group"), &topic);
    scenarios::listings_to_a_closed_stdout(&url).await;
}

#[test]
fn operator_mistakes_are_named() {
    let Some(bootstrap) = bootstrap() else { return };
    let topic = unique("mistakes");
    scenarios::operator_mistakes(&format!("kafka://{bootstrap}?topics={topic}"), &topic);
}

/// The soak (scenarios/soak.rs) on a private Apache Kafka node over 64 partitions: 200,000
/// messages in CI (`scripts/soak` runs it long), members killed, stopped, frozen past their
/// session and the node restarted on a seeded schedule, every sequence verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soak_under_seeded_faults_verifies_every_sequence() {
    let (Some(_), Some(python)) = (bootstrap(), scenarios::python()) else {
        return;
    };
    let cluster = match tokio::task::spawn_blocking(|| convoy_testkit::nodes::kafka::KafkaCluster::start(1))
        .await
        .unwrap()
    {
        Ok(cluster) => std::sync::Arc::new(std::sync::Mutex::new(cluster)),
        Err(missing @ NodeError::Missing(_)) => return convoy_testkit::support::skip(missing),
        Err(e) => panic!("{e}"),
    };
    let bootstrap = cluster.lock().unwrap().bootstrap();
    let topic = unique("soak");
    let partitions = scenarios::soak::partitions(64);
    let url = format!(
        "{}&partitions={partitions}&session_timeout_ms=6000",
        url(&bootstrap, &unique("soak-group"), &topic)
    );
    let kafka_python = vec![
        python,
        scenarios::interop_script("kafka_python_rounds.py"),
        bootstrap,
        topic.clone(),
        partitions.to_string(),
    ];
    let broker = cluster.clone();
    let plan = scenarios::soak::SoakPlan::from_env(std::time::Duration::from_secs(9));
    scenarios::soak::soak(&url, &topic, plan, kafka_python, move || {
        let mut cluster = broker.lock().unwrap();
        let node = cluster.node(1).unwrap();
        node.kill().expect("the node was killed");
        node.restart().unwrap();
    })
    .await;
    drop(cluster);
}
