//! Standard output that its reader may close: `convoy topic list | head -1`, or `convoy consume
//! | less` and then `q`. A closed stdout is not a failure of the command (and never a panic, as
//! `println!` makes it): a listing ends early with exit status 0, an action (a replay) goes on
//! and only its report is cut, and `consume` stops, committing only what it printed.

use std::fmt;
use std::io::Write;

/// Standard output was closed by its reader (or cannot be written any more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StdoutClosed;

/// Writes `args` to stdout, flushed (a line a reader sees at once, and a closed pipe noticed at
/// the line that could not be written, not at exit).
pub fn write(args: fmt::Arguments<'_>) -> Result<(), StdoutClosed> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(args)
        .and_then(|()| stdout.flush())
        .map_err(|_| StdoutClosed)
}

/// Writes one line to stdout: `Err(StdoutClosed)` once its reader has gone.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes to stdout without a newline: `Err(StdoutClosed)` once its reader has gone.
macro_rules! out_part {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}

pub(crate) use {out, out_part};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_to_stdout_is_written() {
        // The test harness captures stdout; the write goes through and reports no closure.
        assert_eq!(write(format_args!("out works\n")), Ok(()));
    }
}
