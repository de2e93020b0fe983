//! `convoy lanes --addr HOST:PORT`: the live view of a running `convoy consume` (started with
//! `--metrics-addr`), from its `/lanes` endpoint: every source's watermark, lag, what it holds
//! and whether it is paused; the lanes whose head runs longest (stuck keys, with attempts and
//! the last error); the keys with the largest backlog. `--watch` refreshes it.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::cli::LanesArgs;
use crate::out::{out, out_part};

pub async fn run(args: &LanesArgs) -> crate::outcome::CliResult {
    let addr = host_port(&args.addr);
    loop {
        let body = fetch(addr, hyper::Method::GET, &format!("/lanes?top={}", args.top)).await?;
        let view: Value = serde_json::from_str(&body)
            .map_err(|e| format!("{addr} did not answer with the lanes' JSON: {e}"))?;
        if let Some(error) = view.get("error").and_then(Value::as_str) {
            return Err(format!("{addr}: {error}").into());
        }
        if args.json {
            out!("{view}")?;
        } else {
            if args.watch.is_some() {
                out_part!("\x1b[2J\x1b[H")?; // clear the screen for the next frame
            }
            out_part!("{}", render(&view))?;
        }
        match args.watch {
            Some(seconds) => tokio::time::sleep(Duration::from_secs_f64(seconds.max(0.2))).await,
            None => return Ok(ExitCode::SUCCESS),
        }
    }
}

/// `HOST:PORT` of what the user gave: also the address `consume` printed
/// (`http://127.0.0.1:9898/metrics`), pasted whole.
pub(crate) fn host_port(addr: &str) -> &str {
    let addr = addr.trim();
    let addr = addr
        .strip_prefix("http://")
        .or_else(|| addr.strip_prefix("HTTP://"))
        .unwrap_or(addr);
    addr.split('/').next().unwrap_or(addr)
}

/// `method` `path` of `addr` (HTTP/1.1): the answer's body.
pub(crate) async fn fetch(addr: &str, method: hyper::Method, path: &str) -> Result<String, String> {
    let unreachable = |e: &dyn std::fmt::Display| {
        format!("no convoy consume answered at {addr} ({e}): is one running with --metrics-addr {addr}?")
    };
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| unreachable(&e))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(&e))?;
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, addr)
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = sender.send_request(request).await.map_err(|e| unreachable(&e))?;
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| unreachable(&e))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

fn text(value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn seconds(value: &Value) -> String {
    value
        .as_f64()
        .map_or_else(|| "-".to_owned(), |s| format!("{s:.1}s"))
}

/// The view as text tables.
fn render(view: &Value) -> String {
    let mut out = String::new();
    let totals = &view["totals"];
    let _ = writeln!(
        out,
        "handled {}  dead-lettered {}  parked {}  duplicates {}  retries {}  held {}  lanes {}  paused sources {}",
        text(&totals["handled"]),
        text(&totals["dead_lettered"]),
        text(&totals["parked"]),
        text(&totals["duplicates"]),
        text(&totals["retries"]),
        text(&totals["held"]),
        text(&totals["active_lanes"]),
        text(&totals["paused_sources"]),
    );
    let _ = writeln!(
        out,
        "\n{:<40} {:>12} {:>12} {:>8} {:>7} {:>8}  paused",
        "source", "watermark", "committed", "lag", "held", "window"
    );
    for s in view["sources"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:<40} {:>12} {:>12} {:>8} {:>7} {:>8}  {}",
            text(&s["source"]),
            text(&s["watermark"]),
            text(&s["committed"]),
            text(&s["lag"]),
            text(&s["held"]),
            text(&s["window"]),
            if s["paused"] == Value::Bool(true) {
                "yes"
            } else {
                ""
            },
        );
    }
    let lanes = |out: &mut String, title: &str, lanes: &Value| {
        let _ = writeln!(out, "\n{title}");
        let _ = writeln!(
            out,
            "{:<28} {:<32} {:>10} {:>8} {:>9} {:>7}  last error",
            "key", "source@offset", "running", "attempts", "queued", "stuck"
        );
        for l in lanes.as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "{:<28} {:<32} {:>10} {:>8} {:>9} {:>7}  {}",
                text(&l["key"]),
                format!("{}@{}", text(&l["source"]), text(&l["offset"])),
                seconds(&l["running_for_s"]),
                text(&l["attempts"]),
                text(&l["queued"]),
                if l["stuck"] == Value::Bool(true) {
                    "STUCK"
                } else {
                    ""
                },
                text(&l["last_error"]),
            );
        }
    };
    lanes(&mut out, "running longest:", &view["oldest"]);
    lanes(&mut out, "largest backlog:", &view["backlog"]);
    out
}
