//! The `convoy` command. Each subcommand lives in its own module; errors end the program with
//! one line on stderr.

mod bed;
mod bench;
mod cli;
mod consume;
mod control;
mod dlq;
mod lanes;
mod metrics_server;
mod out;
mod outcome;
mod produce;
mod settings;
mod topic;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::outcome::{CliError, CliResult};

/// What is logged unless `RUST_LOG` says otherwise: a consumer's lifecycle (joined, sources
/// assigned and revoked, outages and recoveries, dead letters) at INFO; warnings elsewhere.
/// librdkafka's own log is off: it repeats every connection failure several times a second;
/// convoy reports outages and recoveries itself.
/// lapin logs every channel the broker closes as an error, and convoy closes channels by design
/// (a lock already taken, a queue looked up that is not there): off too.
const DEFAULT_LOG: &str =
    "warn,rdkafka=off,lapin=off,convoy=info,convoy_core=info,convoy_kafka=info,convoy_amqp=info,convoy_nats=info";

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| match cli.command {
            Command::Consume(_) => tracing_subscriber::EnvFilter::new(DEFAULT_LOG),
            _ => tracing_subscriber::EnvFilter::new("warn,rdkafka=off,lapin=off"),
        });
    // Colours only for a person at a terminal, and never when NO_COLOR is set (no-color.org).
    use std::io::IsTerminal as _;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour);
    match cli.log_format {
        cli::LogFormat::Text => logs.init(),
        cli::LogFormat::Json => logs.json().init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(CliError::StdoutClosed) => ExitCode::SUCCESS,
        Err(CliError::Failed(message)) => fail(&message),
    }
}

async fn run(cli: Cli) -> CliResult {
    let config = settings::connect_config(&cli)?;
    let command = match cli.command {
        // The view of a running consumer: its endpoint, not a broker.
        Command::Lanes(args) => return lanes::run(&args).await,
        Command::Pause(args) => return control::run(&args, true).await,
        Command::Resume(args) => return control::run(&args, false).await,
        other => other,
    };
    if !matches!(command, Command::Bench(_)) && config.url.is_none() {
        return Err(
            "name the broker with --url (or CONVOY_URL, or url in --config), e.g. kafka://127.0.0.1:9092: \
             only `convoy bench` defaults to memory://, which lives inside one process — a message \
             produced there vanishes when the command ends"
                .into(),
        );
    }
    match command {
        Command::Bench(args) => bench::run(&config, &args).await,
        Command::Produce(args) => produce::run(&config, &args).await,
        Command::Consume(args) => consume::run(&config, &args).await,
        Command::Dlq(command) => dlq::run(&config, command).await,
        Command::Topic(command) => topic::run(&config, command).await,
        Command::Lanes(args) => lanes::run(&args).await,
        Command::Pause(args) => control::run(&args, true).await,
        Command::Resume(args) => control::run(&args, false).await,
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("error: {}", message.replace('\n', " "));
    ExitCode::FAILURE
}
