//! A throwaway `redis-server`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use tempfile::TempDir;

use crate::binaries::require_program;
use crate::launch::{log_tail, wait_ready, with_retries};
use crate::net::exchange;
use crate::port::free_port;
use crate::process::{ServerProcess, at_exit};

/// How long a start or restart may take before it counts as failed.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// A `redis-server` on a free loopback port, in its own temporary directory, with no
/// persistence (`--save "" --appendonly no`). Killed (SIGKILL) when dropped.
///
/// ```no_run
/// let redis = fencelock_testkit::RedisServer::start();
/// println!("connect to {}", redis.url());
/// ```
pub struct RedisServer {
    process: ServerProcess,
    port: u16,
    args: Vec<String>,
    log: PathBuf,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a standalone server and waits until it answers `PING`.
    ///
    /// Panics if `redis-server` is not installed or does not come up.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra `redis-server` arguments appended after the defaults
    /// (later arguments win), e.g. `&["--replicaof", "127.0.0.1", "6380"]` or
    /// `&["--cluster-enabled", "yes"]`. In cluster mode a free cluster bus port is
    /// chosen with `--cluster-port` unless one is given.
    pub fn start_with(args: &[&str]) -> Self {
        let program = require_program("redis-server", "redis-server");
        with_retries("redis-server", || {
            let dir = tempfile::Builder::new()
                .prefix("fencelock-redis-")
                .tempdir()
                .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
            let port = free_port();
            let mut full = vec![
                "--port".to_string(),
                port.to_string(),
                "--bind".into(),
                "127.0.0.1".into(),
                "--dir".into(),
                dir.path().display().to_string(),
                "--save".into(),
                String::new(),
                "--appendonly".into(),
                "no".into(),
                "--daemonize".into(),
                "no".into(),
                "--protected-mode".into(),
                "no".into(),
            ];
            if args.contains(&"--cluster-enabled") && !args.contains(&"--cluster-port") {
                full.extend(["--cluster-port".to_string(), free_port().to_string()]);
            }
            full.extend(args.iter().map(|a| a.to_string()));
            let server = RedisServer {
                process: ServerProcess::new(),
                port,
                args: full,
                log: dir.path().join("redis.log"),
                dir,
            };
            server.spawn_and_wait(&program)?;
            Ok(server)
        })
    }

    /// One server per test process, started on first use and shared by every test in
    /// it. Do not pause, kill or restart it: other tests use it concurrently. It dies
    /// with the process; its directory is removed at normal exit.
    pub fn shared() -> &'static RedisServer {
        static SHARED: OnceLock<RedisServer> = OnceLock::new();
        SHARED.get_or_init(|| {
            at_exit(|| {
                if let Some(server) = SHARED.get() {
                    if server.process.kill_at_exit() {
                        let _ = std::fs::remove_dir_all(server.dir());
                    }
                }
            });
            RedisServer::start()
        })
    }

    fn spawn_and_wait(&self, program: &Path) -> Result<(), String> {
        let mut command = Command::new(program);
        command.args(&self.args).current_dir(self.dir.path());
        self.process
            .start(command, &self.log)
            .map_err(|e| format!("cannot spawn {}: {e}", program.display()))?;
        let what = format!("redis-server on port {}", self.port);
        let result = wait_ready(&self.process, &self.log, &what, READY_TIMEOUT, || {
            self.ping(Duration::from_millis(500))
        });
        if result.is_err() {
            self.process.kill();
        }
        result
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The pid of the server process (of the last one, after [`RedisServer::kill`]).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The server's working directory (it also holds `redis.log`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The file receiving the server's stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of the server log, for diagnostics.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }

    /// Whether the server process is running (paused counts as running).
    pub fn is_running(&self) -> bool {
        self.process.is_running()
    }

    /// Sends a raw `PING` and reports whether `+PONG` (or `-NOAUTH`, for a server
    /// started with a password) arrives within `timeout`.
    pub fn ping(&self, timeout: Duration) -> bool {
        exchange(self.port, b"PING\r\n", timeout, |a| a.ends_with(b"\r\n"))
            .is_ok_and(|a| a.starts_with(b"+PONG") || a.starts_with(b"-NOAUTH"))
    }

    /// Freezes the server with SIGSTOP: connections stay open, nothing is answered.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// Thaws a [`RedisServer::pause`]d server with SIGCONT.
    pub fn resume(&self) {
        self.process.resume();
    }

    /// Kills the server with SIGKILL and reaps it. The port and directory are kept for
    /// [`RedisServer::restart`]. Does nothing if it is not running.
    pub fn kill(&self) {
        self.process.kill();
    }

    /// Starts the server again on the same port and directory, with the same
    /// arguments, killing it first if it still runs, and waits until it answers. The
    /// data set is empty afterwards (no persistence).
    pub fn restart(&self) {
        let program = require_program("redis-server", "redis-server");
        self.process.kill();
        with_retries(&format!("redis-server again on port {}", self.port), || {
            self.spawn_and_wait(&program)
        });
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.process.kill();
    }
}
