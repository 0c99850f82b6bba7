//! A throwaway multi-member etcd cluster on loopback, for fault tests.

use std::time::{Duration, Instant};

use crate::etcd::{EtcdServer, MemberSpec, READY_TIMEOUT};
use crate::launch::with_retries;
use crate::port::free_ports;

/// `n` etcd members on loopback, each with its own ports and data directory. All are
/// killed when the cluster is dropped.
pub struct EtcdCluster {
    members: Vec<EtcdServer>,
}

impl EtcdCluster {
    /// Starts an `n`-member cluster (`m0`, `m1`, ...) and waits until every member is
    /// healthy (sees a leader). Panics if `etcd` is missing or the cluster does not
    /// form.
    pub fn start(n: usize) -> Self {
        assert!(n > 0, "an etcd cluster needs at least one member");
        with_retries(&format!("a {n}-member etcd cluster"), || {
            let ports = free_ports(2 * n);
            let initial_cluster = (0..n)
                .map(|i| format!("m{i}=http://127.0.0.1:{}", ports[2 * i + 1]))
                .collect::<Vec<_>>()
                .join(",");
            let token = format!("fencelock-cluster-{}", ports[0]);
            let mut members = Vec::with_capacity(n);
            for i in 0..n {
                members.push(EtcdServer::spawn_member(&MemberSpec {
                    name: &format!("m{i}"),
                    client_port: ports[2 * i],
                    peer_port: ports[2 * i + 1],
                    initial_cluster: &initial_cluster,
                    token: &token,
                    clustered: n > 1,
                    extra: &[],
                })?);
            }
            for member in &members {
                member.wait_up(true)?;
            }
            Ok(EtcdCluster { members })
        })
    }

    /// The members, in order (`m0` first).
    pub fn members(&self) -> &[EtcdServer] {
        &self.members
    }

    /// Member `i`. Panics if out of range.
    pub fn member(&self, i: usize) -> &EtcdServer {
        &self.members[i]
    }

    /// `127.0.0.1:PORT` of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(EtcdServer::endpoint).collect()
    }

    /// `http://127.0.0.1:PORT` of every member.
    pub fn urls(&self) -> Vec<String> {
        self.members.iter().map(EtcdServer::url).collect()
    }

    /// Kills member `i` with SIGKILL (see [`Server::kill`](crate::Server::kill)).
    pub fn kill_member(&self, i: usize) {
        self.members[i].kill();
    }

    /// Restarts member `i` on its ports and data (see [`EtcdServer::restart`]).
    pub fn restart_member(&self, i: usize) {
        self.members[i].restart();
    }

    /// The index of the member that is leader right now, asking each running member
    /// for its status; `None` if no member answers as leader.
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.is_running()
                && m.status()
                    .is_some_and(|(id, leader)| !id.is_empty() && id == leader)
        })
    }

    /// Polls [`EtcdCluster::leader`] until there is one; panics after `timeout`.
    pub fn wait_for_leader(&self, timeout: Duration) -> usize {
        let started = Instant::now();
        loop {
            if let Some(i) = self.leader() {
                return i;
            }
            assert!(
                started.elapsed() < timeout,
                "fencelock-testkit: no etcd leader after {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every running member is healthy; panics after the usual start-up
    /// timeout.
    pub fn wait_healthy(&self) {
        let started = Instant::now();
        while !self
            .members
            .iter()
            .filter(|m| m.is_running())
            .all(EtcdServer::is_healthy)
        {
            assert!(
                started.elapsed() < READY_TIMEOUT,
                "fencelock-testkit: etcd cluster not healthy after {READY_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
