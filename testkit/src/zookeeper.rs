//! A throwaway standalone ZooKeeper (and the member type of [`crate::ZkEnsemble`]).

use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use crate::binaries::{require_file, require_program};
use crate::launch::with_retries;
use crate::net::exchange_at;
use crate::netns::in_namespace;
use crate::port::free_port;
use crate::process::at_exit;
use crate::scratch::Scratch;
use crate::server::Server;
use crate::tls::TestCertificates;

/// How long a start or restart may take before it counts as failed (a JVM is slow).
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The server jar from Debian's `zookeeper` package. Its manifest `Class-Path` names
/// its dependencies (netty, jetty, jackson, slf4j-api, zookeeper-jute, ...) in
/// /usr/share/java, so the jar alone is enough to run the server.
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

/// An slf4j binding that writes to stderr (Debian's `libslf4j-java`, a dependency of
/// `zookeeper`). Without it the server logs nothing.
const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";

/// Netty jars the Netty connection factory (needed for TLS) uses that `zookeeper.jar`'s
/// manifest does not name (Debian's `libnetty-java`, a dependency of `zookeeper`):
/// `SslHandler` is a netty-codec decoder, and netty-transport needs the resolver.
const NETTY_EXTRA_JARS: &[&str] = &[
    "/usr/share/java/netty-codec.jar",
    "/usr/share/java/netty-resolver.jar",
    "/usr/share/java/netty-transport-native-unix-common.jar",
];

/// How a [`ZkServer`] started with [`ZkServer::start_secure`] protects its clients'
/// connections.
///
/// ```no_run
/// use fencelock_testkit::{TestCertificates, ZkSecurity, ZkServer};
///
/// let certs = TestCertificates::generate();
/// let server = ZkServer::start_secure(&ZkSecurity {
///     tls: Some(&certs),
///     client_auth: true,
///     sasl_users: vec![("app".into(), "s3cret".into())],
/// });
/// println!("zks://app:s3cret@127.0.0.1:{}?sasl=digest-md5", server.tls_port().unwrap());
/// ```
#[derive(Clone, Default)]
pub struct ZkSecurity<'a> {
    /// Serve TLS with these certificates on a second port, [`ZkServer::tls_port`]
    /// (`secureClientPort`, through the Netty connection factory; the server's key store
    /// and trust store are the PEM files). The plain [`ZkServer::port`] stays open for
    /// the testkit's four-letter-word probes (and for plain clients).
    pub tls: Option<&'a TestCertificates>,
    /// With `tls`: require a client certificate signed by the CA
    /// (`ssl.clientAuth=need`); otherwise none is asked for (`none`).
    pub client_auth: bool,
    /// SASL DIGEST-MD5 users, `(name, password)`, in a JAAS `Server` section
    /// (`DigestLoginModule`). When not empty, the server requires SASL authentication of
    /// every session (`enforce.auth.enabled=true`, `enforce.auth.schemes=sasl`): a client
    /// without it, or with a wrong password, is refused.
    pub sasl_users: Vec<(String, String)>,
}

/// The ZooKeeper settings every server here uses: `tickTime=500` so sessions as short
/// as 1 s are allowed, up to 60 s; no AdminServer (it would take port 8080); every
/// four-letter word allowed; no connection limit.
const BASE_CONFIG: &str = "tickTime=500
initLimit=20
syncLimit=10
minSessionTimeout=1000
maxSessionTimeout=60000
maxClientCnxns=0
admin.enableServer=false
4lw.commands.whitelist=*
";

/// A ZooKeeper server on a free loopback client port, with its `dataDir` in a
/// temporary directory, run directly with `java` (no `zkServer.sh`, which
/// daemonizes). Killed (SIGKILL) when dropped.
///
/// The transaction log is not fsynced (`zookeeper.forceSync=no`): data survives a
/// killed server (the page cache outlives the process), not a machine crash.
pub struct ZkServer {
    core: Server,
    /// The address it serves clients on: 127.0.0.1, or its own in a network namespace.
    ip: Ipv4Addr,
    /// The network namespace it runs in (see [`crate::NetLab`]), if any.
    netns: Option<String>,
    port: u16,
    main_class: &'static str,
    /// Member of an ensemble: a restart waits only until it answers `ruok`, since it
    /// may need other members to form a quorum.
    ensemble: bool,
    config: PathBuf,
    /// The TLS client port (`secureClientPort`), if TLS is served.
    tls_port: Option<u16>,
    /// JVM options for TLS and SASL (`-D...`), and whether the Netty jars are needed.
    jvm_options: Vec<String>,
    netty: bool,
    /// The file libfaketime reads the server's clock offset from, if it runs under it
    /// ([`ZkServer::start_with_fake_clock`]).
    fake_clock: Option<PathBuf>,
}

/// Where Debian's `libfaketime` puts the library: `/usr/lib/<multiarch>/faketime/`.
const LIBFAKETIME: &str = "faketime/libfaketime.so.1";

impl ZkServer {
    /// Starts a standalone server and waits until `srvr` reports `Mode: standalone`.
    ///
    /// Panics if `java` or the ZooKeeper jar is not installed, or the server does not
    /// come up within 30 s.
    pub fn start() -> Self {
        with_retries("ZooKeeper", || {
            let port = free_port();
            let server = ZkServer::spawn_member(
                port,
                "org.apache.zookeeper.server.ZooKeeperServerMain",
                "",
                None,
            )?;
            server.wait_up(|mode| mode == "standalone")?;
            Ok(server)
        })
    }

    /// Starts a standalone server with TLS and/or SASL as `security` says, and waits
    /// until it serves (judged on the plain port, see [`ZkSecurity::tls`]).
    ///
    /// Panics as [`ZkServer::start`] does.
    pub fn start_secure(security: &ZkSecurity<'_>) -> Self {
        Self::start_standalone("ZooKeeper (TLS/SASL)", Some(security), false)
    }

    /// A standalone server on 127.0.0.1 with `security` (if any), under libfaketime if
    /// `fake_clock`, waited for until it serves.
    fn start_standalone(what: &str, security: Option<&ZkSecurity<'_>>, fake_clock: bool) -> Self {
        with_retries(what, || {
            let port = free_port();
            let security = security.map(|security| (security, security.tls.map(|_| free_port())));
            let server = ZkServer::spawn_with(
                Ipv4Addr::LOCALHOST,
                None,
                port,
                "org.apache.zookeeper.server.ZooKeeperServerMain",
                "",
                None,
                security,
                fake_clock,
            )?;
            server.wait_up(|mode| mode == "standalone")?;
            Ok(server)
        })
    }

    /// A standalone server that also serves TLS on [`ZkServer::tls_port`] with `certs`,
    /// requiring client certificates if `client_auth` (see [`ZkSecurity`]).
    pub fn start_tls(certs: &TestCertificates, client_auth: bool) -> Self {
        Self::start_secure(&ZkSecurity {
            tls: Some(certs),
            client_auth,
            sasl_users: Vec::new(),
        })
    }

    /// A standalone server that requires SASL DIGEST-MD5 authentication of every
    /// session, with the `(name, password)` users (see [`ZkSecurity::sasl_users`]).
    pub fn start_sasl(users: &[(&str, &str)]) -> Self {
        Self::start_secure(&ZkSecurity {
            tls: None,
            client_auth: false,
            sasl_users: users
                .iter()
                .map(|(user, password)| (user.to_string(), password.to_string()))
                .collect(),
        })
    }

    /// A standalone server whose clocks [`ZkServer::jump_clock`] can move forward while
    /// it runs (F14): the JVM runs under libfaketime (Debian's `libfaketime`), whose
    /// offset moves its wall clock and its monotonic clock alike, so the session tracker
    /// sees time pass at once.
    ///
    /// Panics as [`ZkServer::start`] does, or if libfaketime is not installed.
    pub fn start_with_fake_clock() -> Self {
        Self::start_standalone("ZooKeeper (fake clock)", None, true)
    }

    /// Moves the server's clocks `by` further forward (offsets add up), as a clock that
    /// jumps would: sessions whose timeout has passed by the new time are expired at the
    /// tracker's next tick.
    ///
    /// Panics if the server was not started with [`ZkServer::start_with_fake_clock`].
    pub fn jump_clock(&self, by: Duration) {
        let file = self
            .fake_clock
            .as_ref()
            .expect("jump_clock needs ZkServer::start_with_fake_clock");
        let now: f64 = std::fs::read_to_string(file)
            .ok()
            .and_then(|text| text.trim().trim_start_matches('+').parse().ok())
            .unwrap_or(0.0);
        let offset = now + by.as_secs_f64();
        std::fs::write(file, format!("+{offset:.3}\n")).expect("write the clock offset");
    }

    /// One server per test process, started on first use and shared by every test in
    /// it. Do not pause, kill or restart it: other tests use it concurrently. It dies
    /// with the process; its directory is removed at normal exit.
    pub fn shared() -> &'static ZkServer {
        static SHARED: OnceLock<ZkServer> = OnceLock::new();
        SHARED.get_or_init(|| {
            at_exit(|| {
                // Its directory, a `Scratch`, is removed by that module's exit hook.
                if let Some(server) = SHARED.get() {
                    server.process.kill_at_exit();
                }
            });
            ZkServer::start()
        })
    }

    /// Writes the configuration (plus `extra_config` lines, and `myid` for an ensemble
    /// member) into a new temporary directory and spawns the server, without waiting.
    pub(crate) fn spawn_member(
        port: u16,
        main_class: &'static str,
        extra_config: &str,
        myid: Option<usize>,
    ) -> Result<ZkServer, String> {
        Self::spawn_member_at(
            Ipv4Addr::LOCALHOST,
            None,
            port,
            main_class,
            extra_config,
            myid,
        )
    }

    /// [`ZkServer::spawn_member`] serving clients on `ip`, run in the network namespace
    /// `netns` if given.
    pub(crate) fn spawn_member_at(
        ip: Ipv4Addr,
        netns: Option<&str>,
        port: u16,
        main_class: &'static str,
        extra_config: &str,
        myid: Option<usize>,
    ) -> Result<ZkServer, String> {
        Self::spawn_with(ip, netns, port, main_class, extra_config, myid, None, false)
    }

    /// [`ZkServer::spawn_member_at`] with TLS on the port given (if any) and SASL as
    /// `security` says, under libfaketime if `fake_clock`.
    #[allow(clippy::too_many_arguments)]
    fn spawn_with(
        ip: Ipv4Addr,
        netns: Option<&str>,
        port: u16,
        main_class: &'static str,
        extra_config: &str,
        myid: Option<usize>,
        security: Option<(&ZkSecurity<'_>, Option<u16>)>,
        fake_clock: bool,
    ) -> Result<ZkServer, String> {
        let dir = Scratch::new("fencelock-zk-")?;
        let data = dir.path().join("data");
        std::fs::create_dir(&data).map_err(|e| format!("cannot create {data:?}: {e}"))?;
        if let Some(id) = myid {
            std::fs::write(data.join("myid"), format!("{id}\n"))
                .map_err(|e| format!("cannot write myid: {e}"))?;
        }
        let config = dir.path().join("zoo.cfg");
        let mut text = format!(
            "{BASE_CONFIG}dataDir={}\nclientPort={port}\nclientPortAddress={ip}\n{extra_config}",
            data.display()
        );
        let mut jvm_options = Vec::new();
        let mut tls_port = None;
        if let Some((security, secure_port)) = security {
            if let (Some(certs), Some(secure_port)) = (security.tls, secure_port) {
                text.push_str(&format!(
                    "secureClientPort={secure_port}\nsecureClientPortAddress={ip}\n"
                ));
                tls_port = Some(secure_port);
                jvm_options.extend(tls_options(dir.path(), certs, security.client_auth)?);
            }
            if !security.sasl_users.is_empty() {
                jvm_options.extend(sasl_options(dir.path(), &security.sasl_users)?);
            }
        }
        std::fs::write(&config, text).map_err(|e| format!("cannot write {config:?}: {e}"))?;
        let fake_clock = if fake_clock {
            let file = dir.path().join("faketime");
            std::fs::write(&file, "+0\n").map_err(|e| format!("cannot write {file:?}: {e}"))?;
            Some(file)
        } else {
            None
        };
        let server = ZkServer {
            core: Server::new(dir, "zookeeper.log"),
            ip,
            netns: netns.map(str::to_owned),
            port,
            main_class,
            ensemble: myid.is_some(),
            config,
            netty: tls_port.is_some(),
            tls_port,
            jvm_options,
            fake_clock,
        };
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&self) -> Result<(), String> {
        let java = require_program("java", "default-jdk-headless");
        let mut classpath = require_file(ZOOKEEPER_JAR, "zookeeper")
            .display()
            .to_string();
        if Path::new(SLF4J_SIMPLE_JAR).is_file() {
            classpath.push(':');
            classpath.push_str(SLF4J_SIMPLE_JAR);
        }
        if self.netty {
            for jar in NETTY_EXTRA_JARS {
                classpath.push(':');
                classpath.push_str(&require_file(jar, "libnetty-java").display().to_string());
            }
        }
        let mut command = Command::new(&java);
        command
            .args(&self.jvm_options)
            .args([
                "-Xms32m",
                "-Xmx256m",
                "-XX:+UseSerialGC",
                "-XX:TieredStopAtLevel=1",
                "-XX:-UsePerfData",
                "-Djava.net.preferIPv4Stack=true",
                "-Dzookeeper.admin.enableServer=false",
                "-Dzookeeper.4lw.commands.whitelist=*",
                "-Dzookeeper.forceSync=no",
                "-Dzookeeper.preAllocSize=4096",
                "-Dzookeeper.fastleader.maxNotificationInterval=2000",
                "-Dorg.slf4j.simpleLogger.showDateTime=true",
                "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
                "-cp",
                &classpath,
                self.main_class,
            ])
            .arg(&self.config)
            .current_dir(self.core.dir.path())
            .env_remove("JAVA_TOOL_OPTIONS")
            .env_remove("JDK_JAVA_OPTIONS");
        if let Some(file) = &self.fake_clock {
            // Wall clock and `nanoTime` (the session tracker's clock) both follow the
            // offset in `file`, read anew at every clock read.
            // libfaketime leaves the monotonic clock alone by default on ARM builds;
            // `FAKETIME`, if inherited, would override the file.
            command
                .env("LD_PRELOAD", libfaketime())
                .env("FAKETIME_TIMESTAMP_FILE", file)
                .env("FAKETIME_NO_CACHE", "1")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "0")
                .env_remove("FAKETIME");
        }
        if let Some(namespace) = &self.netns {
            command = in_namespace(namespace, &command);
        }
        self.core
            .process
            .start(command, &self.core.log)
            .map_err(|e| format!("cannot spawn {}: {e}", java.display()))
    }

    /// Waits until `srvr` reports a mode accepted by `mode_ok`; kills the server on
    /// failure.
    ///
    /// With a TLS port, also until that port accepts connections: ZooKeeper starts the
    /// secure listener after the plain one already serves, so `srvr` alone let a test
    /// connect over TLS before anything listened there (refused: seen once on a fresh
    /// machine, `mutual_tls_needs_the_client_certificate`).
    pub(crate) fn wait_up(&self, mode_ok: impl Fn(&str) -> bool) -> Result<(), String> {
        let what = format!("ZooKeeper on port {}", self.port);
        self.core.wait_ready(&what, READY_TIMEOUT, || {
            self.mode().is_some_and(|m| mode_ok(&m))
                && self.tls_port.is_none_or(|port| {
                    std::net::TcpStream::connect_timeout(
                        &std::net::SocketAddr::from((self.ip, port)),
                        Duration::from_secs(1),
                    )
                    .is_ok()
                })
        })
    }

    /// Sends a four-letter-word command (`ruok`, `srvr`, `stat`, `mntr`, `cons`, ...)
    /// and returns the whole answer (1 s timeout).
    pub fn four_letter_word(&self, command: &str) -> io::Result<String> {
        let answer = exchange_at(
            self.ip,
            self.port,
            command.as_bytes(),
            Duration::from_secs(1),
            |_| false,
        )?;
        Ok(String::from_utf8_lossy(&answer).into_owned())
    }

    /// The `Mode:` line of `srvr` (`standalone`, `leader`, `follower`, ...), or `None`
    /// if the server does not answer or is not serving requests yet. (`ruok` says
    /// `imok` before the server serves, so readiness is judged by `srvr`.)
    pub fn mode(&self) -> Option<String> {
        let answer = self.four_letter_word("srvr").ok()?;
        answer
            .lines()
            .find_map(|line| line.strip_prefix("Mode:"))
            .map(|mode| mode.trim().to_string())
    }

    /// The client port (plain TCP).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The TLS client port (`secureClientPort`) of a server started with TLS (see
    /// [`ZkServer::start_secure`]), `None` otherwise.
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `127.0.0.1:PORT`; `IP:PORT` for a member in a network namespace.
    pub fn connect_string(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }

    /// The address it serves clients on: 127.0.0.1, or its own in a network namespace.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The network namespace it runs in, if any (see [`ZkEnsemble::start_isolated`]).
    ///
    /// [`ZkEnsemble::start_isolated`]: crate::ZkEnsemble::start_isolated
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_deref()
    }

    /// Starts the server again on the same port and `dataDir` (data and unexpired
    /// sessions persist), killing it first if it still runs. A standalone server is
    /// waited for until it serves; an ensemble member only until it answers `ruok`.
    pub fn restart(&self) {
        self.core.process.kill();
        let ensemble = self.ensemble;
        with_retries(&format!("ZooKeeper again on port {}", self.port), || {
            self.spawn()?;
            if ensemble {
                let what = format!("ZooKeeper on port {}", self.port);
                self.core.wait_ready(&what, READY_TIMEOUT, || {
                    self.four_letter_word("ruok").is_ok_and(|a| a == "imok")
                })
            } else {
                self.wait_up(|mode| mode == "standalone")
            }
        });
    }
}

/// The libfaketime library, in whichever multiarch directory of `/usr/lib` holds it
/// (panics naming the package if none does).
fn libfaketime() -> PathBuf {
    std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|dir| dir.path().join(LIBFAKETIME))
        .find(|path| path.is_file())
        .unwrap_or_else(|| require_file(&format!("/usr/lib/<arch>/{LIBFAKETIME}"), "libfaketime"))
}

/// The JVM options that serve TLS with `certs` (key store: the server key and
/// certificate in one PEM file written to `dir`; trust store: the CA).
fn tls_options(
    dir: &Path,
    certs: &TestCertificates,
    client_auth: bool,
) -> Result<Vec<String>, String> {
    let read = |path: PathBuf| {
        std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path:?}: {e}"))
    };
    let key_store = dir.join("server-keystore.pem");
    let pem = format!(
        "{}{}",
        read(certs.server_key())?,
        read(certs.server_cert())?
    );
    std::fs::write(&key_store, pem).map_err(|e| format!("cannot write {key_store:?}: {e}"))?;
    Ok(vec![
        "-Dzookeeper.serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory"
            .to_string(),
        format!("-Dzookeeper.ssl.keyStore.location={}", key_store.display()),
        "-Dzookeeper.ssl.keyStore.type=PEM".to_string(),
        format!(
            "-Dzookeeper.ssl.trustStore.location={}",
            certs.ca().display()
        ),
        "-Dzookeeper.ssl.trustStore.type=PEM".to_string(),
        format!(
            "-Dzookeeper.ssl.clientAuth={}",
            if client_auth { "need" } else { "none" }
        ),
    ])
}

/// The JVM options that require SASL DIGEST-MD5 with `users`, whose JAAS file is written
/// to `dir`.
fn sasl_options(dir: &Path, users: &[(String, String)]) -> Result<Vec<String>, String> {
    let quote = |text: &str| text.replace('\\', "\\\\").replace('"', "\\\"");
    let mut jaas =
        String::from("Server {\n    org.apache.zookeeper.server.auth.DigestLoginModule required");
    for (user, password) in users {
        if user.is_empty() || !user.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!(
                "SASL user name {user:?}: use letters, digits and _"
            ));
        }
        jaas.push_str(&format!("\n    user_{user}=\"{}\"", quote(password)));
    }
    jaas.push_str(";\n};\n");
    let path = dir.join("jaas.conf");
    std::fs::write(&path, jaas).map_err(|e| format!("cannot write {path:?}: {e}"))?;
    Ok(vec![
        format!("-Djava.security.auth.login.config={}", path.display()),
        "-Dzookeeper.authProvider.1=org.apache.zookeeper.server.auth.SASLAuthenticationProvider"
            .to_string(),
        "-Dzookeeper.enforce.auth.enabled=true".to_string(),
        "-Dzookeeper.enforce.auth.schemes=sasl".to_string(),
    ])
}

impl Drop for ZkServer {
    fn drop(&mut self) {
        self.core.process.kill();
    }
}

impl std::ops::Deref for ZkServer {
    type Target = Server;

    /// The process, directory and log, with the fault controls (`pause`, `kill`, ...).
    fn deref(&self) -> &Server {
        &self.core
    }
}
