//! What an assignment's read-back of parked keys costs on a dead-letter destination with a
//! million dead letters and ten parked keys, beside a whole read (`convoy_testkit::readback`),
//! on any broker:
//!
//! ```text
//! cargo run --release -p convoy --features kafka --example readback_bench -- --url kafka://127.0.0.1:9092
//! cargo run --release -p convoy --example readback_bench -- --url nats://127.0.0.1:4222
//! cargo run --release -p convoy --example readback_bench -- --url 'amqp://guest:guest@127.0.0.1:5672/%2f'
//! ```
//! Exits non-zero unless the assignment read at most 10,000 records, held at most 10 MB and
//! found the parked keys a whole read finds.

use std::process::ExitCode;

use clap::Parser;
use convoy_testkit::readback::{run, Shape};
use convoy_testkit::support::unique;

#[derive(Parser, Debug)]
struct Args {
    /// Broker URL (a fresh topic and group are made on it, and deleted after).
    #[arg(long, default_value = "memory://")]
    url: String,
    /// Dead letters written in all.
    #[arg(long, default_value_t = 1_000_000)]
    dead_letters: usize,
    /// Keys parked among them.
    #[arg(long, default_value_t = 10)]
    parked_keys: usize,
    /// Records a read-back reads past its checkpoint before it saves a new one.
    #[arg(long, default_value_t = convoy::parking::CHECKPOINT_AFTER)]
    checkpoint_after: usize,
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    let args = Args::parse();
    let shape = Shape {
        dead_letters: args.dead_letters,
        parked_keys: args.parked_keys,
        checkpoint_after: args.checkpoint_after,
    };
    let topic = unique("readback");
    let connection = convoy::connect(&args.url)
        .await?
        .with_topics(&[topic.as_str()])
        .with_group(unique("readback-group"));
    let dlq = connection.dlq_topic()?;
    connection.create_topic(&dlq, 1).await?;
    let scheme = connection.endpoint().scheme.clone();
    let status = run(
        &scheme,
        connection.dead_letter_sink()?,
        &connection.endpoint().group,
        &shape,
    )
    .await;
    if scheme != "memory" {
        connection.remove_dead_letter_topic(&dlq).await?;
    }
    Ok(status)
}
