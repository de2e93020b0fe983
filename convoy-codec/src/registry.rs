//! A client of the Confluent Schema Registry REST API (also served by Karapace and Apicurio's
//! compatibility layer): schemas by id, and registering a schema under a subject. Both are
//! cached for the life of the client, as the registry's ids are immutable.
//!
//! Failures say whether retrying can help. The registry not answering, answering 5xx, or
//! refusing the credentials is [`CodecError::Unavailable`]: a consumer's message is retried in
//! its lane until the registry (or its configuration) is fixed, never dead-lettered for it. The
//! registry saying a schema id does not exist is [`CodecError::Malformed`]: the payload names a
//! schema nobody registered there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use convoy_core::codec::CodecError;
use serde_json::{json, Value};

use crate::SchemaError;

/// The media type of the registry's API.
const MEDIA_TYPE: &str = "application/vnd.schemaregistry.v1+json";

/// The kind of a schema, as the registry names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SchemaKind {
    /// Avro (the registry's default: `schemaType` absent).
    Avro,
    /// Protobuf: the `.proto` file's text.
    Protobuf,
    /// JSON Schema.
    Json,
}

impl SchemaKind {
    fn name(self) -> &'static str {
        match self {
            SchemaKind::Avro => "AVRO",
            SchemaKind::Protobuf => "PROTOBUF",
            SchemaKind::Json => "JSON",
        }
    }

    fn of(name: Option<&str>) -> Option<SchemaKind> {
        match name {
            None | Some("AVRO") => Some(SchemaKind::Avro),
            Some("PROTOBUF") => Some(SchemaKind::Protobuf),
            Some("JSON") => Some(SchemaKind::Json),
            Some(_) => None,
        }
    }
}

/// A schema the registry holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisteredSchema {
    /// Its id, as framed payloads carry it.
    pub id: u32,
    /// Its kind.
    pub kind: SchemaKind,
    /// Its text.
    pub text: String,
}

/// The subject a topic's values are registered under by the registry's default strategy
/// (TopicNameStrategy): `<topic>-value`.
pub fn value_subject(topic: &str) -> String {
    format!("{topic}-value")
}

/// A schema registry client. Clones share the connection pool and the caches.
#[derive(Clone)]
pub struct SchemaRegistry {
    inner: Arc<Inner>,
}

struct Inner {
    base: String,
    http: reqwest::Client,
    auth: Option<(String, String)>,
    by_id: Mutex<HashMap<u32, Arc<RegisteredSchema>>>,
    registered: Mutex<HashMap<(String, SchemaKind, String), u32>>,
}

impl std::fmt::Debug for SchemaRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchemaRegistry")
            .field("url", &self.inner.base)
            .finish_non_exhaustive()
    }
}

impl SchemaRegistry {
    /// A client of the registry at `url` (`http://host:port`, optionally with a path prefix),
    /// each request given 10 seconds.
    pub fn new(url: &str) -> Result<Self, SchemaError> {
        SchemaRegistry::builder(url).build()
    }

    /// A client with credentials or another timeout.
    pub fn builder(url: &str) -> SchemaRegistryBuilder {
        SchemaRegistryBuilder {
            url: url.to_string(),
            auth: None,
            timeout: Duration::from_secs(10),
        }
    }

    /// The registry's address.
    pub fn url(&self) -> &str {
        &self.inner.base
    }

    /// The schema with `id`, from the cache or the registry.
    pub async fn schema(&self, id: u32) -> Result<Arc<RegisteredSchema>, CodecError> {
        if let Some(schema) = lock(&self.inner.by_id).get(&id) {
            return Ok(schema.clone());
        }
        let (status, body) = self
            .call(reqwest::Method::GET, &format!("/schemas/ids/{id}"), None)
            .await?;
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(CodecError::malformed(format!(
                "schema id {id} is not in the schema registry at {} ({}): \
                 was the payload written against another registry?",
                self.inner.base,
                error_text(&body)
            )));
        }
        if !status.is_success() {
            return Err(self.unavailable(status, &body));
        }
        let text = body.get("schema").and_then(Value::as_str).ok_or_else(|| {
            CodecError::unavailable(format!(
                "the schema registry at {} answered schema id {id} without a schema: {body}",
                self.inner.base
            ))
        })?;
        let kind_name = body.get("schemaType").and_then(Value::as_str);
        let kind = SchemaKind::of(kind_name).ok_or_else(|| {
            CodecError::malformed(format!(
                "schema id {id} is of a kind this client does not know: {kind_name:?}"
            ))
        })?;
        let schema = Arc::new(RegisteredSchema {
            id,
            kind,
            text: text.to_string(),
        });
        lock(&self.inner.by_id).insert(id, schema.clone());
        Ok(schema)
    }

    /// Registers `text` under `subject` (or finds it registered already) and returns its id.
    /// A schema the subject's compatibility rules refuse is [`CodecError::Unencodable`].
    pub async fn register(&self, subject: &str, kind: SchemaKind, text: &str) -> Result<u32, CodecError> {
        let cache_key = (subject.to_string(), kind, text.to_string());
        if let Some(&id) = lock(&self.inner.registered).get(&cache_key) {
            return Ok(id);
        }
        let mut request = json!({ "schema": text });
        if kind != SchemaKind::Avro {
            request["schemaType"] = json!(kind.name());
        }
        let path = format!("/subjects/{}/versions", encode_path(subject));
        let (status, body) = self.call(reqwest::Method::POST, &path, Some(request)).await?;
        if status.is_client_error() && !matches!(status.as_u16(), 401 | 403 | 408 | 429) {
            return Err(CodecError::unencodable(format!(
                "the schema registry at {} refused the {} schema for subject {subject:?}: {}",
                self.inner.base,
                kind.name(),
                error_text(&body)
            )));
        }
        if !status.is_success() {
            return Err(self.unavailable(status, &body));
        }
        let id = body
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| {
                CodecError::unavailable(format!(
                    "the schema registry at {} answered a registration without an id: {body}",
                    self.inner.base
                ))
            })?;
        lock(&self.inner.registered).insert(cache_key, id);
        lock(&self.inner.by_id).entry(id).or_insert_with(|| {
            Arc::new(RegisteredSchema {
                id,
                kind,
                text: text.to_string(),
            })
        });
        Ok(id)
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(reqwest::StatusCode, Value), CodecError> {
        let url = format!("{}{path}", self.inner.base);
        let mut request = self.inner.http.request(method, &url).header("accept", MEDIA_TYPE);
        if let Some(body) = body {
            request = request.header("content-type", MEDIA_TYPE).body(body.to_string());
        }
        if let Some((user, password)) = &self.inner.auth {
            request = request.basic_auth(user, Some(password));
        }
        let unanswered = |e: reqwest::Error| {
            CodecError::unavailable(format!("the schema registry at {url} did not answer: {e}"))
        };
        let response = request.send().await.map_err(unanswered)?;
        let status = response.status();
        let bytes = response.bytes().await.map_err(unanswered)?;
        // Error bodies are JSON too; anything else (a proxy's HTML page) is kept as text.
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Ok((status, body))
    }

    fn unavailable(&self, status: reqwest::StatusCode, body: &Value) -> CodecError {
        let hint = match status.as_u16() {
            401 | 403 => ": check the registry's credentials (retried until they are fixed)",
            _ => "",
        };
        CodecError::unavailable(format!(
            "the schema registry at {} answered {status}: {}{hint}",
            self.inner.base,
            error_text(body)
        ))
    }
}

/// Builds a [`SchemaRegistry`].
#[derive(Debug)]
pub struct SchemaRegistryBuilder {
    url: String,
    auth: Option<(String, String)>,
    timeout: Duration,
}

impl SchemaRegistryBuilder {
    /// HTTP basic authentication (Confluent Cloud: the API key and secret).
    pub fn basic_auth(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.auth = Some((user.into(), password.into()));
        self
    }

    /// How long one request may take before it counts as unanswered (default 10 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The client. Rejects an address that is not `http://…`.
    pub fn build(self) -> Result<SchemaRegistry, SchemaError> {
        let base = self.url.trim_end_matches('/').to_string();
        if base.starts_with("https://") {
            return Err(SchemaError::Registry(format!(
                "{base}: https is not supported by this build of convoy-codec yet; \
                 reach the registry over http (a local proxy or sidecar) for now"
            )));
        }
        if base.strip_prefix("http://").is_none_or(str::is_empty) {
            return Err(SchemaError::Registry(format!(
                "{:?} is not a registry address; expected http://host:port",
                self.url
            )));
        }
        if self.timeout.is_zero() {
            return Err(SchemaError::Registry(
                "the registry timeout must be more than zero".into(),
            ));
        }
        let http = reqwest::Client::builder()
            .timeout(self.timeout)
            .build()
            .map_err(|e| SchemaError::Registry(format!("cannot build the HTTP client: {e}")))?;
        Ok(SchemaRegistry {
            inner: Arc::new(Inner {
                base,
                http,
                auth: self.auth,
                by_id: Mutex::new(HashMap::new()),
                registered: Mutex::new(HashMap::new()),
            }),
        })
    }
}

/// The caches hold plain maps; a panic elsewhere cannot leave one half-written.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn error_text(body: &Value) -> String {
    match (body.get("error_code"), body.get("message")) {
        (Some(code), Some(message)) => {
            format!("{} (error_code {code})", message.as_str().unwrap_or_default())
        }
        _ => body.to_string(),
    }
}

/// Subjects may hold any character; the path segment escapes what a URL would misread.
fn encode_path(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(byte as char),
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked_at_startup() {
        assert!(SchemaRegistry::new("http://127.0.0.1:8081/").is_ok());
        assert_eq!(
            SchemaRegistry::new("http://127.0.0.1:8081/").unwrap().url(),
            "http://127.0.0.1:8081"
        );
        let err = SchemaRegistry::new("https://psrc.example:443").unwrap_err();
        assert!(err.to_string().contains("https is not supported"), "{err}");
        let err = SchemaRegistry::new("127.0.0.1:8081").unwrap_err();
        assert!(err.to_string().contains("expected http://host:port"), "{err}");
        let err = SchemaRegistry::builder("http://r")
            .timeout(Duration::ZERO)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("timeout"), "{err}");
    }

    #[test]
    fn subjects_are_escaped_in_paths() {
        assert_eq!(encode_path("orders-value"), "orders-value");
        assert_eq!(encode_path("a/b c"), "a%2Fb%20c");
        assert_eq!(value_subject("orders"), "orders-value");
    }
}
