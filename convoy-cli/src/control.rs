//! `convoy pause` and `convoy resume`: an operator's pause of a key or a source of a running
//! `convoy consume --metrics-addr ADDR --control`, through its endpoint (POST /pause, /resume;
//! GET /paused).

use std::process::ExitCode;

use serde_json::Value;

use crate::cli::PauseArgs;
use crate::lanes::{fetch, host_port};
use crate::out::out;

pub async fn run(args: &PauseArgs, pause: bool) -> crate::outcome::CliResult {
    let addr = host_port(&args.addr);
    let (method, path) = match (&args.key, &args.source) {
        _ if args.list => (hyper::Method::GET, "/paused".to_owned()),
        (Some(key), _) => (
            hyper::Method::POST,
            format!("{}?key={}", verb(pause), encode(key)),
        ),
        (None, Some(source)) => (
            hyper::Method::POST,
            format!("{}?source={}", verb(pause), encode(source)),
        ),
        (None, None) => {
            return Err("name what to pause: --key KEY or --source TOPIC/PARTITION (or --list)".into())
        }
    };
    let body = fetch(addr, method, &path).await?;
    let answer: Value =
        serde_json::from_str(&body).map_err(|e| format!("{addr} did not answer with JSON ({e}): {body}"))?;
    if let Some(error) = answer.get("error").and_then(Value::as_str) {
        return Err(format!("{addr}: {error}").into());
    }
    out!("{answer}")?;
    Ok(ExitCode::SUCCESS)
}

fn verb(pause: bool) -> &'static str {
    if pause {
        "/pause"
    } else {
        "/resume"
    }
}

fn encode(text: &str) -> String {
    form_urlencoded::byte_serialize(text.as_bytes()).collect()
}
