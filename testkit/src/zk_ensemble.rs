//! A throwaway ZooKeeper ensemble on loopback, for fault tests.

use std::time::{Duration, Instant};

use crate::launch::with_retries;
use crate::port::free_ports;
use crate::zookeeper::ZkServer;

/// `n` ZooKeeper servers forming one ensemble on loopback, each with its own client,
/// quorum and election ports and `dataDir`. All are killed when it is dropped.
pub struct ZkEnsemble {
    members: Vec<ZkServer>,
}

impl ZkEnsemble {
    /// Starts an `n`-server ensemble (use an odd `n`, e.g. 3) and waits until every
    /// member is leader or follower. Panics if `java` or the ZooKeeper jar is missing or
    /// the ensemble does not form within 30 s.
    pub fn start(n: usize) -> Self {
        assert!(n > 0, "a ZooKeeper ensemble needs at least one server");
        with_retries(&format!("a {n}-server ZooKeeper ensemble"), || {
            let ports = free_ports(3 * n);
            let servers: String = (0..n)
                .map(|i| {
                    format!(
                        "server.{}=127.0.0.1:{}:{}\n",
                        i + 1,
                        ports[3 * i + 1],
                        ports[3 * i + 2]
                    )
                })
                .collect();
            let extra = format!("standaloneEnabled=false\nreconfigEnabled=false\n{servers}");
            let mut members = Vec::with_capacity(n);
            for i in 0..n {
                members.push(ZkServer::spawn_member(
                    ports[3 * i],
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                    &extra,
                    Some(i + 1),
                )?);
            }
            for member in &members {
                member.wait_up(|mode| mode == "leader" || mode == "follower")?;
            }
            Ok(ZkEnsemble { members })
        })
    }

    /// The members, in order (`myid` 1 first).
    pub fn members(&self) -> &[ZkServer] {
        &self.members
    }

    /// Member `i` (its `myid` is `i + 1`). Panics if out of range.
    pub fn member(&self, i: usize) -> &ZkServer {
        &self.members[i]
    }

    /// `127.0.0.1:P1,127.0.0.1:P2,...`, for a client of the whole ensemble.
    pub fn connect_string(&self) -> String {
        self.members
            .iter()
            .map(ZkServer::connect_string)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Kills member `i` with SIGKILL (see [`Server::kill`](crate::Server::kill)).
    pub fn kill_member(&self, i: usize) {
        self.members[i].kill();
    }

    /// Restarts member `i` on its ports and `dataDir` (see [`ZkServer::restart`]).
    pub fn restart_member(&self, i: usize) {
        self.members[i].restart();
    }

    /// The index of the member whose `srvr` says `Mode: leader`, if any.
    pub fn leader(&self) -> Option<usize> {
        self.members
            .iter()
            .position(|m| m.is_running() && m.mode().as_deref() == Some("leader"))
    }

    /// Polls [`ZkEnsemble::leader`] until there is one; panics after `timeout`.
    pub fn wait_for_leader(&self, timeout: Duration) -> usize {
        let started = Instant::now();
        loop {
            if let Some(i) = self.leader() {
                return i;
            }
            assert!(
                started.elapsed() < timeout,
                "fencelock-testkit: no ZooKeeper leader after {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
