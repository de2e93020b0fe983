//! `convoy consume`: the configured topics through lanes, with a handler that prints each
//! message on one line; stops on SIGINT (Ctrl-C) or SIGTERM (`docker stop`, Kubernetes), or
//! after exactly `--max-messages`, draining (what is in flight, or with `--drain buffered`
//! everything fetched) and committing first. A second signal aborts the drain: what is
//! unfinished stays uncommitted and goes to the next consumer. A closed stdout (`| head`, or
//! `| less` and then `q`) stops it too, at once: only what was printed is committed, and the
//! exit status is 0.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use convoy::{
    handler_fn, header_names, transform_fn, ConnectConfig, Delivery, Drain, Engine, EngineReport,
    HandlerError, OutgoingMessage, Output, StopSignals, EVENT_ID_HEADER,
};

use crate::cli::{ConsumeArgs, DrainArg, PayloadEncoding};
use crate::metrics_server;
use crate::out::out;
use crate::settings::{fit_to_topics, through_outage};
use convoy_bench::FaultPlan;

/// Longest payload printed per message.
const PREVIEW: usize = 120;

/// The exit status after a second signal aborted the drain: 128 + the signal's number, as
/// shells report a process ended by it.
fn aborted_status(signal: &str) -> u8 {
    match signal {
        "SIGTERM" => 128 + 15,
        _ => 128 + 2,
    }
}

/// `text` on one line: control characters (newlines, tabs, …) and backslashes escaped, so one
/// message is always one output line and the line reads back unambiguously.
fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '\\' || c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A payload as printed: a one-line preview of its text, or all of it in base64 or hex.
fn shown(payload: &[u8], encoding: PayloadEncoding) -> String {
    use base64::Engine as _;
    match encoding {
        PayloadEncoding::Text => {
            let preview: String = String::from_utf8_lossy(payload).chars().take(PREVIEW).collect();
            one_line(&preview)
        }
        PayloadEncoding::Base64 => base64::engine::general_purpose::STANDARD.encode(payload),
        PayloadEncoding::Hex => payload.iter().map(|b| format!("{b:02x}")).collect(),
    }
}

/// What the handler does with each message: `--work-ms`, `--fail-on`, and the printed line.
#[derive(Clone)]
struct Handling {
    quiet: bool,
    encoding: PayloadEncoding,
    work: Duration,
    fail_on: Option<Vec<u8>>,
    /// `--transient-rate`, `--terminal-rate` and `--fault-seed` (none when both rates are 0).
    faults: Option<FaultPlan>,
    /// Told when stdout's reader has gone: `run` stops the consumer.
    stdout_closed: Arc<tokio::sync::Notify>,
}

impl Handling {
    async fn handle(&self, d: &Delivery) -> Result<(), HandlerError> {
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        if let Some(text) = self.fail_on.as_deref() {
            if d.payload().windows(text.len().max(1)).any(|w| w == text) {
                return Err(HandlerError::terminal(format!(
                    "the payload contains {:?} (--fail-on)",
                    String::from_utf8_lossy(text)
                )));
            }
        }
        if let Some(plan) = &self.faults {
            let seq = convoy_bench::probe::decode_seq(d.payload());
            let key = d.message().key.as_deref().unwrap_or_default();
            // A replay comes once the cause is fixed: terminal failures spare it, transient
            // ones do not.
            let headers = &d.message().headers;
            let replayed = headers.get(header_names::REPLAY).is_some()
                || headers.get(header_names::REPLAYED_FROM).is_some();
            let failure = seq.and_then(|seq| match replayed {
                true => plan.transient_failure(key, seq, d.attempt()),
                false => plan.failure_at_rate(key, seq, d.attempt()),
            });
            if let Some(failure) = failure {
                return Err(failure);
            }
        }
        if !self.quiet {
            let printed = out!(
                "{}@{} key={} attempt={} {}",
                d.source(),
                d.offset(),
                one_line(&d.message().key_display()),
                d.attempt(),
                shown(d.payload(), self.encoding)
            );
            if printed.is_err() {
                // Nobody reads this message's line, so it is not finished: neither handled nor a
                // dead letter. The stop `run` starts now cancels this call, and commits only
                // what was printed.
                self.stdout_closed.notify_one();
                std::future::pending::<()>().await;
            }
        }
        Ok(())
    }
}

/// The copy `--forward-to` publishes: key, payload and headers, but not the input's event id
/// (the engine derives the copy's from it).
fn forwarded(d: &Delivery, topic: &str) -> Output {
    let message = d.message();
    let mut copy = OutgoingMessage {
        key: message.key.clone(),
        payload: message.payload.clone(),
        headers: Default::default(),
    };
    for (name, value) in message.headers.iter().filter(|(n, _)| *n != EVENT_ID_HEADER) {
        copy.headers.append(name, value.clone());
    }
    Output::new(topic, copy)
}

/// A consumer whose engine runs.
struct Started {
    running: convoy::EngineHandle,
    stdout_closed: Arc<tokio::sync::Notify>,
}

pub async fn run(config: &ConnectConfig, args: &ConsumeArgs) -> crate::outcome::CliResult {
    // Listening before anything else: a signal while connecting or joining stops the start
    // cleanly (nothing was handled, nothing is to be committed), and from then on no signal is
    // lost (see `StopSignals`).
    let mut signals = StopSignals::listen().map_err(|e| format!("cannot listen for SIGINT/SIGTERM: {e}"))?;
    let Started {
        running,
        stdout_closed,
    } = tokio::select! {
        started = start(config, args) => started?,
        signal = signals.next() => {
            eprintln!("{signal} while starting: stopped before consuming anything");
            return Ok(ExitCode::SUCCESS);
        }
    };
    let stopper = running.stopper();
    until_stopped(running, stopper, stdout_closed, signals).await
}

/// Connects, builds the engine and starts it.
async fn start(config: &ConnectConfig, args: &ConsumeArgs) -> Result<Started, crate::outcome::CliError> {
    // A member started while its broker restarts waits it out, as a running member does; an
    // address nothing answers at fails once the wait is over, with the same one-line error.
    let connection = through_outage("connecting", || config.connect())
        .await
        .map_err(|e| e.to_string())?;
    if connection.endpoint().topics.is_empty() {
        return Err("name the topics to consume with --topic (or ?topics= in the URL)".into());
    }
    let connection = fit_to_topics(connection, config, args.create).await?;
    if args.create {
        // Created before anything subscribes: a Kafka consumer does not create the topics it
        // subscribes to, and would wait for them to appear (RabbitMQ and NATS declare them as
        // they subscribe; creating what exists changes nothing anywhere).
        through_outage("creating the topics", || connection.create_topics())
            .await
            .map_err(|e| e.to_string())?;
    }
    if let Some(to) = &args.forward_to {
        forward_target_exists(&connection, to, args.create).await?;
    }
    if args.commit_interval_ms == Some(0) {
        return Err("--commit-interval-ms must be > 0".into());
    }
    // The recorder must be in place before the engine registers its metric handles.
    let endpoint = match args.metrics_addr {
        Some(addr) => Some(metrics_server::serve(addr, args.control).await?),
        None => None,
    };
    let handling = Handling {
        quiet: args.quiet,
        encoding: args.payload_encoding,
        work: Duration::from_millis(args.work_ms),
        fail_on: args.fail_on.clone().map(String::into_bytes),
        faults: (args.transient_rate > 0.0 || args.terminal_rate > 0.0).then(|| FaultPlan {
            seed: args.fault_seed,
            transient_rate: args.transient_rate,
            transient_attempts: 1,
            terminal_rate: args.terminal_rate,
            ..FaultPlan::default()
        }),
        stdout_closed: Arc::new(tokio::sync::Notify::new()),
    };
    let stdout_closed = handling.stdout_closed.clone();
    // The engine's defaults, then `[engine]` of --config and CONVOY_ENGINE_*, then the flags.
    let mut config = connection.engine_config().map_err(|e| e.to_string())?;
    if let Some(ms) = args.commit_interval_ms {
        config.commit_interval = Duration::from_millis(ms);
    }
    config.park_keys |= args.park_keys;
    if let Some(max) = args.max_messages {
        config.max_messages = Some(max);
    }
    if let Some(seconds) = args.shutdown_timeout_s {
        config.shutdown_timeout = Duration::from_secs(seconds);
    }
    if let Some(drain) = args.drain {
        config.drain = match drain {
            DrainArg::InFlight => Drain::InFlight,
            DrainArg::Buffered => Drain::Buffered,
        };
    }
    config.drain_timeout = config.drain_timeout.min(config.shutdown_timeout);
    let builder = match args.forward_to.clone() {
        None => Engine::builder(handler_fn(move |d: Delivery| {
            let handling = handling.clone();
            async move { handling.handle(&d).await }
        })),
        Some(to) => Engine::transform_builder(transform_fn(move |d: Delivery| {
            let (handling, to) = (handling.clone(), to.clone());
            async move {
                handling.handle(&d).await?;
                Ok(vec![forwarded(&d, &to)])
            }
        })),
    };
    let engine = builder
        .config(config)
        .dead_letter_sink(connection.dead_letter_sink().map_err(|e| e.to_string())?)
        .build()
        .map_err(|e| e.to_string())?;
    if connection.endpoint().scheme == "memory" {
        // Checked after the settings, so that a bad one is still named here.
        return Err(
            "memory:// lives inside one process: no other program can publish to it, so \
                    `convoy consume` would wait forever on an empty broker. Name a broker with --url \
                    (kafka://, amqp://, nats://); memory:// is for `convoy bench` and for the library"
                .into(),
        );
    }
    let running = engine.start(&connection).await.map_err(|e| e.to_string())?;
    if let Some(endpoint) = &endpoint {
        endpoint.engine_started(running.stats_reader(), running.inspector(), running.pauser());
    }
    Ok(Started {
        running,
        stdout_closed,
    })
}

/// `--forward-to`'s topic exists (or, with `--create`, is created): a typo must not make a
/// topic (Kafka would auto-create it with one partition).
async fn forward_target_exists(
    connection: &convoy::Connection,
    to: &str,
    create: bool,
) -> Result<(), String> {
    if connection.endpoint().scheme == "memory" {
        return Ok(());
    }
    let listed = connection.list_topics().await.map_err(|e| e.to_string())?;
    if listed.iter().any(|t| t.name == to) {
        return Ok(());
    }
    if !create {
        return Err(format!(
            "topic {to} (--forward-to) does not exist on this broker: create it with \
             `convoy topic create {to} --partitions N`, or pass --create"
        ));
    }
    connection
        .create_topic(to, connection.endpoint().partitions)
        .await
        .map_err(|e| e.to_string())
}

/// Runs until the engine stops: a signal, a closed stdout, `--max-messages`.
async fn until_stopped(
    running: convoy::EngineHandle,
    stopper: convoy::Stopper,
    stdout_closed: Arc<tokio::sync::Notify>,
    mut signals: StopSignals,
) -> crate::outcome::CliResult {
    let join = running.join();
    tokio::pin!(join);
    let mut aborted_by = None;
    let mut closed = false;
    let report = loop {
        tokio::select! {
            report = &mut join => break report.map_err(|e| e.to_string())?,
            () = stdout_closed.notified(), if !closed => {
                closed = true;
                eprintln!("stdout closed: stopping — committing only what was printed");
                // Nothing unfinished can be printed any more: stop, and abort the drain at once
                // (what is unfinished is cancelled and left to the next consumer).
                while stopper.requests() < 2 {
                    stopper.shutdown();
                }
            }
            signal = signals.next(), if aborted_by.is_none() => {
                if stopper.requests() == 0 {
                    eprintln!("{signal}: stopping — finishing what is in flight, then committing ({signal} again to abort the drain)");
                } else {
                    eprintln!("second {signal}: aborting the drain");
                    aborted_by = Some(signal);
                }
                stopper.shutdown();
            }
        }
    };
    summarize(&report);
    Ok(match aborted_by {
        Some(signal) => ExitCode::from(aborted_status(signal)),
        None => ExitCode::SUCCESS,
    })
}

fn summarize(report: &EngineReport) {
    let s = report.stats;
    let committed: Vec<String> = report
        .committed
        .iter()
        .map(|(source, watermark)| format!("{source}={watermark}"))
        .collect();
    let cancelled = if report.cancelled > 0 {
        format!(
            ", {} cancelled unfinished (uncommitted: the next consumer handles them)",
            report.cancelled
        )
    } else {
        String::new()
    };
    eprintln!(
        "stopped: {} handled, {} dead-lettered, {} set aside behind a parked key, {} duplicates skipped, {} retries{cancelled}; committed watermarks: {}",
        s.handled,
        s.dead_lettered,
        s.parked,
        s.duplicates,
        s.retries,
        if committed.is_empty() {
            "none".to_owned()
        } else {
            committed.join(", ")
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_is_one_line() {
        assert_eq!(one_line("a\nb\r\tc"), "a\\nb\\r\\tc");
        assert_eq!(one_line("back\\slash"), "back\\\\slash");
        assert_eq!(one_line("héllo ✓"), "héllo ✓", "printable text is left alone");
        assert!(!one_line("x\u{1b}[31m").contains('\u{1b}'));
    }
}
