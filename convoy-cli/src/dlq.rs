//! `convoy dlq list` and `convoy dlq replay`.

use std::process::ExitCode;

use convoy::dlq::{self, DeadLetterRecord, Selection};
use convoy::ConnectConfig;

use crate::cli::{DlqCommand, SelectionArgs};
use crate::out::{out, StdoutClosed};
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
            let parked = dlq::parked(&connection).await.map_err(|e| e.to_string())?;
            let mut parked: Vec<_> = parked.iter().collect();
            parked.sort_by(|a, b| a.0.cmp(b.0));
            if json {
                for r in &records {
                    out!(
                        "{}",
                        serde_json::to_string(&json_of(r)).map_err(|e| e.to_string())?
                    )?;
                }
                for (key, parking) in &parked {
                    let line = serde_json::json!({
                        "parked_key": String::from_utf8_lossy(key),
                        "waiting": parking.pending(),
                        "replay_under_way": parking.replaying().map(|r| &r.id),
                    });
                    out!("{line}")?;
                }
            } else {
                print_table(&records)?;
                if !parked.is_empty() {
                    out!("\nparked keys (group {}):", connection.endpoint().group)?;
                    for (key, parking) in &parked {
                        let under_way = parking.replaying().map_or_else(String::new, |r| {
                            format!(", replay {} of {} under way", r.id, r.count)
                        });
                        out!(
                            "  {}  {} waiting{under_way}",
                            String::from_utf8_lossy(key),
                            parking.pending()
                        )?;
                    }
                }
            }
            eprintln!(
                "{} dead letters in {}, {} keys parked",
                records.len(),
                connection.dlq_topic().map_err(|e| e.to_string())?,
                parked.len()
            );
        }
        DlqCommand::Replay {
            selection,
            all,
            to,
            dry_run,
            resume,
        } => {
            if resume {
                for key in &selection.keys {
                    let replay = dlq::resume_parked(&connection, key.as_bytes())
                        .await
                        .map_err(|e| e.to_string())?;
                    print_all_replayed(replay.records.iter(), &replay.receipts);
                    eprintln!(
                        "published replay {} of {key} again: {} messages",
                        replay.id,
                        replay.records.len()
                    );
                }
                return Ok(ExitCode::SUCCESS);
            }
            if selection.is_empty() && !all {
                return Err("select what to replay with --key, --reason or --offsets, or pass --all".into());
            }
            let parked = dlq::parked(&connection).await.map_err(|e| e.to_string())?;
            // A parked key named by --key is replayed whole; other selections leave every
            // parked key's messages alone (a part of one replayed out of order would break it).
            let whole: Vec<String> = selection
                .keys
                .iter()
                .filter(|k| parked.get(k.as_bytes()).is_some())
                .cloned()
                .collect();
            let records: Vec<_> = dlq::list(&connection, &selection_of(selection))
                .await
                .map_err(|e| e.to_string())?
                .into_iter()
                .filter(|r| r.message.key.as_ref().is_none_or(|k| parked.get(k).is_none()))
                .collect();
            if dry_run {
                print_table(&records)?;
                for key in &whole {
                    let waiting = parked.get(key.as_bytes()).map_or(0, |p| p.pending());
                    out!("parked key {key}: would replay its {waiting} messages, in order, and unpark it")?;
                }
                eprintln!(
                    "dry run: would replay {} dead letters and {} parked keys",
                    records.len(),
                    whole.len()
                );
                return Ok(ExitCode::SUCCESS);
            }
            for key in &whole {
                let replay = dlq::replay_parked(&connection, key.as_bytes())
                    .await
                    .map_err(|e| e.to_string())?;
                print_all_replayed(replay.records.iter(), &replay.receipts);
                eprintln!(
                    "replayed parked key {key}: {} messages in order (replay {}); it is unparked once they are handled",
                    replay.records.len(),
                    replay.id
                );
            }
            if records.is_empty() && !whole.is_empty() {
                return Ok(ExitCode::SUCCESS);
            }
            let receipts = dlq::replay(&connection, &records, to.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            print_all_replayed(records.iter().map(|r| &r.message), &receipts);
            eprintln!("replayed {} dead letters", receipts.len());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A line per replayed dead letter: where it was, its key, where it went. A closed stdout
/// cuts this report, never the replay: every selected key is still replayed.
fn print_all_replayed<'a>(records: impl Iterator<Item = &'a convoy::Message>, receipts: &[convoy::Receipt]) {
    for (record, receipt) in records.zip(receipts) {
        let line = out!(
            "{}@{} key={} -> {}@{}",
            record.source,
            record.offset,
            record.key_display(),
            receipt.source,
            receipt.offset
        );
        if line.is_err() {
            return;
        }
    }
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

fn print_table(records: &[DeadLetterRecord]) -> Result<(), StdoutClosed> {
    out!(
        "{:>8}  {:<20} {:<18} {:>8}  {:<28} error",
        "offset",
        "key",
        "cause",
        "attempts",
        "from"
    )?;
    for r in records {
        let from = format!(
            "{}@{}",
            r.original_source.as_deref().unwrap_or("?"),
            r.original_offset
                .map_or_else(|| "?".to_owned(), |o| o.to_string())
        );
        let error: String = r.error.chars().take(ERROR_WIDTH).collect();
        out!(
            "{:>8}  {:<20} {:<18} {:>8}  {:<28} {error}",
            r.message.offset,
            r.message.key_display(),
            r.cause,
            r.attempts,
            from
        )?;
    }
    Ok(())
}
