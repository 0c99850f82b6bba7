//! What the etcd, ZooKeeper and Redis servers of the testkit have in common: the process
//! (across restarts), its temporary directory and its log, and the fault controls on
//! them. Each server type dereferences to [`Server`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::launch::{log_tail, wait_ready};
use crate::process::ServerProcess;
use crate::scratch::Scratch;

/// One server's process, directory and log. Reached through `Deref` from
/// [`EtcdServer`](crate::EtcdServer), [`ZkServer`](crate::ZkServer) and
/// [`RedisServer`](crate::RedisServer): `server.pause()`, `server.log_tail()`, ...
pub struct Server {
    pub(crate) process: ServerProcess,
    pub(crate) log: PathBuf,
    pub(crate) dir: Scratch,
}

impl Server {
    /// No process yet; the log is the file `log_name` in `dir`.
    pub(crate) fn new(dir: Scratch, log_name: &str) -> Self {
        Server {
            process: ServerProcess::new(),
            log: dir.path().join(log_name),
            dir,
        }
    }

    /// Waits until `ready()` holds (see [`wait_ready`]); kills the process if it does
    /// not within `timeout`, or if it exits first.
    pub(crate) fn wait_ready(
        &self,
        what: &str,
        timeout: Duration,
        ready: impl FnMut() -> bool,
    ) -> Result<(), String> {
        let result = wait_ready(&self.process, &self.log, what, timeout, ready);
        if result.is_err() {
            self.process.kill();
        }
        result
    }

    /// The pid of the server process (of the last one, after [`Server::kill`]).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The server's temporary directory (data, configuration and log live in it).
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

    /// Freezes the server with SIGSTOP: connections stay open, nothing is answered, and
    /// the server expires no leases or sessions meanwhile. Panics if it is not running.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// Thaws a [`Server::pause`]d server with SIGCONT.
    pub fn resume(&self) {
        self.process.resume();
    }

    /// Kills the server with SIGKILL and reaps it. Ports and directory are kept for the
    /// server type's `restart`. Does nothing if it is not running.
    pub fn kill(&self) {
        self.process.kill();
    }
}
