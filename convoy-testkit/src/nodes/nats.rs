//! Private nats-server processes with JetStream: one server, or a three-server cluster whose
//! streams and buckets can have three replicas. The program is `CONVOY_NATS_SERVER` (scripts/test
//! points it at the pinned 2.12 build), else `nats-server` on PATH.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::tls::TestCa;
use super::{fresh_dir, http_get, http_status, port_open, remove_dir, tail, wait_until, NodeError};
use crate::support::free_port;

/// How long a server may take to answer its health check after a start.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// The nats-server program to run.
pub fn binary() -> Result<PathBuf, NodeError> {
    let program = std::env::var("CONVOY_NATS_SERVER")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "nats-server".to_owned());
    match Command::new(&program).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(PathBuf::from(program)),
        _ => Err(NodeError::Missing(program)),
    }
}

/// Cluster membership of one server: its route port and the other servers' route ports.
struct Routes {
    cluster_name: String,
    own: u16,
    others: Vec<u16>,
}

/// One private nats-server; killed (SIGKILL) and its directory removed when dropped.
pub struct NatsServer {
    binary: PathBuf,
    dir: PathBuf,
    name: String,
    port: u16,
    monitor_port: u16,
    routes: Option<Routes>,
    /// Extra arguments (TLS, a user) the server starts with every time.
    extra: Vec<String>,
    child: Option<Child>,
}

impl NatsServer {
    fn new(binary: PathBuf, name: &str, routes: Option<Routes>) -> Result<NatsServer, NodeError> {
        let port = |what: &str| {
            free_port().map_err(|e| NodeError::failed(format!("finding a free port for {what}"), e))
        };
        Ok(NatsServer {
            dir: fresh_dir(&format!("nats-{}", super::unique(name)))?,
            name: name.to_owned(),
            port: port("a nats-server")?,
            monitor_port: port("its monitoring")?,
            routes,
            extra: Vec::new(),
            child: None,
            binary,
        })
    }

    /// A single server with JetStream, started and healthy.
    pub fn start() -> Result<NatsServer, NodeError> {
        let mut server = NatsServer::new(binary()?, "single", None)?;
        server.spawn()?;
        server.wait_ready()?;
        Ok(server)
    }

    /// A single server with JetStream that requires TLS (its certificate signed by `ca`) and a
    /// login (`user`, `password`), started and healthy.
    pub fn start_tls(ca: &TestCa, user: &str, password: &str) -> Result<NatsServer, NodeError> {
        let mut server = NatsServer::new(binary()?, "tls", None)?;
        server.extra = vec![
            "--tls".into(),
            "--tlscert".into(),
            ca.server_pem().display().to_string(),
            "--tlskey".into(),
            ca.server_key().display().to_string(),
            "--user".into(),
            user.into(),
            "--pass".into(),
            password.into(),
        ];
        server.spawn()?;
        server.wait_ready()?;
        Ok(server)
    }

    /// Starts the process (its JetStream store survives restarts) without waiting for it.
    pub fn spawn(&mut self) -> Result<(), NodeError> {
        let mut command = Command::new(&self.binary);
        command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-m", &self.monitor_port.to_string(), "--server_name", &self.name])
            .arg("-js")
            .arg("-sd")
            .arg(self.dir.join("store"))
            .arg("-l")
            .arg(self.dir.join("nats.log"))
            .args(&self.extra);
        if let Some(routes) = &self.routes {
            let others: Vec<String> = routes
                .others
                .iter()
                .map(|p| format!("nats://127.0.0.1:{p}"))
                .collect();
            command
                .args(["--cluster_name", &routes.cluster_name])
                .args(["--cluster", &format!("nats://127.0.0.1:{}", routes.own)])
                .args(["--routes", &others.join(",")]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| NodeError::failed(format!("starting {}", self.binary.display()), e))?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the server answers its health check (JetStream current with its cluster).
    pub fn wait_ready(&self) -> Result<(), NodeError> {
        let healthy = || port_open(self.port) && http_status(self.monitor_port, "/healthz") == Some(200);
        if wait_until(READY_WITHIN, healthy) {
            Ok(())
        } else {
            Err(NodeError::failed(
                format!("nats-server {} on port {}", self.name, self.port),
                format!(
                    "not healthy within {READY_WITHIN:?}; its log ends:\n{}",
                    tail(&self.dir.join("nats.log"), 20)
                ),
            ))
        }
    }

    /// Starts the server again after a kill and waits until it is healthy.
    pub fn restart(&mut self) -> Result<(), NodeError> {
        self.spawn()?;
        self.wait_ready()
    }

    /// A crash: SIGKILL, waiting until the process is gone. An error if it was not running (a
    /// test's fault must really happen).
    pub fn kill(&mut self) -> Result<(), NodeError> {
        super::kill_child(self.child.take(), &format!("killing {}", self.name))
    }

    /// Freezes (`STOP`) or thaws (`CONT`) the process.
    pub fn signal(&self, name: &str) -> Result<(), NodeError> {
        match &self.child {
            Some(child) => super::signal(child.id(), name, Duration::ZERO),
            None => Err(NodeError::failed(
                format!("signalling {}", self.name),
                "not running",
            )),
        }
    }

    /// `127.0.0.1:<port>`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The server's name (`--server_name`), as JetStream reports stream leaders.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True while this server's process runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.kill();
        remove_dir(&self.dir);
    }
}

/// Three (or more) nats-servers routed into one cluster with JetStream.
pub struct NatsCluster {
    /// The servers, `n1 … nN`.
    pub servers: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts `size` servers and waits until every one is healthy (a JetStream meta leader is
    /// elected and each server is current with it).
    pub fn start(size: usize) -> Result<NatsCluster, NodeError> {
        let binary = binary()?;
        let route_ports: Vec<u16> = (0..size)
            .map(|_| free_port().map_err(|e| NodeError::failed("finding a free route port", e)))
            .collect::<Result<_, _>>()?;
        let cluster_name = format!("convoy-{}", std::process::id());
        let mut servers = Vec::with_capacity(size);
        for (i, own) in route_ports.iter().enumerate() {
            let routes = Routes {
                cluster_name: cluster_name.clone(),
                own: *own,
                others: route_ports.iter().copied().filter(|p| p != own).collect(),
            };
            servers.push(NatsServer::new(
                binary.clone(),
                &format!("n{}", i + 1),
                Some(routes),
            )?);
        }
        // All before waiting on any: JetStream needs a quorum of the cluster to be healthy.
        for server in &mut servers {
            server.spawn()?;
        }
        for server in &servers {
            server.wait_ready()?;
        }
        // Healthy is not enough to place a stream on every server: until the meta leader counts
        // each peer online, a stream of three replicas is refused ("no suitable peers for
        // placement, peer offline"), which a loaded machine shows.
        let cluster = NatsCluster { servers };
        if !wait_until(READY_WITHIN, || cluster.meta_peers_online(size)) {
            return Err(NodeError::failed(
                "the NATS cluster",
                format!("its JetStream meta leader did not count all {size} servers online within {READY_WITHIN:?}"),
            ));
        }
        Ok(cluster)
    }

    /// True once a server leads the JetStream meta group and counts its `size - 1` peers
    /// current and online (`/jsz`'s `meta_cluster.replicas`, which only the leader lists).
    fn meta_peers_online(&self, size: usize) -> bool {
        self.servers.iter().any(|server| {
            let Some((200, body)) = http_get(server.monitor_port, "/jsz") else {
                return false;
            };
            let Ok(jsz) = serde_json::from_str::<serde_json::Value>(&body) else {
                return false;
            };
            jsz["meta_cluster"]["replicas"].as_array().is_some_and(|peers| {
                peers.len() + 1 == size && peers.iter().all(|p| p["current"] == true && p["offline"] != true)
            })
        })
    }

    /// Every server's address, comma-separated (a client URL's server list).
    pub fn addresses(&self) -> String {
        self.servers
            .iter()
            .map(NatsServer::address)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The server named `name`.
    pub fn by_name(&mut self, name: &str) -> Option<&mut NatsServer> {
        self.servers.iter_mut().find(|s| s.name == name)
    }

    /// The name of the server leading `stream`'s replicas, as a running server's monitoring
    /// endpoint (`/jsz`) reports it.
    pub fn stream_leader(&mut self, stream: &str) -> Option<String> {
        let ports: Vec<u16> = self
            .servers
            .iter_mut()
            .filter_map(|s| s.is_running().then_some(s.monitor_port))
            .collect();
        ports.into_iter().find_map(|port| {
            let (status, body) = http_get(port, "/jsz?accounts=true&streams=true")?;
            if status != 200 {
                return None;
            }
            let jsz: serde_json::Value = serde_json::from_str(&body).ok()?;
            jsz["account_details"]
                .as_array()?
                .iter()
                .filter_map(|account| account["stream_detail"].as_array())
                .flatten()
                .find(|detail| detail["name"] == stream)
                .and_then(|detail| detail["cluster"]["leader"].as_str().map(str::to_owned))
        })
    }
}
