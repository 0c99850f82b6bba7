//! `fencelock run`: a command under a lock.

use std::io::{ErrorKind, IsTerminal};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error, LockGuard, Permits, Wait};
use nix::sys::signal::Signal;
use tokio::process::Child;

use crate::args::{RunArgs, WaitArgs};
use crate::child;
use crate::events::Events;
use crate::exit::{Failure, code, code_of, one_line};
use crate::signals::{self, Received, Signals};

/// How long the release of a lost lock may take before fencelock gives up on it (the
/// backend frees it with its lease anyway).
pub const CLEANUP_TIMEOUT: Duration = Duration::from_secs(5);

/// See [`settle`].
const SETTLE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the command's process group is looked at after its own process exited
/// while others of the group still run (a group cannot be waited for).
const GROUP_POLL: Duration = Duration::from_millis(50);

/// How the command ended.
enum Outcome {
    /// It exited by itself (or after a forwarded signal).
    Exited(ExitStatus),
    /// The lock was lost; the command was stopped.
    Lost { reason: String, killed: bool },
}

/// What the command runs holding: `run`'s lock or semaphore permits, `elect`'s
/// leadership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// The lock NAME.
    Lock,
    /// Permits of semaphore NAME (`run --permits N/LIMIT`).
    Permits(Permits),
    /// Leadership of election NAME, campaigning with this value (`elect`).
    Leader(String),
}

impl Grant {
    /// Takes it on `locks`, as `options` say.
    ///
    /// # Errors
    ///
    /// The library's: as [`DistributedLock::acquire`], `acquire_permits` or `campaign`.
    ///
    /// # Cancel safety
    ///
    /// As the library's: a dropped request leaves nothing behind.
    pub async fn take(
        &self,
        locks: &dyn DistributedLock,
        name: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        match self {
            Grant::Lock => locks.acquire(name, options).await,
            Grant::Permits(permits) => locks.acquire_permits(name, *permits, options).await,
            Grant::Leader(value) => locks.campaign(name, value, options).await,
        }
    }

    /// How messages name what is held: `lock "x"`, `semaphore "x" (1 of 3 permits)`,
    /// `leadership of "x"`.
    pub fn describe(&self, name: &str) -> String {
        match self {
            Grant::Lock => format!("lock {name:?}"),
            Grant::Permits(permits) => format!(
                "semaphore {name:?} ({} of {} permits)",
                permits.count(),
                permits.limit()
            ),
            Grant::Leader(_) => format!("leadership of {name:?}"),
        }
    }

    /// The variable the command gets besides `run`'s: `FENCELOCK_PERMITS=N/LIMIT` or
    /// `FENCELOCK_VALUE=VALUE`.
    pub fn env(&self) -> Option<(&'static str, String)> {
        match self {
            Grant::Lock => None,
            Grant::Permits(permits) => Some((
                "FENCELOCK_PERMITS",
                format!("{}/{}", permits.count(), permits.limit()),
            )),
            Grant::Leader(value) => Some(("FENCELOCK_VALUE", value.clone())),
        }
    }
}

/// Runs the command under the lock (or `--permits` of the semaphore) and returns the
/// exit code.
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
    let grant = args.permits.map_or(Grant::Lock, Grant::Permits);
    run_holding(args, grant).await
}

/// [`run`], holding `grant` (`elect` holds leadership).
///
/// # Errors
///
/// As [`run`].
///
/// # Cancel safety
///
/// As [`run`].
pub async fn run_holding(args: RunArgs, grant: Grant) -> Result<u8, Failure> {
    let events = Events::new(&args.output);
    let mut signals = Signals::listen()?;
    let (locks, guard) = match acquire(
        &args.url,
        &args.wait,
        &args.name,
        &grant,
        &events,
        &mut signals,
    )
    .await?
    {
        Acquired::Held(locks, guard) => (locks, guard),
        Acquired::Interrupted(code) => return Ok(code),
    };
    let what = grant.describe(&args.name);
    tracing::debug!(
        backend = guard.backend(),
        key = guard.backend_key(),
        token = guard.token().get(),
        "acquired {what}"
    );
    child::become_subreaper();
    let mut child = match spawn(&args, &guard, &grant) {
        Ok(child) => {
            tracing::debug!(pid = child.id(), "started the command");
            child
        }
        Err(failure) => {
            let _ = tokio::time::timeout(CLEANUP_TIMEOUT, guard.release()).await;
            return Err(failure);
        }
    };
    let grace = args.child.kill_grace.value;
    let outcome = supervise(&mut child, &guard, &mut signals, grace, &events).await?;
    drop(locks);
    match outcome {
        Outcome::Exited(status) => finish(guard, status, &what, &events).await,
        Outcome::Lost { reason, killed } => {
            events.lost(&guard);
            let _ = tokio::time::timeout(CLEANUP_TIMEOUT, guard.release()).await;
            let how = if killed {
                format!(
                    "killed the command (SIGKILL after {} grace)",
                    args.child.kill_grace
                )
            } else {
                "stopped the command (SIGTERM)".to_owned()
            };
            Err(Failure::new(
                code::LOST,
                format!("{what} was lost: {reason}; {how}"),
            ))
        }
    }
}

/// The result of [`acquire`].
pub enum Acquired {
    /// The lock, and the connection it lives on.
    Held(Arc<dyn DistributedLock>, LockGuard),
    /// A signal arrived first: exit with this code.
    Interrupted(u8),
}

/// Connects and acquires `name` as `wait` says, or stops at the first signal.
///
/// # Errors
///
/// A [`Failure`]: usage or connection errors, or not acquired (`--conflict-exit-code`,
/// default 75, with the wait as the user wrote it).
///
/// # Cancel safety
///
/// Not meant to be cancelled (a dropped acquire is cleaned up in the background, but
/// the process should then [`settle`]).
pub async fn acquire(
    url: &crate::args::UrlArg,
    wait: &WaitArgs,
    name: &str,
    grant: &Grant,
    events: &Events,
    signals: &mut Signals,
) -> Result<Acquired, Failure> {
    // Counted before connecting: the connection's own tasks end when it is dropped, and
    // what is then left is the clean-up of a failed acquire.
    let tasks_before = alive_tasks();
    // `--wait` bounds the whole command, connecting included (the connect timeout still
    // applies when it is shorter); what connecting used is taken off the acquire's wait.
    // `-n` / `--wait 0` do not wait for the lock, but connecting gets its connect timeout.
    let started = tokio::time::Instant::now();
    let limit = wait_limit(wait);
    let locks = tokio::select! {
        locks = crate::backend::connect_within(url, false, limit) => locks?,
        signal = signals.recv() => return Ok(Acquired::Interrupted(signals::exit_code(signal))),
    };
    let options = match limit {
        // At least a millisecond: a wait used up by connecting still makes one try (its
        // round trips are bounded by the backend's grace), reported as a timeout.
        Some((limit, _)) => options(wait).wait(Wait::Timeout(
            limit
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(1)),
        )),
        None => options(wait),
    };
    let acquired = tokio::select! {
        guard = grant.take(&*locks, name, options) => guard.map_err(|e| not_acquired(e, &grant.describe(name), wait)),
        signal = signals.recv() => Err(Failure::new(signals::exit_code(signal), format!("interrupted by {signal} while waiting for the lock"))),
    };
    match acquired {
        Ok(guard) => {
            events.acquired(&guard);
            Ok(Acquired::Held(locks, guard))
        }
        Err(failure) => {
            events.not_acquired(name, &failure.message);
            // The connection's own tasks (subscriptions, keepalives) end with it; what
            // is left is the clean-up of the failed acquire, which settle waits for.
            drop(locks);
            settle(tasks_before).await;
            Err(failure)
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
/// for others until then. Waits until the tasks started since `before` (counted before
/// connecting) are done, at most [`SETTLE_TIMEOUT`]. Call it after dropping the
/// connection, whose own tasks would otherwise count.
///
/// # Errors
///
/// None: past the timeout it returns, and the tasks still running are left to the
/// process's exit.
///
/// # Cancel safety
///
/// Cancel safe: it only waits.
pub async fn settle(before: usize) {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    while alive_tasks() > before && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The user's `--wait`, when it is a limit (not `-n`, `--wait 0` or no `--wait`), with
/// its text as written.
fn wait_limit(args: &WaitArgs) -> Option<(Duration, &(dyn std::fmt::Display + Sync))> {
    match &args.wait {
        _ if args.nonblock => None,
        Some(wait) if !wait.value.is_zero() => {
            Some((wait.value, wait as &(dyn std::fmt::Display + Sync)))
        }
        _ => None,
    }
}

/// The acquire options of the command line. Without `--lease` the backend's configured
/// lease is used (etcd `lease=`, ZooKeeper `session_timeout=`), never a second default.
pub fn options(args: &WaitArgs) -> AcquireOptions {
    let wait = match &args.wait {
        _ if args.nonblock => Wait::NoWait,
        None => Wait::Forever,
        Some(wait) if wait.value.is_zero() => Wait::NoWait,
        Some(wait) => Wait::Timeout(wait.value),
    };
    let options = AcquireOptions::new().wait(wait);
    match (&args.fixed_lease, &args.lease) {
        (Some(fixed), _) => options.fixed_lease(fixed.value),
        (None, Some(lease)) => options.lease(lease.value),
        (None, None) => options,
    }
}

/// Not acquired: the conflict exit code, naming `what` ([`Grant::describe`]).
fn not_acquired(error: Error, what: &str, wait: &WaitArgs) -> Failure {
    let conflict = wait.conflict_exit_code.unwrap_or(code::NOT_ACQUIRED);
    match error {
        Error::Timeout { .. } => {
            let within = wait
                .wait
                .as_ref()
                .map_or_else(String::new, ToString::to_string);
            Failure::new(
                conflict,
                format!("{what} was not acquired within {within}: another owner holds it"),
            )
        }
        Error::Contended { .. } => Failure::new(
            conflict,
            format!("{what} is held by another owner (not waiting)"),
        ),
        // Any other refusal (the client's `max_waiters=` limit is full): not acquired,
        // so `-E` applies to it as to the others.
        other if code_of(&other) == code::NOT_ACQUIRED => Failure::new(conflict, one_line(&other)),
        other => other.into(),
    }
}

fn spawn(args: &RunArgs, guard: &LockGuard, grant: &Grant) -> Result<Child, Failure> {
    let (program, rest): (&std::ffi::OsStr, Vec<&std::ffi::OsStr>) = match &args.child.shell {
        Some(script) => ("sh".as_ref(), vec!["-c".as_ref(), script.as_os_str()]),
        None => {
            let Some((program, rest)) = args.command.split_first() else {
                return Err(Failure::usage("no command given after --"));
            };
            (
                program.as_os_str(),
                rest.iter().map(|a| a.as_os_str()).collect(),
            )
        }
    };
    let argv: Vec<&std::ffi::OsStr> = std::iter::once(program).chain(rest).collect();
    let mut command = child::command(&argv);
    command
        .env("FENCELOCK_TOKEN", guard.token().get().to_string())
        .env("FENCELOCK_NAME", guard.name())
        .env("FENCELOCK_BACKEND", guard.backend())
        .kill_on_drop(true);
    if let Some(key) = guard.backend_key() {
        command.env("FENCELOCK_KEY", key);
    }
    if let Some((variable, value)) = grant.env() {
        command.env(variable, value);
    }
    // In a process group of its own the command cannot read the terminal (it would be
    // stopped, holding the lock): it gets end-of-file instead.
    if std::io::stdin().is_terminal() {
        command.stdin(std::process::Stdio::null());
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

/// Waits for the command and for every process it left in its group, forwarding
/// signals to the group once, and stops the group if the lock is lost.
async fn supervise(
    child: &mut Child,
    guard: &LockGuard,
    signals: &mut Signals,
    grace: Duration,
    events: &Events,
) -> Result<Outcome, Failure> {
    let internal = |e: std::io::Error| Failure::new(code::INTERNAL, one_line(&e));
    let group = child.id();
    // The command's own process has exited, but processes it started are still in its
    // group (`worker & exit 0`): they may still write, so the lock is kept (renewed, and
    // their group stopped if it is lost) until the last of them is gone, as flock(1)
    // keeps its lock while any process holding its descriptor lives.
    let mut exited: Option<ExitStatus> = None;
    let mut warned = false;
    loop {
        tokio::select! {
            // A loss already known wins over an exit seen at the same time: the command
            // may have worked past it.
            biased;
            _ = guard.lost() => {
                let reason = guard.lost_reason().unwrap_or("lost").to_owned();
                let killed = stop(child, group, grace).await.map_err(internal)?;
                return Ok(Outcome::Lost { reason, killed });
            }
            status = child.wait(), if exited.is_none() => {
                let status = status.map_err(internal)?;
                if !child::group_alive(group) {
                    return Ok(Outcome::Exited(status));
                }
                exited = Some(status);
            }
            () = tokio::time::sleep(GROUP_POLL), if exited.is_some() => {
                child::reap_group(group);
                if !child::group_alive(group) {
                    return Ok(Outcome::Exited(exited.unwrap_or_default()));
                }
                // Said once, and only of processes still there a poll later (not of a
                // pipeline's members exiting together with its shell).
                if !warned {
                    warned = true;
                    events.warn(&format!(
                        "the command exited; the lock is kept until the processes it left \
                         in its process group ({}) have exited",
                        group.unwrap_or_default()
                    ));
                }
            }
            received = signals.next() => match received {
                Received::Forward(signal) => child::signal_group(group, signal),
                Received::Suspend => {
                    // Ctrl-Z reached fencelock's group only: stop the command's group too,
                    // so it never runs while fencelock (and its renewals) are stopped;
                    // resume it when fencelock is resumed. A loss meanwhile stops it as
                    // usual.
                    child::signal_group(group, Signal::SIGSTOP);
                    signals::stop_self();
                    if guard.is_lost() {
                        // Lost while stopped: the command must not run another instant
                        // as if it held the lock. SIGTERM is pending before SIGCONT, so
                        // it is what the command sees first; the loss is handled next.
                        child::signal_group(group, Signal::SIGTERM);
                    }
                    child::signal_group(group, Signal::SIGCONT);
                }
            },
        }
    }
}

/// SIGTERM to the command's group, then SIGKILL to what is left of it after `grace`.
/// Returns whether SIGKILL was needed.
async fn stop(child: &mut Child, group: Option<u32>, grace: Duration) -> std::io::Result<bool> {
    child::signal_group(group, Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        // Reaped first: a zombie still counts as a member of its group.
        let exited = child.try_wait()?.is_some();
        if exited {
            child::reap_group(group);
        }
        if exited && !child::group_alive(group) {
            return Ok(false);
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child::signal_group(group, Signal::SIGKILL);
    let _ = child.kill().await;
    Ok(true)
}

/// Releases after the command exited and picks the exit code; `what` names what was
/// held ([`Grant::describe`]).
async fn finish(
    guard: LockGuard,
    status: ExitStatus,
    what: &str,
    events: &Events,
) -> Result<u8, Failure> {
    let name = guard.name().to_owned();
    let token = guard.token();
    tracing::debug!(%status, "the command exited; releasing {what}");
    match guard.release().await {
        Ok(()) => {
            events.released(&name);
            Ok(status_code(status))
        }
        Err(Error::Lost { reason, .. }) => {
            events.lost_at_release(&name, token, &reason);
            Err(Failure::new(
                code::LOST,
                format!("{what} was lost before the command finished: {reason}"),
            ))
        }
        Err(error) => {
            events.warn(&format!(
                "releasing {what} failed ({}); it expires with its lease",
                one_line(&error)
            ));
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

    fn wait_args(args: &[&str]) -> WaitArgs {
        use clap::Parser as _;
        let line = ["fencelock", "run"]
            .iter()
            .chain(args)
            .chain(&["job", "--", "true"]);
        match crate::args::Cli::try_parse_from(line).unwrap().command {
            crate::args::Command::Run(run) => run.wait,
            _ => unreachable!("a run command line"),
        }
    }

    /// Every refusal that exits 75 (someone holds the lock, or the client's
    /// `max_waiters=` limit is full) takes `-E CODE` instead; other errors keep theirs.
    #[test]
    fn the_conflict_exit_code_applies_to_every_refusal() {
        let refusals = [
            Error::Timeout {
                name: "job".into(),
                waited: Duration::from_secs(1),
            },
            Error::Contended { name: "job".into() },
            Error::TooManyWaiters {
                name: "job".into(),
                limit: 1,
            },
        ];
        for error in refusals {
            assert_eq!(crate::exit::code_of(&error), code::NOT_ACQUIRED, "{error}");
            let what = error.to_string();
            let failure = not_acquired(error, "job", &wait_args(&["-E", "3"]));
            assert_eq!(failure.code, 3, "{what}");
            assert!(failure.message.contains("job"), "{}", failure.message);
        }
        let default = not_acquired(
            Error::TooManyWaiters {
                name: "job".into(),
                limit: 1,
            },
            "job",
            &wait_args(&[]),
        );
        assert_eq!(default.code, code::NOT_ACQUIRED);
        let usage = not_acquired(
            Error::InvalidConfig("x".into()),
            "job",
            &wait_args(&["-E", "3"]),
        );
        assert_eq!(usage.code, code::USAGE);
    }

    #[test]
    fn exit_statuses_follow_the_shell() {
        assert_eq!(status_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(status_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(status_code(ExitStatus::from_raw(15)), 143);
        assert_eq!(status_code(ExitStatus::from_raw(9)), 137);
    }
}
