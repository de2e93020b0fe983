//! The engine's cost per message in CPU instructions: a figure that does not move with the
//! machine's load, unlike msg/s. Run under callgrind by `scripts/bench/cost`, which does the
//! arithmetic; by itself it only drains a topic once.
//!
//! ```text
//! valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/cost_per_message --mode engine --messages 100000
//! ```
//!
//! Both modes publish the same `--messages` (over `--keys`, on `--partitions` of the embedded
//! broker) and read them all on a single-threaded runtime (deterministic scheduling):
//! - `engine`: convoy's engine with its default configuration (idempotency store on, no tracing
//!   subscriber) and a handler that only counts; messages carry an event id and a `traceparent`
//!   as convoy's publishers give them;
//! - `bare`: a bare member of another group drains the topic and counts, no engine.
//!
//! `engine − bare` is what the engine adds; taking it at two sizes and dividing the difference
//! by the difference in messages removes start-up and shutdown, so what is left is per message.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use convoy_core::{handler_fn, Engine, OutgoingMessage};
use convoy_memory::baseline::bare_drain;
use convoy_testkit::{MemoryBroker, MemoryDeadLetterSink, MemoryTransport};
use tokio::sync::Notify;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    /// convoy's engine with a handler that only counts.
    Engine,
    /// A bare member drains the same messages.
    Bare,
}

#[derive(Parser, Debug)]
#[command(about = "Drain a prefilled topic with the engine or a bare member (for callgrind)")]
struct Args {
    #[arg(long, value_enum)]
    mode: Mode,
    /// Messages to publish and read.
    #[arg(long, default_value_t = 100_000)]
    messages: u64,
    /// Distinct keys.
    #[arg(long, default_value_t = 1_000)]
    keys: u64,
    /// Partitions of the topic.
    #[arg(long, default_value_t = 8)]
    partitions: u32,
}

const TOPIC: &str = "cost";

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot build a Tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&args)) {
        Ok(read) if read == args.messages => {
            println!("{:?}: read {read} messages", args.mode);
            ExitCode::SUCCESS
        }
        Ok(read) => {
            eprintln!("error: read {read} of {} messages", args.messages);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> Result<u64, String> {
    let broker = MemoryBroker::new();
    broker.create_topic(TOPIC, args.partitions);
    let keys = args.keys.max(1);
    for i in 0..args.messages {
        let mut message = OutgoingMessage::new(format!("key-{}", i % keys), format!("{{\"n\":{i}}}"));
        // As every convoy publisher does: an event id (checked for duplicates) and a traceparent.
        message.stamp();
        broker
            .publish(TOPIC, message)
            .map_err(|e| format!("publishing: {e}"))?;
    }
    match args.mode {
        Mode::Bare => {
            let mut bytes = 0usize;
            let read = bare_drain(&broker, TOPIC, args.messages, Duration::from_secs(3600), |m| {
                bytes += m.payload.len();
            })
            .await;
            std::hint::black_box(bytes);
            Ok(read)
        }
        Mode::Engine => {
            let handled = Arc::new(AtomicU64::new(0));
            let all_handled = Arc::new(Notify::new());
            let (count, done, expected) = (handled.clone(), all_handled.clone(), args.messages);
            let handler = handler_fn(move |_delivery| {
                if count.fetch_add(1, Relaxed) + 1 == expected {
                    done.notify_one();
                }
                std::future::ready(Ok(()))
            });
            let engine = Engine::builder(handler)
                .dead_letter_sink(MemoryDeadLetterSink::new(&broker, "cost.dlq"))
                .build()
                .map_err(|e| e.to_string())?;
            let transport = MemoryTransport::new(&broker, "cost-engine", &[TOPIC]);
            let running = engine.start(&transport).await.map_err(|e| e.to_string())?;
            if expected > 0 {
                all_handled.notified().await;
            }
            running.stop().await.map_err(|e| e.to_string())?;
            Ok(handled.load(Relaxed))
        }
    }
}
