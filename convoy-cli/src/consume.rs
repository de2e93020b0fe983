//! `convoy consume`: the configured topics through lanes, with a handler that prints each
//! message on one line; stops on Ctrl-C or after `--max-messages`, draining and committing
//! first. A second Ctrl-C aborts the drain: what is unfinished stays uncommitted and goes to
//! the next consumer.

use std::process::ExitCode;
use std::time::Duration;

use convoy::{handler_fn, ConnectConfig, Delivery, Engine, EngineConfig, EngineReport, HandlerError};

use crate::cli::ConsumeArgs;
use crate::metrics_server;
use crate::settings::connect;

/// Longest payload printed per message.
const PREVIEW: usize = 120;

/// The exit status after a second Ctrl-C aborted the drain (128 + SIGINT, as shells report it).
const ABORTED: u8 = 130;

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

pub async fn run(config: &ConnectConfig, args: &ConsumeArgs) -> crate::CliResult {
    let connection = connect(config).await?;
    if connection.endpoint().topics.is_empty() {
        return Err("name the topics to consume with --topic (or ?topics= in the URL)".into());
    }
    if args.commit_interval_ms == 0 {
        return Err("--commit-interval-ms must be > 0".into());
    }
    // The recorder must be in place before the engine registers its metric handles.
    if let Some(addr) = args.metrics_addr {
        metrics_server::serve(addr)?;
    }
    let (quiet, work) = (args.quiet, Duration::from_millis(args.work_ms));
    let handler = handler_fn(move |d: Delivery| async move {
        if !work.is_zero() {
            tokio::time::sleep(work).await;
        }
        if !quiet {
            let payload = String::from_utf8_lossy(d.payload());
            let preview: String = payload.chars().take(PREVIEW).collect();
            println!(
                "{}@{} key={} attempt={} {}",
                d.source(),
                d.offset(),
                one_line(&d.message().key_display()),
                d.attempt(),
                one_line(&preview)
            );
        }
        Ok::<(), HandlerError>(())
    });
    let engine = Engine::builder(handler)
        .config(EngineConfig {
            group: connection.endpoint().group.clone(),
            commit_interval: Duration::from_millis(args.commit_interval_ms),
            ..EngineConfig::default()
        })
        .dead_letter_sink(connection.dead_letter_sink().map_err(|e| e.to_string())?)
        .build()
        .map_err(|e| e.to_string())?;
    // Listening before the engine starts: from here on no Ctrl-C is lost (see `Interrupts`).
    let mut interrupts = Interrupts::listen().map_err(|e| format!("cannot listen for Ctrl-C: {e}"))?;
    let running = engine.start(&connection).await.map_err(|e| e.to_string())?;
    let stopper = running.stopper();
    let finished = |s: &convoy::StatsSnapshot| s.handled + s.dead_lettered + s.duplicates;
    loop {
        tokio::select! {
            _ = interrupts.next() => break,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {
                let done = args.max_messages.is_some_and(|max| finished(&running.stats()) >= max);
                if done || running.is_finished() {
                    break;
                }
            }
        }
    }
    stopper.shutdown();
    if !running.is_finished() {
        eprintln!("stopping: draining the messages in flight (Ctrl-C again to abort the drain)");
    }
    let join = running.join();
    tokio::pin!(join);
    let mut aborted = false;
    let report = loop {
        tokio::select! {
            report = &mut join => break report.map_err(|e| e.to_string())?,
            _ = interrupts.next(), if !aborted => {
                aborted = true;
                eprintln!("second Ctrl-C: aborting the drain");
                stopper.shutdown();
            }
        }
    };
    summarize(&report);
    Ok(if aborted {
        ExitCode::from(ABORTED)
    } else {
        ExitCode::SUCCESS
    })
}

/// Ctrl-C notifications, from one listener kept for the whole command. A fresh
/// `tokio::signal::ctrl_c()` per wait loses a signal that arrives between two waits: once any
/// listener was registered the process no longer dies of SIGINT, and a listener created later
/// does not see an earlier signal (seen: a member left waiting forever after its Ctrl-C).
struct Interrupts {
    #[cfg(unix)]
    signals: tokio::signal::unix::Signal,
    #[cfg(windows)]
    signals: tokio::signal::windows::CtrlC,
}

impl Interrupts {
    fn listen() -> std::io::Result<Self> {
        Ok(Interrupts {
            #[cfg(unix)]
            signals: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?,
            #[cfg(windows)]
            signals: tokio::signal::windows::ctrl_c()?,
        })
    }

    /// The next Ctrl-C (at once if one arrived since the last).
    async fn next(&mut self) {
        if self.signals.recv().await.is_none() {
            // The runtime's signal driver is gone: no Ctrl-C can come any more.
            std::future::pending::<()>().await;
        }
    }
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
        "stopped: {} handled, {} dead-lettered, {} duplicates skipped, {} retries{cancelled}; committed watermarks: {}",
        s.handled,
        s.dead_lettered,
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
