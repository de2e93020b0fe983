//! The engine inside a service: the consumer runs beside an HTTP server (axum) that answers
//! what an orchestrator asks — `/healthz` (the engine is alive: `StatsSnapshot::health`), `/readyz` (it holds
//! sources, nothing waits past its deadline, commits go through: `StatsSnapshot::readiness`)
//! and `/stats` (the counters as JSON). Kubernetes' probes point at the first two.
//!
//! Its logs are JSON lines, as a log collector wants them (`tracing_subscriber::fmt().json()`,
//! feature `json` of `tracing-subscriber`; no ANSI colours): here they are captured and
//! checked to be JSON, with the engine's lifecycle events among them.
//!
//! The example serves on 127.0.0.1 (a free port), publishes orders, asks its own endpoints
//! while they are handled, and checks the answers: ready once sources are assigned, every
//! order counted in `/stats`.

use std::future::IntoFuture;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use convoy::{handler_fn, Delivery, HandlerError, OutgoingMessage, StatsReader};
use convoy_examples::{main_of, verdict, Error, Example};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ORDERS: u64 = 200;

/// The endpoints, over the running engine's counters.
fn endpoints(stats: StatsReader) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|State(stats): State<StatsReader>| async move { probe(stats.snapshot().health(), "ok") }),
        )
        .route(
            "/readyz",
            get(|State(stats): State<StatsReader>| async move {
                probe(stats.snapshot().readiness(), "ready")
            }),
        )
        .route(
            "/stats",
            get(|State(stats): State<StatsReader>| async move {
                let s = stats.snapshot();
                Json(serde_json::json!({
                    "handled": s.handled,
                    "dead_lettered": s.dead_lettered,
                    "finished": s.finished(),
                    "held": s.held,
                    "sources": s.sources,
                }))
            }),
        )
        .with_state(stats)
}

/// A probe's answer: 200 with `ok`, or 503 with the reason.
fn probe(answer: Result<(), String>, ok: &str) -> (StatusCode, String) {
    match answer {
        Ok(()) => (StatusCode::OK, ok.to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

/// Where the JSON log lines go: a buffer the example reads back (a service writes to stdout).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// JSON log lines at INFO (`RUST_LOG` overrides), without colours: the library recipe.
fn json_logs(to: &Captured) -> Result<(), Error> {
    let to = to.clone();
    tracing_subscriber::fmt()
        .json()
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(move || to.clone())
        .try_init()
        .map_err(|e| format!("installing the log subscriber: {e}"))?;
    Ok(())
}

/// A GET of `path` on `addr`: status code and body.
async fn get_path(addr: std::net::SocketAddr, path: &str) -> Result<(u16, String), Error> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {response:?}"))?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Ok((status, body))
}

async fn run() -> Result<ExitCode, Error> {
    let logs = Captured::default();
    json_logs(&logs)?;
    let example = Example::setup("service").await?;
    let handler = handler_fn(|d: Delivery| async move {
        d.payload_str()?;
        Ok::<(), HandlerError>(())
    });
    let running = example.start(handler, |_| {}).await?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(axum::serve(listener, endpoints(running.stats_reader())).into_future());
    println!("service: health on http://{addr}/healthz, readiness on /readyz, counters on /stats");

    let alive = get_path(addr, "/healthz").await?;
    running.wait_for("sources assigned", |s| s.sources > 0).await?;
    let ready = get_path(addr, "/readyz").await?;
    example
        .publish(
            (0..ORDERS)
                .map(|i| OutgoingMessage::new(format!("order-{}", i % 20), format!("item {i}")))
                .collect(),
        )
        .await?;
    running
        .wait_for("every order finished", |s| s.finished() >= ORDERS)
        .await?;
    let (_, stats) = get_path(addr, "/stats").await?;
    let stats: serde_json::Value = serde_json::from_str(&stats)?;
    running.stop().await?;
    let ended = get_path(addr, "/healthz").await?;
    server.abort();
    example.clean_up().await?;

    println!(
        "service: /healthz {alive:?}, /readyz {ready:?}, /stats {stats}, /healthz once stopped {ended:?}"
    );
    let logged = String::from_utf8_lossy(&logs.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    let lines: Vec<serde_json::Value> = logged
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    let all_json = !lines.is_empty() && lines.len() == logged.lines().count();
    let said = |what: &str| {
        lines
            .iter()
            .any(|l| l["fields"]["message"].as_str().is_some_and(|m| m.contains(what)))
    };
    println!("service: {} JSON log lines", lines.len());
    Ok(verdict(
        "service",
        &[
            ("/healthz answers 200 while the engine runs", alive.0 == 200),
            ("/healthz answers 503 once the engine has ended", ended.0 == 503),
            (
                "every log line is JSON, without colours",
                all_json && !logged.contains('\u{1b}'),
            ),
            (
                "the log has the engine's lifecycle events",
                said("source assigned"),
            ),
            (
                "/readyz answers 200 once sources are assigned",
                ready == (200, "ready".to_owned()),
            ),
            (
                "/stats counts every order",
                stats["finished"] == ORDERS && stats["handled"] == ORDERS,
            ),
        ],
    ))
}

fn main() -> ExitCode {
    main_of("service", run())
}
