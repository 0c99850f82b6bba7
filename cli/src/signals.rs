//! The signals `run` forwards to its command: SIGINT, SIGTERM, SIGHUP.

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};

use crate::exit::Failure;

/// Listeners for the forwarded signals. While they exist, these signals no longer end
/// fencelock by default: they are delivered here instead.
pub struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
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
        })
    }

    /// The next signal received.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a signal not yet returned stays pending.
    ///
    /// # Errors
    ///
    /// None: it waits until a signal arrives.
    pub async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.interrupt.recv() => Signal::SIGINT,
            _ = self.terminate.recv() => Signal::SIGTERM,
            _ = self.hangup.recv() => Signal::SIGHUP,
        }
    }
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
