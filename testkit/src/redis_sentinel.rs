//! A throwaway Redis master with one replica, watched by three Sentinels.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::RedisServer;
use crate::binaries::require_program;
use crate::launch::{wait_ready, with_retries};
use crate::net::exchange;
use crate::port::free_port;
use crate::process::ServerProcess;

/// The master name the Sentinels monitor.
pub const SENTINEL_SERVICE: &str = "fencelock";

/// One `redis-server --sentinel` process.
pub struct RedisSentinel {
    process: ServerProcess,
    port: u16,
    _dir: TempDir,
}

impl RedisSentinel {
    fn start(master_port: u16) -> Self {
        let program = require_program("redis-server", "redis-server");
        with_retries("redis sentinel", || {
            let dir = tempfile::Builder::new()
                .prefix("fencelock-sentinel-")
                .tempdir()
                .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
            let port = free_port();
            let conf: PathBuf = dir.path().join("sentinel.conf");
            let text = format!(
                "port {port}\nbind 127.0.0.1\ndaemonize no\nprotected-mode no\ndir {dir}\n\
                 sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master_port} 2\n\
                 sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n\
                 sentinel failover-timeout {SENTINEL_SERVICE} 3000\n\
                 sentinel parallel-syncs {SENTINEL_SERVICE} 1\n",
                dir = dir.path().display()
            );
            std::fs::write(&conf, text).map_err(|e| format!("cannot write {conf:?}: {e}"))?;
            let log = dir.path().join("sentinel.log");
            let sentinel = RedisSentinel {
                process: ServerProcess::new(),
                port,
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
                    exchange(port, b"PING\r\n", Duration::from_millis(500), |a| {
                        a.ends_with(b"\r\n")
                    })
                    .is_ok_and(|a| a.starts_with(b"+PONG"))
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

    /// The master address this Sentinel currently reports, as `127.0.0.1:PORT`.
    pub fn master_addr(&self) -> Option<String> {
        let request = format!("SENTINEL get-master-addr-by-name {SENTINEL_SERVICE}\r\n");
        let answer = exchange(
            self.port,
            request.as_bytes(),
            Duration::from_millis(500),
            |a| a.iter().filter(|&&b| b == b'\n').count() >= 5 || a.starts_with(b"*-1"),
        )
        .ok()?;
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

/// A master, one replica and three Sentinels (quorum 2, down-after 1 s). Killed when
/// dropped.
///
/// ```no_run
/// let set = fencelock_testkit::RedisSentinelSet::start();
/// println!("connect to {}", set.url());
/// ```
pub struct RedisSentinelSet {
    master: RedisServer,
    replica: RedisServer,
    sentinels: Vec<RedisSentinel>,
}

impl RedisSentinelSet {
    /// Starts everything and waits until the replica is in sync and every Sentinel
    /// knows the master and the replica.
    pub fn start() -> Self {
        let master = RedisServer::start();
        let port = master.port().to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        let sentinels: Vec<RedisSentinel> = (0..3)
            .map(|_| RedisSentinel::start(master.port()))
            .collect();
        let set = RedisSentinelSet {
            master,
            replica,
            sentinels,
        };
        let cli = require_program("redis-cli", "redis-tools");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let synced = Command::new(&cli)
                .args(["-p", &set.replica.port().to_string(), "info", "replication"])
                .output()
                .is_ok_and(|o| {
                    String::from_utf8_lossy(&o.stdout).contains("master_link_status:up")
                });
            let known = set.sentinels.iter().all(|s| {
                Command::new(&cli)
                    .args([
                        "-p",
                        &s.port().to_string(),
                        "sentinel",
                        "replicas",
                        SENTINEL_SERVICE,
                    ])
                    .output()
                    .is_ok_and(|o| !o.stdout.trim_ascii().is_empty())
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
