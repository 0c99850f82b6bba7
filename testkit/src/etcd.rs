//! A throwaway single-node `etcd` (and the member type of [`crate::EtcdCluster`]).

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::binaries::require_program;
use crate::launch::with_retries;
use crate::net::http;
use crate::netns::in_namespace;
use crate::port::free_ports;
use crate::process::at_exit;
use crate::scratch::Scratch;
use crate::server::Server;

/// How long a start or restart may take before it counts as failed.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// Timeout of one HTTP probe.
const PROBE_TIMEOUT: Duration = Duration::from_millis(1000);

/// An `etcd` member on free loopback client and peer ports, with its data directory in
/// a temporary directory. Killed (SIGKILL) when dropped.
///
/// Started alone by [`EtcdServer::start`], it is a one-node cluster with fast raft
/// timing (`--heartbeat-interval 50 --election-timeout 500`). [`crate::EtcdCluster`]
/// hands out its members as `EtcdServer`s too.
pub struct EtcdServer {
    core: Server,
    name: String,
    /// The address it listens on: 127.0.0.1, or its own in a network namespace.
    ip: Ipv4Addr,
    /// The network namespace it runs in (see [`crate::NetLab`]), if any.
    netns: Option<String>,
    client_port: u16,
    peer_port: u16,
    args: Vec<String>,
    /// Member of a multi-node cluster: a restart waits only until it answers, since it
    /// may be unable to find a leader alone.
    clustered: bool,
}

/// What a member needs to know to start.
pub(crate) struct MemberSpec<'a> {
    pub(crate) name: &'a str,
    pub(crate) client_port: u16,
    pub(crate) peer_port: u16,
    pub(crate) initial_cluster: &'a str,
    pub(crate) token: &'a str,
    pub(crate) clustered: bool,
    pub(crate) extra: &'a [&'a str],
    /// Where it listens (127.0.0.1 unless in a namespace).
    pub(crate) ip: Ipv4Addr,
    /// The network namespace to run in, if any.
    pub(crate) netns: Option<&'a str>,
}

impl EtcdServer {
    /// Starts a one-node etcd and waits until `/health` reports `"health":"true"`.
    ///
    /// Panics if `etcd` is not installed or does not come up.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Like [`EtcdServer::start`] with extra `etcd` flags appended after the defaults;
    /// a repeated flag takes its last value, so e.g. `&["--heartbeat-interval", "100",
    /// "--election-timeout", "1000"]` overrides the fast defaults.
    pub fn start_with(args: &[&str]) -> Self {
        Self::start_single("etcd", |_| args.iter().map(|a| a.to_string()).collect())
    }

    /// Starts a one-node etcd that also serves clients over TLS with the given PEM
    /// certificate and key, and returns it with the TLS client port. The plain client port
    /// ([`EtcdServer::client_port`]) stays open for the readiness probe and for tests.
    pub fn start_tls(cert: &Path, key: &Path) -> (Self, u16) {
        let tls_port = free_ports(1)[0];
        let server = Self::start_single("etcd (TLS)", |client_port| {
            let urls = format!("http://127.0.0.1:{client_port},https://127.0.0.1:{tls_port}");
            vec![
                "--listen-client-urls".into(),
                urls.clone(),
                "--advertise-client-urls".into(),
                urls,
                "--cert-file".into(),
                cert.display().to_string(),
                "--key-file".into(),
                key.display().to_string(),
            ]
        });
        (server, tls_port)
    }

    /// Starts a one-node cluster on fresh ports with the extra flags `extra(client_port)`
    /// and waits until it is healthy, retrying on new ports.
    fn start_single(what: &str, extra: impl Fn(u16) -> Vec<String>) -> Self {
        with_retries(what, || {
            let ports = free_ports(2);
            let (client_port, peer_port) = (ports[0], ports[1]);
            let initial_cluster = format!("n0=http://127.0.0.1:{peer_port}");
            let token = format!("fencelock-{client_port}");
            let extra = extra(client_port);
            let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
            let server = EtcdServer::spawn_member(&MemberSpec {
                name: "n0",
                client_port,
                peer_port,
                initial_cluster: &initial_cluster,
                token: &token,
                clustered: false,
                extra: &extra,
                ip: Ipv4Addr::LOCALHOST,
                netns: None,
            })?;
            server.wait_up(true)?;
            Ok(server)
        })
    }

    /// One server per test process, started on first use and shared by every test in
    /// it. Do not pause, kill or restart it: other tests use it concurrently. It dies
    /// with the process; its directory is removed at normal exit.
    pub fn shared() -> &'static EtcdServer {
        static SHARED: OnceLock<EtcdServer> = OnceLock::new();
        SHARED.get_or_init(|| {
            at_exit(|| {
                // Its directory, a `Scratch`, is removed by that module's exit hook.
                if let Some(server) = SHARED.get() {
                    server.process.kill_at_exit();
                }
            });
            EtcdServer::start()
        })
    }

    /// Creates the member's directory and spawns it, without waiting.
    pub(crate) fn spawn_member(spec: &MemberSpec<'_>) -> Result<EtcdServer, String> {
        let dir = Scratch::new("fencelock-etcd-")?;
        let client_url = format!("http://{}:{}", spec.ip, spec.client_port);
        let peer_url = format!("http://{}:{}", spec.ip, spec.peer_port);
        let mut args: Vec<String> = [
            "--name",
            spec.name,
            "--data-dir",
            &dir.path().join("data").display().to_string(),
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            spec.initial_cluster,
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            spec.token,
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(spec.extra.iter().map(|s| s.to_string()));
        let server = EtcdServer {
            core: Server::new(dir, "etcd.log"),
            name: spec.name.to_string(),
            ip: spec.ip,
            netns: spec.netns.map(str::to_owned),
            client_port: spec.client_port,
            peer_port: spec.peer_port,
            args,
            clustered: spec.clustered,
        };
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&self) -> Result<(), String> {
        let program = require_program("etcd", "etcd-server");
        let mut command = Command::new(&program);
        command.args(&self.args).current_dir(self.core.dir.path());
        if cfg!(target_arch = "aarch64") {
            // etcd 3.4 refuses to start on arm64 without this.
            command.env("ETCD_UNSUPPORTED_ARCH", "arm64");
        }
        if let Some(namespace) = &self.netns {
            command = in_namespace(namespace, &command);
        }
        self.core
            .process
            .start(command, &self.core.log)
            .map_err(|e| format!("cannot spawn {}: {e}", program.display()))
    }

    /// Waits until the member is healthy (`healthy`) or merely answers HTTP; kills it
    /// on failure.
    pub(crate) fn wait_up(&self, healthy: bool) -> Result<(), String> {
        let what = format!("etcd member {} on port {}", self.name, self.client_port);
        self.core.wait_ready(&what, READY_TIMEOUT, || {
            if healthy {
                self.is_healthy()
            } else {
                self.health_body().is_some()
            }
        })
    }

    /// The response to `GET /health`, if the member answers.
    fn health_body(&self) -> Option<String> {
        http(
            self.ip,
            self.client_port,
            "GET",
            "/health",
            "",
            PROBE_TIMEOUT,
        )
        .ok()
        .filter(|r| r.contains("\"health\""))
    }

    /// Whether `GET /health` says `"health":"true"` (the member sees a leader), or,
    /// failing that, the maintenance status names a leader.
    pub fn is_healthy(&self) -> bool {
        self.health_body()
            .is_some_and(|body| body.contains("\"health\":\"true\""))
            || self
                .status()
                .is_some_and(|(_, leader)| !leader.is_empty() && leader != "0")
    }

    /// `(member_id, leader_id)` from `POST /v3/maintenance/status`, as decimal strings.
    pub(crate) fn status(&self) -> Option<(String, String)> {
        let response = http(
            self.ip,
            self.client_port,
            "POST",
            "/v3/maintenance/status",
            "{}",
            PROBE_TIMEOUT,
        )
        .ok()?;
        Some((
            json_string_field(&response, "member_id")?,
            json_string_field(&response, "leader")?,
        ))
    }

    /// The sum of the Prometheus samples named `name` (any labels) on `GET /metrics`, or
    /// `None` if the server does not answer or has no such sample. For example
    /// `etcd_debugging_mvcc_watch_stream_total`, the number of open watch streams.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let response = http(
            self.ip,
            self.client_port,
            "GET",
            "/metrics",
            "",
            PROBE_TIMEOUT,
        )
        .ok()?;
        let (head, body) = response.split_once("\r\n\r\n")?;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)?
        } else {
            body.to_owned()
        };
        let samples: Vec<f64> = body
            .lines()
            .filter(|line| {
                line.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse().ok())
            .collect();
        (!samples.is_empty()).then(|| samples.iter().sum())
    }

    /// The member name (`n0` for a single server, `m0`, `m1`, ... in a cluster).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The raft peer port.
    pub fn peer_port(&self) -> u16 {
        self.peer_port
    }

    /// `127.0.0.1:PORT` (client port); `IP:PORT` for a member in a network namespace.
    pub fn endpoint(&self) -> String {
        format!("{}:{}", self.ip, self.client_port)
    }

    /// `http://127.0.0.1:PORT` (client port); `http://IP:PORT` in a network namespace.
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.ip, self.client_port)
    }

    /// The address it listens on: 127.0.0.1, or its own in a network namespace.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The network namespace it runs in, if any (see [`EtcdCluster::start_isolated`]).
    ///
    /// [`EtcdCluster::start_isolated`]: crate::EtcdCluster::start_isolated
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_deref()
    }

    /// Starts the server again on the same ports and data directory (the data
    /// persists), killing it first if it still runs. A single server is waited for
    /// until healthy; a cluster member only until it answers, since it may need other
    /// members to elect a leader.
    pub fn restart(&self) {
        self.core.process.kill();
        with_retries(
            &format!(
                "etcd member {} again on port {}",
                self.name, self.client_port
            ),
            || {
                self.spawn()?;
                self.wait_up(!self.clustered)
            },
        );
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.core.process.kill();
    }
}

/// The value of the first `"key":"value"` string field in a JSON text (etcd's gateway
/// encodes 64-bit ids as strings). Good enough for the fixed shapes etcd returns.
fn json_string_field(json: &str, key: &str) -> Option<String> {
    let pattern = format!("\"{key}\":\"");
    let start = json.find(&pattern)? + pattern.len();
    let len = json[start..].find('"')?;
    Some(json[start..start + len].to_string())
}

impl std::ops::Deref for EtcdServer {
    type Target = Server;

    /// The process, directory and log, with the fault controls (`pause`, `kill`, ...).
    fn deref(&self) -> &Server {
        &self.core
    }
}

/// The body of a `Transfer-Encoding: chunked` HTTP response.
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size..)?.strip_prefix("\r\n")?;
    }
}
