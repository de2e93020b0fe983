//! Private Apache Kafka nodes in KRaft mode, each a combined broker + controller in a JVM of its
//! own: one node, or a three-node cluster (one controller quorum, topics replicated three times
//! with `min.insync.replicas=2`). The distribution is `CONVOY_KAFKA_HOME` — the directory
//! `scripts/brokers/kafka home` prints, holding `lib/` (the broker's jars from Maven Central)
//! and `log4j2.properties`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::tls::{TestCa, STORE_PASSWORD};
use super::{fresh_dir, port_open, remove_dir, tail, wait_until, NodeError};
use crate::support::free_port;

/// How long a node may take to start (a JVM on a busy 2-core machine; a restarted node also
/// catches up with the others' logs).
const START_WITHIN: Duration = Duration::from_secs(120);
/// Each node's heap: three of them run beside the tests on a small machine.
const HEAP: &str = "-Xmx384m";
const STARTED: &str = "Kafka Server started";

/// The Kafka distribution directory (`CONVOY_KAFKA_HOME`), checked to hold the broker's jars.
pub fn home() -> Result<PathBuf, NodeError> {
    let home = std::env::var("CONVOY_KAFKA_HOME")
        .ok()
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| {
            NodeError::Missing("Apache Kafka (CONVOY_KAFKA_HOME is not set; scripts/test sets it)".into())
        })?;
    if !home.join("lib").is_dir() || Command::new("java").arg("-version").output().is_err() {
        return Err(NodeError::Missing(format!(
            "Apache Kafka in {} (lib/ and java)",
            home.display()
        )));
    }
    Ok(home)
}

/// One private Kafka node; killed and its directory removed when dropped.
pub struct KafkaNode {
    home: PathBuf,
    id: u32,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl KafkaNode {
    /// `127.0.0.1:<port>`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The node id (`node.id`), as partition leaders are reported.
    pub fn id(&self) -> u32 {
        self.id
    }

    fn java(&self, class: &str) -> Command {
        let mut java = Command::new("java");
        java.arg("-cp").arg(self.home.join("lib").join("*")).arg(class);
        java
    }

    fn started_count(&self) -> usize {
        std::fs::read_to_string(self.dir.join("logs").join("server.log"))
            .map(|log| log.matches(STARTED).count())
            .unwrap_or(0)
    }

    /// Starts the JVM without waiting for it.
    fn spawn(&mut self) -> Result<(), NodeError> {
        let logs = self.dir.join("logs");
        let child = Command::new("java")
            .args([
                "-Xms128m",
                HEAP,
                "-XX:+UseG1GC",
                "-XX:MaxGCPauseMillis=20",
                "-Djava.awt.headless=true",
            ])
            .arg(format!("-Dkafka.logs.dir={}", logs.display()))
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                self.home.join("log4j2.properties").display()
            ))
            .arg("-cp")
            .arg(self.home.join("lib").join("*"))
            .arg("kafka.Kafka")
            .arg(self.dir.join("server.properties"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(logs.join("stderr.log"))
                    .map_err(|e| NodeError::failed("creating the node's stderr log", e))?,
            ))
            .spawn()
            .map_err(|e| NodeError::failed("starting a Kafka JVM", e))?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the node logged its start (after `before` earlier starts) and listens.
    fn wait_started(&mut self, before: usize) -> Result<(), NodeError> {
        let started = wait_until(START_WITHIN, || {
            self.started_count() > before && port_open(self.port)
                || self
                    .child
                    .as_mut()
                    .is_some_and(|c| !matches!(c.try_wait(), Ok(None)))
        });
        if started && self.is_running() {
            return Ok(());
        }
        Err(NodeError::failed(
            format!("starting Kafka node {} on port {}", self.id, self.port),
            format!(
                "not started within {START_WITHIN:?}; its logs end:\n{}\n{}",
                tail(&self.dir.join("logs").join("server.log"), 20),
                tail(&self.dir.join("logs").join("stderr.log"), 10)
            ),
        ))
    }

    /// Starts the node again after a kill or a stop (its log directory survives) and waits
    /// until it runs.
    pub fn restart(&mut self) -> Result<(), NodeError> {
        let before = self.started_count();
        self.spawn()?;
        self.wait_started(before)
    }

    /// A crash: SIGKILL, waiting until the process is gone. An error if it was not running (a
    /// test's fault must really happen).
    pub fn kill(&mut self) -> Result<(), NodeError> {
        super::kill_child(self.child.take(), &format!("killing Kafka node {}", self.id))
    }

    /// A controlled shutdown (SIGTERM: leadership moves away first), waiting until it exits.
    pub fn stop(&mut self) -> Result<(), NodeError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // Our own child: gone once it can be waited for (`kill -0` would see a zombie).
        super::signal(child.id(), "TERM", Duration::ZERO)?;
        let exited = wait_until(Duration::from_secs(60), || !matches!(child.try_wait(), Ok(None)));
        if exited {
            return Ok(());
        }
        let _ = child.kill();
        let _ = child.wait();
        Err(NodeError::failed(
            format!("stopping Kafka node {}", self.id),
            "no controlled shutdown within 60 s; killed",
        ))
    }

    /// True while the node's JVM runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for KafkaNode {
    fn drop(&mut self) {
        let _ = self.kill();
        remove_dir(&self.dir);
    }
}

/// The SASL mechanism of a secured node's listener.
pub const SCRAM: &str = "SCRAM-SHA-512";

/// One private node with a `SASL_SSL` listener beside its plaintext one: TLS with a test CA's
/// server certificate, SASL SCRAM-SHA-512 with the users it was formatted with.
pub struct SecuredKafka {
    /// The node (its plaintext listener is [`KafkaNode::address`]).
    pub node: KafkaNode,
    sasl_ssl_port: u16,
}

impl SecuredKafka {
    /// Formats and starts the node; `ca` signs its certificate, `users` are (name, password).
    pub fn start(ca: &TestCa, users: &[(&str, &str)]) -> Result<SecuredKafka, NodeError> {
        let home = home()?;
        let port = || free_port().map_err(|e| NodeError::failed("finding a free port for Kafka", e));
        let (plain, secure, controller) = (port()?, port()?, port()?);
        let dir = fresh_dir(&format!("kafka-{}", super::unique("secured")))?;
        std::fs::create_dir_all(dir.join("logs"))
            .map_err(|e| NodeError::failed("creating the node's log directory", e))?;
        let properties = format!(
            "process.roles=broker,controller\n\
             node.id=1\n\
             controller.quorum.voters=1@127.0.0.1:{controller}\n\
             listeners=PLAINTEXT://127.0.0.1:{plain},SASL_SSL://127.0.0.1:{secure},CONTROLLER://127.0.0.1:{controller}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{plain},SASL_SSL://127.0.0.1:{secure}\n\
             inter.broker.listener.name=PLAINTEXT\n\
             controller.listener.names=CONTROLLER\n\
             listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL\n\
             sasl.enabled.mechanisms={SCRAM}\n\
             listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;\n\
             ssl.keystore.type=PKCS12\n\
             ssl.keystore.location={store}\n\
             ssl.keystore.password={STORE_PASSWORD}\n\
             ssl.key.password={STORE_PASSWORD}\n\
             log.dirs={data}\n\
             offsets.topic.replication.factor=1\n\
             transaction.state.log.replication.factor=1\n\
             transaction.state.log.min.isr=1\n\
             share.coordinator.state.topic.replication.factor=1\n\
             share.coordinator.state.topic.min.isr=1\n\
             group.initial.rebalance.delay.ms=0\n\
             group.consumer.min.session.timeout.ms=6000\n\
             group.consumer.session.timeout.ms=10000\n",
            store = ca.server_p12().display(),
            data = dir.join("data").display(),
        );
        std::fs::write(dir.join("server.properties"), properties)
            .map_err(|e| NodeError::failed("writing server.properties", e))?;
        let mut node = KafkaNode {
            home,
            id: 1,
            port: plain,
            dir,
            child: None,
        };
        let out = node
            .java("kafka.tools.StorageTool")
            .arg("random-uuid")
            .output()
            .map_err(|e| NodeError::failed("making a cluster id", e))?;
        let cluster_id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let mut format = node.java("kafka.tools.StorageTool");
        format
            .args(["format", "-t", &cluster_id, "-c"])
            .arg(node.dir.join("server.properties"));
        for (name, password) in users {
            format.args([
                "--add-scram",
                &format!("{SCRAM}=[name={name},password={password}]"),
            ]);
        }
        let formatted = format
            .output()
            .map_err(|e| NodeError::failed("formatting a Kafka log directory", e))?;
        if !formatted.status.success() {
            return Err(NodeError::failed(
                "formatting the secured Kafka node",
                String::from_utf8_lossy(&formatted.stderr),
            ));
        }
        node.spawn()?;
        node.wait_started(0)?;
        if !wait_until(START_WITHIN, || port_open(secure)) {
            return Err(NodeError::failed(
                "starting the secured Kafka node",
                "its SASL_SSL port never opened",
            ));
        }
        Ok(SecuredKafka {
            node,
            sasl_ssl_port: secure,
        })
    }

    /// `127.0.0.1:<port>` of the `SASL_SSL` listener.
    pub fn sasl_ssl_address(&self) -> String {
        format!("127.0.0.1:{}", self.sasl_ssl_port)
    }
}

/// One or more KRaft nodes with one controller quorum.
pub struct KafkaCluster {
    /// The nodes, ids 1 … N.
    pub nodes: Vec<KafkaNode>,
}

impl KafkaCluster {
    /// Formats and starts `size` nodes (all before waiting on any: a node waits for a majority
    /// of the controllers), replicating topics and internal topics `min(size, 3)` times with
    /// `min.insync.replicas` one below that.
    pub fn start(size: usize) -> Result<KafkaCluster, NodeError> {
        let home = home()?;
        let port = || free_port().map_err(|e| NodeError::failed("finding a free port for Kafka", e));
        let ports: Vec<(u16, u16)> = (0..size)
            .map(|_| Ok((port()?, port()?)))
            .collect::<Result<_, NodeError>>()?;
        let voters: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, controller))| format!("{}@127.0.0.1:{controller}", i + 1))
            .collect();
        let replicas = size.min(3);
        let min_isr = replicas.saturating_sub(1).max(1);
        let mut nodes = Vec::with_capacity(size);
        let mut cluster_id: Option<String> = None;
        for (i, (client, controller)) in ports.iter().enumerate() {
            let id = i as u32 + 1;
            let dir = fresh_dir(&format!("kafka-{}", super::unique(&format!("n{id}"))))?;
            std::fs::create_dir_all(dir.join("logs"))
                .map_err(|e| NodeError::failed("creating the node's log directory", e))?;
            let properties = format!(
                "process.roles=broker,controller\n\
                 node.id={id}\n\
                 controller.quorum.voters={voters}\n\
                 listeners=PLAINTEXT://127.0.0.1:{client},CONTROLLER://127.0.0.1:{controller}\n\
                 advertised.listeners=PLAINTEXT://127.0.0.1:{client}\n\
                 inter.broker.listener.name=PLAINTEXT\n\
                 controller.listener.names=CONTROLLER\n\
                 listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT\n\
                 log.dirs={data}\n\
                 default.replication.factor={replicas}\n\
                 min.insync.replicas={min_isr}\n\
                 offsets.topic.replication.factor={replicas}\n\
                 transaction.state.log.replication.factor={replicas}\n\
                 transaction.state.log.min.isr={min_isr}\n\
                 share.coordinator.state.topic.replication.factor={replicas}\n\
                 share.coordinator.state.topic.min.isr={min_isr}\n\
                 group.initial.rebalance.delay.ms=0\n\
                 group.consumer.min.session.timeout.ms=6000\n\
                 group.consumer.session.timeout.ms=10000\n",
                voters = voters.join(","),
                data = dir.join("data").display(),
            );
            std::fs::write(dir.join("server.properties"), properties)
                .map_err(|e| NodeError::failed("writing server.properties", e))?;
            let node = KafkaNode {
                home: home.clone(),
                id,
                port: *client,
                dir,
                child: None,
            };
            let id_text = match &cluster_id {
                Some(id) => id.clone(),
                None => {
                    let out = node
                        .java("kafka.tools.StorageTool")
                        .arg("random-uuid")
                        .output()
                        .map_err(|e| NodeError::failed("making a cluster id", e))?;
                    let made = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                    cluster_id = Some(made.clone());
                    made
                }
            };
            let formatted = node
                .java("kafka.tools.StorageTool")
                .args(["format", "-t", &id_text, "-c"])
                .arg(node.dir.join("server.properties"))
                .output()
                .map_err(|e| NodeError::failed("formatting a Kafka log directory", e))?;
            if !formatted.status.success() {
                return Err(NodeError::failed(
                    format!("formatting Kafka node {id}"),
                    String::from_utf8_lossy(&formatted.stderr),
                ));
            }
            nodes.push(node);
        }
        for node in &mut nodes {
            node.spawn()?;
        }
        for node in &mut nodes {
            node.wait_started(0)?;
        }
        Ok(KafkaCluster { nodes })
    }

    /// Every node's address, comma-separated (a bootstrap list).
    pub fn bootstrap(&self) -> String {
        self.nodes
            .iter()
            .map(KafkaNode::address)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The node with `id`.
    pub fn node(&mut self, id: u32) -> Option<&mut KafkaNode> {
        self.nodes.iter_mut().find(|n| n.id == id)
    }
}
