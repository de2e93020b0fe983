//! `convoy produce`: keyed messages from lines (`KEY<sep>PAYLOAD`, the payload as text, base64
//! or hex) or generated (JSON, or the benchmark's probes for `convoy bench --prefilled-topic`),
//! published in order and confirmed. A bad line stops it — after publishing every line before
//! it, and saying how many — or, with `--skip-bad-lines`, is named and skipped.

use std::process::ExitCode;

use base64::Engine as _;
use convoy::{ConnectConfig, OutgoingMessage, TopicSpec};
use convoy_bench::scenario::prefill;
use convoy_bench::{KeySpread, OrderChecker};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};

use crate::cli::{PayloadEncoding, ProduceArgs};
use crate::settings::connect;

/// Messages published per confirmed batch.
const BATCH: usize = 1_000;

pub async fn run(config: &ConnectConfig, args: &ProduceArgs) -> crate::outcome::CliResult {
    if args.separator.is_empty() {
        return Err("--separator must not be empty".into());
    }
    if args.generate.is_some() && args.keys == 0 {
        return Err("--keys must be at least 1: generated messages are spread over that many keys".into());
    }
    let connection = crate::settings::fit_to_topics(connect(config).await?, config, true).await?;
    let topic = connection
        .endpoint()
        .topics
        .first()
        .cloned()
        .ok_or("name the topic to publish to with --topic (or ?topics= in the URL)")?;
    // Idempotent. On RabbitMQ a group receives only what is published once its queues exist:
    // the group named (by --group, CONVOY_GROUP, the config file or the URL) is declared, no
    // other — a publish no group receives is refused, never kept for no one.
    let groups = match crate::settings::group_named(config) {
        true => vec![connection.endpoint().group.clone()],
        false => Vec::new(),
    };
    let spec = TopicSpec {
        partitions: connection.endpoint().partitions,
        groups,
        replication: None,
    };
    connection
        .declare_topic(&topic, &spec)
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
        let spread = KeySpread::new(args.keys, args.zipf).map_err(|e| format!("--zipf: {e}"))?;
        prefill(publisher.as_ref(), &OrderChecker::new(), count, &spread, 0)
            .await
            .map_err(|e| e.to_string())?;
        published = count;
    } else if let Some(count) = args.generate {
        for seq in 0..count {
            let key = format!("key-{}", seq % args.keys as u64);
            let payload = format!(r#"{{"key":"{key}","seq":{seq}}}"#);
            batch.push(with_headers(OutgoingMessage::new(key, payload), args));
            if batch.len() == BATCH {
                published += flush(&mut batch).await?;
            }
        }
    } else {
        let mut reader: Box<dyn AsyncBufRead + Unpin + Send> = match &args.file {
            Some(path) => Box::new(BufReader::new(
                tokio::fs::File::open(path)
                    .await
                    .map_err(|e| format!("cannot open {}: {e}", path.display()))?,
            )),
            None => Box::new(BufReader::new(tokio::io::stdin())),
        };
        let mut bytes = Vec::new();
        let mut number = 0u64;
        let mut skipped = Vec::new();
        loop {
            bytes.clear();
            let read = reader
                .read_until(b'\n', &mut bytes)
                .await
                .map_err(|e| format!("reading input: {e}"))?;
            if read == 0 {
                break;
            }
            number += 1;
            let line = match std::str::from_utf8(&bytes) {
                Ok(text) => Ok(text.trim_end_matches('\n').trim_end_matches('\r')),
                Err(_) => Err(format!(
                    "line {number}: not UTF-8 text (binary input?): write payloads as base64 or hex, \
                     one per line, and pass --payload-encoding base64 or hex"
                )),
            };
            if line.as_ref().is_ok_and(|l| l.trim().is_empty()) {
                continue;
            }
            match line.and_then(|line| parse_line(line, number, args)) {
                Ok(message) => batch.push(with_headers(message, args)),
                Err(bad) if args.skip_bad_lines => {
                    eprintln!("skipping {bad}");
                    skipped.push(number);
                }
                Err(bad) => {
                    // Everything before the bad line goes out first, so "published N" is exact.
                    if !batch.is_empty() {
                        published += flush(&mut batch)
                            .await
                            .map_err(|e| published_before(published, &e))?;
                    }
                    return Err(format!(
                        "{bad}; the {published} message(s) before it were published to {topic} \
                         (--skip-bad-lines skips such lines instead)"
                    )
                    .into());
                }
            }
            if batch.len() == BATCH {
                published += flush(&mut batch)
                    .await
                    .map_err(|e| published_before(published, &e))?;
            }
        }
        if !skipped.is_empty() {
            eprintln!("skipped {} bad line(s): {}", skipped.len(), list(&skipped));
        }
    }
    if !batch.is_empty() {
        published += flush(&mut batch)
            .await
            .map_err(|e| published_before(published, &e))?;
    }
    if connection.endpoint().scheme == "memory" {
        // Said, not refused: memory:// is where `produce`'s input parsing is tried safely.
        eprintln!(
            "published {published} messages to {topic} on memory://, inside this process only: \
             they are gone now that it exits (name a broker with --url to keep them)"
        );
    } else {
        eprintln!("published {published} messages to {topic}");
    }
    Ok(ExitCode::SUCCESS)
}

/// A failed publish, saying how many messages went out before it.
fn published_before(published: u64, error: &str) -> String {
    format!("{error} (the {published} message(s) before this batch were published)")
}

/// Line numbers, the first twenty of them.
fn list(numbers: &[u64]) -> String {
    let shown: Vec<String> = numbers.iter().take(20).map(u64::to_string).collect();
    match numbers.len() > 20 {
        true => format!("{}, …", shown.join(", ")),
        false => shown.join(", "),
    }
}

fn with_headers(mut message: OutgoingMessage, args: &ProduceArgs) -> OutgoingMessage {
    for (name, value) in &args.headers {
        message.headers.insert(name.clone(), value.clone());
    }
    message
}

/// One input line as a message, or an error naming the line.
fn parse_line(line: &str, number: u64, args: &ProduceArgs) -> Result<OutgoingMessage, String> {
    let decode = |payload: &str| {
        decode_payload(payload, args.payload_encoding).map_err(|why| format!("line {number}: {why}"))
    };
    if args.keyless {
        return Ok(OutgoingMessage::keyless(decode(line)?));
    }
    match line.split_once(args.separator.as_str()) {
        Some(("", _)) => Err(format!(
            "line {number}: empty key (convoy treats an empty key as no key: publish keyless \
             messages with --keyless)"
        )),
        Some((key, payload)) => Ok(OutgoingMessage::new(key.to_owned(), decode(payload)?)),
        None => Err(format!(
            "line {number}: expected KEY{}PAYLOAD (use --separator to change it, or --keyless)",
            args.separator.escape_default()
        )),
    }
}

/// A payload as written on a line: the text itself, or bytes in base64 or hex.
fn decode_payload(text: &str, encoding: PayloadEncoding) -> Result<Vec<u8>, String> {
    match encoding {
        PayloadEncoding::Text => Ok(text.as_bytes().to_vec()),
        PayloadEncoding::Base64 => {
            let trimmed = text.trim();
            base64::engine::general_purpose::STANDARD
                .decode(trimmed)
                .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(trimmed))
                .map_err(|e| format!("the payload is not base64 ({e})"))
        }
        PayloadEncoding::Hex => {
            let digits = text.trim().as_bytes();
            if !digits.len().is_multiple_of(2) {
                return Err("the payload is not hex (an odd number of digits)".into());
            }
            digits
                .chunks(2)
                .map(|pair| {
                    std::str::from_utf8(pair)
                        .ok()
                        .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                        .ok_or_else(|| {
                            format!(
                                "the payload is not hex ({:?} is no byte)",
                                String::from_utf8_lossy(pair)
                            )
                        })
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_decode_from_text_base64_and_hex() {
        assert_eq!(
            decode_payload("héllo", PayloadEncoding::Text).unwrap(),
            "héllo".as_bytes()
        );
        assert_eq!(
            decode_payload("AAH/", PayloadEncoding::Base64).unwrap(),
            [0, 1, 255]
        );
        assert_eq!(
            decode_payload("AAE", PayloadEncoding::Base64).unwrap(),
            [0, 1],
            "unpadded"
        );
        assert_eq!(
            decode_payload("0001ff", PayloadEncoding::Hex).unwrap(),
            [0, 1, 255]
        );
        assert!(decode_payload("0g", PayloadEncoding::Hex)
            .unwrap_err()
            .contains("not hex"));
        assert!(decode_payload("abc", PayloadEncoding::Hex)
            .unwrap_err()
            .contains("odd"));
        assert!(decode_payload("@@", PayloadEncoding::Base64)
            .unwrap_err()
            .contains("not base64"));
    }
}
