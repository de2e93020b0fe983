//! Private broker nodes for the tests that crash, restart or cluster brokers: processes a test
//! starts itself — free loopback ports, a directory of their own under the system's temporary
//! directory — and stops by the PID it recorded, never a broker it did not start. Single nodes
//! and three-node clusters of NATS ([`nats`]), RabbitMQ ([`rabbitmq`]) and Apache Kafka
//! ([`kafka`]); a test CA and a loopback server certificate for their TLS listeners ([`tls`]).
//! Where the broker programs are comes from the environment scripts/test sets
//! (`CONVOY_NATS_SERVER`, `CONVOY_KAFKA_HOME`; RabbitMQ from Debian's package on PATH).
//!
//! These helpers block (they spawn processes and wait for ports): call them from a blocking
//! context (`tokio::task::spawn_blocking`, `block_in_place`) in async tests.

pub mod kafka;
pub mod nats;
pub mod rabbitmq;
pub mod tls;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Why a private node could not be started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The broker's program is not installed here (the test should say so and skip).
    #[error("{0} is not installed here")]
    Missing(String),
    /// Starting, stopping or preparing a node failed.
    #[error("{what}: {detail}")]
    Failed {
        /// What was being done.
        what: String,
        /// What went wrong (a log excerpt where there is one).
        detail: String,
    },
}

impl NodeError {
    pub(crate) fn failed(what: impl Into<String>, detail: impl std::fmt::Display) -> NodeError {
        NodeError::Failed {
            what: what.into(),
            detail: detail.to_string(),
        }
    }
}

/// A name no other node of this process has: `<name>-<pid>-<n>` (tests of one binary run
/// side by side, each with private nodes of its own).
pub(crate) fn unique(name: &str) -> String {
    static NODES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NODES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{name}-{}-{n}", std::process::id())
}

/// A fresh, empty directory for a node named by [`unique`], removed by [`remove_dir`].
pub(crate) fn fresh_dir(name: &str) -> Result<PathBuf, NodeError> {
    let dir = std::env::temp_dir().join(format!("convoy-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| NodeError::failed(format!("creating {}", dir.display()), e))?;
    Ok(dir)
}

pub(crate) fn remove_dir(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}

/// True while something accepts connections on the loopback port.
pub fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)).is_ok()
}

/// Polls `ready` every 50 ms until it is true or `within` passed.
pub(crate) fn wait_until(within: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if ready() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// True while the process `pid` exists.
pub(crate) fn alive(pid: u32) -> bool {
    Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Sends `signal` (`KILL`, `TERM`, `STOP`, `CONT`) to `pid` and, for KILL and TERM, waits until
/// the process is gone (at most `within`; zero: no wait), so a restart never races it for its
/// ports. For a process that is not this one's child (a child that exited stays a zombie until
/// waited for, and `kill -0` still finds it).
pub(crate) fn signal(pid: u32, signal: &str, within: Duration) -> Result<(), NodeError> {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status();
    if matches!(signal, "KILL" | "TERM") && !within.is_zero() && !wait_until(within, || !alive(pid)) {
        return Err(NodeError::failed(
            format!("stopping process {pid} with SIG{signal}"),
            format!("still running after {within:?}"),
        ));
    }
    Ok(())
}

/// SIGKILLs a node's own `child` and reaps it; an error (naming `what`) if there was none or it
/// had already exited: a test's fault must really happen.
pub(crate) fn kill_child(child: Option<std::process::Child>, what: &str) -> Result<(), NodeError> {
    let Some(mut child) = child else {
        return Err(NodeError::failed(what, "it was not running"));
    };
    if !matches!(child.try_wait(), Ok(None)) {
        return Err(NodeError::failed(what, "it had already exited"));
    }
    child.kill().map_err(|e| NodeError::failed(what, e))?;
    child.wait().map_err(|e| NodeError::failed(what, e))?;
    Ok(())
}

/// The last `lines` lines of a log file, for error messages.
pub(crate) fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A minimal HTTP GET on the loopback (monitoring endpoints): the status code and the body.
pub(crate) fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(500))
            .ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// The status code of a GET on the loopback.
pub(crate) fn http_status(port: u16, path: &str) -> Option<u16> {
    http_get(port, path).map(|(status, _)| status)
}
