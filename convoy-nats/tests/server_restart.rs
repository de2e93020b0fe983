//! A nats-server killed (`kill -9`) and restarted twice while an engine consumes and a producer
//! publishes: the client reconnects by itself, leases that could not be renewed in time are
//! reported lost and taken again, and each partition is read again from its committed
//! watermark. Nothing is lost, no key's order is violated; JetStream's file storage keeps the
//! streams, the watermarks and the published messages across the crashes. The server is a
//! private one (its own port and store directory), started and killed by this test by its PID:
//! the machine's nats-server is never touched.

#![allow(clippy::unwrap_used)] // tests unwrap what they set up themselves

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use convoy_nats::{admin, NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::support::free_port;
use convoy_testkit::{restarts, OrderChecker};

/// A private nats-server with JetStream, killed when dropped.
struct Server {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Server {
    fn start() -> Option<Server> {
        if Command::new("nats-server").arg("--version").output().is_err() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("convoy-nats-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Server {
            dir,
            port: free_port().unwrap(),
            child: None,
        };
        server.boot();
        Some(server)
    }

    fn boot(&mut self) {
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(self.dir.join("store"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the private nats-server did not come up on port {}", self.port);
    }

    /// A crash: SIGKILL to the process this test started.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_restarted_twice_loses_nothing() {
    common::init_tracing();
    if common::server().is_none() {
        eprintln!("skipped: {} is not set (scripts/test sets it)", common::URL_VAR);
        return;
    }
    let Some(mut server) = tokio::task::spawn_blocking(Server::start).await.unwrap() else {
        eprintln!("skipped: nats-server is not installed here");
        return;
    };
    let topic = common::unique("convoy-restart");
    let config = common::test_config(&server.address(), &common::unique("g"), &topic, 4);
    admin::create_topics(&config, &[(&topic, 4)]).await.unwrap();
    let checker = Arc::new(OrderChecker::new());
    let engine = restarts::start_engine(
        &NatsTransport::new(config.clone()).unwrap(),
        Arc::new(NatsDeadLetterSink::new(&config)),
        &config.group,
        &checker,
    )
    .await;
    // The stream stores a batch re-sent after a lost acknowledgement once (same event ids).
    let publisher = NatsPublisher::new(&config, &topic);
    // Restarted at once the first time, and the second time after an outage longer than a lease
    // lasts, so the member loses its partitions and takes them again.
    let long_outage = config.lease_ttl() + Duration::from_secs(1);
    restarts::publish_through_two_crashes(engine, &publisher, &checker, |crash| {
        server.kill();
        std::thread::sleep(if crash == 0 { Duration::ZERO } else { long_outage });
        server.boot();
    })
    .await;
}
