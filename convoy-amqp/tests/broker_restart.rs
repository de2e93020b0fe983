//! A RabbitMQ node killed (`kill -9`) and restarted twice while an engine consumes and a
//! producer publishes: the member reconnects with backoff, declares again and takes its
//! partitions again; the unacknowledged messages come back in order. Nothing is lost, no key's
//! order is violated. The node is a private one (its own port, data directory and node name),
//! started and stopped by this test by its PID: the machine's RabbitMQ is never touched.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use convoy_amqp::{admin, AmqpDeadLetterSink, AmqpPublisher, AmqpTransport};
use convoy_testkit::support::free_port;
use convoy_testkit::{restarts, OrderChecker};

/// A private RabbitMQ node (the recipe of shared/brokers.md), stopped when dropped.
struct Node {
    dir: PathBuf,
    name: String,
    port: u16,
    dist_port: u16,
}

impl Node {
    fn start() -> Option<Node> {
        if Command::new("rabbitmq-server").arg("--help").output().is_err() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("convoy-rabbit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("mnesia")).unwrap();
        std::fs::create_dir_all(dir.join("log")).unwrap();
        std::fs::write(dir.join("plugins"), "[].").unwrap();
        let node = Node {
            name: format!("convoytest{}@localhost", std::process::id()),
            port: free_port().unwrap(),
            dist_port: free_port().unwrap(),
            dir,
        };
        std::fs::write(
            node.dir.join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{}\n", node.port),
        )
        .unwrap();
        // rabbitmq-server, run as root, drops to the rabbitmq user: the directory is its.
        let chown = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&node.dir)
            .status();
        if !chown.is_ok_and(|s| s.success()) {
            return None;
        }
        node.boot();
        Some(node)
    }

    fn env(&self, command: &mut Command) {
        let d = &self.dir;
        command
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("plugins"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", d.join("feature_flags"))
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", d.join("plugins-expand"));
    }

    fn boot(&self) {
        let mut start = Command::new("rabbitmq-server");
        start.arg("-detached");
        self.env(&mut start);
        assert!(
            start.status().unwrap().success(),
            "rabbitmq-server -detached failed"
        );
        let mut wait = Command::new("rabbitmqctl");
        wait.args(["-n", &self.name, "wait"])
            .arg(self.dir.join("pid"))
            .args(["--timeout", "120"]);
        self.env(&mut wait);
        let status = wait.output().unwrap();
        assert!(
            status.status.success(),
            "the private node did not come up: {}",
            String::from_utf8_lossy(&status.stdout)
        );
    }

    fn pid(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("pid"))
            .ok()
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.is_empty())
    }

    /// A crash: SIGKILL by its recorded PID.
    fn kill(&self) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").args(["-9", &pid]).status();
            // Wait until the process is gone, so the restart does not race it for its port.
            for _ in 0..200 {
                if !Command::new("kill")
                    .args(["-0", &pid])
                    .status()
                    .is_ok_and(|s| s.success())
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = std::fs::remove_file(self.dir.join("pid"));
    }

    fn uri(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let mut stop = Command::new("rabbitmqctl");
        stop.args(["-n", &self.name, "stop"]).arg(self.dir.join("pid"));
        self.env(&mut stop);
        if !stop.output().is_ok_and(|o| o.status.success()) {
            self.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_and_restarted_twice_loses_nothing() {
    common::init_tracing();
    if common::uri().is_none() {
        eprintln!("skipped: {} is not set (scripts/test sets it)", common::URI_VAR);
        return;
    }
    let Some(node) = tokio::task::spawn_blocking(Node::start).await.unwrap() else {
        eprintln!("skipped: rabbitmq-server is not installed here");
        return;
    };
    let topic = common::unique("convoy-restart");
    let config = common::test_config(&node.uri(), &common::unique("g"), &topic, 4);
    admin::create_topics(&config, &[(&topic, 4)]).await.unwrap();
    let checker = Arc::new(OrderChecker::new());
    let engine = restarts::start_engine(
        &AmqpTransport::new(config.clone()).unwrap(),
        Arc::new(AmqpDeadLetterSink::new(&config)),
        &config.group,
        &checker,
    )
    .await;
    // A quorum queue killed within moments of its creation can come back without a Raft leader
    // (RabbitMQ 3.10, seen here: consuming it then hangs); let the queues settle first.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let publisher = AmqpPublisher::new(&config, &topic);
    restarts::publish_through_two_crashes(engine, &publisher, &checker, |_| {
        node.kill();
        node.boot();
    })
    .await;
}
