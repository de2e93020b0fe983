//! What the runnable examples share: `--url` (the embedded `memory://` broker by default),
//! fresh topics per run, an engine over the connection that runs until every message finished,
//! and the invariant report that sets the exit code.
//!
//! ```text
//! cargo run -p convoy-examples --example ledger
//! cargo run -p convoy-examples --example ledger -- --url kafka://127.0.0.1:9092
//! cargo run -p convoy-examples --example ledger -- --url 'amqp://guest:guest@127.0.0.1:5672/%2f'
//! ```

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use convoy::dlq::{self, DeadLetterRecord};
use convoy::{
    BatchConfig, BatchHandler, Connection, Engine, EngineBuilder, EngineConfig, EngineHandle, Handler,
    OutgoingMessage, RetryPolicy, StatsSnapshot,
};

/// Any error of an example, printed as one line.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// The examples' command line.
#[derive(Parser, Debug)]
struct Args {
    /// Broker URL: memory:// (embedded, zero setup), kafka://host:port[?parameters] or
    /// amqp://user:password@host:port/vhost[?parameters].
    #[arg(long, default_value = "memory://")]
    url: String,
}

/// One example run: a fresh topic, group and dead-letter topic on the chosen broker.
pub struct Example {
    connection: Connection,
    name: &'static str,
}

impl Example {
    /// Parses `--url`, connects and creates `<name>-<unique>` and its dead-letter topic.
    pub async fn setup(name: &'static str) -> Result<Example, Error> {
        let args = Args::parse();
        let unique = convoy::unique_suffix();
        let topic = format!("{name}-{unique}");
        let connection = convoy::connect(&args.url)
            .await?
            .with_topics(&[topic.as_str()])
            .with_group(format!("{name}-{unique}"))
            .with_dlq_topic(format!("{topic}.dlq"));
        connection.create_topics().await?;
        println!("{name}: topic {topic} on {}", connection.endpoint().scheme);
        Ok(Example { connection, name })
    }

    /// Publishes messages in order, confirmed.
    pub async fn publish(&self, messages: Vec<OutgoingMessage>) -> Result<(), Error> {
        let topic = &self.connection.endpoint().topics[0];
        self.connection.publisher(topic)?.publish_all(messages).await?;
        Ok(())
    }

    /// Runs `handler` through the engine until `expected` messages finished (handled or
    /// dead-lettered) — or until SIGINT or SIGTERM — then stops gracefully: what is in flight
    /// finishes, the watermarks are committed, the group is left (a second signal aborts the
    /// drain). `convoy::run_until_signalled_or` is what a service's `main` calls.
    pub async fn run(
        &self,
        handler: impl Handler,
        retry: RetryPolicy,
        expected: u64,
    ) -> Result<StatsSnapshot, Error> {
        self.run_engine(Engine::builder(handler), retry, expected).await
    }

    /// As [`run`](Self::run), with a batch handler whose calls gather messages as `batch` says.
    pub async fn run_batches(
        &self,
        handler: impl BatchHandler,
        batch: BatchConfig,
        retry: RetryPolicy,
        expected: u64,
    ) -> Result<StatsSnapshot, Error> {
        self.run_engine(Engine::batch_builder(handler, batch)?, retry, expected)
            .await
    }

    async fn run_engine(
        &self,
        builder: EngineBuilder,
        retry: RetryPolicy,
        expected: u64,
    ) -> Result<StatsSnapshot, Error> {
        let engine = builder
            .config({
                let mut config = EngineConfig::for_group(self.connection.endpoint().group.clone());
                config.retry = retry;
                config
            })
            .dead_letter_sink(self.connection.dead_letter_sink()?)
            .build()?;
        let running = engine.start(&self.connection).await?;
        let stats = running.stats_reader();
        let all_finished = async move {
            loop {
                let s = stats.snapshot();
                if s.handled + s.dead_lettered >= expected {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let within = tokio::time::timeout(
            Duration::from_secs(120),
            convoy::run_until_signalled_or(running, all_finished),
        );
        let report = within
            .await
            .map_err(|_| format!("{}: not every message finished within 120 s", self.name))??;
        let s = report.stats;
        if s.handled + s.dead_lettered < expected {
            return Err(format!(
                "{}: stopped before every message finished ({} of {expected})",
                self.name,
                s.handled + s.dead_lettered
            )
            .into());
        }
        Ok(s)
    }

    /// Starts `handler` through the engine, configured by `configure`, for an example that
    /// acts while it runs (an operator's replay).
    pub async fn start(
        &self,
        handler: impl Handler,
        configure: impl FnOnce(&mut EngineConfig),
    ) -> Result<Running, Error> {
        self.start_with(Engine::builder(handler), configure).await
    }

    /// As [`start`](Self::start), from a builder the example set up further (its own
    /// idempotency store).
    pub async fn start_with(
        &self,
        builder: EngineBuilder,
        configure: impl FnOnce(&mut EngineConfig),
    ) -> Result<Running, Error> {
        let mut config = EngineConfig::for_group(self.connection.endpoint().group.clone());
        configure(&mut config);
        let engine = builder
            .config(config)
            .dead_letter_sink(self.connection.dead_letter_sink()?)
            .build()?;
        Ok(Running {
            handle: engine.start(&self.connection).await?,
            name: self.name,
        })
    }

    /// The connection (for the `dlq` calls an operator makes).
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// Deletes what the run declared where the broker keeps it (RabbitMQ's queues: the broker
    /// is shared).
    pub async fn clean_up(&self) -> Result<(), Error> {
        let topic = &self.connection.endpoint().topics[0];
        Ok(self.connection.delete_topic(topic).await?)
    }

    /// The dead letters of this run, with their reasons.
    pub async fn dead_letters(&self) -> Result<Vec<DeadLetterRecord>, Error> {
        Ok(dlq::all(&self.connection).await?)
    }
}

/// An engine an example started.
pub struct Running {
    handle: EngineHandle,
    name: &'static str,
}

impl Running {
    /// Waits (at most 120 s) until `done` holds for the engine's counters.
    pub async fn wait_for(
        &self,
        what: &str,
        done: impl Fn(&StatsSnapshot) -> bool,
    ) -> Result<StatsSnapshot, Error> {
        let stats = self.handle.stats_reader();
        let reached = async {
            loop {
                let s = stats.snapshot();
                if done(&s) {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(120), reached)
            .await
            .map_err(|_| format!("{}: {what}: not within 120 s ({:?})", self.name, stats.snapshot()).into())
    }

    /// The engine's counters, readable from anywhere (a health endpoint).
    pub fn stats_reader(&self) -> convoy::StatsReader {
        self.handle.stats_reader()
    }

    /// Stops gracefully (drains, commits, leaves); the final counters.
    pub async fn stop(self) -> Result<StatsSnapshot, Error> {
        Ok(self.handle.stop().await?.stats)
    }
}

/// Prints each invariant and exits non-zero unless all hold.
pub fn verdict(name: &str, checks: &[(&str, bool)]) -> ExitCode {
    for (what, held) in checks {
        println!("  [{}] {what}", if *held { "ok" } else { "FAILED" });
    }
    if checks.iter().all(|(_, held)| *held) {
        println!("{name}: every invariant held");
        ExitCode::SUCCESS
    } else {
        println!("{name}: an invariant failed");
        ExitCode::FAILURE
    }
}

/// Runs an example's body, printing its error as one line.
pub fn main_of<F>(name: &str, body: F) -> ExitCode
where
    F: std::future::Future<Output = Result<ExitCode, Error>>,
{
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(body).unwrap_or_else(|e| {
        eprintln!("{name}: {e}");
        ExitCode::FAILURE
    })
}
