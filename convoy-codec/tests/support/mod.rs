//! A stand-in for the Confluent Schema Registry: the REST calls convoy-codec makes, answered
//! with the bodies, status codes and content type a real registry answers (Apicurio Registry
//! 3.3.3's Confluent API, recorded in `tests/recorded.txt`; `registry_real.rs` runs the same
//! calls against it), plus switches for what a real one cannot be made to do on demand: stop
//! answering, refuse credentials.

#![allow(clippy::unwrap_used, dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
struct State {
    // (kind, text) by id - 1.
    schemas: Vec<(Option<String>, String)>,
    // Subject → the ids registered under it, oldest first.
    subjects: HashMap<String, Vec<u32>>,
}

/// The fake registry; dropping it does not stop its task (the test's runtime ends it).
pub struct FakeRegistry {
    pub url: String,
    state: Arc<Mutex<State>>,
    /// Answer 503 to everything.
    pub down: Arc<AtomicBool>,
    /// Require `Authorization: Basic a2V5OnNlY3JldA==` (key:secret).
    pub require_auth: Arc<AtomicBool>,
    /// Subjects that refuse a second, different schema (as BACKWARD refuses an incompatible one).
    pub strict: Arc<Mutex<Vec<String>>>,
    /// Schema fetches answered 200.
    pub fetched: Arc<AtomicU64>,
    /// Requests refused while down.
    pub refused: Arc<AtomicU64>,
    /// Registrations answered 200.
    pub registered: Arc<AtomicU64>,
}

impl FakeRegistry {
    pub async fn start() -> FakeRegistry {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let fake = FakeRegistry {
            url,
            state: Arc::default(),
            down: Arc::default(),
            require_auth: Arc::default(),
            strict: Arc::default(),
            fetched: Arc::default(),
            refused: Arc::default(),
            registered: Arc::default(),
        };
        let served = fake.clone_handles();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let served = served.clone_handles();
                tokio::spawn(async move { served.serve(stream).await });
            }
        });
        fake
    }

    fn clone_handles(&self) -> FakeRegistry {
        FakeRegistry {
            url: self.url.clone(),
            state: self.state.clone(),
            down: self.down.clone(),
            require_auth: self.require_auth.clone(),
            strict: self.strict.clone(),
            fetched: self.fetched.clone(),
            refused: self.refused.clone(),
            registered: self.registered.clone(),
        }
    }

    /// Puts a schema in the registry, as another producer would have; its id.
    pub fn seed(&self, subject: &str, kind: Option<&str>, text: &str) -> u32 {
        let mut state = self.state.lock().unwrap();
        state.schemas.push((kind.map(str::to_string), text.to_string()));
        let id = state.schemas.len() as u32;
        state.subjects.entry(subject.to_string()).or_default().push(id);
        id
    }

    async fn serve(&self, stream: TcpStream) {
        let mut reader = BufReader::new(stream);
        // Keep-alive: answer requests on this connection until the client closes it.
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            let mut parts = line.split_whitespace();
            let (method, path) = (
                parts.next().unwrap_or("").to_string(),
                parts.next().unwrap_or("").to_string(),
            );
            let mut length = 0;
            let mut authorization = None;
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).await.unwrap_or(0) == 0 {
                    return;
                }
                let header = header.trim_end();
                if header.is_empty() {
                    break;
                }
                let (name, value) = header.split_once(':').unwrap_or((header, ""));
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => length = value.trim().parse().unwrap_or(0),
                    "authorization" => authorization = Some(value.trim().to_string()),
                    _ => {}
                }
            }
            let mut body = vec![0; length];
            if reader.read_exact(&mut body).await.is_err() {
                return;
            }
            let (status, answer) = self.answer(&method, &path, &body, authorization.as_deref());
            let reason = match status {
                200 => "OK",
                401 => "Unauthorized",
                404 => "Not Found",
                409 => "Conflict",
                _ => "Service Unavailable",
            };
            let answer = answer.to_string();
            let response = format!(
                "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
                answer.len()
            );
            if reader.get_mut().write_all(response.as_bytes()).await.is_err() {
                return;
            }
        }
    }

    fn answer(&self, method: &str, path: &str, body: &[u8], authorization: Option<&str>) -> (u16, Value) {
        if self.down.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return (
                503,
                json!({"error_code": 50003, "message": "Error while forwarding the request to the leader"}),
            );
        }
        if self.require_auth.load(Ordering::SeqCst) && authorization != Some("Basic a2V5OnNlY3JldA==") {
            return (401, json!({"error_code": 40101, "message": "Unauthorized"}));
        }
        let mut state = self.state.lock().unwrap();
        if let ("GET", Some(id)) = (method, path.strip_prefix("/schemas/ids/")) {
            let found = id
                .parse::<usize>()
                .ok()
                .and_then(|id| state.schemas.get(id.wrapping_sub(1)));
            return match found {
                Some((kind, text)) => {
                    self.fetched.fetch_add(1, Ordering::SeqCst);
                    let mut answer = json!({ "schema": text });
                    if let Some(kind) = kind {
                        answer["schemaType"] = json!(kind);
                    }
                    (200, answer)
                }
                None => (
                    404,
                    json!({"error_code": 40403, "message": format!("Schema {id} not found")}),
                ),
            };
        }
        let subject = path
            .strip_prefix("/subjects/")
            .and_then(|p| p.strip_suffix("/versions"));
        if let ("POST", Some(subject)) = (method, subject) {
            let request: Value = serde_json::from_slice(body).unwrap();
            let text = request["schema"].as_str().unwrap().to_string();
            let kind = request
                .get("schemaType")
                .and_then(Value::as_str)
                .map(str::to_string);
            let existing = state
                .schemas
                .iter()
                .position(|s| s.0 == kind && s.1 == text)
                .map(|i| i as u32 + 1);
            let versions = state.subjects.get(subject).cloned().unwrap_or_default();
            if let Some(id) = existing.filter(|id| versions.contains(id)) {
                self.registered.fetch_add(1, Ordering::SeqCst);
                return (200, json!({ "id": id }));
            }
            if !versions.is_empty() && self.strict.lock().unwrap().iter().any(|s| s == subject) {
                return (
                    409,
                    json!({"error_code": 409, "message": format!("Incompatible schema, compatibility_mode=BACKWARD")}),
                );
            }
            let id = match existing {
                Some(id) => id,
                None => {
                    state.schemas.push((kind, text));
                    state.schemas.len() as u32
                }
            };
            state.subjects.entry(subject.to_string()).or_default().push(id);
            self.registered.fetch_add(1, Ordering::SeqCst);
            return (200, json!({ "id": id }));
        }
        (404, json!({"error_code": 404, "message": "HTTP 404 Not Found"}))
    }
}
