//! What an engine's read-back of parked keys costs on a dead-letter destination with a long
//! history: a few parked keys among a million dead letters, written in stretches with the
//! read-backs an engine makes (one per `checkpoint_after` records it writes), then a fresh
//! engine's assignment — against the baseline of reading the whole destination, as every
//! assignment did before checkpoints.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use convoy_core::parking::ParkedKeys;
use convoy_core::{DeadLetter, DeadLetterCause, DeadLetterSink, Message, TransportError};

/// The history to write.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Dead letters written in all (the parked keys' records included).
    pub dead_letters: usize,
    /// Keys parked among them.
    pub parked_keys: usize,
    /// Records a read-back reads past its checkpoint before it saves a new one.
    pub checkpoint_after: usize,
}

/// What the assignment's read-back cost, beside a whole read.
#[derive(Debug)]
pub struct Report {
    /// Dead letters the destination holds.
    pub written: usize,
    /// Time to write them (with the read-backs made meanwhile).
    pub write_time: Duration,
    /// The assignment's read-back: records read past the checkpoint, and its time.
    pub records_read: usize,
    /// How long it took.
    pub read_time: Duration,
    /// Bytes held by what it read: the checkpoint plus the records after it.
    pub held_bytes: usize,
    /// Keys it found parked.
    pub parked: usize,
    /// The baseline: a whole read of the destination (records, time, bytes).
    pub whole_records: usize,
    /// How long the whole read took.
    pub whole_time: Duration,
    /// Bytes the whole read held.
    pub whole_bytes: usize,
    /// Keys the whole read found parked (must equal `parked`).
    pub whole_parked: usize,
    /// Why the whole read failed, if it did.
    pub whole_error: Option<String>,
}

/// A dead letter of `group` for `key`: one that parks its key, or a plain terminal one.
fn record(group: &str, key: &str, id: &str, parks: bool) -> DeadLetter {
    let payload = Bytes::from(format!("{{\"entry\":\"{id}\",\"cents\":-500}}"));
    crate::parking::dead_letter(group, key, id, DeadLetterCause::Terminal, parks, payload)
}

/// What one dead letter written here weighs as read back (key, payload, headers).
fn record_bytes(group: &str) -> usize {
    let out = record(group, "k49999", "d999999", false).to_outgoing();
    let headers: usize = out.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    out.key.map_or(0, |k| k.len()) + out.payload.len() + headers
}

fn held(records: &[Message]) -> usize {
    records.iter().map(Message::weight).sum()
}

/// Writes the history through `sink` (a stretch's dead letters published concurrently, as an
/// engine's lanes do), reading back as an engine would, then measures a fresh assignment's
/// read-back and a whole read.
pub async fn measure(
    sink: Arc<dyn DeadLetterSink>,
    group: &str,
    shape: &Shape,
) -> Result<Report, TransportError> {
    let started = Instant::now();
    let mut written = 0;
    for k in 0..shape.parked_keys {
        sink.publish(&record(group, &format!("parked-{k}"), &format!("p{k}"), true))
            .await?;
        written += 1;
    }
    let stretch = shape.checkpoint_after.max(1);
    while written < shape.dead_letters {
        let n = stretch.min(shape.dead_letters - written);
        let batch: Vec<DeadLetter> = (written..written + n)
            .map(|i| record(group, &format!("k{}", i % 50_000), &format!("d{i}"), false))
            .collect();
        for result in futures_util::future::join_all(batch.iter().map(|d| sink.publish(d))).await {
            result?;
        }
        written += n;
        if written < shape.dead_letters {
            // What an engine that wrote `checkpoint_after` records does on its next tick.
            ParkedKeys::catch_up(group, &*sink, shape.checkpoint_after).await?;
        }
    }
    let write_time = started.elapsed();

    let started = Instant::now();
    let caught_up = ParkedKeys::catch_up(group, &*sink, shape.checkpoint_after).await?;
    let read_time = started.elapsed();
    let checkpoint = convoy_core::parking::checkpoint_bytes(group, &*sink).await?;

    let started = Instant::now();
    // The baseline may fail where the checkpoint does not (RabbitMQ's whole read has a time
    // limit): said in the report, not an error of the bench.
    let (whole, whole_error) = match sink.read_back().await {
        Ok(whole) => (whole, None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    let whole_time = started.elapsed();
    let whole_parked = ParkedKeys::read(group, &whole).len();
    Ok(Report {
        written,
        write_time,
        records_read: caught_up.read,
        read_time,
        // The checkpoint, and the records read past it (each the size of one written here).
        held_bytes: checkpoint + caught_up.read * record_bytes(group),
        parked: caught_up.keys.len(),
        whole_records: whole.len(),
        whole_time,
        whole_bytes: held(&whole),
        whole_parked,
        whole_error,
    })
}

impl Report {
    /// The report as the benchmark prints it.
    pub fn print(&self, broker: &str, shape: &Shape) {
        let mb = |b: usize| b as f64 / 1_000_000.0;
        println!(
            "{broker}: {} dead letters ({} parked keys) written in {:.1} s, a read-back per {} written",
            self.written,
            shape.parked_keys,
            self.write_time.as_secs_f64(),
            shape.checkpoint_after
        );
        println!(
            "  assignment, from the checkpoint: {} records read in {:.3} s, {:.3} MB held, {} keys parked",
            self.records_read,
            self.read_time.as_secs_f64(),
            mb(self.held_bytes),
            self.parked
        );
        if let Some(e) = &self.whole_error {
            println!(
                "  baseline, the whole destination: FAILED after {:.1} s: {e}",
                self.whole_time.as_secs_f64()
            );
            return;
        }
        println!(
            "  baseline, the whole destination: {} records read in {:.3} s, {:.1} MB held, {} keys parked",
            self.whole_records,
            self.whole_time.as_secs_f64(),
            mb(self.whole_bytes),
            self.whole_parked
        );
        println!(
            "  ratio: {:.4} of the records, {:.4} of the time",
            self.records_read as f64 / self.whole_records.max(1) as f64,
            self.read_time.as_secs_f64() / self.whole_time.as_secs_f64().max(1e-9)
        );
    }

    /// True when the read-back is within the bound (at most `max_records` records and
    /// `max_bytes` held) and found what a whole read finds.
    pub fn within(&self, max_records: usize, max_bytes: usize) -> bool {
        self.records_read <= max_records
            && self.held_bytes <= max_bytes
            && (self.whole_error.is_some() || self.parked == self.whole_parked)
    }
}

/// The bench's body for one broker: measures, prints, and fails unless an assignment read at
/// most 10,000 records and held at most 10 MB, and found what a whole read finds.
pub async fn run(
    broker: &str,
    sink: Arc<dyn DeadLetterSink>,
    group: &str,
    shape: &Shape,
) -> std::process::ExitCode {
    match measure(sink, group, shape).await {
        Ok(report) => {
            report.print(broker, shape);
            match report.within(10_000, 10_000_000) {
                true => std::process::ExitCode::SUCCESS,
                false => {
                    println!(
                        "  FAILED: an assignment must read at most 10,000 records and hold at most 10 MB"
                    );
                    std::process::ExitCode::FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("readback bench on {broker}: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
