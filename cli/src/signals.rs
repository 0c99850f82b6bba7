//! The signals `run` forwards to its command (SIGINT, SIGTERM, SIGHUP), and the terminal
//! stop (SIGTSTP), which `run` passes on to the command before stopping itself.

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};

use crate::exit::Failure;

/// Listeners for the forwarded signals. While they exist, these signals no longer end
/// fencelock by default: they are delivered here instead.
pub struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
    suspend: tokio::signal::unix::Signal,
}

impl Signals {
    /// Starts listening.
    ///
    /// # Errors
    ///
    /// When the signal handlers cannot be installed.
    pub fn listen() -> Result<Self, Failure> {
        let install = |kind| {
            signal(kind).map_err(|e| Failure::new(crate::exit::code::INTERNAL, e.to_string()))
        };
        Ok(Signals {
            interrupt: install(SignalKind::interrupt())?,
            terminate: install(SignalKind::terminate())?,
            hangup: install(SignalKind::hangup())?,
            suspend: install(SignalKind::from_raw(Signal::SIGTSTP as i32))?,
        })
    }

    /// The next signal to act on, while there is no command yet (connecting, waiting for
    /// the lock). A terminal stop (Ctrl-Z) meanwhile stops fencelock at once, as it would
    /// without the listeners, and it waits on once continued: it is not left pending to
    /// stop everything right after the lock is granted.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a signal not yet returned stays pending.
    ///
    /// # Errors
    ///
    /// None: it waits until a signal arrives.
    pub async fn recv(&mut self) -> Signal {
        loop {
            tokio::select! {
                _ = self.interrupt.recv() => return Signal::SIGINT,
                _ = self.terminate.recv() => return Signal::SIGTERM,
                _ = self.hangup.recv() => return Signal::SIGHUP,
                _ = self.suspend.recv() => stop_self(),
            }
        }
    }
}

/// A signal for `run` and `hold` to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// SIGINT, SIGTERM or SIGHUP: forward it, or end.
    Forward(Signal),
    /// SIGTSTP (Ctrl-Z), which no longer stops fencelock by itself while the listeners
    /// exist: see [`stop_self`].
    Suspend,
}

impl Signals {
    /// The next signal of either kind.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a signal not yet returned stays pending.
    ///
    /// # Errors
    ///
    /// None: it waits until a signal arrives.
    pub async fn next(&mut self) -> Received {
        tokio::select! {
            _ = self.interrupt.recv() => Received::Forward(Signal::SIGINT),
            _ = self.terminate.recv() => Received::Forward(Signal::SIGTERM),
            _ = self.hangup.recv() => Received::Forward(Signal::SIGHUP),
            _ = self.suspend.recv() => Received::Suspend,
        }
    }
}

/// Stops fencelock (SIGSTOP to itself), as SIGTSTP would have; returns once it is
/// continued (SIGCONT).
pub fn stop_self() {
    let _ = nix::sys::signal::raise(Signal::SIGSTOP);
}

/// The shell's exit status for a process ended by `signal`: 128 + its number.
pub fn exit_code(signal: Signal) -> u8 {
    128u8.saturating_add(signal as i32 as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_convention() {
        assert_eq!(exit_code(Signal::SIGINT), 130);
        assert_eq!(exit_code(Signal::SIGTERM), 143);
        assert_eq!(exit_code(Signal::SIGKILL), 137);
    }
}
