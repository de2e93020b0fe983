//! Private RabbitMQ nodes (Debian's rabbitmq-server on PATH): one node, or three joined into a
//! cluster. Each has its own name, ports, data and log directories and config; every listener
//! (AMQP, Erlang distribution, epmd) is on 127.0.0.1. Run as root, `rabbitmq-server` drops to the
//! `rabbitmq` user, so a node's directory belongs to it (and is not under a 0700 home), and the
//! nodes of one machine share that user's Erlang cookie — what clustering needs.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use super::tls::TestCa;
use super::{alive, fresh_dir, port_open, remove_dir, tail, wait_until, NodeError};
use crate::support::free_port;

/// How long a node may take to boot (about 4 s here; a restarted cluster member waits for its
/// peers too).
const BOOT_WITHIN: Duration = Duration::from_secs(120);

/// One private RabbitMQ node; stopped (killed if it will not stop) when dropped.
pub struct RabbitNode {
    dir: PathBuf,
    name: String,
    port: u16,
    dist_port: u16,
    /// The `amqps` listener, if the node has one.
    tls_port: Option<u16>,
}

impl RabbitNode {
    /// Prepares a node's directory and config (`label` tells nodes of one test apart), with a
    /// TLS listener when `ca` is given.
    fn new(label: &str, ca: Option<&TestCa>) -> Result<RabbitNode, NodeError> {
        if Command::new("rabbitmq-server").arg("--help").output().is_err() {
            return Err(NodeError::Missing("rabbitmq-server".into()));
        }
        let port = |what: &str| {
            free_port().map_err(|e| NodeError::failed(format!("finding a free port for {what}"), e))
        };
        let unique = super::unique(label);
        let dir = fresh_dir(&format!("rabbit-{unique}"))?;
        for sub in ["mnesia", "log"] {
            std::fs::create_dir_all(dir.join(sub))
                .map_err(|e| NodeError::failed("creating the node's directories", e))?;
        }
        let node = RabbitNode {
            name: format!("convoy{}@localhost", unique.replace('-', "")),
            port: port("AMQP")?,
            dist_port: port("Erlang distribution")?,
            tls_port: ca.map(|_| port("AMQPS")).transpose()?,
            dir,
        };
        let write = |file: &str, text: String| {
            std::fs::write(node.dir.join(file), text)
                .map_err(|e| NodeError::failed(format!("writing {file}"), e))
        };
        write("plugins", "[].".into())?;
        let mut conf = format!("listeners.tcp.local = 127.0.0.1:{}\n", node.port);
        if let (Some(ca), Some(tls_port)) = (ca, node.tls_port) {
            conf.push_str(&format!(
                "listeners.ssl.local = 127.0.0.1:{tls_port}\n\
                 ssl_options.cacertfile = {}\n\
                 ssl_options.certfile = {}\n\
                 ssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_none\n\
                 ssl_options.fail_if_no_peer_cert = false\n",
                ca.ca_pem().display(),
                ca.server_pem().display(),
                ca.server_key().display(),
            ));
        }
        write("rabbitmq.conf", conf)?;
        let owned = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&node.dir)
            .status();
        if !owned.is_ok_and(|s| s.success()) {
            return Err(NodeError::failed(
                "handing the node's directory to the rabbitmq user",
                "chown failed (the tests run as root on the project's machines)",
            ));
        }
        Ok(node)
    }

    /// A single node, booted.
    pub fn start() -> Result<RabbitNode, NodeError> {
        RabbitNode::start_fresh("single", None)
    }

    /// A single node with an `amqps` listener too, its certificate signed by `ca`, booted.
    pub fn start_tls(ca: &TestCa) -> Result<RabbitNode, NodeError> {
        RabbitNode::start_fresh("tls", Some(ca))
    }

    /// A fresh node, booted; if it does not boot, another with fresh ports, up to
    /// [`BOOT_ATTEMPTS`] in all. A node's ports are found free and released before it binds
    /// them, and any process (a client's ephemeral port) may take one meanwhile: seen once in a
    /// full run, a node that stopped at boot (`rabbit_is_not_running`).
    fn start_fresh(kind: &str, ca: Option<&TestCa>) -> Result<RabbitNode, NodeError> {
        let mut attempt = 1;
        loop {
            // A node that failed is stopped and its directory removed when dropped.
            let node = RabbitNode::new(kind, ca)?;
            match node.boot() {
                Ok(()) => return Ok(node),
                Err(e) if attempt < BOOT_ATTEMPTS => {
                    eprintln!("{e}\n(boot attempt {attempt} of {BOOT_ATTEMPTS}: trying a fresh node)");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
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
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", d.join("plugins-expand"))
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            );
    }

    /// `rabbitmqctl -n <node> args…`, returning its standard output.
    pub fn ctl(&self, args: &[&str]) -> Result<String, NodeError> {
        let mut ctl = Command::new("rabbitmqctl");
        ctl.args(["-n", &self.name]).args(args);
        self.env(&mut ctl);
        let out = ctl
            .output()
            .map_err(|e| NodeError::failed(format!("running rabbitmqctl {}", args.join(" ")), e))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(NodeError::failed(
                format!("rabbitmqctl -n {} {}", self.name, args.join(" ")),
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            ))
        }
    }

    /// Boots the node (again, after a kill: its data survives) and waits until it runs.
    pub fn boot(&self) -> Result<(), NodeError> {
        match self.boot_once() {
            // Once more when no process of it runs: right after a SIGKILL, epmd may still hold
            // the old node's name for a moment and refuse the new one.
            Err(first) if !self.is_running() => {
                eprintln!("booting {} again after: {first}", self.name);
                std::thread::sleep(Duration::from_secs(2));
                self.boot_once()
            }
            done => done,
        }
    }

    fn boot_once(&self) -> Result<(), NodeError> {
        let mut start = Command::new("rabbitmq-server");
        start.arg("-detached");
        self.env(&mut start);
        let started = start
            .status()
            .map_err(|e| NodeError::failed("running rabbitmq-server -detached", e))?;
        let pid = self.dir.join("pid");
        let pid = pid.to_string_lossy();
        let waited = self.ctl(&["wait", &pid, "--timeout", &BOOT_WITHIN.as_secs().to_string()]);
        if !started.success()
            || waited.is_err()
            || !wait_until(Duration::from_secs(30), || port_open(self.port))
        {
            return Err(NodeError::failed(
                format!("booting RabbitMQ node {}", self.name),
                format!("{waited:?}; its log ends:\n{}", self.log_tail()),
            ));
        }
        Ok(())
    }

    fn log_tail(&self) -> String {
        let logs = std::fs::read_dir(self.dir.join("log"))
            .map(|entries| entries.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default();
        logs.iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
            .map(|p| tail(p, 15))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// A crash: SIGKILL by the recorded PID, waiting until the process is gone. An error if no
    /// process of the node runs (a test's fault must really happen) or it outlives the signal.
    pub fn kill(&self) -> Result<(), NodeError> {
        let killed = match self.pid().filter(|pid| alive(*pid)) {
            Some(pid) => super::signal(pid, "KILL", Duration::from_secs(30)),
            None => Err(NodeError::failed(
                format!("killing {}", self.name),
                "it was not running (no live process in its pid file)",
            )),
        };
        let _ = std::fs::remove_file(self.dir.join("pid"));
        killed
    }

    /// Freezes (`STOP`) or thaws (`CONT`) the node's process.
    pub fn signal(&self, name: &str) -> Result<(), NodeError> {
        match self.pid() {
            Some(pid) => super::signal(pid, name, Duration::from_secs(30)),
            None => Err(NodeError::failed(
                format!("signalling {}", self.name),
                "not running",
            )),
        }
    }

    /// True while the node's process runs.
    pub fn is_running(&self) -> bool {
        self.pid().is_some_and(alive)
    }

    /// The node's Erlang name (`convoy…@localhost`), as `leader` columns show it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The AMQP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`.
    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// `amqps://guest:guest@127.0.0.1:<tls port>/%2f`, for a node started with
    /// [`start_tls`](Self::start_tls).
    pub fn amqps_uri(&self) -> Option<String> {
        self.tls_port
            .map(|port| format!("amqps://guest:guest@127.0.0.1:{port}/%2f"))
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        let pid = self.dir.join("pid");
        if self.is_running() && self.ctl(&["stop", &pid.to_string_lossy()]).is_err() {
            let _ = self.kill();
        }
        remove_dir(&self.dir);
    }
}

/// How many fresh nodes [`RabbitNode::start`] tries before it gives up.
const BOOT_ATTEMPTS: u32 = 3;

/// Three (or more) private nodes joined into one cluster (quorum queues declared on it are
/// replicated over its members; [`RabbitCluster::queue_leaders`] tells where each one leads).
pub struct RabbitCluster {
    /// The nodes; the first is the one the others joined.
    pub nodes: Vec<RabbitNode>,
}

impl RabbitCluster {
    /// Boots `size` nodes and joins the others to the first.
    pub fn start(size: usize) -> Result<RabbitCluster, NodeError> {
        let nodes: Vec<RabbitNode> = (1..=size)
            .map(|i| RabbitNode::new(&format!("n{i}"), None))
            .collect::<Result<_, _>>()?;
        for node in &nodes {
            node.boot()?;
        }
        let first = nodes[0].name.clone();
        for node in &nodes[1..] {
            node.ctl(&["stop_app"])?;
            node.ctl(&["join_cluster", &first])?;
            node.ctl(&["start_app"])?;
        }
        Ok(RabbitCluster { nodes })
    }

    /// A URI naming every node (`amqp://guest:guest@127.0.0.1:p1,127.0.0.1:p2,…/%2f`), which
    /// convoy-amqp connects to in turn.
    pub fn uri(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("amqp://guest:guest@{}/%2f", hosts.join(","))
    }

    /// Each quorum queue's leader node, as a running node reports them.
    pub fn queue_leaders(&self) -> Result<Vec<(String, String)>, NodeError> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .ok_or_else(|| NodeError::failed("listing queue leaders", "no node runs"))?;
        let listing = node.ctl(&[
            "list_queues",
            "name",
            "type",
            "leader",
            "--quiet",
            "--no-table-headers",
        ])?;
        Ok(listing
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let (name, kind, leader) = (fields.next()?, fields.next()?, fields.next()?);
                (kind == "quorum").then(|| (name.to_owned(), leader.to_owned()))
            })
            .collect())
    }
}
