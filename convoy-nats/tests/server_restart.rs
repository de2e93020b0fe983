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

use convoy_core::{Engine, OutgoingMessage, Publisher};
use convoy_nats::{admin, NatsDeadLetterSink, NatsPublisher, NatsTransport};
use convoy_testkit::conformance::test_config;
use convoy_testkit::probe::{probe_batch, ProbeHandler, RecordingSink};
use convoy_testkit::OrderChecker;

/// A private nats-server with JetStream, killed when dropped.
struct Server {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
            port: free_port(),
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

/// Publishes `batch` until the server acknowledges it (it may be down): the same messages with
/// the same event ids each time, so the stream stores a batch re-sent after a lost
/// acknowledgement once.
async fn publish_until_acknowledged(publisher: &NatsPublisher, batch: Vec<OutgoingMessage>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while let Err(e) = publisher.publish_all(batch.clone()).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "publishing never succeeded: {e}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
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
    let publisher = NatsPublisher::new(&config, &topic);
    let sink = NatsDeadLetterSink::new(&config);
    let mut engine_config = test_config(&config.group);
    engine_config.drain_timeout = Duration::from_secs(5);
    let engine = Engine::builder(ProbeHandler::new(checker.clone()))
        .config(engine_config)
        .dead_letter_sink(RecordingSink::new(Arc::new(sink), checker.clone()))
        .build()
        .unwrap()
        .start(&NatsTransport::new(config.clone()).unwrap())
        .await
        .unwrap();

    let (keys, chunks, per_chunk) = (20usize, 12usize, 200usize);
    let mut kills = 0;
    for chunk in 0..chunks {
        let batch: Vec<OutgoingMessage> =
            probe_batch(&checker, "key-", keys, chunk * per_chunk, per_chunk, 0)
                .into_iter()
                .map(|m| {
                    let id = format!(
                        "{}-{}",
                        String::from_utf8_lossy(m.key.as_deref().unwrap_or_default()),
                        String::from_utf8_lossy(&m.payload)
                    );
                    m.event_id(id)
                })
                .collect();
        publish_until_acknowledged(&publisher, batch).await;
        // Mid-stream, twice: once some of what was published is handled, kill the server and
        // bring it back — at once the first time, and the second time after an outage longer
        // than a lease lasts, so the member loses its partitions and takes them again.
        if (chunk == 3 || chunk == 7) && kills < 2 {
            let target = checker.published() / 2;
            assert!(
                checker
                    .wait_for(Duration::from_secs(120), |c| c.finished() >= target)
                    .await,
                "no progress before the crash: {:?}",
                checker.report()
            );
            let outage = if kills == 0 {
                Duration::ZERO
            } else {
                config.lease_ttl() + Duration::from_secs(1)
            };
            tokio::task::block_in_place(|| {
                server.kill();
                std::thread::sleep(outage);
                server.boot();
            });
            kills += 1;
        }
    }
    assert!(
        checker.wait_complete(Duration::from_secs(120)).await,
        "not everything was handled after two server crashes: {:?}",
        checker.report()
    );
    engine.stop().await.unwrap();
    let report = checker.report();
    println!(
        "server restarts: {kills}, published {}, finished {}, redelivered duplicates {}, lost {}, violations {}",
        report.published, report.finished, report.duplicates, report.lost, report.order_violations
    );
    assert_eq!(kills, 2);
    assert!(report.is_clean(), "{report:#?}");
    assert_eq!(report.finished, report.published);
}
