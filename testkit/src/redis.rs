//! A throwaway `redis-server`.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::binaries::require_program;
use crate::launch::with_retries;
use crate::net::exchange;
use crate::port::{free_port, port_open};
use crate::process::at_exit;
use crate::scratch::Scratch;
use crate::server::Server;
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
    core: Server,
    port: u16,
    /// Whether the port speaks TLS only.
    tls: bool,
    args: Vec<String>,
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
        Self::start_tls_with(certs, auth_clients, &[])
    }

    /// Like [`RedisServer::start_tls`], with extra `redis-server` arguments appended
    /// after the TLS ones (later arguments win), e.g. `&["--tls-replication", "yes",
    /// "--replicaof", "127.0.0.1", "6380"]` or `&["--cluster-enabled", "yes",
    /// "--tls-cluster", "yes"]`. In cluster mode a free cluster bus port is chosen with
    /// `--cluster-port` unless one is given.
    ///
    /// The server also gets `certs`' client certificate for the connections it opens
    /// itself (`--tls-client-cert-file`, `--tls-client-key-file`: replication and the
    /// cluster bus), so that peers started with `auth_clients` accept it.
    pub fn start_tls_with(certs: &TestCertificates, auth_clients: bool, args: &[&str]) -> Self {
        Self::start_on("redis-server (TLS)", true, |port| {
            let mut all: Vec<String> = [
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
                "--tls-client-cert-file",
                &certs.client_cert().display().to_string(),
                "--tls-client-key-file",
                &certs.client_key().display().to_string(),
            ]
            .iter()
            .map(|a| a.to_string())
            .collect();
            all.extend(args.iter().map(|a| a.to_string()));
            all
        })
    }

    /// Starts a server on a fresh port with the extra arguments `extra(port)` appended
    /// after the defaults, retrying on new ports.
    fn start_on(what: &str, tls: bool, extra: impl Fn(u16) -> Vec<String>) -> Self {
        let program = require_program("redis-server", "redis-server");
        with_retries(what, || {
            let dir = Scratch::new("fencelock-redis-")?;
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
                core: Server::new(dir, "redis.log"),
                port,
                tls,
                args: full,
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
                // Its directory, a `Scratch`, is removed by that module's exit hook.
                if let Some(server) = SHARED.get() {
                    server.process.kill_at_exit();
                }
            });
            RedisServer::start()
        })
    }

    fn spawn_and_wait(&self, program: &Path) -> Result<(), String> {
        let mut command = Command::new(program);
        command.args(&self.args).current_dir(self.core.dir.path());
        // The log is appended to across restarts: only what this start writes counts.
        let log_start = std::fs::metadata(&self.core.log).map_or(0, |m| m.len());
        self.core
            .process
            .start(command, &self.core.log)
            .map_err(|e| format!("cannot spawn {}: {e}", program.display()))?;
        let what = format!("redis-server on port {}", self.port);
        self.core.wait_ready(&what, READY_TIMEOUT, || {
            if self.tls {
                // No TLS client here: trust the server's own word, then the port.
                std::fs::read(&self.core.log).is_ok_and(|log| {
                    let new = log.get(log_start as usize..).unwrap_or_default();
                    String::from_utf8_lossy(new).contains("Ready to accept connections")
                }) && port_open(self.port)
            } else {
                self.ping(Duration::from_millis(500))
            }
        })
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

    /// Starts the server again on the same port and directory, with the same
    /// arguments, killing it first if it still runs, and waits until it answers. The
    /// data set is empty afterwards (no persistence).
    pub fn restart(&self) {
        let program = require_program("redis-server", "redis-server");
        self.core.process.kill();
        with_retries(&format!("redis-server again on port {}", self.port), || {
            self.spawn_and_wait(&program)
        });
    }
}

/// The `redis-cli` options that make it speak TLS to servers started with `certs`: trust
/// the CA, and present the client certificate (for servers started with
/// `--tls-auth-clients yes`).
pub(crate) fn cli_tls_args(certs: &TestCertificates) -> Vec<String> {
    vec![
        "--tls".into(),
        "--cacert".into(),
        certs.ca().display().to_string(),
        "--cert".into(),
        certs.client_cert().display().to_string(),
        "--key".into(),
        certs.client_key().display().to_string(),
    ]
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.core.process.kill();
    }
}

impl std::ops::Deref for RedisServer {
    type Target = Server;

    /// The process, directory and log, with the fault controls (`pause`, `kill`, ...).
    fn deref(&self) -> &Server {
        &self.core
    }
}
