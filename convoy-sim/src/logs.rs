//! The engine's own log lines (tracing, at DEBUG) written into a kept trace between the
//! simulator's events, stamped with virtual time: what a reader of a failing seed needs to see
//! why the engine did what it did. They are not part of the trace's hash.

use std::io::Write;

use tokio::time::Instant;
use tracing_subscriber::fmt::MakeWriter;

use crate::trace::{Lines, Trace};

/// Writes each formatted log line into the trace's lines.
#[derive(Clone)]
pub struct LogWriter {
    lines: Lines,
    start: Instant,
}

/// One line being written.
pub struct LineWriter {
    lines: Lines,
    start: Instant,
    buffer: Vec<u8>,
}

impl Write for LineWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.buffer);
        let text = text.trim_end();
        if !text.is_empty() {
            let line = format!("{}     | {text}", Trace::stamp(self.start));
            self.lines.lock().unwrap_or_else(|p| p.into_inner()).push(line);
        }
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        LineWriter {
            lines: self.lines.clone(),
            start: self.start,
            buffer: Vec::new(),
        }
    }
}

/// Sends this thread's log lines (DEBUG and above, convoy's; `CONVOY_SIM_LOG` sets another
/// filter, e.g. `convoy_core=trace`) into `trace` until the guard drops.
pub fn capture(trace: &Trace) -> tracing::subscriber::DefaultGuard {
    let writer = LogWriter {
        lines: trace.lines_handle(),
        start: trace.start(),
    };
    let subscriber = tracing_subscriber::fmt()
        .with_writer(writer)
        .without_time()
        .with_ansi(false)
        .with_target(false)
        .with_env_filter(
            std::env::var("CONVOY_SIM_LOG")
                .unwrap_or_else(|_| "convoy_core=debug,convoy_memory=debug".to_owned()),
        )
        .finish();
    tracing::subscriber::set_default(subscriber)
}
