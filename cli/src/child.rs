//! Starting the command of `fencelock run` so that it can always be stopped: in a process
//! group of its own (a lost lock stops the whole pipeline), and on Linux killed when
//! fencelock dies (`PR_SET_PDEATHSIG`).

// `pre_exec` is unsafe: the closure runs between fork and exec, where only
// async-signal-safe calls are allowed. It makes two system calls (`prctl`, `getppid`).
#![allow(unsafe_code)]

use std::ffi::OsStr;
use std::ops::{Deref, DerefMut};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// A command to run under a lock, protected as [`protect`] says. Set its environment and
/// standard streams through `Deref` to [`Command`], then [`Guarded::spawn`] it once.
pub struct Guarded {
    command: Command,
}

/// The protected command for `argv` (program and arguments): what `run`, and every
/// other subcommand that runs a command while it holds something, starts. The
/// command's process group is what callers stop: the spawned child's pid is its id.
pub fn command<S: AsRef<OsStr>>(argv: &[S]) -> Guarded {
    let (program, args) = argv
        .split_first()
        .map_or((OsStr::new(""), &[][..]), |(p, a)| (p.as_ref(), a));
    let mut command = Command::new(program);
    command.args(args);
    protect(&mut command);
    Guarded { command }
}

impl Guarded {
    /// Starts the command.
    ///
    /// # Errors
    ///
    /// The command could not be started: its error's kind says whether it was not found
    /// ([`std::io::ErrorKind::NotFound`]) or could not be executed.
    pub fn spawn(&mut self) -> std::io::Result<Child> {
        self.command.spawn()
    }
}

impl Deref for Guarded {
    type Target = Command;
    fn deref(&self) -> &Command {
        &self.command
    }
}

impl DerefMut for Guarded {
    fn deref_mut(&mut self) -> &mut Command {
        &mut self.command
    }
}

/// Puts the command in a process group of its own and, on Linux, has the kernel send it
/// SIGKILL when fencelock's main thread ends (however fencelock dies).
///
/// The parent-death signal is tied to the thread that forks: `run` spawns from the
/// runtime's `block_on` future, which runs on the main thread for the process's life.
pub fn protect(command: &mut Command) {
    command.process_group(0);
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id();
        // SAFETY: the closure only makes the `prctl` and `getppid` system calls, which are
        // async-signal-safe, and allocates nothing.
        unsafe {
            command.pre_exec(move || {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                // fencelock died between fork and prctl: nobody would stop this command.
                if nix::unistd::getppid().as_raw() as u32 != parent {
                    return Err(std::io::Error::other(
                        "fencelock exited while starting the command",
                    ));
                }
                Ok(())
            });
        }
    }
}

/// Sends `signal` to the command's process group (its pid, since it leads it); a group
/// that is gone is not an error.
pub fn signal_group(pid: Option<u32>, signal: Signal) {
    if let Some(pid) = pid.and_then(|pid| i32::try_from(pid).ok()) {
        let _ = killpg(Pid::from_raw(pid), signal);
    }
}

/// Whether any process is left in the command's group (signal 0 reaches one).
pub fn group_alive(pid: Option<u32>) -> bool {
    pid.and_then(|pid| i32::try_from(pid).ok())
        .is_some_and(|pid| killpg(Pid::from_raw(pid), None).is_ok())
}

/// Reaps the zombies of the command's group that are fencelock's children. After the
/// command's own process exited, what it left behind is reparented to the nearest
/// subreaper, which is fencelock when it runs as a container's init (PID 1): unreaped,
/// such a zombie would keep the group "alive" for ever. Only this group's members are
/// waited for (the command itself was reaped already), so no other child's status is
/// taken.
pub fn reap_group(pid: Option<u32>) {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    let Some(group) = pid.and_then(|pid| i32::try_from(pid).ok()) else {
        return;
    };
    // Each call reaps one; `StillAlive` (none exited) or an error (no child left in the
    // group) ends it.
    while let Ok(status) = waitpid(Pid::from_raw(-group), Some(WaitPidFlag::WNOHANG)) {
        if status == WaitStatus::StillAlive {
            break;
        }
    }
}

/// Makes fencelock a child subreaper (Linux): a process the command leaves behind is
/// reparented to fencelock rather than to init when the command exits, so
/// [`reap_group`] can reap it when it ends. Otherwise, under an init that reaps only its
/// own child (`tail -f /dev/null` or `sleep infinity` as a container's PID 1), it would
/// stay a zombie in the command's group, and `run` would wait for the group for ever.
pub fn become_subreaper() {
    #[cfg(target_os = "linux")]
    {
        let _ = nix::sys::prctl::set_child_subreaper(true);
    }
}
