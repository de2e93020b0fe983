//! `convoy dlq list` and `convoy dlq replay`.

use std::process::ExitCode;

use convoy::dlq::{self, DeadLetterRecord, Selection};
use convoy::ConnectConfig;

use crate::cli::{DlqCommand, SelectionArgs};
use crate::settings::connect;

/// Longest error text shown in the list.
const ERROR_WIDTH: usize = 60;

pub async fn run(config: &ConnectConfig, command: DlqCommand) -> crate::CliResult {
    let connection = connect(config).await?;
    match command {
        DlqCommand::List { selection, json } => {
            let records = dlq::list(&connection, &selection_of(selection))
                .await
                .map_err(|e| e.to_string())?;
            if json {
                for r in &records {
                    println!(
                        "{}",
                        serde_json::to_string(&json_of(r)).map_err(|e| e.to_string())?
                    );
                }
            } else {
                print_table(&records);
            }
            eprintln!(
                "{} dead letters in {}",
                records.len(),
                connection.dlq_topic().map_err(|e| e.to_string())?
            );
        }
        DlqCommand::Replay {
            selection,
            all,
            to,
            dry_run,
        } => {
            if selection.is_empty() && !all {
                return Err("select what to replay with --key, --reason or --offsets, or pass --all".into());
            }
            let records = dlq::list(&connection, &selection_of(selection))
                .await
                .map_err(|e| e.to_string())?;
            if dry_run {
                print_table(&records);
                eprintln!("dry run: would replay {} dead letters", records.len());
                return Ok(ExitCode::SUCCESS);
            }
            let receipts = dlq::replay(&connection, &records, to.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            for (record, receipt) in records.iter().zip(&receipts) {
                println!(
                    "{}@{} key={} -> {}@{}",
                    record.message.source,
                    record.message.offset,
                    record.message.key_display(),
                    receipt.source,
                    receipt.offset
                );
            }
            eprintln!("replayed {} dead letters", receipts.len());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn selection_of(args: SelectionArgs) -> Selection {
    Selection {
        keys: args.keys,
        reason: args.reason,
        offsets: args.offsets,
    }
}

fn json_of(r: &DeadLetterRecord) -> serde_json::Value {
    serde_json::json!({
        "offset": r.message.offset,
        "source": r.message.source.as_str(),
        "key": r.message.key.as_ref().map(|k| String::from_utf8_lossy(k).into_owned()),
        "payload": String::from_utf8_lossy(&r.message.payload),
        "cause": r.cause,
        "error_class": r.error_class,
        "error": r.error,
        "attempts": r.attempts,
        "original_source": r.original_source,
        "original_offset": r.original_offset,
        "group": r.group,
    })
}

fn print_table(records: &[DeadLetterRecord]) {
    println!(
        "{:>8}  {:<20} {:<18} {:>8}  {:<28} error",
        "offset", "key", "cause", "attempts", "from"
    );
    for r in records {
        let from = format!(
            "{}@{}",
            r.original_source.as_deref().unwrap_or("?"),
            r.original_offset
                .map_or_else(|| "?".to_owned(), |o| o.to_string())
        );
        let error: String = r.error.chars().take(ERROR_WIDTH).collect();
        println!(
            "{:>8}  {:<20} {:<18} {:>8}  {:<28} {error}",
            r.message.offset,
            r.message.key_display(),
            r.cause,
            r.attempts,
            from
        );
    }
}
