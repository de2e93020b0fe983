//! The engine inside a service: the consumer runs beside an HTTP server (axum) that answers
//! what an orchestrator asks — `/healthz` (the engine task is alive), `/readyz` (it holds
//! sources, nothing waits past its deadline, commits go through: `StatsSnapshot::readiness`)
//! and `/stats` (the counters as JSON). Kubernetes' probes point at the first two.
//!
//! The example serves on 127.0.0.1 (a free port), publishes orders, asks its own endpoints
//! while they are handled, and checks the answers: ready once sources are assigned, every
//! order counted in `/stats`.

use std::future::IntoFuture;
use std::process::ExitCode;

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
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(stats): State<StatsReader>| async move {
                match stats.snapshot().readiness() {
                    Ok(()) => (StatusCode::OK, "ready".to_owned()),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
                }
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
    server.abort();
    example.clean_up().await?;

    println!("service: /healthz {alive:?}, /readyz {ready:?}, /stats {stats}");
    Ok(verdict(
        "service",
        &[
            ("/healthz answers 200 while the engine runs", alive.0 == 200),
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
