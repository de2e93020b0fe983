//! Prometheus metrics over HTTP: the engine's `metrics` go to metrics-exporter-prometheus, whose
//! own HTTP listener serves them (`GET /metrics`).

use std::net::SocketAddr;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusBuilder;
use metrics_util::MetricKindMask;

/// How long a gauge nobody sets any more stays on the page.
const GONE_AFTER: Duration = Duration::from_secs(30);

/// Installs the Prometheus recorder and serves it on `addr`, on the current runtime. Must run
/// before the engine registers its metric handles.
pub fn serve(addr: SocketAddr) -> Result<(), String> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        // The engine sets its gauges on every tick; those of a partition this member handed
        // over or lost are never set again, and go from the page after this long.
        .idle_timeout(MetricKindMask::GAUGE, Some(GONE_AFTER))
        .install()
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    eprintln!("metrics at http://{addr}/metrics");
    Ok(())
}
