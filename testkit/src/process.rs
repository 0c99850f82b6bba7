//! Server child processes that cannot outlive the test process.
//!
//! Every server is spawned from one dedicated thread that never exits, with
//! `PR_SET_PDEATHSIG(SIGKILL)` set in the child before `exec`. The kernel sends that
//! signal when the *thread* that forked the child exits; cargo runs each test on its own
//! short-lived thread, so spawning from test threads would kill servers as soon as the
//! test that started a shared server returns. With the spawner thread the signal fires
//! only when the whole test process goes away, for whatever reason (even SIGKILL).
//!
//! Shared per-process servers live in statics, which are never dropped; [`at_exit`]
//! registers a libc `atexit` hook that kills them and deletes their directories when the
//! test binary exits normally.

// This is the only module that needs `unsafe`: `pre_exec`, `prctl`, `kill`, `atexit`.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, Once, OnceLock, PoisonError, mpsc};

/// Locks `mutex`, ignoring poisoning (a panicking test must not wedge every other one).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

/// The channel to the spawner thread, started on first use.
fn spawner() -> &'static mpsc::Sender<SpawnRequest> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (requests, incoming) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("fencelock-testkit-spawner".into())
            .spawn(move || {
                // The sender lives in a static, so this loop (and thread) never ends.
                for (mut command, reply) in incoming {
                    let _ = reply.send(spawn_here(&mut command));
                }
            })
            .unwrap_or_else(|e| panic!("fencelock-testkit: cannot start spawner thread: {e}"));
        requests
    })
}

/// Runs on the spawner thread.
fn spawn_here(command: &mut Command) -> io::Result<Child> {
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(libc::pid_t::MAX);
    // SAFETY: the hook runs in the forked child between fork and exec. It only calls
    // the async-signal-safe functions prctl(2), getppid(2) and _exit(2); it allocates
    // nothing and takes no locks (`last_os_error` only reads errno).
    unsafe {
        command.pre_exec(move || {
            let sigkill = libc::c_ulong::try_from(libc::SIGKILL).unwrap_or(9);
            if libc::prctl(libc::PR_SET_PDEATHSIG, sigkill, 0usize, 0usize, 0usize) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent died before the prctl took effect: do not start an orphan.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    command.spawn()
}

/// Spawns `command` on the spawner thread (see the module docs).
fn spawn(command: Command) -> io::Result<Child> {
    let (reply, answer) = mpsc::channel();
    spawner()
        .send((command, reply))
        .map_err(|_| io::Error::other("fencelock-testkit spawner thread is gone"))?;
    answer
        .recv()
        .map_err(|_| io::Error::other("fencelock-testkit spawner thread is gone"))?
}

/// Sends `signal` to `pid`; false if there is no such process.
fn send_signal(pid: u32, signal: libc::c_int) -> bool {
    match libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) has no memory-safety preconditions; pid > 0 targets one process.
        Ok(pid) if pid > 0 => unsafe { libc::kill(pid, signal) == 0 },
        _ => false,
    }
}

/// Whether a process with this pid exists and is not a zombie.
///
/// A stopped (SIGSTOP) process is alive. Pid 0 is never alive.
pub fn process_alive(pid: u32) -> bool {
    let exists = match libc::pid_t::try_from(pid) {
        Ok(p) if p > 0 => {
            // SAFETY: signal 0 only checks for existence and permission; nothing is sent.
            let found = unsafe { libc::kill(p, 0) } == 0;
            found || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
        }
        _ => false,
    };
    if !exists {
        return false;
    }
    // `/proc/PID/stat` is "pid (comm) STATE ..."; comm may contain ')', so use the last.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].trim_start().chars().next())
            .is_none_or(|state| state != 'Z' && state != 'X'),
        Err(_) => true,
    }
}

/// One server's child process, across restarts. All methods take `&self`.
pub(crate) struct ServerProcess {
    child: Mutex<Option<Child>>,
    last_pid: AtomicU32,
}

impl ServerProcess {
    /// No process yet.
    pub(crate) fn new() -> Self {
        ServerProcess {
            child: Mutex::new(None),
            last_pid: AtomicU32::new(0),
        }
    }

    /// Spawns `command` with stdin from /dev/null and stdout/stderr appended to `log`.
    /// Kills the previous process first, if any.
    pub(crate) fn start(&self, mut command: Command, log: &Path) -> io::Result<()> {
        self.kill();
        let out = OpenOptions::new().create(true).append(true).open(log)?;
        let err = out.try_clone()?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let child = spawn(command)?;
        self.last_pid.store(child.id(), Ordering::SeqCst);
        *lock(&self.child) = Some(child);
        Ok(())
    }

    /// The pid of the current process, or of the last one if it was killed; 0 if none
    /// was ever started.
    pub(crate) fn pid(&self) -> u32 {
        self.last_pid.load(Ordering::SeqCst)
    }

    /// The exit status if the process was started and has exited on its own.
    pub(crate) fn exit_status(&self) -> Option<ExitStatus> {
        lock(&self.child)
            .as_mut()
            .and_then(|child| child.try_wait().ok().flatten())
    }

    /// Whether a process was started, not killed, and has not exited.
    pub(crate) fn is_running(&self) -> bool {
        lock(&self.child)
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// Sends `signal` to the running process. Panics if there is none: pausing a killed
    /// server is a bug in the test.
    fn signal_running(&self, signal: libc::c_int, what: &str) {
        let mut child = lock(&self.child);
        // Holding the lock with the child unreaped guarantees the pid is still ours.
        let pid = child
            .as_mut()
            .and_then(|c| matches!(c.try_wait(), Ok(None)).then(|| c.id()));
        match pid {
            Some(pid) => {
                send_signal(pid, signal);
            }
            None => panic!("fencelock-testkit: cannot {what} a server that is not running"),
        }
    }

    /// SIGSTOP: the process keeps its sockets but answers nothing.
    pub(crate) fn pause(&self) {
        self.signal_running(libc::SIGSTOP, "pause");
    }

    /// SIGCONT after [`ServerProcess::pause`].
    pub(crate) fn resume(&self) {
        self.signal_running(libc::SIGCONT, "resume");
    }

    /// SIGKILL and reap. Does nothing if no process is running.
    pub(crate) fn kill(&self) {
        if let Some(mut child) = lock(&self.child).take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// [`ServerProcess::kill`] for the `atexit` path: never blocks on the lock (a busy
    /// lock leaves the process to its parent-death signal).
    pub(crate) fn kill_at_exit(&self) {
        let child = match self.child.try_lock() {
            Ok(mut child) => child.take(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().take(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if let Some(mut child) = child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

type ExitHook = Box<dyn FnOnce() + Send>;

static EXIT_HOOKS: Mutex<Vec<ExitHook>> = Mutex::new(Vec::new());

/// Runs `hook` when the process exits normally (libc `exit`, which is how both a
/// passing and a failing test binary end). Used to stop shared servers and delete their
/// directories, since statics are never dropped.
pub(crate) fn at_exit(hook: impl FnOnce() + Send + 'static) {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // SAFETY: `run_exit_hooks` is a plain `extern "C" fn()` that never unwinds.
        unsafe {
            libc::atexit(run_exit_hooks);
        }
    });
    lock(&EXIT_HOOKS).push(Box::new(hook));
}

extern "C" fn run_exit_hooks() {
    let hooks = match EXIT_HOOKS.try_lock() {
        Ok(mut hooks) => std::mem::take(&mut *hooks),
        Err(_) => return,
    };
    for hook in hooks {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(hook));
    }
}
