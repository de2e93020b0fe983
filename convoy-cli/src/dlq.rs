//! `convoy dlq list`, `replay`, `unpark` and `purge`.

use std::process::ExitCode;
use std::time::SystemTime;

use convoy::dlq::{self, DeadLetterRecord, Selection};
use convoy::ConnectConfig;

use crate::cli::{DlqCommand, SelectionArgs};
use crate::out::{out, StdoutClosed};
use crate::settings::connect;

/// Longest error text shown in the list.
const ERROR_WIDTH: usize = 60;

pub async fn run(config: &ConnectConfig, command: DlqCommand) -> crate::outcome::CliResult {
    let connection = connect(config).await?;
    topics_exist(&connection).await?;
    let group = connection.endpoint().group.clone();
    let by_group = dlq::parked_by_group(&connection)
        .await
        .map_err(|e| e.to_string())?;
    let own = by_group.get(&group).cloned().unwrap_or_default();
    match command {
        DlqCommand::List {
            selection,
            json,
            purged,
        } => {
            let mut selection = selection_of(selection);
            selection.purged = purged;
            let records = dlq::list(&connection, &selection)
                .await
                .map_err(|e| e.to_string())?;
            let mut parked: Vec<_> = own.iter().collect();
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
                "{} dead letters in {}, {} keys parked in group {group}",
                records.len(),
                connection.dlq_topic().map_err(|e| e.to_string())?,
                parked.len()
            );
            for (other, keys) in by_group.iter().filter(|(g, _)| **g != group) {
                eprintln!(
                    "{} keys parked in group {other} ({}): name the group to see or replay them (group={other} in the URL, or --group {other})",
                    keys.len(),
                    shown_keys(keys)
                );
            }
        }
        DlqCommand::Replay {
            selection,
            all,
            to,
            dry_run,
            resume,
            force,
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
            let parked = &own;
            // A parked key named by --key is replayed whole; other selections leave every
            // parked key's messages alone (a part of one replayed out of order would break it).
            let whole: Vec<String> = selection
                .keys
                .iter()
                .filter(|k| parked.get(k.as_bytes()).is_some())
                .cloned()
                .collect();
            if !whole.is_empty() && (selection.reason.is_some() || selection.offsets.is_some()) {
                return Err(format!(
                    "{} is parked in group {group}: a parked key is replayed whole, in its order, and --reason and --offsets pick single dead letters; drop them to replay the key",
                    whole.join(", ")
                )
                .into());
            }
            for key in selection
                .keys
                .iter()
                .filter(|k| parked.get(k.as_bytes()).is_none())
            {
                if let Some((other, _)) = by_group
                    .iter()
                    .find(|(_, keys)| keys.get(key.as_bytes()).is_some())
                {
                    return Err(format!(
                        "{key} is parked in group {other}, not in {group} (the group this command names): \
                         name it (group={other} in the URL, or --group {other}); its dead letters replayed now \
                         would only be set aside again behind the parked key"
                    )
                    .into());
                }
            }
            let selected = dlq::list(&connection, &selection_of(selection))
                .await
                .map_err(|e| e.to_string())?;
            let before = selected.len();
            // A dead letter of a key parked in its own group stays: the key is replayed whole.
            let records: Vec<_> = selected
                .into_iter()
                .filter(|r| {
                    let parked_in = by_group.get(&r.group).unwrap_or(parked);
                    r.message.key.as_ref().is_none_or(|k| parked_in.get(k).is_none())
                })
                .collect();
            // Dead letters replayed before, or passed over by an unpark, stay, unless the
            // operator means to run them again.
            let (again, records): (Vec<_>, Vec<_>) = records
                .into_iter()
                .partition(|r| (r.replays > 0 || r.skipped_at.is_some()) && !force);
            if !again.is_empty() {
                eprintln!(
                    "skipped {} dead letters replayed before or passed over by an unpark (`dlq list` marks them; --force replays them again): {}",
                    again.len(),
                    shown_offsets(&again)
                );
            }
            let left_out = before - records.len() - again.len();
            if left_out
                > whole
                    .iter()
                    .map(|k| parked.get(k.as_bytes()).map_or(0, |p| p.pending()))
                    .sum::<usize>()
            {
                eprintln!(
                    "left out: dead letters of parked keys (a parked key is replayed whole, by --key and in its group; `dlq list` names them)"
                );
            }
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
            let named: Vec<&[u8]> = whole.iter().map(|k| k.as_bytes()).collect();
            let outcomes = dlq::replay_parked_keys(&connection, &named)
                .await
                .map_err(|e| e.to_string())?;
            for (key, outcome) in whole.iter().zip(outcomes) {
                let replay = outcome.map_err(|e| e.to_string())?;
                print_all_replayed(replay.records.iter(), &replay.receipts);
                eprintln!(
                    "replayed parked key {key}: {} messages in order (replay {}); it is unparked once they are handled",
                    replay.records.len(),
                    replay.id
                );
            }
            if records.is_empty() {
                if whole.is_empty() {
                    eprintln!("nothing to replay");
                }
                return Ok(ExitCode::SUCCESS);
            }
            let receipts = dlq::replay(&connection, &records, to.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            print_all_replayed(records.iter().map(|r| &r.message), &receipts);
            eprintln!("replayed {} dead letters", receipts.len());
        }
        DlqCommand::Unpark { key, note } => {
            if own.get(key.as_bytes()).is_none() {
                if let Some((other, _)) = by_group
                    .iter()
                    .find(|(_, keys)| keys.get(key.as_bytes()).is_some())
                {
                    return Err(format!(
                        "{key} is parked in group {other}, not in {group}: name it (group={other} in the URL, or --group {other})"
                    )
                    .into());
                }
            }
            let unparked = dlq::unpark(&connection, key.as_bytes(), &note)
                .await
                .map_err(|e| e.to_string())?;
            let head = &unparked.skipped;
            out!(
                "passed over {}@{} key={} (not replayed; `dlq list` marks it skipped)",
                head.source,
                head.offset,
                head.key_display()
            )?;
            match &unparked.replay {
                Some(replay) => {
                    print_all_replayed(replay.records.iter(), &replay.receipts);
                    eprintln!(
                        "unparked {key}: its failed message passed over, the {} messages behind it replayed in order (replay {}); it is unparked once they are handled",
                        replay.records.len(),
                        replay.id
                    );
                }
                None => eprintln!("unparked {key}: its failed message passed over, nothing else was waiting"),
            }
        }
        DlqCommand::Purge {
            selection,
            all,
            note,
            dry_run,
        } => {
            if selection.is_empty() && !all {
                return Err(
                    "select what to purge with --key, --reason, --offsets or --older-than, or pass --all"
                        .into(),
                );
            }
            let records = dlq::list(&connection, &selection_of(selection))
                .await
                .map_err(|e| e.to_string())?;
            if dry_run {
                print_table(&records)?;
                eprintln!("dry run: would purge {} dead letters", records.len());
                return Ok(ExitCode::SUCCESS);
            }
            let purged = dlq::purge(&connection, &records, &note)
                .await
                .map_err(|e| e.to_string())?;
            eprintln!(
                "purged {purged} dead letters ({}); `dlq list --purged` still shows them",
                shown_offsets(&records)
            );
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

/// A few of `keys`, for a line of text.
fn shown_keys(keys: &convoy::parking::ParkedKeys) -> String {
    let mut shown: Vec<String> = keys
        .iter()
        .take(5)
        .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
        .collect();
    if keys.len() > shown.len() {
        shown.push("…".to_owned());
    }
    shown.join(", ")
}

/// The topics the command names exist: a misspelled one is an error, not an empty listing.
async fn topics_exist(connection: &convoy::Connection) -> Result<(), String> {
    let endpoint = connection.endpoint();
    if endpoint.scheme == "memory" || endpoint.topics.is_empty() {
        return Ok(());
    }
    let listed = connection.list_topics().await.map_err(|e| e.to_string())?;
    match endpoint
        .topics
        .iter()
        .find(|t| !listed.iter().any(|l| &&l.name == t))
    {
        Some(missing) => Err(format!(
            "topic {missing} does not exist on this broker (`convoy topic list` shows what does)"
        )),
        None => Ok(()),
    }
}

fn selection_of(args: SelectionArgs) -> Selection {
    let selection = Selection {
        keys: args.keys,
        reason: args.reason,
        offsets: args.offsets,
        ..Selection::default()
    };
    match args.older_than {
        Some(age) => selection.older_than(age.into()),
        None => selection,
    }
}

/// Where a few of `records` are in the dead-letter topic, for a line of text.
fn shown_offsets(records: &[DeadLetterRecord]) -> String {
    let mut shown: Vec<String> = records
        .iter()
        .take(5)
        .map(|r| format!("offset {}", r.message.offset))
        .collect();
    if records.len() > shown.len() {
        shown.push("…".to_owned());
    }
    shown.join(", ")
}

/// A time as RFC 3339 in UTC, to the second (`-` when unknown).
fn shown_time(at: Option<SystemTime>) -> String {
    at.map_or_else(
        || "-".to_owned(),
        |t| humantime::format_rfc3339_seconds(t).to_string(),
    )
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
        "first_failure_at": r.first_failure_at.map(|t| shown_time(Some(t))),
        "dead_lettered_at": r.dead_lettered_at.map(|t| shown_time(Some(t))),
        "replays": r.replays,
        "last_replayed_at": r.last_replayed_at.map(|t| shown_time(Some(t))),
        "skipped_at": r.skipped_at.map(|t| shown_time(Some(t))),
        "purged_at": r.purged_at.map(|t| shown_time(Some(t))),
    })
}

fn print_table(records: &[DeadLetterRecord]) -> Result<(), StdoutClosed> {
    out!(
        "{:>8}  {:<20} {:<20} {:<18} {:>8}  {:<28} {:<10} error",
        "offset",
        "dead-lettered (UTC)",
        "key",
        "cause",
        "attempts",
        "from",
        "marks"
    )?;
    for r in records {
        let from = format!(
            "{}@{}",
            r.original_source.as_deref().unwrap_or("?"),
            r.original_offset
                .map_or_else(|| "?".to_owned(), |o| o.to_string())
        );
        let error: String = r.error.chars().take(ERROR_WIDTH).collect();
        let replayed = marks(r);
        out!(
            "{:>8}  {:<20} {:<20} {:<18} {:>8}  {:<28} {replayed:<10} {error}",
            r.message.offset,
            shown_time(r.dead_lettered_at),
            r.message.key_display(),
            r.cause,
            r.attempts,
            from
        )?;
    }
    Ok(())
}

/// What operators did to a dead letter: replayed (how often), passed over by an unpark, purged.
fn marks(r: &DeadLetterRecord) -> String {
    let mut marks = Vec::new();
    match r.replays {
        0 => {}
        1 => marks.push("replayed".to_owned()),
        n => marks.push(format!("replayed {n}x")),
    }
    if r.skipped_at.is_some() {
        marks.push("skipped".to_owned());
    }
    if r.purged_at.is_some() {
        marks.push("purged".to_owned());
    }
    if marks.is_empty() {
        return "-".to_owned();
    }
    marks.join(",")
}
