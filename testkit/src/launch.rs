//! Waiting for a spawned server to become ready, and retrying start-up.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::process::ServerProcess;

/// How many times a server is started (on fresh ports each time) before giving up.
const ATTEMPTS: usize = 3;

/// Polls `ready` every 50 ms until it returns true. Fails early if the process exits,
/// or after `timeout`; the error includes the tail of `log`.
pub(crate) fn wait_ready(
    process: &ServerProcess,
    log: &Path,
    what: &str,
    timeout: Duration,
    mut ready: impl FnMut() -> bool,
) -> Result<(), String> {
    let started = Instant::now();
    loop {
        if let Some(status) = process.exit_status() {
            return Err(format!(
                "{what} exited during start-up ({status}); {}",
                log_tail(log)
            ));
        }
        if ready() {
            return Ok(());
        }
        if started.elapsed() >= timeout {
            return Err(format!(
                "{what} not ready after {timeout:?}; {}",
                log_tail(log)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Calls `attempt` up to [`ATTEMPTS`] times until it succeeds; panics with the last
/// error (which carries the server's log tail) if none does.
pub(crate) fn with_retries<T>(what: &str, mut attempt: impl FnMut() -> Result<T, String>) -> T {
    let mut last = String::new();
    for _ in 0..ATTEMPTS {
        match attempt() {
            Ok(value) => return value,
            Err(e) => last = e,
        }
    }
    panic!("fencelock-testkit: could not start {what} ({ATTEMPTS} attempts); last failure: {last}")
}

/// The last lines of a server log, labelled with its path, for panic messages.
pub(crate) fn log_tail(log: &Path) -> String {
    const LINES: usize = 40;
    const MAX_CHARS: usize = 6000;
    match std::fs::read(log) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            let mut tail = lines[lines.len().saturating_sub(LINES)..].join("\n");
            if tail.len() > MAX_CHARS {
                let mut cut = tail.len() - MAX_CHARS;
                while !tail.is_char_boundary(cut) {
                    cut += 1;
                }
                tail = tail[cut..].to_string();
            }
            format!("last lines of {}:\n{tail}", log.display())
        }
        Err(e) => format!("cannot read log {}: {e}", log.display()),
    }
}
