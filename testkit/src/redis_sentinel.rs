//! A throwaway Redis master with one replica, watched by three Sentinels.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::binaries::require_program;
use crate::launch::{wait_ready, with_retries};
use crate::net::exchange;
use crate::port::free_port;
use crate::process::ServerProcess;
use crate::{FaultProxy, RedisServer};

/// The master name the Sentinels monitor.
pub const SENTINEL_SERVICE: &str = "fencelock";

/// One `redis-server --sentinel` process.
pub struct RedisSentinel {
    process: ServerProcess,
    port: u16,
    /// The Sentinel's own `requirepass`, if any.
    password: Option<String>,
    _dir: TempDir,
}

/// What the Sentinels of a set need to know besides the master's port.
#[derive(Clone, Copy, Default)]
struct SentinelAuth<'a> {
    /// The password of the monitored master and replica (`sentinel auth-pass`).
    master: Option<&'a str>,
    /// The Sentinels' own password (`requirepass` and `sentinel sentinel-pass`).
    sentinel: Option<&'a str>,
}

impl RedisSentinel {
    fn start(master_port: u16, auth: SentinelAuth<'_>) -> Self {
        let program = require_program("redis-server", "redis-server");
        with_retries("redis sentinel", || {
            let dir = tempfile::Builder::new()
                .prefix("fencelock-sentinel-")
                .tempdir()
                .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
            let port = free_port();
            let conf: PathBuf = dir.path().join("sentinel.conf");
            let mut text = format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\nprotected-mode no\ndir {dir}\n\
                 sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master_port} 2\n\
                 sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n\
                 sentinel failover-timeout {SENTINEL_SERVICE} 3000\n\
                 sentinel parallel-syncs {SENTINEL_SERVICE} 1\n",
                dir = dir.path().display()
            );
            if let Some(password) = auth.master {
                text.push_str(&format!(
                    "sentinel auth-pass {SENTINEL_SERVICE} {password}\n"
                ));
            }
            if let Some(password) = auth.sentinel {
                text.push_str(&format!(
                    "requirepass {password}\nsentinel sentinel-pass {password}\n"
                ));
            }
            std::fs::write(&conf, text).map_err(|e| format!("cannot write {conf:?}: {e}"))?;
            let log = dir.path().join("sentinel.log");
            let sentinel = RedisSentinel {
                process: ServerProcess::new(),
                port,
                password: auth.sentinel.map(str::to_owned),
                _dir: dir,
            };
            let mut command = Command::new(&program);
            command.arg(&conf).arg("--sentinel");
            sentinel
                .process
                .start(command, &log)
                .map_err(|e| format!("cannot spawn redis-server --sentinel: {e}"))?;
            let what = format!("redis sentinel on port {port}");
            let result = wait_ready(
                &sentinel.process,
                &log,
                &what,
                Duration::from_secs(15),
                || {
                    sentinel
                        .exchange("PING\r\n", |a| a.ends_with(b"\r\n"))
                        .is_some_and(|a| a.starts_with(b"+PONG"))
                },
            );
            if let Err(e) = result {
                sentinel.process.kill();
                return Err(e);
            }
            Ok(sentinel)
        })
    }

    /// The Sentinel's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sends `request` (after an `AUTH` with the Sentinel's password, if it has one, whose
    /// `+OK` is cut from the answer) and reads until `complete` says the answer is whole.
    fn exchange(&self, request: &str, complete: impl Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
        const OK: &[u8] = b"+OK\r\n";
        let timeout = Duration::from_millis(500);
        match &self.password {
            None => exchange(self.port, request.as_bytes(), timeout, complete).ok(),
            Some(password) => {
                let request = format!("AUTH {password}\r\n{request}",);
                let answer = exchange(self.port, request.as_bytes(), timeout, |a| {
                    a.strip_prefix(OK).is_some_and(&complete)
                })
                .ok()?;
                answer.strip_prefix(OK).map(<[u8]>::to_vec)
            }
        }
    }

    /// The master address this Sentinel currently reports, as `127.0.0.1:PORT`.
    pub fn master_addr(&self) -> Option<String> {
        let request = format!("SENTINEL get-master-addr-by-name {SENTINEL_SERVICE}\r\n");
        let answer = self.exchange(&request, |a| {
            a.iter().filter(|&&b| b == b'\n').count() >= 5 || a.starts_with(b"*-1")
        })?;
        let text = String::from_utf8_lossy(&answer);
        let lines: Vec<&str> = text.split("\r\n").collect();
        (lines.len() >= 5 && lines[0] == "*2").then(|| format!("{}:{}", lines[2], lines[4]))
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        self.process.kill();
    }
}

/// A master, one replica and three Sentinels (quorum 2, down-after 1 s), optionally
/// with passwords ([`RedisSentinelSet::start_with_password`]). Killed when dropped.
///
/// ```no_run
/// let set = fencelock_testkit::RedisSentinelSet::start();
/// println!("connect to {}", set.url());
/// ```
pub struct RedisSentinelSet {
    master: RedisServer,
    replica: RedisServer,
    sentinels: Vec<RedisSentinel>,
    password: Option<String>,
    /// The proxy in front of the master ([`RedisSentinelSet::start_behind_proxy`]).
    proxy: Option<FaultProxy>,
}

impl RedisSentinelSet {
    /// Starts everything and waits until the replica is in sync and every Sentinel
    /// knows the master and the replica.
    pub fn start() -> Self {
        Self::start_set(SentinelAuth::default(), false)
    }

    /// Like [`RedisSentinelSet::start`], with a [`FaultProxy`] in front of the master:
    /// the Sentinels monitor the proxy's address and the replica replicates through it,
    /// so every client the Sentinels send to the master connects through the proxy.
    ///
    /// To cut one client off: connect the clients that must keep working, call
    /// [`FaultProxy::exempt_open_connections`] (which also exempts the Sentinels' and
    /// the replica's links, so that no failover follows), connect the client to cut
    /// off, then set the fault.
    pub fn start_behind_proxy() -> Self {
        Self::start_set(SentinelAuth::default(), true)
    }

    /// Like [`RedisSentinelSet::start`], with the master and the replica started with
    /// `--requirepass PASSWORD --masterauth PASSWORD` (clients authenticate as the
    /// `default` user; the replica, and after a failover the old master, authenticate to
    /// their master) and the Sentinels configured with `sentinel auth-pass`. With
    /// `sentinel_password`, the Sentinels also require that password themselves
    /// (`requirepass`; `sentinel sentinel-pass` among each other).
    pub fn start_with_password(password: &str, sentinel_password: Option<&str>) -> Self {
        Self::start_set(
            SentinelAuth {
                master: Some(password),
                sentinel: sentinel_password,
            },
            false,
        )
    }

    fn start_set(auth: SentinelAuth<'_>, behind_proxy: bool) -> Self {
        let auth_args: Vec<&str> = match auth.master {
            Some(password) => vec!["--requirepass", password, "--masterauth", password],
            None => Vec::new(),
        };
        let master = RedisServer::start_with(&auth_args);
        let proxy = behind_proxy.then(|| FaultProxy::start(&master.addr()));
        let announced = proxy.as_ref().map_or(master.port(), FaultProxy::port);
        let port = announced.to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &port];
        replica_args.extend(&auth_args);
        let replica = RedisServer::start_with(&replica_args);
        let sentinels: Vec<RedisSentinel> = (0..3)
            .map(|_| RedisSentinel::start(announced, auth))
            .collect();
        let set = RedisSentinelSet {
            master,
            replica,
            sentinels,
            password: auth.master.map(str::to_owned),
            proxy,
        };
        let cli = require_program("redis-cli", "redis-tools");
        let with_password = |password: Option<&str>| {
            let mut command = Command::new(&cli);
            if let Some(password) = password {
                command.args(["--no-auth-warning", "-a", password]);
            }
            command
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let synced = with_password(set.password.as_deref())
                .args(["-p", &set.replica.port().to_string(), "info", "replication"])
                .output()
                .is_ok_and(|o| {
                    String::from_utf8_lossy(&o.stdout).contains("master_link_status:up")
                });
            let known = set.sentinels.iter().all(|s| {
                with_password(s.password.as_deref())
                    .args([
                        "-p",
                        &s.port().to_string(),
                        "sentinel",
                        "replicas",
                        SENTINEL_SERVICE,
                    ])
                    .output()
                    .is_ok_and(|o| {
                        !o.stdout.trim_ascii().is_empty() && !o.stdout.starts_with(b"NOAUTH")
                    })
                    && s.master_addr().is_some()
            });
            if synced && known {
                return set;
            }
            assert!(
                Instant::now() < deadline,
                "fencelock-testkit: the Sentinel set did not come up"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The proxy in front of the master ([`RedisSentinelSet::start_behind_proxy`]).
    pub fn proxy(&self) -> Option<&FaultProxy> {
        self.proxy.as_ref()
    }

    /// The initial master.
    pub fn master(&self) -> &RedisServer {
        &self.master
    }

    /// The initial replica.
    pub fn replica(&self) -> &RedisServer {
        &self.replica
    }

    /// The Sentinels.
    pub fn sentinels(&self) -> &[RedisSentinel] {
        &self.sentinels
    }

    /// The password of the master and the replica
    /// ([`RedisSentinelSet::start_with_password`]).
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// `redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/fencelock`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!("redis+sentinel://{}/{SENTINEL_SERVICE}", hosts.join(","))
    }
}
