//! `fencelock run`: a command under a lock.

use std::io::ErrorKind;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error, LockGuard, Retry, RetryPolicy, Wait};
use nix::sys::signal::Signal;
use tokio::process::{Child, Command};

use crate::args::RunArgs;
use crate::exit::{Failure, code, one_line};
use crate::signals::{self, Signals};

/// How long the release of a lost lock may take before fencelock gives up on it (the
/// backend frees it with its lease anyway).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(5);

/// See [`settle`].
const SETTLE_TIMEOUT: Duration = Duration::from_secs(2);

/// How the command ended.
enum Outcome {
    /// It exited by itself (or after a forwarded signal).
    Exited(ExitStatus),
    /// The lock was lost; the command was stopped.
    Lost { reason: String, killed: bool },
}

/// Runs `args.command` under the lock and returns the exit code.
///
/// # Errors
///
/// A [`Failure`] with the documented exit code when the lock cannot be taken, the
/// command cannot be started, or the lock is lost.
///
/// # Cancel safety
///
/// Not meant to be cancelled: it owns the child process; the binary's signal handling
/// stops the child and releases the lock instead.
pub async fn run(args: RunArgs) -> Result<u8, Failure> {
    let mut signals = Signals::listen()?;
    let url = args.url.resolve();
    let locks = tokio::select! {
        locks = fencelock::connect(&url) => locks?,
        signal = signals.recv() => return Ok(signals::exit_code(signal)),
    };
    let locks: Arc<dyn DistributedLock> = Arc::new(Retry::new(locks, RetryPolicy::default()));
    let options = options(&args);
    let tasks_before = alive_tasks();
    let acquired = tokio::select! {
        guard = locks.acquire(&args.name, options) => guard.map_err(not_acquired),
        signal = signals.recv() => Err(Failure::new(signals::exit_code(signal), format!("interrupted by {signal} while waiting for the lock"))),
    };
    let guard = match acquired {
        Ok(guard) => guard,
        Err(failure) => {
            settle(tasks_before).await;
            return Err(failure);
        }
    };
    let mut child = match spawn(&args, &guard) {
        Ok(child) => child,
        Err(failure) => {
            let _ = tokio::time::timeout(CLEANUP_TIMEOUT, guard.release()).await;
            return Err(failure);
        }
    };
    match supervise(&mut child, &guard, &mut signals, args.kill_grace).await? {
        Outcome::Exited(status) => finish(guard, status).await,
        Outcome::Lost { reason, killed } => {
            let _ = tokio::time::timeout(CLEANUP_TIMEOUT, guard.release()).await;
            let how = if killed {
                format!(
                    "killed the command (SIGKILL after {:?} grace)",
                    args.kill_grace
                )
            } else {
                "stopped the command (SIGTERM)".to_owned()
            };
            Err(Failure::new(
                code::LOST,
                format!("lock {:?} was lost: {reason}; {how}", args.name),
            ))
        }
    }
}

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Gives the backend's background clean-up of a failed or interrupted acquire (deleting
/// this client's waiting key or node) a moment to finish before the process exits:
/// otherwise the key stays until its lease or session expires, and blocks the name
/// for others until then. Waits until the tasks started since `before` are done, at most
/// [`SETTLE_TIMEOUT`].
async fn settle(before: usize) {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    while alive_tasks() > before && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn options(args: &RunArgs) -> AcquireOptions {
    let wait = match args.wait {
        None => Wait::Forever,
        Some(wait) if wait.is_zero() => Wait::NoWait,
        Some(wait) => Wait::Timeout(wait),
    };
    let options = AcquireOptions::new().wait(wait);
    match args.fixed_lease {
        Some(fixed) => options.fixed_lease(fixed),
        None => options.lease(args.lease),
    }
}

fn not_acquired(error: Error) -> Failure {
    match error {
        Error::Timeout { name, waited } => Failure::new(
            code::NOT_ACQUIRED,
            format!("lock {name:?} was not acquired within {waited:?}: another owner holds it"),
        ),
        other => other.into(),
    }
}

fn spawn(args: &RunArgs, guard: &LockGuard) -> Result<Child, Failure> {
    let Some((program, rest)) = args.command.split_first() else {
        return Err(Failure::usage("no command given after --"));
    };
    let mut command = Command::new(program);
    command
        .args(rest)
        .env("FENCELOCK_TOKEN", guard.token().get().to_string())
        .env("FENCELOCK_NAME", guard.name())
        .env("FENCELOCK_BACKEND", guard.backend())
        .kill_on_drop(true);
    if let Some(key) = guard.backend_key() {
        command.env("FENCELOCK_KEY", key);
    }
    command.spawn().map_err(|e| {
        let program = program.to_string_lossy();
        match e.kind() {
            ErrorKind::NotFound => {
                Failure::new(code::NOT_FOUND, format!("command not found: {program}"))
            }
            _ => Failure::new(
                code::CANNOT_EXECUTE,
                format!("cannot execute {program}: {}", one_line(&e)),
            ),
        }
    })
}

/// Waits for the command, forwarding signals, and stops it if the lock is lost.
async fn supervise(
    child: &mut Child,
    guard: &LockGuard,
    signals: &mut Signals,
    grace: Duration,
) -> Result<Outcome, Failure> {
    let internal = |e: std::io::Error| Failure::new(code::INTERNAL, one_line(&e));
    loop {
        tokio::select! {
            status = child.wait() => return Ok(Outcome::Exited(status.map_err(internal)?)),
            _ = guard.lost() => {
                let reason = guard.lost_reason().unwrap_or("lost").to_owned();
                let killed = stop(child, grace).await.map_err(internal)?;
                return Ok(Outcome::Lost { reason, killed });
            }
            signal = signals.recv() => signals::send(child.id(), signal),
        }
    }
}

/// SIGTERM, then SIGKILL after `grace`. Returns whether SIGKILL was needed.
async fn stop(child: &mut Child, grace: Duration) -> std::io::Result<bool> {
    signals::send(child.id(), Signal::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_ok() {
        return Ok(false);
    }
    child.kill().await?;
    Ok(true)
}

/// Releases after the command exited and picks the exit code.
async fn finish(guard: LockGuard, status: ExitStatus) -> Result<u8, Failure> {
    let name = guard.name().to_owned();
    match guard.release().await {
        Ok(()) => Ok(status_code(status)),
        Err(Error::Lost { reason, .. }) => Err(Failure::new(
            code::LOST,
            format!("lock {name:?} was lost before the command finished: {reason}"),
        )),
        Err(error) => {
            eprintln!(
                "fencelock: warning: releasing lock {name:?} failed ({}); it expires with its lease",
                one_line(&error)
            );
            Ok(status_code(status))
        }
    }
}

/// The command's exit code, or 128 + the signal that ended it.
fn status_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(signal)) => 128u8.saturating_add(u8::try_from(signal).unwrap_or(0)),
        (None, None) => code::INTERNAL,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_follow_the_shell() {
        assert_eq!(status_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(status_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(status_code(ExitStatus::from_raw(15)), 143);
        assert_eq!(status_code(ExitStatus::from_raw(9)), 137);
    }
}
