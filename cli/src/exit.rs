//! Exit codes and the one-line error every failure ends in.

use std::fmt;

use fencelock::Error;

/// The command's own exit status is passed through; these are fencelock's own outcomes.
pub mod code {
    /// Success (`inspect`, `bench`), or the command's own status 0 (`run`).
    pub const OK: u8 = 0;
    /// Bad usage: unknown option, bad duration, bad URL, unknown scheme, invalid lock
    /// name or lease.
    pub const USAGE: u8 = 64;
    /// The lock backend is unreachable or failed.
    pub const UNAVAILABLE: u8 = 69;
    /// A bug in fencelock.
    pub const INTERNAL: u8 = 70;
    /// Standard output could not be written (a closed pipe, a full disk).
    pub const IO_ERROR: u8 = 74;
    /// The lock was not acquired within `--wait` (someone else holds it).
    pub const NOT_ACQUIRED: u8 = 75;
    /// The lock was lost while the command ran: the command was stopped (SIGTERM, then
    /// SIGKILL after `--kill-grace`), or the loss was found at release.
    pub const LOST: u8 = 76;
    /// The command was found but could not be executed.
    pub const CANNOT_EXECUTE: u8 = 126;
    /// The command was not found.
    pub const NOT_FOUND: u8 = 127;
}

/// A failure of the CLI: an exit code and a one-line message.
#[derive(Debug)]
pub struct Failure {
    /// The process exit code.
    pub code: u8,
    /// The message, without the `fencelock: ` prefix.
    pub message: String,
}

impl Failure {
    /// A failure with this code and message.
    pub fn new(code: u8, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// A usage error.
    pub fn usage(message: impl Into<String>) -> Self {
        Failure::new(code::USAGE, message)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Writes `text` to standard output and flushes it. A reader that went away (`| head`)
/// or a full disk is a [`Failure`] with [`code::IO_ERROR`], not a panic (which
/// `print!` would be, since Rust ignores `SIGPIPE`).
///
/// # Errors
///
/// The write's error, as said.
pub fn print_out(text: &str) -> Result<(), Failure> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| {
            Failure::new(
                code::IO_ERROR,
                format!("cannot write to standard output: {e}"),
            )
        })
}

/// [`print_out`] with a newline after `text`.
///
/// # Errors
///
/// As [`print_out`].
pub fn println_out(text: &str) -> Result<(), Failure> {
    print_out(&format!("{text}\n"))
}

/// The exit code for a library error.
pub fn code_of(error: &Error) -> u8 {
    match error {
        Error::InvalidName { .. }
        | Error::InvalidConfig(_)
        | Error::InvalidUrl { .. }
        | Error::UnknownScheme { .. }
        | Error::BackendNotCompiled { .. }
        | Error::RequirementNotMet { .. } => code::USAGE,
        Error::Timeout { .. } | Error::Contended { .. } | Error::TooManyWaiters { .. } => {
            code::NOT_ACQUIRED
        }
        Error::Lost { .. } | Error::Unavailable { .. } | Error::Backend { .. } => code::UNAVAILABLE,
        _ => code::INTERNAL,
    }
}

/// The error and its sources on one line: `a: b: c`.
pub fn one_line(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line.replace('\n', " ")
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure::new(code_of(&error), one_line(&error))
    }
}

/// `eprintln!` that ignores a standard error that cannot be written (a closed pipe:
/// `fencelock run -v ... 2>&1 | head -1`), where `eprintln!` panics. A message that
/// cannot be shown must not turn a documented exit code into a panic's 101, nor unwind
/// through a held guard.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}
pub(crate) use say;

/// [`say!`] without the newline.
macro_rules! say_more {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut stderr = std::io::stderr().lock();
        let _ = write!(stderr, $($arg)*);
        let _ = stderr.flush();
    }};
}
pub(crate) use say_more;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn codes_by_kind() {
        let timeout = Error::Timeout {
            name: "a".into(),
            waited: Duration::from_secs(1),
        };
        assert_eq!(code_of(&timeout), code::NOT_ACQUIRED);
        assert_eq!(code_of(&Error::InvalidConfig("x".into())), code::USAGE);
        let down = Error::unavailable("etcd", std::io::Error::other("connection refused"));
        assert_eq!(code_of(&down), code::UNAVAILABLE);
        let failure = Failure::from(down);
        assert_eq!(
            failure.message,
            "lock backend etcd is unavailable: connection refused"
        );
    }
}
