//! How a command ends: an exit status, or one line for the user.

use std::process::ExitCode;

use crate::out;

/// How a command ended.
pub type CliResult = Result<ExitCode, CliError>;

/// Why a command ended early.
#[derive(Debug)]
pub enum CliError {
    /// A failure: one line for the user, exit status 1.
    Failed(String),
    /// Its reader closed stdout (`| head`): nothing more to show, exit status 0.
    StdoutClosed,
}

impl From<String> for CliError {
    fn from(message: String) -> Self {
        CliError::Failed(message)
    }
}

impl From<&str> for CliError {
    fn from(message: &str) -> Self {
        CliError::Failed(message.to_owned())
    }
}

impl From<out::StdoutClosed> for CliError {
    fn from(_: out::StdoutClosed) -> Self {
        CliError::StdoutClosed
    }
}
