//! What `run` and `hold` say about the lock, on stderr: nothing (`--quiet`), warnings
//! only (the default), also acquisitions and releases (`--verbose`), or every event as
//! a JSON line (`--json`).

use std::io::Write;

use fencelock::LockGuard;
use serde_json::{Value, json};

use crate::args::OutputArgs;

/// Where lock events go.
#[derive(Debug, Clone, Copy)]
pub struct Events {
    quiet: bool,
    verbose: bool,
    json: bool,
}

impl Events {
    /// As the command line says.
    pub fn new(args: &OutputArgs) -> Self {
        Events {
            quiet: args.quiet,
            verbose: args.verbose,
            json: args.json,
        }
    }

    /// Whether events are JSON lines.
    pub fn is_json(&self) -> bool {
        self.json
    }

    fn emit(&self, event: Value) {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "{event}");
    }

    /// The lock was acquired.
    pub fn acquired(&self, guard: &LockGuard) {
        if self.json {
            self.emit(json!({
                "event": "acquired",
                "name": guard.name(),
                "backend": guard.backend(),
                "key": guard.backend_key(),
                "token": guard.token().get(),
            }));
        } else if self.verbose {
            crate::exit::say!(
                "fencelock: acquired {:?} on {} (token {}, key {})",
                guard.name(),
                guard.backend(),
                guard.token(),
                guard.backend_key().unwrap_or("-")
            );
        }
    }

    /// The lock was released.
    pub fn released(&self, name: &str) {
        if self.json {
            self.emit(json!({ "event": "released", "name": name }));
        } else if self.verbose {
            crate::exit::say!("fencelock: released {name:?}");
        }
    }

    /// The lock was lost (the failure line follows in text mode).
    pub fn lost(&self, guard: &LockGuard) {
        if self.json {
            self.emit(json!({
                "event": "lost",
                "name": guard.name(),
                "token": guard.token().get(),
                "cause": guard.lost_cause().map_or("other", |c| c.as_str()),
                "reason": guard.lost_reason(),
            }));
        }
    }

    /// The release found the lock already lost (the failure line follows in text
    /// mode): the guard is gone, so its name and token are given, and the cause is
    /// `other` with the backend's `reason`.
    pub fn lost_at_release(&self, name: &str, token: fencelock::FencingToken, reason: &str) {
        if self.json {
            self.emit(json!({
                "event": "lost",
                "name": name,
                "token": token.get(),
                "cause": "other",
                "reason": reason,
            }));
        }
    }

    /// The lock was not acquired (the failure line follows in text mode).
    pub fn not_acquired(&self, name: &str, reason: &str) {
        if self.json {
            self.emit(json!({ "event": "not_acquired", "name": name, "reason": reason }));
        }
    }

    /// A warning: shown unless `--quiet` (as a JSON event with `--json`).
    pub fn warn(&self, message: &str) {
        if self.json {
            self.emit(json!({ "event": "warning", "message": message }));
        } else if !self.quiet {
            crate::exit::say!("fencelock: warning: {message}");
        }
    }
}
