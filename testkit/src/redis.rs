//! A throwaway `redis-server`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use tempfile::TempDir;

use crate::binaries::require_program;
use crate::launch::{log_tail, wait_ready, with_retries};
use crate::net::exchange;
use crate::port::{free_port, port_open};
use crate::process::{ServerProcess, at_exit};
use crate::tls::TestCertificates;

/// How long a start or restart may take before it counts as failed.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// A `redis-server` on a free loopback port, in its own temporary directory, with no
/// persistence (`--save "" --appendonly no`). Killed (SIGKILL) when dropped.
///
/// [`RedisServer::start_tls`] starts one that speaks only TLS.
///
/// ```no_run
/// let redis = fencelock_testkit::RedisServer::start();
/// println!("connect to {}", redis.url());
/// ```
pub struct RedisServer {
    process: ServerProcess,
    port: u16,
    /// Whether the port speaks TLS only.
    tls: bool,
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
        Self::start_on("redis-server", false, |_| {
            args.iter().map(|a| a.to_string()).collect()
        })
    }

    /// Starts a server that listens only on TLS (`--port 0 --tls-port PORT`), on
    /// 127.0.0.1, with `certs`' server certificate (valid for `127.0.0.1` and
    /// `localhost`). With `auth_clients` it requires a client certificate signed by
    /// `certs`' CA (`--tls-auth-clients yes`); otherwise it asks for none. Waits until
    /// the server logs that it is ready and the port accepts connections.
    ///
    /// [`RedisServer::port`] is the TLS port and [`RedisServer::url`] a `rediss://` URL;
    /// clients must trust [`TestCertificates::ca`].
    ///
    /// Panics if `redis-server` is not installed, was built without TLS, or does not
    /// come up.
    pub fn start_tls(certs: &TestCertificates, auth_clients: bool) -> Self {
        Self::start_on("redis-server (TLS)", true, |port| {
            [
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &certs.server_cert().display().to_string(),
                "--tls-key-file",
                &certs.server_key().display().to_string(),
                "--tls-ca-cert-file",
                &certs.ca().display().to_string(),
                "--tls-auth-clients",
                if auth_clients { "yes" } else { "no" },
            ]
            .iter()
            .map(|a| a.to_string())
            .collect()
        })
    }

    /// Starts a server on a fresh port with the extra arguments `extra(port)` appended
    /// after the defaults, retrying on new ports.
    fn start_on(what: &str, tls: bool, extra: impl Fn(u16) -> Vec<String>) -> Self {
        let program = require_program("redis-server", "redis-server");
        with_retries(what, || {
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
            let args = extra(port);
            if args.iter().any(|a| a == "--cluster-enabled")
                && !args.iter().any(|a| a == "--cluster-port")
            {
                full.extend(["--cluster-port".to_string(), free_port().to_string()]);
            }
            full.extend(args);
            let server = RedisServer {
                process: ServerProcess::new(),
                port,
                tls,
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
        // The log is appended to across restarts: only what this start writes counts.
        let log_start = std::fs::metadata(&self.log).map_or(0, |m| m.len());
        self.process
            .start(command, &self.log)
            .map_err(|e| format!("cannot spawn {}: {e}", program.display()))?;
        let what = format!("redis-server on port {}", self.port);
        let result = wait_ready(&self.process, &self.log, &what, READY_TIMEOUT, || {
            if self.tls {
                // No TLS client here: trust the server's own word, then the port.
                std::fs::read(&self.log).is_ok_and(|log| {
                    let new = log.get(log_start as usize..).unwrap_or_default();
                    String::from_utf8_lossy(new).contains("Ready to accept connections")
                }) && port_open(self.port)
            } else {
                self.ping(Duration::from_millis(500))
            }
        });
        if result.is_err() {
            self.process.kill();
        }
        result
    }

    /// The TCP port (the TLS port of a [`RedisServer::start_tls`] server).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `redis://127.0.0.1:PORT`, or `rediss://127.0.0.1:PORT` for a
    /// [`RedisServer::start_tls`] server.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Whether the server speaks only TLS ([`RedisServer::start_tls`]).
    pub fn is_tls(&self) -> bool {
        self.tls
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
    /// started with a password) arrives within `timeout`. A TLS server cannot be pinged
    /// without a TLS client: for it, whether the port accepts TCP connections.
    pub fn ping(&self, timeout: Duration) -> bool {
        if self.tls {
            return port_open(self.port);
        }
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
