//! A throwaway multi-member etcd cluster on loopback (or with each member in its own
//! network namespace), for fault tests.

use std::time::{Duration, Instant};

use crate::etcd::{EtcdServer, MemberSpec, READY_TIMEOUT};
use crate::launch::with_retries;
use crate::netns::NetLab;
use crate::port::free_ports;

/// The client port of a member in its own network namespace.
const NETNS_CLIENT_PORT: u16 = 2379;
/// The peer port of a member in its own network namespace.
const NETNS_PEER_PORT: u16 = 2380;

/// `n` etcd members on loopback, each with its own ports and data directory. All are
/// killed when the cluster is dropped.
pub struct EtcdCluster {
    // Dropped in this order: the members (killed) before their namespaces.
    members: Vec<EtcdServer>,
    net: Option<NetLab>,
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
                    ip: std::net::Ipv4Addr::LOCALHOST,
                    netns: None,
                })?);
            }
            for member in &members {
                member.wait_up(true)?;
            }
            Ok(EtcdCluster { members, net: None })
        })
    }

    /// Starts an `n`-member cluster with each member in its own network namespace (see
    /// [`NetLab`]): member `i` listens on `net().ip(i)`, ports 2379 (clients) and 2380
    /// (peers), and the test process reaches it over a veth. [`EtcdCluster::net`] cuts
    /// and heals links between members. Waits until every member is healthy.
    ///
    /// Panics if network namespaces cannot be made on this machine (root, `ip`,
    /// `iptables`), if `etcd` is missing, or if the cluster does not form.
    pub fn start_isolated(n: usize) -> Self {
        assert!(n > 0, "an etcd cluster needs at least one member");
        let net = NetLab::create(n);
        let members = with_retries(&format!("a {n}-member etcd cluster in namespaces"), || {
            let initial_cluster = (0..n)
                .map(|i| format!("m{i}=http://{}:{NETNS_PEER_PORT}", net.ip(i)))
                .collect::<Vec<_>>()
                .join(",");
            let token = format!("fencelock-netns-{}-{}", std::process::id(), net.ip(0));
            let mut members = Vec::with_capacity(n);
            for i in 0..n {
                members.push(EtcdServer::spawn_member(&MemberSpec {
                    name: &format!("m{i}"),
                    client_port: NETNS_CLIENT_PORT,
                    peer_port: NETNS_PEER_PORT,
                    initial_cluster: &initial_cluster,
                    token: &token,
                    clustered: n > 1,
                    extra: &[],
                    ip: net.ip(i),
                    netns: Some(net.namespace(i)),
                })?);
            }
            for member in &members {
                member.wait_up(true)?;
            }
            Ok(members)
        });
        EtcdCluster {
            members,
            net: Some(net),
        }
    }

    /// The network namespaces of a cluster made by [`EtcdCluster::start_isolated`]
    /// (`None` for one on loopback): cut members off with [`NetLab::isolate`], undo it
    /// with [`NetLab::heal`].
    pub fn net(&self) -> Option<&NetLab> {
        self.net.as_ref()
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
