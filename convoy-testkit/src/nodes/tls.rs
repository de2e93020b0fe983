//! A certificate authority made by a test, and one server certificate it signs for the
//! loopback (`127.0.0.1` and `localhost`), for private brokers with TLS listeners. Made with the
//! `openssl` command (Debian's `openssl` package), in a directory of its own removed on drop.
//! Nothing here is trusted outside the test that made it: the CA key lives and dies with it.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{fresh_dir, remove_dir, NodeError};

/// The password of the PKCS#12 key store (brokers on the JVM read that format).
pub const STORE_PASSWORD: &str = "convoy-test";

/// A test CA and a server certificate for the loopback.
pub struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    /// Makes the CA and the server's key and certificate (RSA 2048, valid two days).
    pub fn new() -> Result<TestCa, NodeError> {
        let dir = fresh_dir(&format!("tls-{}", super::unique("ca")))?;
        let ca = TestCa { dir };
        std::fs::write(
            ca.path("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        )
        .map_err(|e| NodeError::failed("writing the certificate's extensions", e))?;
        ca.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=convoy test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ])?;
        ca.openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ])?;
        ca.openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "server.ext",
            "-out",
            "server.pem",
        ])?;
        let password = format!("pass:{STORE_PASSWORD}");
        ca.openssl(&[
            "pkcs12",
            "-export",
            "-in",
            "server.pem",
            "-inkey",
            "server.key",
            "-name",
            "server",
            "-out",
            "server.p12",
            "-passout",
            &password,
        ])?;
        // Brokers started as another user (RabbitMQ drops to `rabbitmq`) must read them.
        for file in ["ca.pem", "server.pem", "server.key", "server.p12"] {
            set_readable(&ca.path(file))?;
        }
        set_readable(&ca.dir)?;
        Ok(ca)
    }

    fn openssl(&self, args: &[&str]) -> Result<(), NodeError> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .map_err(|_| NodeError::Missing("the openssl command".into()))?;
        if out.status.success() {
            return Ok(());
        }
        Err(NodeError::failed(
            format!("openssl {}", args.join(" ")),
            String::from_utf8_lossy(&out.stderr),
        ))
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// The CA's certificate (PEM): what clients trust.
    pub fn ca_pem(&self) -> PathBuf {
        self.path("ca.pem")
    }

    /// The server's certificate (PEM).
    pub fn server_pem(&self) -> PathBuf {
        self.path("server.pem")
    }

    /// The server's private key (PEM, unencrypted).
    pub fn server_key(&self) -> PathBuf {
        self.path("server.key")
    }

    /// The server's key and certificate in a PKCS#12 store ([`STORE_PASSWORD`]).
    pub fn server_p12(&self) -> PathBuf {
        self.path("server.p12")
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        remove_dir(&self.dir);
    }
}

#[cfg(unix)]
fn set_readable(path: &Path) -> Result<(), NodeError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = if path.is_dir() { 0o755 } else { 0o644 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| NodeError::failed(format!("making {} readable", path.display()), e))
}

#[cfg(not(unix))]
fn set_readable(_: &Path) -> Result<(), NodeError> {
    Ok(())
}
