//! Small helpers every broker's tests need on a shared machine: names no other test or run
//! uses, logs in the test output, clean-up that runs whatever state the test's runtime is in,
//! a free loopback port for a private broker, and waiting for what arrives late without a fixed
//! sleep.

use std::future::Future;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use convoy_core::{DeadLetterSink, Engine, EngineConfig, EngineHandle, Transport};
use tokio::time::Instant;

use crate::{OrderChecker, ProbeHandler, RecordingSink};

/// A file of the repository, by its path from the repository's root (`scripts/interop/x.py`).
///
/// Found from the `CARGO_MANIFEST_DIR` cargo sets when it runs a test (the tested crate's
/// directory, one below the root), not the one compiled in: a build cache shared by two
/// checkouts (CI's clone and a developer's tree) keeps binaries compiled in the other one, and
/// a compiled-in path then names a file of the other checkout, or none.
pub fn repo_file(path: &str) -> String {
    let crate_dir =
        std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
    format!("{crate_dir}/../{path}")
}

/// Logs to the test output when `RUST_LOG` is set (once per process; later calls do nothing).
pub fn init_tracing() {
    if std::env::var("RUST_LOG").is_ok() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A name unique per process, moment and call: `<prefix>-<pid>-<nanos hex>-<n>` (letters,
/// digits and `-`, valid as a Kafka topic, a RabbitMQ queue and a NATS subject token).
pub fn unique(prefix: &str) -> String {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let n = CALLS.fetch_add(1, Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos:x}-{n}", std::process::id())
}

/// An environment variable's value, with an empty one counted as unset.
pub fn setting(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|s| !s.is_empty())
}

/// The variable `scripts/test` (the README's test command) sets: with it, a test whose broker,
/// tool or variable is missing fails naming it instead of skipping.
pub const REQUIRE_ALL: &str = "CONVOY_REQUIRE_ALL";

/// What a skipped test writes to stderr, first on its line: `scripts/test` counts these lines.
pub const SKIPPED: &str = "convoy-test-skipped:";

/// A test cannot run here because `missing` (a variable, a program) is not: under
/// [`REQUIRE_ALL`] the test fails naming it; otherwise it is skipped, which is said on stderr
/// past the test harness's capture (a passing test's `eprintln!` is never shown), in a line
/// `scripts/test` counts. The caller returns after it.
#[track_caller]
pub fn skip(missing: impl std::fmt::Display) {
    if setting(REQUIRE_ALL).is_some() {
        panic!("missing prerequisite: {missing} ({REQUIRE_ALL} is set: scripts/test installs, starts and exports every prerequisite, so look at its output above)");
    }
    let caller = std::panic::Location::caller();
    let _ = writeln!(
        std::io::stderr(),
        "{SKIPPED} {missing} (at {}:{})",
        caller.file(),
        caller.line()
    );
}

/// The value of the prerequisite variable `var`, or `None` after [`skip`]ping the test.
#[track_caller]
pub fn required(var: &str) -> Option<String> {
    let value = setting(var);
    if value.is_none() {
        skip(format!("{var} is not set"));
    }
    value
}

/// Runs `f` to completion on a runtime of its own on another thread, and waits for it: clean-up
/// from `Drop` works whether the test's runtime is running, blocked or gone.
pub fn block_on_side<F: Future<Output = ()> + Send + 'static>(f: F) {
    let _ = std::thread::spawn(move || {
        if let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() {
            runtime.block_on(f);
        }
    })
    .join();
}

/// A loopback port nothing listens on at the moment of the call, for a private broker.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Calls `read` until it returns at least `expected` items or `within` has passed, and returns
/// the last answer: for destinations written asynchronously (dead letters on their way).
pub async fn read_until<T, E, F, Fut>(expected: usize, within: Duration, mut read: F) -> Result<Vec<T>, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Vec<T>, E>>,
{
    let deadline = Instant::now() + within;
    loop {
        let all = read().await?;
        if all.len() >= expected || Instant::now() >= deadline {
            return Ok(all);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts an engine on `transport` whose handler is a [`ProbeHandler`] recording into
/// `checker`, its dead letters going to `sink` and recorded into `checker` too; panics if it
/// cannot start (what every scenario that runs whole members needs).
pub(crate) async fn start_probe_engine(
    transport: &dyn Transport,
    sink: Arc<dyn DeadLetterSink>,
    config: EngineConfig,
    checker: &Arc<OrderChecker>,
) -> EngineHandle {
    let engine = match Engine::builder(ProbeHandler::new(checker.clone()))
        .config(config)
        .dead_letter_sink(RecordingSink::new(sink, checker.clone()))
        .build()
    {
        Ok(engine) => engine,
        Err(e) => panic!("test engine config rejected: {e}"),
    };
    match engine.start(transport).await {
        Ok(handle) => handle,
        Err(e) => panic!("an engine could not start: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_differ_within_one_moment() {
        let (a, b) = (unique("t"), unique("t"));
        assert_ne!(a, b);
        assert!(a.starts_with(&format!("t-{}-", std::process::id())));
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'), "{a}");
    }

    #[tokio::test(start_paused = true)]
    async fn read_until_returns_once_enough_arrived() {
        let mut calls = 0;
        let got: Result<Vec<u32>, ()> = read_until(3, Duration::from_secs(30), || {
            calls += 1;
            let answer = (0..calls).collect();
            async move { Ok(answer) }
        })
        .await;
        assert_eq!(got, Ok(vec![0, 1, 2]));
    }

    #[tokio::test(start_paused = true)]
    async fn read_until_gives_up_with_what_it_has_and_passes_errors_on() {
        let got: Result<Vec<u32>, ()> =
            read_until(3, Duration::from_millis(350), || async { Ok(vec![7]) }).await;
        assert_eq!(got, Ok(vec![7]));
        let failed: Result<Vec<u32>, &str> =
            read_until(1, Duration::from_secs(1), || async { Err("down") }).await;
        assert_eq!(failed, Err("down"));
    }
}
