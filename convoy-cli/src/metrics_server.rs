//! Prometheus metrics over HTTP: the engine's `metrics` go to a Prometheus recorder, and a tiny
//! HTTP/1.1 responder serves its text at `GET /metrics` (anything else: 404).

use std::net::SocketAddr;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The server task; dropping it stops serving.
pub struct MetricsServer(JoinHandle<()>);

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Installs the recorder and serves it on `addr`.
pub async fn serve(addr: SocketAddr) -> Result<MetricsServer, String> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    eprintln!("metrics at http://{addr}/metrics");
    Ok(MetricsServer(tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(respond(stream, handle.clone()));
        }
    })))
}

async fn respond(mut stream: TcpStream, handle: PrometheusHandle) {
    // Requests are tiny; read until the end of the headers (or 8 KiB).
    let mut request = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
    }
    let (status, body) = if request.starts_with(b"GET /metrics ") {
        ("200 OK", handle.render())
    } else {
        ("404 Not Found", "try GET /metrics\n".to_owned())
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}
