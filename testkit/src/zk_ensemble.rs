//! A throwaway ZooKeeper ensemble on loopback (or with each server in its own network
//! namespace), for fault tests.

use std::time::{Duration, Instant};

use crate::launch::with_retries;
use crate::netns::NetLab;
use crate::port::free_ports;
use crate::zookeeper::ZkServer;

/// The ports of a server in its own network namespace: clients, quorum, election.
const NETNS_PORTS: [u16; 3] = [2181, 2888, 3888];

/// `n` ZooKeeper servers forming one ensemble on loopback, each with its own client,
/// quorum and election ports and `dataDir`. All are killed when it is dropped.
pub struct ZkEnsemble {
    // Dropped in this order: the servers (killed) before their namespaces.
    members: Vec<ZkServer>,
    net: Option<NetLab>,
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
            Ok(ZkEnsemble { members, net: None })
        })
    }

    /// Starts an `n`-server ensemble with each server in its own network namespace (see
    /// [`NetLab`]): server `i` serves clients on `net().ip(i)`, port 2181 (quorum 2888,
    /// election 3888), and the test process reaches it over a veth. [`ZkEnsemble::net`]
    /// cuts and heals links between servers. Waits until every server is leader or
    /// follower.
    ///
    /// Panics if network namespaces cannot be made on this machine (root, `ip`,
    /// `iptables`), if `java` or the ZooKeeper jar is missing, or if the ensemble does not
    /// form within 30 s.
    pub fn start_isolated(n: usize) -> Self {
        assert!(n > 0, "a ZooKeeper ensemble needs at least one server");
        let net = NetLab::create(n);
        let [client, quorum, election] = NETNS_PORTS;
        let members = with_retries(
            &format!("a {n}-server ZooKeeper ensemble in namespaces"),
            || {
                let servers: String = (0..n)
                    .map(|i| format!("server.{}={}:{quorum}:{election}\n", i + 1, net.ip(i)))
                    .collect();
                let extra = format!("standaloneEnabled=false\nreconfigEnabled=false\n{servers}");
                let mut members = Vec::with_capacity(n);
                for i in 0..n {
                    members.push(ZkServer::spawn_member_at(
                        net.ip(i),
                        Some(net.namespace(i)),
                        client,
                        "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                        &extra,
                        Some(i + 1),
                    )?);
                }
                for member in &members {
                    member.wait_up(|mode| mode == "leader" || mode == "follower")?;
                }
                Ok(members)
            },
        );
        ZkEnsemble {
            members,
            net: Some(net),
        }
    }

    /// The network namespaces of an ensemble made by [`ZkEnsemble::start_isolated`]
    /// (`None` for one on loopback): cut servers off with [`NetLab::isolate`], undo it
    /// with [`NetLab::heal`].
    pub fn net(&self) -> Option<&NetLab> {
        self.net.as_ref()
    }

    /// The members, in order (`myid` 1 first).
    pub fn members(&self) -> &[ZkServer] {
        &self.members
    }

    /// Member `i` (its `myid` is `i + 1`). Panics if out of range.
    pub fn member(&self, i: usize) -> &ZkServer {
        &self.members[i]
    }

    /// `127.0.0.1:P1,127.0.0.1:P2,...` (member addresses in namespaces), for a client of
    /// the whole ensemble.
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
