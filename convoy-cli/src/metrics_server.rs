//! The operator's endpoint of `convoy consume --metrics-addr`: Prometheus metrics, health,
//! readiness and the live view of the lanes, over HTTP (hyper).
//!
//! - `GET /metrics` — the engine's metrics (metrics-exporter-prometheus), durations as
//!   histograms with fixed buckets, so they add up across replicas;
//! - `GET /healthz` — 200 while the process answers (alive);
//! - `GET /readyz` — 200 once the engine runs, holds sources and its commits go through (or
//!   failed for less than 30 s: `StatsSnapshot::readiness`); 503 with the reason otherwise;
//! - `GET /lanes?top=N` — JSON: every source (watermark, committed, lag, held, window, paused),
//!   the lanes whose head runs longest (attempts, last error) and the most queued keys;
//! - with `--control`: `POST /pause?key=K` (or `?source=topic/3`), `POST /resume?…`, and
//!   `GET /paused` — an operator's pause (`convoy pause`), answered with what is paused;
//! - anything else — 404, naming these.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use convoy::{Inspection, Inspector, PauseTarget, Pauser, SourceId, StatsReader, StatsSnapshot};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use serde_json::json;

/// Lanes of each kind `/lanes` shows unless asked for another count.
const DEFAULT_TOP: usize = 10;

/// What the endpoint serves; the engine's parts are set once it started.
pub struct Endpoint {
    prometheus: PrometheusHandle,
    engine: OnceLock<(StatsReader, Inspector, Pauser)>,
    /// POST /pause and /resume are served (`--control`).
    control: bool,
}

impl Endpoint {
    /// The running engine, whose state `/readyz` and `/lanes` show, and `/pause` changes.
    pub fn engine_started(&self, stats: StatsReader, inspector: Inspector, pauser: Pauser) {
        let _ = self.engine.set((stats, inspector, pauser));
    }
}

/// Installs the Prometheus recorder and serves the endpoint on `addr`, on the current runtime.
/// Must run before the engine registers its metric handles.
pub async fn serve(addr: SocketAddr, control: bool) -> Result<Arc<Endpoint>, String> {
    let prometheus = PrometheusBuilder::new()
        // Gauges of a partition this member handed over or lost are never set again.
        .idle_timeout(MetricKindMask::GAUGE, Some(convoy::metrics::GAUGE_IDLE_AFTER))
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            convoy::metrics::SECONDS_BUCKETS,
        )
        .map_err(|e| format!("metric buckets: {e}"))?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    let endpoint = Arc::new(Endpoint {
        prometheus,
        engine: OnceLock::new(),
        control,
    });
    let serving = endpoint.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let endpoint = serving.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let endpoint = endpoint.clone();
                    async move { Ok::<_, Infallible>(endpoint.answer(request).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    eprintln!("metrics at http://{addr}/metrics (also /healthz, /readyz, /lanes)");
    Ok(endpoint)
}

fn respond(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Full<Bytes>> {
    respond(status, "application/json", value.to_string())
}

impl Endpoint {
    async fn answer(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        match request.uri().path() {
            "/metrics" => respond(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.prometheus.render(),
            ),
            "/healthz" => respond(StatusCode::OK, "text/plain", "ok\n"),
            "/readyz" => self.readiness(),
            "/pause" | "/resume" | "/paused" => self.control(&request).await,
            "/lanes" => {
                let top = query(request.uri().query(), "top")
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(DEFAULT_TOP);
                self.lanes(top).await
            }
            other => respond(
                StatusCode::NOT_FOUND,
                "text/plain",
                format!("no {other} here: /metrics, /healthz, /readyz, /lanes, /pause, /resume, /paused\n"),
            ),
        }
    }

    fn readiness(&self) -> Response<Full<Bytes>> {
        let snapshot = self.engine.get().map(|(stats, _, _)| stats.snapshot());
        let (status, body) = readiness(snapshot.as_ref());
        json_response(status, &body)
    }

    async fn lanes(&self, top: usize) -> Response<Full<Bytes>> {
        let Some((stats, inspector, _)) = self.engine.get() else {
            return json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"error": "the engine has not started"}),
            );
        };
        match inspector.inspect(top).await {
            Some(inspection) => json_response(StatusCode::OK, &to_json(&inspection, stats)),
            None => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"error": "the engine stopped"}),
            ),
        }
    }
}

impl Endpoint {
    /// An operator's pause or resume (POST), or what is paused (GET /paused).
    async fn control(&self, request: &Request<Incoming>) -> Response<Full<Bytes>> {
        if !self.control {
            return json_response(
                StatusCode::FORBIDDEN,
                &json!({"error": "this consumer takes no pauses: start it with --control"}),
            );
        }
        let Some((_, _, pauser)) = self.engine.get() else {
            return json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"error": "the engine has not started"}),
            );
        };
        let path = request.uri().path();
        if path != "/paused" {
            if request.method() != hyper::Method::POST {
                return json_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &json!({"error": format!("{path} takes POST")}),
                );
            }
            let pairs: Vec<(String, String)> =
                form_urlencoded::parse(request.uri().query().unwrap_or("").as_bytes())
                    .into_owned()
                    .collect();
            let value = |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            let target = match (value("key"), value("source")) {
                (Some(key), None) => PauseTarget::Key(Bytes::from(key)),
                (None, Some(source)) => PauseTarget::Source(SourceId::new(source)),
                _ => {
                    return json_response(
                        StatusCode::BAD_REQUEST,
                        &json!({"error": "name one key (?key=K) or one source (?source=topic/partition)"}),
                    )
                }
            };
            let done = match path {
                "/pause" => pauser.pause(target).await,
                _ => pauser.resume(target).await,
            };
            if !done {
                return json_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &json!({"error": "the engine stopped"}),
                );
            }
        }
        match pauser.paused().await {
            Some(paused) => json_response(
                StatusCode::OK,
                &json!({
                    "paused_keys": paused.keys.iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect::<Vec<_>>(),
                    "paused_sources": paused.sources.iter().map(SourceId::as_str).collect::<Vec<_>>(),
                }),
            ),
            None => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"error": "the engine stopped"}),
            ),
        }
    }
}

/// Whether a member is ready, and why not: `None` is an engine that has not started yet.
fn readiness(snapshot: Option<&StatsSnapshot>) -> (StatusCode, serde_json::Value) {
    let Some(s) = snapshot else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"ready": false, "reason": "the engine has not started (connecting, joining the group)"}),
        );
    };
    let reason = s.readiness().err();
    let status = match reason {
        None => StatusCode::OK,
        Some(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    let body = json!({
        "ready": reason.is_none(),
        "reason": reason,
        "sources": s.sources,
        "held": s.held,
        "commits": s.commits,
        "commits_failing_for_s": s.commits_failing_for.map(|d| d.as_secs_f64()),
        "stalled_on": s.stalled.map(|stall| format!("{:?}", stall.on)),
    });
    (status, body)
}

/// The value of `name` in a query string.
fn query<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

/// An inspection as `/lanes` serves it (and `convoy lanes` reads it).
fn to_json(inspection: &Inspection, stats: &StatsReader) -> serde_json::Value {
    let s = stats.snapshot();
    let lane = |l: &convoy::LaneView| {
        json!({
            "key": l.key,
            "source": l.source.as_str(),
            "offset": l.offset,
            "attempts": l.attempts,
            "running_for_s": l.running_for.map(|d| d.as_secs_f64()),
            "last_error": l.last_error,
            "queued": l.queued,
            "stuck": matches!((l.running_for, inspection.stuck_timeout), (Some(r), Some(t)) if r >= t),
        })
    };
    let sources: Vec<serde_json::Value> = inspection
        .sources
        .iter()
        .map(|v| {
            json!({
                "source": v.source.as_str(),
                "watermark": v.watermark,
                "committed": v.committed,
                "lag": v.lag,
                "held": v.held,
                "window": v.window,
                "paused": v.paused,
            })
        })
        .collect();
    let totals: BTreeMap<&str, serde_json::Value> = BTreeMap::from([
        ("handled", json!(s.handled)),
        ("dead_lettered", json!(s.dead_lettered)),
        ("parked", json!(s.parked)),
        ("duplicates", json!(s.duplicates)),
        ("retries", json!(s.retries)),
        ("held", json!(s.held)),
        ("active_lanes", json!(s.active_lanes)),
        ("paused_sources", json!(s.paused_sources)),
    ]);
    json!({
        "totals": totals,
        "sources": sources,
        "oldest": inspection.oldest.iter().map(lane).collect::<Vec<_>>(),
        "backlog": inspection.backlog.iter().map(lane).collect::<Vec<_>>(),
        "stuck_timeout_s": inspection.stuck_timeout.map(|d| d.as_secs_f64()),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn member(sources: usize, commits_failing_for: Option<Duration>) -> StatsSnapshot {
        StatsSnapshot {
            sources,
            commits: 7,
            commits_failing_for,
            ..StatsSnapshot::default()
        }
    }

    #[test]
    fn a_member_is_not_ready_before_its_engine_runs_or_without_sources() {
        let (status, body) = readiness(None);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["ready"], false);
        assert!(
            body["reason"].as_str().is_some_and(|r| r.contains("not started")),
            "{body}"
        );

        let (status, body) = readiness(Some(&member(0, None)));
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body["reason"]
                .as_str()
                .is_some_and(|r| r.contains("no sources assigned")),
            "{body}"
        );
    }

    #[test]
    fn commits_failing_briefly_keep_a_member_ready_and_failing_long_do_not() {
        let (status, body) = readiness(Some(&member(3, None)));
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["ready"], true);
        assert_eq!(body["sources"], 3);
        assert_eq!(body["commits"], 7);

        let (status, body) = readiness(Some(&member(3, Some(Duration::from_secs(5)))));
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["commits_failing_for_s"], 5.0);

        let (status, body) = readiness(Some(&member(3, Some(Duration::from_secs(45)))));
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["ready"], false);
        assert_eq!(body["reason"], "commits have been failing for 45 s");
    }

    #[test]
    fn a_member_waiting_past_a_deadline_is_not_ready() {
        let mut stalled = member(3, None);
        stalled.stalled = Some(convoy::Stall {
            on: convoy::StallOn::ReadBack,
            overdue: Duration::from_secs(12),
        });
        let (status, body) = readiness(Some(&stalled));
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body["reason"]
                .as_str()
                .is_some_and(|r| r.contains("read back") && r.contains("12 s")),
            "{body}"
        );
        assert_eq!(body["stalled_on"], "ReadBack");
    }
}
