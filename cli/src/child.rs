//! Starting a command that runs under a lock so that it can always be stopped: in a
//! process group of its own (a lost lock stops the whole pipeline), and on Linux with
//! the whole group killed when fencelock dies, however it dies.
//!
//! The kernel's parent-death signal (`PR_SET_PDEATHSIG`) reaches one process, and is
//! cleared in every process that one forks: set on the command itself, it would stop
//! `sh` but not the `./upload.sh` that `sh -c './report.sh; ./upload.sh'` runs, nor a
//! pipeline's members, nor what `make` starts. So on Linux fencelock's direct child is
//! a small **guardian**, the fencelock binary itself started again with
//! [`GUARDIAN_ARG`] as its first argument (see [`guardian_main`]). It leads the group,
//! gets a catchable parent-death signal, and starts the command in its own group; when
//! fencelock dies it kills the group with SIGKILL, the command and everything the
//! command started that stayed in the group. Otherwise it only waits: the signals
//! fencelock sends to the group reach the command directly, and when the command exits
//! the guardian exits with the same status (a signal's death is raised again), so
//! fencelock sees what it would have seen of the command itself.
//!
//! A command whose own process exits leaving other processes in its group (`worker &
//! exit 0`) keeps its lock until they are gone (see `run`). So that they too die with
//! fencelock, the guardian then forks a **rear guard** before it exits (see
//! `guardian::rear_guard`): it stays in the group, watches fencelock as the guardian
//! did, and ends by itself once it is the group's last member.

// `pre_exec` is unsafe: the closure runs between fork and exec, where only
// async-signal-safe calls are allowed. The closures here make only system calls
// (`prctl`, `getppid`, `fcntl`), and allocate nothing. Setting a signal's action to its
// default (`signal`) is unsafe in nix for handlers; no handler is installed here.
// `fork`, `sigtimedwait`, `dup2` and `_exit` are the rear guard's (see `rear_guard`).
#![allow(unsafe_code)]

use std::ffi::OsStr;
use std::ops::{Deref, DerefMut};
use std::process::ExitCode;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// The hidden first argument that makes the fencelock binary a guardian (see the
/// module's documentation). `main` checks it before parsing anything.
pub const GUARDIAN_ARG: &str = "__fencelock-guardian";

/// A command to run under a lock, protected as the module says. Set its environment and
/// standard streams through `Deref` to [`Command`], then [`Guarded::spawn`] it once.
/// The spawned child's pid is the id of the command's process group: that is what
/// [`signal_group`], [`group_alive`] and [`reap_group`] take.
pub struct Guarded {
    command: Command,
    /// The pipe on which the guardian reports that the command could not be started:
    /// read end, write end (Linux; `None` once spawned).
    #[cfg(target_os = "linux")]
    status: Option<std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)>>,
}

/// The protected command for `argv` (program and arguments): what `run`, and every
/// other subcommand that runs a command while it holds something, starts.
///
/// On Linux the process started is the guardian, which starts `argv` in its process
/// group; elsewhere (no parent-death signal) it is `argv` itself, in a group of its own.
pub fn command<S: AsRef<OsStr>>(argv: &[S]) -> Guarded {
    #[cfg(target_os = "linux")]
    {
        guarded_command(argv)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let (program, args) = argv
            .split_first()
            .map_or((OsStr::new(""), &[][..]), |(p, a)| (p.as_ref(), a));
        let mut command = Command::new(program);
        command.args(args).process_group(0);
        Guarded { command }
    }
}

#[cfg(target_os = "linux")]
fn guarded_command<S: AsRef<OsStr>>(argv: &[S]) -> Guarded {
    use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};
    use std::os::fd::AsRawFd as _;

    let parent = std::process::id();
    // Both ends close on exec; the child below keeps the write end open for the
    // guardian, so no other process fencelock starts meanwhile inherits it.
    let status = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(std::io::Error::from);
    let write = status.as_ref().map_or(-1, |(_, write)| write.as_raw_fd());
    // `/proc/self/exe` rather than a path: it is this binary even if the file was
    // replaced or deleted since fencelock started (an upgrade).
    let mut command = Command::new("/proc/self/exe");
    command
        .arg0("fencelock")
        .arg(GUARDIAN_ARG)
        .arg(parent.to_string())
        .arg(write.to_string())
        .arg("--")
        .args(argv)
        .process_group(0);
    // SAFETY: the closure only makes the `prctl`, `getppid` and `fcntl` system calls,
    // which are async-signal-safe, and allocates nothing (the error is a constant
    // `io::Error` kind carrying an errno, or a static message).
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(guardian::PARENT_DEATH)?;
            // fencelock died between fork and prctl: nobody would stop this command.
            if nix::unistd::getppid().as_raw() as u32 != parent {
                return Err(std::io::ErrorKind::Other.into());
            }
            // SAFETY: `write` is the pipe's write end, open in this forked child.
            let fd = std::os::fd::BorrowedFd::borrow_raw(write);
            fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty()))?;
            Ok(())
        });
    }
    Guarded {
        command,
        status: Some(status),
    }
}

impl Guarded {
    /// Starts the command (once).
    ///
    /// Blocks until the command was started or refused (as [`Command::spawn`] does):
    /// on Linux the guardian reports the command's failure to start on a pipe.
    ///
    /// # Errors
    ///
    /// The command could not be started: its error's kind says whether it was not found
    /// ([`std::io::ErrorKind::NotFound`]) or could not be executed. On Linux also when
    /// the guardian could not be started (kind [`std::io::ErrorKind::Other`]), or when
    /// spawned a second time.
    pub fn spawn(&mut self) -> std::io::Result<Child> {
        #[cfg(target_os = "linux")]
        {
            use std::io::Read as _;
            let (read, write) = self
                .status
                .take()
                .ok_or_else(|| std::io::Error::other("the command was started already"))??;
            let child = self.command.spawn().map_err(|e| {
                std::io::Error::other(format!("cannot start fencelock's guardian: {e}"))
            });
            // Only the guardian's copy of the write end is left: end of file on the
            // read end means it closed it (the command was started) or died.
            drop(write);
            let child = child?;
            let mut report = Vec::new();
            std::fs::File::from(read).read_to_end(&mut report)?;
            match guardian::decode_failure(&report) {
                // The guardian exits at once (127 or 126); dropped, the child is
                // killed if need be and reaped by tokio.
                Some(error) => Err(error),
                None => Ok(child),
            }
        }
        #[cfg(not(target_os = "linux"))]
        {
            self.command.spawn()
        }
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

/// When fencelock was started as a guardian ([`GUARDIAN_ARG`] first), runs it and
/// returns its exit code; otherwise `None` (a normal start). Called first in `main`.
pub fn guardian_main() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next().as_deref() != Some(OsStr::new(GUARDIAN_ARG)) {
        return None;
    }
    #[cfg(target_os = "linux")]
    {
        Some(guardian::main(args))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = args;
        Some(ExitCode::from(crate::exit::code::USAGE))
    }
}

#[cfg(target_os = "linux")]
mod guardian {
    use std::ffi::OsString;
    use std::io::Write as _;
    use std::os::fd::{FromRawFd as _, OwnedFd, RawFd};
    use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
    use std::process::{ExitCode, ExitStatus};

    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, kill, sigprocmask};
    use nix::unistd::{Pid, getppid};

    use crate::exit::code;

    /// The guardian's parent-death signal. Any catchable one would do (the guardian
    /// looks at its parent on every signal); one that ends a process by default, so
    /// a fencelock that dies before the guardian blocks it ends the guardian too, before
    /// the command was started.
    pub const PARENT_DEATH: Signal = Signal::SIGTERM;

    /// The guardian: `PARENT_PID STATUS_FD -- PROGRAM ARGS...` after [`super::GUARDIAN_ARG`].
    pub fn main(args: impl Iterator<Item = OsString>) -> ExitCode {
        // First, before anything can be lost: every signal is waited for, none acts on
        // the guardian by itself (the parent-death signal would end it; the group's
        // SIGINT, SIGTERM, SIGHUP are meant for the command). Blocked, not ignored: an
        // ignored disposition would be inherited across exec, while the mask is emptied
        // for the command before it executes (below).
        let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::all()), None);
        // `fencelock` in `ps` and `top`, not `exe` (it was started as /proc/self/exe).
        let _ = nix::sys::prctl::set_name(c"fencelock");
        let Some((parent, status, argv)) = parse(args) else {
            eprintln!("fencelock: {} is fencelock's own", super::GUARDIAN_ARG);
            return ExitCode::from(code::USAGE);
        };
        // SAFETY: fencelock passed this descriptor, the pipe's write end, for this
        // process alone; nothing else here owns it.
        let status = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(status) });
        // Not the command's: fencelock reads the pipe until every write end is closed,
        // which must be when the guardian closes its own after starting the command.
        if fcntl(&status, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).is_err() {
            return ExitCode::from(code::INTERNAL);
        }
        // fencelock died before the guardian started: its parent-death signal may have
        // come before the guardian could block it. Start nothing.
        if getppid() != parent {
            return ExitCode::from(code::INTERNAL);
        }
        let guardian = std::process::id();
        let mut command = std::process::Command::new(&argv[0]);
        command.args(&argv[1..]);
        // SAFETY: the closure only makes the `prctl`, `getppid` and `sigprocmask` system
        // calls, which are async-signal-safe, and allocates nothing.
        unsafe {
            command.pre_exec(move || {
                // Killed with the guardian too (fencelock's last resort `kill`): not
                // its children, but then fencelock kills the group itself.
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
                if nix::unistd::getppid().as_raw() as u32 != guardian {
                    return Err(std::io::ErrorKind::Other.into());
                }
                // std leaves the signal mask as it is: the command starts with none
                // blocked, as it would have without the guardian.
                sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
                Ok(())
            });
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(error) => {
                let errno = error.raw_os_error().unwrap_or(0);
                let _ = (&status).write_all(&errno.to_ne_bytes());
                return ExitCode::from(if error.kind() == std::io::ErrorKind::NotFound {
                    code::NOT_FOUND
                } else {
                    code::CANNOT_EXECUTE
                });
            }
        };
        // Started: end of file for fencelock, which goes on.
        drop(status);
        let waited = SigSet::all();
        loop {
            // Any signal wakes the guardian (an unknown, real-time one is an error
            // here): SIGCHLD, the parent-death signal, or one sent to the group.
            let signal = waited.wait().ok();
            // The parent-death signal comes whenever a thread of fencelock that
            // started the guardian ends; only when fencelock is gone does the
            // guardian have another parent (init or a subreaper).
            if getppid() != parent {
                // The whole group: the command, what it started there, the guardian.
                let _ = kill(Pid::from_raw(0), Signal::SIGKILL);
                return ExitCode::from(code::INTERNAL);
            }
            if signal == Some(Signal::SIGCHLD) {
                match child.try_wait() {
                    Ok(Some(exited)) => {
                        rear_guard(parent);
                        return exit_like(exited);
                    }
                    Ok(None) => {}
                    Err(_) => return ExitCode::from(code::INTERNAL),
                }
            }
        }
    }

    /// How often the rear guard looks whether it is the last of its group (it wakes at
    /// once on a signal, such as its parent-death signal).
    const REAR_GUARD_POLL: std::time::Duration = std::time::Duration::from_millis(50);

    /// Called by the guardian once the command's own process exited (and was reaped):
    /// when other processes are left in the group (`worker & exit 0`; fencelock keeps
    /// the lock while they live), forks a rear guard that watches `fencelock` for them,
    /// since the guardian exits now with the command's status. Nothing left: no fork
    /// (one scan of /proc). /proc unreadable: no rear guard, as without one.
    pub(super) fn rear_guard(fencelock: Pid) {
        let guardian = Pid::this();
        if !others_in_group(guardian, guardian) {
            return;
        }
        // SAFETY: the guardian has a single thread (it starts none, nor does
        // `std::process::Command`), so the child may run any code, as after exec.
        // A failed fork leaves the group as without a rear guard.
        if let Ok(nix::unistd::ForkResult::Child) = unsafe { nix::unistd::fork() } {
            watch(fencelock, guardian);
        }
    }

    /// The rear guard: in the group (led by the guardian, whose pid cannot be reused
    /// while the group lives), every signal still blocked (the guardian's mask). Its
    /// parent is the guardian, then fencelock, a child subreaper (`become_subreaper`),
    /// once the guardian exited; any other parent means fencelock is gone, and the group
    /// gets SIGKILL as the guardian would have sent. Its parent-death signal wakes it at
    /// once (when the guardian exits too: it then only looks); it also looks every
    /// [`REAR_GUARD_POLL`], which covers a parent that died before the signal was set,
    /// and exits once no other live process is left in the group (so `run` sees the
    /// group end). Its exit status is no one's: fencelock reaps it as a group member.
    fn watch(fencelock: Pid, group: Pid) -> ! {
        use std::os::fd::AsRawFd as _;
        let _ = nix::sys::prctl::set_pdeathsig(PARENT_DEATH);
        let _ = nix::sys::prctl::set_name(c"fencelock");
        // The command's streams are not kept open by the rear guard: whoever reads
        // them to their end waits for the command's processes only.
        if let Ok(null) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
        {
            for fd in 0..3 {
                // SAFETY: plain descriptor numbers; `null` stays open across the call.
                unsafe { nix::libc::dup2(null.as_raw_fd(), fd) };
            }
        }
        let me = Pid::this();
        let waited = SigSet::all();
        // SAFETY: all-zero is a valid `timespec` (whatever padding it has).
        let mut timeout: nix::libc::timespec = unsafe { std::mem::zeroed() };
        timeout.tv_nsec = REAR_GUARD_POLL.subsec_nanos().into();
        loop {
            // SAFETY: valid pointers to a set and a timeout; no `siginfo` wanted.
            unsafe { nix::libc::sigtimedwait(waited.as_ref(), std::ptr::null_mut(), &timeout) };
            let parent = getppid();
            if parent != fencelock && parent != group {
                let _ = kill(Pid::from_raw(0), Signal::SIGKILL);
            }
            if !others_in_group(group, me) {
                // SAFETY: ends this process at once, without the guardian's exit work
                // (nothing of it is this process's to flush or run).
                unsafe { nix::libc::_exit(0) };
            }
        }
    }

    /// Whether a live process (not a zombie) other than `me` is in process group
    /// `group`, from /proc (false when it cannot be read).
    fn others_in_group(group: Pid, me: Pid) -> bool {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return false;
        };
        entries.flatten().any(|entry| {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                return false;
            };
            pid != me.as_raw()
                && std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|stat| live_member(&stat, group.as_raw()))
        })
    }

    /// Whether a `/proc/PID/stat` line is of a live process (not a zombie) in `group`:
    /// `PID (COMM) STATE PPID PGRP ...`, COMM being any bytes up to the last `)`.
    fn live_member(stat: &str, group: i32) -> bool {
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let mut fields = rest.split_ascii_whitespace();
        let state = fields.next();
        let pgrp = fields.nth(1).and_then(|f| f.parse::<i32>().ok());
        !matches!(state, Some("Z" | "X" | "x")) && pgrp == Some(group)
    }

    /// `PARENT_PID STATUS_FD -- PROGRAM ARGS...`.
    fn parse(mut args: impl Iterator<Item = OsString>) -> Option<(Pid, RawFd, Vec<OsString>)> {
        let parent = args.next()?.to_str()?.parse().ok()?;
        let status = args.next()?.to_str()?.parse().ok()?;
        if args.next()? != "--" {
            return None;
        }
        let argv: Vec<OsString> = args.collect();
        (!argv.is_empty() && status > 2).then_some((Pid::from_raw(parent), status, argv))
    }

    /// Exits as the command did: its code, or death by the same signal (raised again,
    /// with its default action and no core file of the guardian's own).
    fn exit_like(status: ExitStatus) -> ExitCode {
        if let Some(code) = status.code() {
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
        let Some(number) = status.signal() else {
            return ExitCode::from(code::INTERNAL);
        };
        if let Ok(signal) = Signal::try_from(number) {
            let _ = nix::sys::prctl::set_dumpable(false);
            // SAFETY: the default action is no handler; nothing runs on delivery.
            let _ = unsafe { nix::sys::signal::signal(signal, SigHandler::SigDfl) };
            let mut only = SigSet::empty();
            only.add(signal);
            let _ = sigprocmask(SigmaskHow::SIG_UNBLOCK, Some(&only), None);
            let _ = kill(Pid::this(), signal);
        }
        // A signal whose default is not to end a process cannot have ended the command;
        // the shell's convention then.
        ExitCode::from(128u8.saturating_add(u8::try_from(number).unwrap_or(0)))
    }

    /// The guardian's report on the status pipe: empty when the command was started,
    /// else the errno of its failure to start.
    pub fn decode_failure(report: &[u8]) -> Option<std::io::Error> {
        if report.is_empty() {
            return None;
        }
        Some(match <[u8; 4]>::try_from(report) {
            Ok(bytes) if i32::from_ne_bytes(bytes) != 0 => {
                std::io::Error::from_raw_os_error(i32::from_ne_bytes(bytes))
            }
            _ => std::io::Error::other("the command could not be started"),
        })
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
