//! A throwaway Redis master with one replica, watched by three Sentinels.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::binaries::require_program;
use crate::launch::{wait_ready, with_retries};
use crate::net::exchange;
use crate::port::free_port;
use crate::process::ServerProcess;
use crate::redis::cli_tls_args;
use crate::scratch::Scratch;
use crate::{FaultProxy, RedisServer, TestCertificates};

/// The master name the Sentinels monitor.
pub const SENTINEL_SERVICE: &str = "fencelock";

/// One `redis-server --sentinel` process.
pub struct RedisSentinel {
    process: ServerProcess,
    port: u16,
    /// The Sentinel's own `requirepass`, if any.
    password: Option<String>,
    /// `redis-cli`'s TLS options, for a Sentinel that listens only on TLS (empty
    /// otherwise).
    cli_tls: Vec<String>,
    _dir: Scratch,
}

/// How the servers and Sentinels of a TLS set are started.
#[derive(Clone, Copy)]
struct SetTls<'a> {
    certs: &'a TestCertificates,
    auth_clients: bool,
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
    fn start(master_port: u16, auth: SentinelAuth<'_>, tls: Option<SetTls<'_>>) -> Self {
        let program = require_program("redis-server", "redis-server");
        with_retries("redis sentinel", || {
            let dir = Scratch::new("fencelock-sentinel-")?;
            let port = free_port();
            let conf: PathBuf = dir.path().join("sentinel.conf");
            let listen = match tls {
                // TLS only, to clients, to the monitored servers and to the other
                // Sentinels (`tls-replication`), which learn its TLS port.
                Some(tls) => format!(
                    "port 0\ntls-port {port}\ntls-cert-file {}\ntls-key-file {}\n\
                     tls-ca-cert-file {}\ntls-auth-clients {}\ntls-replication yes\n\
                     tls-client-cert-file {}\ntls-client-key-file {}\n",
                    tls.certs.server_cert().display(),
                    tls.certs.server_key().display(),
                    tls.certs.ca().display(),
                    if tls.auth_clients { "yes" } else { "no" },
                    tls.certs.client_cert().display(),
                    tls.certs.client_key().display(),
                ),
                None => format!("port {port}\n"),
            };
            let mut text = format!(
                "{listen}bind 127.0.0.1\ndaemonize no\nprotected-mode no\ndir {dir}\n\
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
                cli_tls: tls.map_or_else(Vec::new, |tls| cli_tls_args(tls.certs)),
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
                    if sentinel.cli_tls.is_empty() {
                        sentinel
                            .exchange("PING\r\n", |a| a.ends_with(b"\r\n"))
                            .is_some_and(|a| a.starts_with(b"+PONG"))
                    } else {
                        sentinel.cli(&["PING"]).is_some_and(|a| a.trim() == "PONG")
                    }
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

    /// Whether the Sentinel speaks only TLS ([`RedisSentinelSet::start_tls`]).
    pub fn is_tls(&self) -> bool {
        !self.cli_tls.is_empty()
    }

    /// `redis-cli` against this Sentinel: with its TLS options and password, if any.
    /// Returns the standard output, or `None` if it could not run, failed or printed an
    /// error reply.
    fn cli(&self, args: &[&str]) -> Option<String> {
        let mut command = Command::new(require_program("redis-cli", "redis-tools"));
        command.args(&self.cli_tls);
        if let Some(password) = &self.password {
            command.args(["--no-auth-warning", "-a", password]);
        }
        let output = command
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let failed = !output.status.success()
            || text.starts_with("ERR")
            || text.starts_with("NOAUTH")
            || text.starts_with("WRONGPASS")
            || text.contains("Could not connect");
        (!failed).then_some(text)
    }

    /// The master address this Sentinel currently reports, as `127.0.0.1:PORT`.
    pub fn master_addr(&self) -> Option<String> {
        if self.is_tls() {
            // No TLS client here: ask through redis-cli, which prints one field a line.
            let text = self.cli(&["SENTINEL", "get-master-addr-by-name", SENTINEL_SERVICE])?;
            let lines: Vec<&str> = text.lines().map(str::trim).collect();
            return match lines.as_slice() {
                [host, port] if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    Some(format!("{host}:{port}"))
                }
                _ => None,
            };
        }
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
/// with passwords ([`RedisSentinelSet::start_with_password`]) and TLS
/// ([`RedisSentinelSet::start_tls`]). Killed when dropped.
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
    /// Whether everything speaks only TLS ([`RedisSentinelSet::start_tls`]).
    tls: bool,
}

impl RedisSentinelSet {
    /// Starts everything and waits until the replica is in sync and every Sentinel
    /// knows the master and the replica.
    pub fn start() -> Self {
        Self::start_set(SentinelAuth::default(), false, None)
    }

    /// Like [`RedisSentinelSet::start_with_password`] (no passwords with `None`), with
    /// the master, the replica and the Sentinels listening only on TLS (`--port 0`,
    /// `certs`' server certificate; with `auth_clients` a client certificate required)
    /// and talking TLS to each other (`tls-replication yes`: replication, and the
    /// Sentinels' links to the servers and to each other). Servers and Sentinels present
    /// `certs`' client certificate on the connections they open.
    ///
    /// [`RedisSentinelSet::url`] is a `rediss+sentinel://` URL without options: clients
    /// must trust [`TestCertificates::ca`] (and, with `auth_clients`, present
    /// [`TestCertificates::client_cert`]), and give the Sentinels' password as
    /// `sentinel_password=`.
    pub fn start_tls(
        certs: &TestCertificates,
        password: Option<&str>,
        sentinel_password: Option<&str>,
        auth_clients: bool,
    ) -> Self {
        Self::start_set(
            SentinelAuth {
                master: password,
                sentinel: sentinel_password,
            },
            false,
            Some(SetTls {
                certs,
                auth_clients,
            }),
        )
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
        Self::start_set(SentinelAuth::default(), true, None)
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
            None,
        )
    }

    fn start_set(auth: SentinelAuth<'_>, behind_proxy: bool, tls: Option<SetTls<'_>>) -> Self {
        let mut auth_args: Vec<&str> = match auth.master {
            Some(password) => vec!["--requirepass", password, "--masterauth", password],
            None => Vec::new(),
        };
        if tls.is_some() {
            auth_args.extend(["--tls-replication", "yes"]);
        }
        let start_server = |args: &[&str]| match tls {
            Some(tls) => RedisServer::start_tls_with(tls.certs, tls.auth_clients, args),
            None => RedisServer::start_with(args),
        };
        let master = start_server(&auth_args);
        let proxy = behind_proxy.then(|| FaultProxy::start(&master.addr()));
        let announced = proxy.as_ref().map_or(master.port(), FaultProxy::port);
        let port = announced.to_string();
        let mut replica_args = vec!["--replicaof", "127.0.0.1", &port];
        replica_args.extend(&auth_args);
        let replica = start_server(&replica_args);
        let sentinels: Vec<RedisSentinel> = (0..3)
            .map(|_| RedisSentinel::start(announced, auth, tls))
            .collect();
        let set = RedisSentinelSet {
            master,
            replica,
            sentinels,
            password: auth.master.map(str::to_owned),
            proxy,
            tls: tls.is_some(),
        };
        let cli = require_program("redis-cli", "redis-tools");
        let cli_tls = tls.map_or_else(Vec::new, |tls| cli_tls_args(tls.certs));
        let with_password = |password: Option<&str>| {
            let mut command = Command::new(&cli);
            command.args(&cli_tls);
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

    /// `redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/fencelock`, or
    /// `rediss+sentinel://...` for a [`RedisSentinelSet::start_tls`] set.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        let scheme = if self.tls {
            "rediss+sentinel"
        } else {
            "redis+sentinel"
        };
        format!("{scheme}://{}/{SENTINEL_SERVICE}", hosts.join(","))
    }

    /// Whether everything speaks only TLS ([`RedisSentinelSet::start_tls`]).
    pub fn is_tls(&self) -> bool {
        self.tls
    }
}
