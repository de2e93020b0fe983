//! The `convoy` binary without a broker process: the benchmark on the embedded broker, and
//! one clear line for each kind of bad input.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn convoy(args: &[&str]) -> Output {
    convoy_with_env(args, &[])
}

fn convoy_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_convoy"));
    command.args(args).env_remove("RUST_LOG");
    for var in [
        "CONVOY_URL",
        "CONVOY_GROUP",
        "CONVOY_TOPICS",
        "CONVOY_DLQ_TOPIC",
        "CONVOY_PARTITIONS",
    ] {
        command.env_remove(var);
    }
    command.envs(env.iter().copied());
    command.output().unwrap()
}

/// The command failed with exactly one line on stderr containing every `expected` text.
fn assert_one_line_error(out: &Output, expected: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should fail: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    for text in expected {
        assert!(stderr.contains(text), "{stderr:?} should mention {text:?}");
    }
}

#[test]
fn bench_on_the_embedded_broker_verifies_every_key() {
    let out = convoy(&["bench", "--messages", "3000", "--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["transport"], "memory");
    assert_eq!(report["messages"], 3000);
    assert_eq!(report["keys"], 10);
    assert_eq!(report["completed"], true);
    assert_eq!(report["order_violations"], 0);
    assert_eq!(report["lost"], 0);
    assert!(
        report["retries"].as_u64().unwrap() > 200,
        "10 % fail once: {report}"
    );
    assert!(report["baseline_throughput_msg_s"].as_f64().unwrap() > 0.0);
    // Beside the seed's own figures, with the latency measured again at the seed's pace.
    assert_eq!(report["scenario"], "seed");
    assert_eq!(report["reference"]["throughput_msg_s"], 14027.0);
    assert_eq!(report["reference"]["p50_ms"], 11.7);
    let held = &report["at_held_rate"];
    assert_eq!(held["offered_rate_msg_s"], 14000.0, "{report}");
    assert_eq!(
        (held["messages"].as_u64(), held["lost"].as_u64()),
        (Some(3000), Some(0))
    );
    assert_eq!(held["order_violations"], 0);
    assert!(
        held["rate_held"].is_boolean() && held["p50_ms"].as_f64().unwrap() > 0.0,
        "{held}"
    );
    // The stages' means add up to the mean latency: the first two are measured on their own,
    // so together they cannot exceed it.
    for run in [&report, held] {
        let stage = |name: &str| run["stages"][name].as_f64().unwrap();
        let measured = stage("to_engine_mean_ms") + stage("in_engine_mean_ms");
        let mean = run["mean_ms"].as_f64().unwrap();
        assert!(measured <= mean * 1.01 + 0.01, "{run}");
        let sum = measured + stage("handler_and_retries_mean_ms");
        assert!((sum - mean).abs() <= mean * 0.01 + 0.01, "{run}");
    }

    // The table says what it compares with, and how to read its stages.
    let out = convoy(&["bench", "--messages", "1000"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    for line in [
        "throughput ÷ target's",
        "at a held rate: p50 ÷ target's",
        "latency mean = the stages' means",
        "14027 msg/s, p50 11.7 ms",
        "do not add up",
    ] {
        assert!(table.contains(line), "{line:?} missing: {table}");
    }
}

#[test]
fn seed_load_reports_whether_the_rate_was_held() {
    let out = convoy(&[
        "bench",
        "--scenario",
        "seed-load",
        "--rate",
        "2000",
        "--duration",
        "1",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["messages"].as_u64(), report["keys"].as_u64()),
        (Some(2000), Some(1000))
    );
    assert_eq!(report["offered_rate_msg_s"], 2000.0);
    assert_eq!(report["scenario"], "seed-load");
    assert!(report.get("at_held_rate").is_none() && report.get("reference").is_none());
    assert!(report["rate_held"].is_boolean(), "{report}");
    assert_eq!(report["lost"], 0);
    // A live load splits the time before the handler at the engine's receipt.
    let stages = &report["stages"];
    for field in [
        "to_ack_p50_ms",
        "to_ack_p99_ms",
        "to_engine_p50_ms",
        "to_engine_p99_ms",
        "in_engine_p50_ms",
        "in_engine_p99_ms",
    ] {
        assert!(
            stages[field].as_f64().is_some_and(|ms| ms > 0.0),
            "{field}: {report}"
        );
    }
    assert!(
        stages["to_engine_p99_ms"].as_f64() <= report["p999_ms"].as_f64().map(|p| p + 1.0),
        "a stage cannot exceed the whole: {report}"
    );
}

#[test]
fn the_table_is_printed_without_json() {
    let out = convoy(&[
        "bench",
        "--scenario",
        "custom",
        "--messages",
        "2000",
        "--keys",
        "50",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for row in [
        "throughput",
        "p99 / p99.9",
        "order violations",
        "ratio to baseline",
        "PASS",
    ] {
        assert!(stdout.contains(row), "{row} missing from\n{stdout}");
    }
}

#[test]
fn a_bad_url_is_one_clear_line() {
    assert_one_line_error(
        &convoy(&["--url", "rabbit://x", "bench"]),
        &[
            "unknown broker URL scheme `rabbit://`",
            "memory://",
            "kafka://",
            "amqp://",
            "nats://",
        ],
    );
    assert_one_line_error(
        &convoy(&["--url", "127.0.0.1:9092", "bench"]),
        &["expected scheme://address"],
    );
    let unreachable = convoy(&["--url", "nats://s3cret@127.0.0.1:1", "bench"]);
    assert_one_line_error(
        &unreachable,
        &["connecting to NATS at 127.0.0.1:1", "is the server running?"],
    );
    assert!(!String::from_utf8_lossy(&unreachable.stderr).contains("s3cret"));
    assert_one_line_error(
        &convoy(&["--url", "nats://127.0.0.1:4222?lease_ttl_ms=5", "consume"]),
        &["`lease_ttl_ms`"],
    );
    assert_one_line_error(
        &convoy(&["--url", "amqp://guest:guest@127.0.0.1:1/%2f", "bench"]),
        &["connecting to RabbitMQ at amqp://guest:<redacted>@127.0.0.1:1/%2f"],
    );
    assert_one_line_error(
        &convoy(&["--url", "amqp://127.0.0.1:5672/%2f?prefetch=0", "consume"]),
        &["`prefetch`"],
    );
    assert_one_line_error(
        &convoy(&["--url", "kafka://127.0.0.1:9092?session_timeout_ms=5", "consume"]),
        &["`session_timeout_ms`", "between 1000"],
    );
    assert_one_line_error(
        &convoy(&["--url", "kafka://localhost?topics=t", "consume"]),
        &["`bootstrap_servers`"],
    );
    assert_one_line_error(
        &convoy(&["--url", "memory://?colour=blue", "bench"]),
        &["`colour`"],
    );
}

#[test]
fn a_prefilled_topic_needs_the_custom_scenario_and_kafka() {
    assert_one_line_error(
        &convoy(&["bench", "--prefilled-topic", "t"]),
        &["--prefilled-topic", "--scenario custom"],
    );
    assert_one_line_error(
        &convoy(&[
            "bench",
            "--scenario",
            "custom",
            "--rate",
            "100",
            "--prefilled-topic",
            "t",
        ]),
        &["--prefilled-topic", "without --rate"],
    );
    // memory:// starts empty in every process: nothing another process filled is there.
    assert_one_line_error(
        &convoy(&["bench", "--scenario", "custom", "--prefilled-topic", "t"]),
        &["--prefilled-topic needs a kafka:// URL"],
    );
    let probes_alone = convoy(&["produce", "--probes"]);
    assert!(!probes_alone.status.success());
    assert!(String::from_utf8_lossy(&probes_alone.stderr).contains("--generate"));
}

#[test]
fn an_unreachable_broker_is_one_clear_line() {
    // Port 1 on the loopback: nothing listens there.
    let out = convoy(&["--url", "kafka://127.0.0.1:1", "topic", "list"]);
    assert_one_line_error(
        &out,
        &["no Kafka broker answered at 127.0.0.1:1", "is it running"],
    );
}

#[test]
fn consume_waits_out_an_unreachable_broker_then_says_so_in_one_error() {
    // A member started while its broker restarts waits (30 s, retrying with backoff, each
    // retry a warning), then fails with the same one-line error as a one-shot command.
    let out = convoy(&["--url", "kafka://127.0.0.1:1", "--topic", "t", "consume"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should fail: {stderr}");
    assert!(
        stderr.contains("connecting: the broker is unavailable; trying again"),
        "{stderr}"
    );
    let last = stderr.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("no Kafka broker answered at 127.0.0.1:1"),
        "{stderr}"
    );
}

#[test]
fn a_bad_config_file_or_variable_is_one_clear_line() {
    let dir = std::env::temp_dir().join(format!("convoy-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad_type = dir.join("bad-type.toml");
    std::fs::write(&bad_type, "url = \"memory://\"\npartitions = \"eight\"\n").unwrap();
    assert_one_line_error(
        &convoy(&["--config", bad_type.to_str().unwrap(), "bench"]),
        &["bad-type.toml", "line 2", "partitions"],
    );
    let unknown = dir.join("unknown.toml");
    std::fs::write(&unknown, "url = \"memory://\"\ntopicz = [\"a\"]\n").unwrap();
    assert_one_line_error(
        &convoy(&["--config", unknown.to_str().unwrap(), "bench"]),
        &["unknown field `topicz`"],
    );
    assert_one_line_error(
        &convoy(&["--config", "/nonexistent/convoy.toml", "bench"]),
        &["/nonexistent/convoy.toml"],
    );
    // The engine's settings: an unknown one names its line, a bad value its setting.
    let engine_typo = dir.join("engine-typo.toml");
    std::fs::write(
        &engine_typo,
        "url = \"memory://\"\ntopics = [\"t\"]\n[engine]\nmax_in_flght = 3\n",
    )
    .unwrap();
    assert_one_line_error(
        &convoy(&["--config", engine_typo.to_str().unwrap(), "consume"]),
        &["line 4", "max_in_flght"],
    );
    let engine_bad = dir.join("engine-bad.toml");
    std::fs::write(
        &engine_bad,
        "url = \"memory://\"\ntopics = [\"t\"]\n[engine.back_pressure]\nsource_high = 10\nsource_low = 20\n",
    )
    .unwrap();
    assert_one_line_error(
        &convoy(&["--config", engine_bad.to_str().unwrap(), "consume"]),
        &["back_pressure.source_low"],
    );
    assert_one_line_error(
        &convoy_with_env(
            &["--url", "memory://?topics=t", "consume"],
            &[("CONVOY_ENGINE_DRAIN", "everything")],
        ),
        &["CONVOY_ENGINE_DRAIN", "everything"],
    );
    assert_one_line_error(
        &convoy_with_env(
            &["--url", "memory://?topics=t", "consume"],
            &[("CONVOY_ENGINE_MAX_IN_FLIGHT", "abc")],
        ),
        &["CONVOY_ENGINE_MAX_IN_FLIGHT", "expected a whole number"],
    );
    assert_one_line_error(
        &convoy_with_env(&["bench"], &[("CONVOY_PARTITIONS", "eight")]),
        &["`CONVOY_PARTITIONS`"],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_input_lines_and_unsafe_replays_are_refused() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", "memory://", "--topic", "t", "produce"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"k1\tv1\nno separator here\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_one_line_error(
        &out,
        &[
            "line 2",
            "KEY\\tPAYLOAD",
            "the 1 message(s) before it were published",
            "--skip-bad-lines",
        ],
    );
    let memory = ["--url", "memory://"];
    assert_one_line_error(
        &convoy(&[&memory[..], &["--topic", "t", "dlq", "replay"]].concat()),
        &["--all"],
    );
    assert_one_line_error(&convoy(&[&memory[..], &["consume"]].concat()), &["--topic"]);
}

#[test]
fn bad_lines_can_be_skipped_and_payloads_decoded() {
    let out = produce(
        b"k1\tv1\nno separator\nk2\tv2\n\nalso bad\n",
        &["--skip-bad-lines"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("skipping line 2"), "{stderr}");
    assert!(stderr.contains("skipped 2 bad line(s): 2, 5"), "{stderr}");
    assert!(stderr.contains("published 2 messages"), "{stderr}");

    let out = produce(b"k1\tAAH/\nk2\tnot*base64\n", &["--payload-encoding", "base64"]);
    assert_one_line_error(
        &out,
        &[
            "line 2",
            "not base64",
            "the 1 message(s) before it were published",
        ],
    );
    let out = produce(b"k1\t00ff\n", &["--payload-encoding", "hex"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn commands_other_than_bench_need_a_broker_url() {
    for command in [
        &["produce"][..],
        &["consume"],
        &["--topic", "t", "dlq", "list"],
        &["topic", "list"],
    ] {
        assert_one_line_error(
            &convoy(command),
            &["--url", "CONVOY_URL", "only `convoy bench` defaults to memory://"],
        );
    }
}

#[test]
fn memory_urls_say_they_live_inside_one_process() {
    assert_one_line_error(
        &convoy(&["--url", "memory://", "--topic", "t", "consume"]),
        &["memory:// lives inside one process", "wait forever", "--url"],
    );
    let out = produce(b"k1\tv1\n", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("published 1 messages to t on memory://, inside this process only: they are gone"),
        "{stderr}"
    );
}

#[test]
fn input_errors_name_the_line_and_the_fix() {
    assert_one_line_error(
        &produce(b"k1\tv1\n\tno key\n", &[]),
        &["line 2", "empty key", "--keyless"],
    );
    assert_one_line_error(
        &produce(b"k1\tv1\nk2\t\xff\xfe binary\n", &[]),
        &["line 2", "not UTF-8", "--payload-encoding"],
    );
    let skipped = produce(b"k1\tv1\nk2\t\xff\nk3\tv3\n", &["--skip-bad-lines"]);
    let stderr = String::from_utf8_lossy(&skipped.stderr);
    assert!(skipped.status.success(), "{stderr}");
    assert!(stderr.contains("skipped 1 bad line(s): 2"), "{stderr}");
    assert!(stderr.contains("published 2 messages"), "{stderr}");
    assert_one_line_error(
        &convoy(&[
            "--url",
            "memory://",
            "--topic",
            "t",
            "produce",
            "--generate",
            "5",
            "--keys",
            "0",
        ]),
        &["--keys must be at least 1"],
    );
}

#[test]
fn impossible_bench_shapes_are_refused() {
    for (args, says) in [
        (&["--keys", "0"][..], "at least 1"),
        (&["--messages", "0"], "at least 1"),
        (&["--partitions", "0"], "at least 1"),
        (
            &["--messages", "10", "--keys", "20"],
            "--keys 20 is more than --messages 10",
        ),
    ] {
        let out = convoy(&[&["bench", "--scenario", "custom"][..], args].concat());
        assert_one_line_error(&out, &[says]);
    }
    // One key: a throughput only from a clock that covered the drain, or none.
    let out = convoy(&[
        "bench",
        "--scenario",
        "custom",
        "--keys",
        "1",
        "--messages",
        "2000",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let elapsed = report["elapsed_s"].as_f64().unwrap();
    match report["throughput_msg_s"].as_f64() {
        Some(rate) => {
            assert!(elapsed >= 0.01, "{report}");
            assert!((rate * elapsed - 2000.0).abs() < 1.0, "{report}");
        }
        None => assert!(elapsed < 0.01, "{report}"),
    }
    // The baseline's drain is held to the same rule: 20 messages drain too fast to time.
    let out = convoy(&["bench", "--scenario", "custom", "--keys", "2", "--messages", "20"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    let baseline = row_of(&table, "baseline");
    assert!(
        baseline.contains("not measured") || baseline.contains("msg/s"),
        "{table}"
    );
    if baseline.contains("msg/s") {
        // Timed after all: its rate covers at least MIN_TIMED_S.
        let rate: f64 = baseline
            .split(" msg/s")
            .next()
            .and_then(|b| b.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no rate in {baseline}"));
        assert!(20.0 / rate >= 0.001, "{table}");
    }
    // No baseline run: said so, no invented 0 msg/s or ratio.
    let out = convoy(&[
        "bench",
        "--scenario",
        "custom",
        "--keys",
        "2",
        "--messages",
        "2000",
        "--no-baseline",
    ]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(
        row_of(&table, "baseline").contains("not run (--no-baseline)"),
        "{table}"
    );
    assert!(row_of(&table, "ratio to baseline").contains("not run"), "{table}");
}

/// The row `name` of a bench table (`| name | value |`).
fn row_of(table: &str, name: &str) -> String {
    table
        .lines()
        .find(|l| l.trim_start_matches("| ").starts_with(name))
        .unwrap_or_else(|| panic!("no {name} row: {table}"))
        .to_owned()
}

#[test]
fn lanes_watch_takes_no_value() {
    // Nothing listens on port 1: the command gets past its arguments and names the address.
    let out = convoy(&["lanes", "--addr", "127.0.0.1:1", "--watch"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!stderr.contains("a value is required"), "{stderr}");
    assert!(stderr.contains("127.0.0.1:1"), "{stderr}");
}

#[test]
fn the_address_consume_prints_is_taken_as_pasted() {
    // `consume` prints `metrics at http://127.0.0.1:PORT/metrics`: pasted whole into `lanes`.
    let out = convoy(&["lanes", "--addr", "http://127.0.0.1:1/metrics"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no convoy consume answered at 127.0.0.1:1 ") && !stderr.contains("lookup"),
        "{stderr}"
    );
    // `--metrics-addr` takes a host name: the command gets past it (to memory://'s refusal).
    let out = convoy(&[
        "--url",
        "memory://?topics=t",
        "consume",
        "--metrics-addr",
        "localhost:0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("memory:// lives inside one process"), "{stderr}");
}

/// `convoy --url memory:// --topic t produce EXTRA…` with `input` on its stdin.
fn produce(input: &[u8], extra: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", "memory://", "--topic", "t", "produce"])
        .args(extra)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// Ctrl-C while `consume` is still connecting (a broker that accepts and never answers) stops
/// it cleanly — exit 0, saying nothing was consumed — instead of killing it by the signal.
#[test]
fn a_signal_while_starting_stops_cleanly() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let url = format!("nats://127.0.0.1:{port}?topics=t&group=g");
    let child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", &url, "consume"])
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It connects only after it listens for signals: once it connected, it is listening.
    let (_connection, _) = silent.accept().unwrap();
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(
        stderr.contains("SIGINT while starting: stopped before consuming anything"),
        "{stderr}"
    );
}
