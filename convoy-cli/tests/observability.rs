//! The dashboard and the alert rules of `deploy/` name only metrics that exist (issue 21, item
//! 4): a real `convoy consume --metrics-addr` on Kafka (scripts/test starts it) handles a few
//! messages; every `convoy_*` metric the Grafana dashboard, the Prometheus rules and KEDA's
//! Prometheus ScaledObject (deploy/kubernetes) use — histograms through their `_bucket` series —
//! is on its `/metrics` page.

#![allow(clippy::unwrap_used)]

mod scenarios;

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use scenarios::{get, unique, KillOnDrop};

/// Every `convoy_…` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find("convoy_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

fn deploy(path: &str) -> String {
    let full = convoy_testkit::support::repo_file(&format!("deploy/{path}"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

#[test]
fn every_metric_the_dashboard_and_the_alerts_name_is_exported() {
    let Some(bootstrap) = convoy_testkit::support::required("CONVOY_KAFKA_BOOTSTRAP") else {
        return;
    };
    let dashboard = deploy("grafana/convoy.json");
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    assert!(!parsed["panels"].as_array().unwrap().is_empty());
    let rules = deploy("prometheus/convoy-alerts.yml");
    // KEDA's Prometheus scaler: the query it scales the Deployment on.
    let scaler = deploy("kubernetes/scaledobject-prometheus.yaml");
    let wanted: BTreeSet<String> = metric_names(&dashboard)
        .into_iter()
        .chain(metric_names(&rules))
        .chain(metric_names(&scaler))
        .collect();
    assert!(wanted.len() >= 10, "{wanted:?}");

    let topic = unique("observed");
    let url = format!("kafka://{bootstrap}?topics={topic}&group={topic}-g&partitions=2");
    let produced = scenarios::convoy(&["--url", &url, "produce", "--generate", "50", "--keys", "5"]);
    assert!(
        produced.status.success(),
        "{}",
        String::from_utf8_lossy(&produced.stderr)
    );
    let port = convoy_testkit::support::free_port().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_convoy"))
        .args(["--url", &url, "consume", "--quiet", "--metrics-addr", &addr])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let guard = KillOnDrop(child.id());
    // The per-partition gauges come with the first lag query: wait for everything named.
    let deadline = Instant::now() + Duration::from_secs(90);
    let missing = loop {
        let page = std::net::TcpStream::connect(&addr)
            .map(|_| get(&addr, "/metrics"))
            .unwrap_or_default();
        let exported: BTreeSet<String> = page
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .map(str::to_owned)
            .collect();
        let missing: Vec<&String> = wanted.iter().filter(|m| !exported.contains(*m)).collect();
        if missing.is_empty() || Instant::now() >= deadline {
            break missing.into_iter().cloned().collect::<Vec<_>>();
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = child.kill();
    let _ = child.wait();
    std::mem::forget(guard); // reaped: its pid may be reused
    assert!(
        missing.is_empty(),
        "named by deploy/ but not exported: {missing:?}"
    );
    println!("deploy/ names {} metrics, all exported: {wanted:?}", wanted.len());
}
