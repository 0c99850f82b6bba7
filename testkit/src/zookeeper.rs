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
use crate::server::Server;

/// How long a start or restart may take before it counts as failed (a JVM is slow).
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The server jar from Debian's `zookeeper` package. Its manifest `Class-Path` names
/// its dependencies (netty, jetty, jackson, slf4j-api, zookeeper-jute, ...) in
/// /usr/share/java, so the jar alone is enough to run the server.
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";

/// An slf4j binding that writes to stderr (Debian's `libslf4j-java`, a dependency of
/// `zookeeper`). Without it the server logs nothing.
const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";

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
}

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

    /// One server per test process, started on first use and shared by every test in
    /// it. Do not pause, kill or restart it: other tests use it concurrently. It dies
    /// with the process; its directory is removed at normal exit.
    pub fn shared() -> &'static ZkServer {
        static SHARED: OnceLock<ZkServer> = OnceLock::new();
        SHARED.get_or_init(|| {
            at_exit(|| {
                if let Some(server) = SHARED.get() {
                    if server.process.kill_at_exit() {
                        let _ = std::fs::remove_dir_all(server.dir());
                    }
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
        let dir = tempfile::Builder::new()
            .prefix("fencelock-zk-")
            .tempdir()
            .map_err(|e| format!("cannot create a temporary directory: {e}"))?;
        let data = dir.path().join("data");
        std::fs::create_dir(&data).map_err(|e| format!("cannot create {data:?}: {e}"))?;
        if let Some(id) = myid {
            std::fs::write(data.join("myid"), format!("{id}\n"))
                .map_err(|e| format!("cannot write myid: {e}"))?;
        }
        let config = dir.path().join("zoo.cfg");
        let text = format!(
            "{BASE_CONFIG}dataDir={}\nclientPort={port}\nclientPortAddress={ip}\n{extra_config}",
            data.display()
        );
        std::fs::write(&config, text).map_err(|e| format!("cannot write {config:?}: {e}"))?;
        let server = ZkServer {
            core: Server::new(dir, "zookeeper.log"),
            ip,
            netns: netns.map(str::to_owned),
            port,
            main_class,
            ensemble: myid.is_some(),
            config,
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
        let mut command = Command::new(&java);
        command
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
    pub(crate) fn wait_up(&self, mode_ok: impl Fn(&str) -> bool) -> Result<(), String> {
        let what = format!("ZooKeeper on port {}", self.port);
        self.core.wait_ready(&what, READY_TIMEOUT, || {
            self.mode().is_some_and(|m| mode_ok(&m))
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

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
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
