//! The `convoy` command. Each subcommand lives in its own module; errors end the program with
//! one line on stderr.

mod bed;
mod bench;
mod cli;
mod consume;
mod dlq;
mod metrics_server;
mod produce;
mod settings;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};

/// A failed command: one line for the user.
type CliResult = Result<ExitCode, String>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if std::env::var("RUST_LOG").is_ok() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(message) => fail(&message),
    }
}

async fn run(cli: Cli) -> CliResult {
    let config = settings::connect_config(&cli)?;
    match cli.command {
        Command::Bench(args) => bench::run(&config, &args).await,
        Command::Produce(args) => produce::run(&config, &args).await,
        Command::Consume(args) => consume::run(&config, &args).await,
        Command::Dlq(command) => dlq::run(&config, command).await,
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("error: {}", message.replace('\n', " "));
    ExitCode::FAILURE
}
