//! Prometheus metrics over HTTP: the engine's `metrics` go to metrics-exporter-prometheus, whose
//! own HTTP listener serves them (`GET /metrics`).

use std::net::SocketAddr;

use metrics_exporter_prometheus::PrometheusBuilder;

/// Installs the Prometheus recorder and serves it on `addr`, on the current runtime. Must run
/// before the engine registers its metric handles.
pub fn serve(addr: SocketAddr) -> Result<(), String> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    eprintln!("metrics at http://{addr}/metrics");
    Ok(())
}
