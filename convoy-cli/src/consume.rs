//! `convoy consume`: the configured topics through lanes, with a handler that prints each
//! message; stops on Ctrl-C or after `--max-messages`, draining and committing first.

use std::process::ExitCode;
use std::time::Duration;

use convoy::{handler_fn, ConnectConfig, Delivery, Engine, EngineConfig, HandlerError, Transport};

use crate::cli::ConsumeArgs;
use crate::metrics_server;
use crate::settings::connect;

/// Longest payload printed per message.
const PREVIEW: usize = 120;

pub async fn run(config: &ConnectConfig, args: &ConsumeArgs) -> crate::CliResult {
    let connection = connect(config).await?;
    if connection.endpoint().topics.is_empty() {
        return Err("name the topics to consume with --topic (or ?topics= in the URL)".into());
    }
    // The recorder must be in place before the engine registers its metric handles.
    let _server = match args.metrics_addr {
        Some(addr) => Some(metrics_server::serve(addr).await?),
        None => None,
    };
    let quiet = args.quiet;
    let handler = handler_fn(move |d: Delivery| async move {
        if !quiet {
            let payload = String::from_utf8_lossy(d.payload());
            let preview: String = payload.chars().take(PREVIEW).collect();
            println!(
                "{}@{} key={} attempt={} {preview}",
                d.source(),
                d.offset(),
                d.message().key_display(),
                d.attempt()
            );
        }
        Ok::<(), HandlerError>(())
    });
    let engine = Engine::builder(handler)
        .config(EngineConfig {
            group: connection.endpoint().group.clone(),
            ..EngineConfig::default()
        })
        .dead_letter_sink(connection.dead_letter_sink().map_err(|e| e.to_string())?)
        .build()
        .map_err(|e| e.to_string())?;
    let subscription = connection.subscribe().await.map_err(|e| e.to_string())?;
    let running = engine.spawn(subscription);
    let finished = |s: &convoy::StatsSnapshot| s.handled + s.dead_lettered + s.duplicates;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            _ = &mut ctrl_c => break,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {
                let done = args.max_messages.is_some_and(|max| finished(&running.stats()) >= max);
                if done || running.is_finished() {
                    break;
                }
            }
        }
    }
    let report = running.stop().await.map_err(|e| e.to_string())?;
    let s = report.stats;
    let committed: Vec<String> = report
        .committed
        .iter()
        .map(|(source, watermark)| format!("{source}={watermark}"))
        .collect();
    eprintln!(
        "stopped: {} handled, {} dead-lettered, {} duplicates skipped, {} retries; committed watermarks: {}",
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
    Ok(ExitCode::SUCCESS)
}
