//! `convoy produce`: keyed messages from lines (`KEY<sep>PAYLOAD`) or generated (JSON, or the
//! benchmark's probes for `convoy bench --prefilled-topic`), published in order and confirmed.

use std::process::ExitCode;

use convoy::{ConnectConfig, OutgoingMessage};
use convoy_testkit::scenario::prefill;
use convoy_testkit::OrderChecker;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};

use crate::cli::ProduceArgs;
use crate::settings::connect;

/// Messages published per confirmed batch.
const BATCH: usize = 1_000;

pub async fn run(config: &ConnectConfig, args: &ProduceArgs) -> crate::CliResult {
    if args.separator.is_empty() {
        return Err("--separator must not be empty".into());
    }
    let connection = connect(config).await?;
    let topic = connection
        .endpoint()
        .topics
        .first()
        .cloned()
        .ok_or("name the topic to publish to with --topic (or ?topics= in the URL)")?;
    // Idempotent: on RabbitMQ this also declares the group's queues, so what is published here
    // is there for that group's consumers.
    connection
        .create_topic(&topic, connection.endpoint().partitions)
        .await
        .map_err(|e| e.to_string())?;
    let publisher = connection.publisher(&topic).map_err(|e| e.to_string())?;
    let mut batch = Vec::with_capacity(BATCH);
    let mut published = 0u64;
    let flush = |batch: &mut Vec<OutgoingMessage>| {
        let messages = std::mem::take(batch);
        let publisher = publisher.clone();
        async move {
            let n = messages.len() as u64;
            publisher.publish_all(messages).await.map_err(|e| e.to_string())?;
            Ok::<u64, String>(n)
        }
    };
    if let Some(count) = args.generate.filter(|_| args.probes) {
        // The benchmark's own pre-fill: same messages, same batches as `convoy bench`.
        prefill(
            publisher.as_ref(),
            &OrderChecker::new(),
            count,
            args.keys.max(1),
            0,
        )
        .await
        .map_err(|e| e.to_string())?;
        published = count;
    } else if let Some(count) = args.generate {
        for seq in 0..count {
            let key = format!("key-{}", seq % args.keys.max(1) as u64);
            let payload = format!(r#"{{"key":"{key}","seq":{seq}}}"#);
            batch.push(with_headers(OutgoingMessage::new(key, payload), args));
            if batch.len() == BATCH {
                published += flush(&mut batch).await?;
            }
        }
    } else {
        let reader: Box<dyn AsyncBufRead + Unpin + Send> = match &args.file {
            Some(path) => Box::new(BufReader::new(
                tokio::fs::File::open(path)
                    .await
                    .map_err(|e| format!("cannot open {}: {e}", path.display()))?,
            )),
            None => Box::new(BufReader::new(tokio::io::stdin())),
        };
        let mut lines = reader.lines();
        let mut number = 0u64;
        while let Some(line) = lines
            .next_line()
            .await
            .map_err(|e| format!("reading input: {e}"))?
        {
            number += 1;
            if line.trim().is_empty() {
                continue;
            }
            batch.push(with_headers(parse_line(&line, number, args)?, args));
            if batch.len() == BATCH {
                published += flush(&mut batch).await?;
            }
        }
    }
    if !batch.is_empty() {
        published += flush(&mut batch).await?;
    }
    eprintln!("published {published} messages to {topic}");
    Ok(ExitCode::SUCCESS)
}

fn with_headers(mut message: OutgoingMessage, args: &ProduceArgs) -> OutgoingMessage {
    for (name, value) in &args.headers {
        message.headers.insert(name.clone(), value.clone());
    }
    message
}

/// One input line as a message, or an error naming the line.
fn parse_line(line: &str, number: u64, args: &ProduceArgs) -> Result<OutgoingMessage, String> {
    if args.keyless {
        return Ok(OutgoingMessage::keyless(line.to_owned()));
    }
    match line.split_once(args.separator.as_str()) {
        Some((key, payload)) if !key.is_empty() => {
            Ok(OutgoingMessage::new(key.to_owned(), payload.to_owned()))
        }
        _ => Err(format!(
            "line {number}: expected KEY{}PAYLOAD (use --separator to change it, or --keyless)",
            args.separator.escape_default()
        )),
    }
}
