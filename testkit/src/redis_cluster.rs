//! A throwaway Redis Cluster on loopback ports, with or without replicas and a password.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::binaries::require_program;
use crate::redis::cli_tls_args;
use crate::{FaultProxy, RedisServer, TestCertificates};

/// A Redis Cluster of `n` masters, created with `redis-cli --cluster create`, each node a
/// [`RedisServer`] in cluster mode (`--cluster-node-timeout 2000`). Killed when dropped.
///
/// [`RedisCluster::start`] makes masters only; [`RedisCluster::start_with_replicas`]
/// gives each master replicas, so that a killed master fails over (about 3–4 s with the
/// 2 s node timeout); [`RedisCluster::start_with_password`] also protects every node
/// with `requirepass` (and `masterauth` for the replicas); [`RedisCluster::start_tls`]
/// makes one that speaks only TLS, to clients and among its nodes.
///
/// ```no_run
/// let cluster = fencelock_testkit::RedisCluster::start(3);
/// println!("connect to {}", cluster.url());
/// ```
pub struct RedisCluster {
    /// The nodes created as masters.
    nodes: Vec<RedisServer>,
    /// The nodes created as replicas.
    replicas: Vec<RedisServer>,
    password: Option<String>,
    /// One proxy per node, in the order of `nodes` then `replicas`
    /// ([`RedisCluster::start_behind_proxies`]).
    proxies: Vec<FaultProxy>,
    /// `redis-cli`'s TLS options ([`RedisCluster::start_tls`]; empty otherwise).
    cli_tls: Vec<String>,
}

/// How the nodes of a TLS cluster are started.
#[derive(Clone, Copy)]
struct ClusterTls<'a> {
    certs: &'a TestCertificates,
    auth_clients: bool,
}

impl RedisCluster {
    /// Starts `n` (at least 3) masters, creates the cluster and waits until every node
    /// reports `cluster_state:ok`. Panics if that does not happen within 30 s.
    pub fn start(n: usize) -> Self {
        Self::start_cluster(n, 0, None, None)
    }

    /// Starts `masters` (at least 3) masters and `replicas_per_master` replicas of each,
    /// creates the cluster (`--cluster-replicas`), and waits until every node reports
    /// `cluster_state:ok` and every replica's link to its master is up. Panics if that
    /// does not happen within 30 s.
    ///
    /// [`RedisCluster::nodes`] are the masters as created, [`RedisCluster::replicas`] the
    /// replicas; after a failover, ask [`RedisCluster::master_of_slot`] who is master.
    pub fn start_with_replicas(masters: usize, replicas_per_master: usize) -> Self {
        Self::start_cluster(masters, replicas_per_master, None, None)
    }

    /// Like [`RedisCluster::start_with_replicas`] (with `password`: and
    /// [`RedisCluster::start_with_password`]), with every node listening only on TLS
    /// ([`RedisServer::start_tls_with`]: `--port 0`, `certs`' server certificate, with
    /// `auth_clients` a client certificate required) and talking TLS to the other nodes
    /// (`--tls-cluster yes`: the cluster bus, and the ports the nodes announce to clients
    /// in `CLUSTER SLOTS` and redirections, are the TLS ones) and to its master
    /// (`--tls-replication yes`). Nodes present `certs`' client certificate to each other.
    ///
    /// [`RedisCluster::url`] is a `rediss+cluster://` URL without options: clients must
    /// trust [`TestCertificates::ca`] (and, with `auth_clients`, present
    /// [`TestCertificates::client_cert`]). [`RedisCluster::cli`] speaks TLS.
    pub fn start_tls(
        certs: &TestCertificates,
        masters: usize,
        replicas_per_master: usize,
        password: Option<&str>,
        auth_clients: bool,
    ) -> Self {
        Self::start_cluster(
            masters,
            replicas_per_master,
            password,
            Some(ClusterTls {
                certs,
                auth_clients,
            }),
        )
    }

    /// Like [`RedisCluster::start_with_replicas`], with every node started with
    /// `--requirepass PASSWORD --masterauth PASSWORD`: clients must authenticate (as the
    /// `default` user), and replicas authenticate to their masters.
    pub fn start_with_password(masters: usize, replicas_per_master: usize, password: &str) -> Self {
        Self::start_cluster(masters, replicas_per_master, Some(password), None)
    }

    /// Like [`RedisCluster::start_with_replicas`], with a [`FaultProxy`] in front of every
    /// node, which the node announces as its address (`cluster-announce-port`): clients
    /// (`CLUSTER SLOTS`, redirections) and replication links go through the proxies, the
    /// cluster bus does not. Returns once every node announces its proxy and every
    /// replica replicates through its master's proxy.
    ///
    /// To cut one client off: connect the clients that must keep working, call
    /// [`FaultProxy::exempt_open_connections`] on every proxy, connect the client to cut
    /// off (with [`RedisCluster::proxied_url`] as its seeds, so that its unlock
    /// subscriptions go through the proxies too), then set the fault.
    pub fn start_behind_proxies(masters: usize, replicas_per_master: usize) -> Self {
        let mut cluster = Self::start_cluster(masters, replicas_per_master, None, None);
        cluster.proxies = cluster
            .all_nodes()
            .map(|node| FaultProxy::start(&node.addr()))
            .collect();
        for (node, proxy) in cluster.all_nodes().zip(&cluster.proxies) {
            let port = proxy.port().to_string();
            assert!(
                cluster
                    .cli(node, &["config", "set", "cluster-announce-port", &port])
                    .is_some(),
                "fencelock-testkit: cannot set cluster-announce-port on {}",
                node.addr()
            );
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster.announces_proxies() {
            assert!(
                Instant::now() < deadline,
                "fencelock-testkit: the Redis Cluster did not announce its proxies"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    /// Whether every node lists every node at its proxy's port, every replica's
    /// replication link goes to its master's proxy and is up, and the cluster is ok.
    fn announces_proxies(&self) -> bool {
        let proxy_ports: Vec<u16> = self.proxies.iter().map(FaultProxy::port).collect();
        let listed = self.all_nodes().all(|node| {
            self.cli(node, &["cluster", "nodes"]).is_some_and(|text| {
                let lines: Vec<NodeLine> = text.lines().filter_map(NodeLine::parse).collect();
                lines.len() == proxy_ports.len()
                    && lines.iter().all(|line| proxy_ports.contains(&line.port))
            })
        });
        let replicating = self.replicas.iter().all(|node| {
            self.cli(node, &["info", "replication"])
                .is_some_and(|text| {
                    text.contains("master_link_status:up")
                        && text.lines().any(|line| {
                            line.trim()
                                .strip_prefix("master_port:")
                                .and_then(|p| p.parse().ok())
                                .is_some_and(|p| proxy_ports.contains(&p))
                        })
                })
        });
        listed && replicating && self.running_nodes_ok()
    }

    /// The proxies of [`RedisCluster::start_behind_proxies`], one per node: the masters
    /// as created, then the replicas.
    pub fn proxies(&self) -> &[FaultProxy] {
        &self.proxies
    }

    /// `redis+cluster://` with every node's proxy as a seed
    /// ([`RedisCluster::start_behind_proxies`]).
    pub fn proxied_url(&self) -> String {
        let hosts: Vec<String> = self.proxies.iter().map(FaultProxy::addr).collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    fn start_cluster(
        masters: usize,
        replicas_per_master: usize,
        password: Option<&str>,
        tls: Option<ClusterTls<'_>>,
    ) -> Self {
        assert!(masters >= 3, "a Redis Cluster needs at least 3 masters");
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        ];
        if let Some(password) = password {
            args.extend(["--requirepass", password, "--masterauth", password]);
        }
        if tls.is_some() {
            args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"]);
        }
        let total = masters * (1 + replicas_per_master);
        let mut nodes: Vec<RedisServer> = (0..total)
            .map(|_| match tls {
                Some(tls) => RedisServer::start_tls_with(tls.certs, tls.auth_clients, &args),
                None => RedisServer::start_with(&args),
            })
            .collect();
        let replicas = nodes.split_off(masters);
        let cluster = RedisCluster {
            nodes,
            replicas,
            password: password.map(str::to_owned),
            proxies: Vec::new(),
            cli_tls: tls.map_or_else(Vec::new, |tls| cli_tls_args(tls.certs)),
        };
        let mut create = cluster.cli_command();
        create.arg("--cluster").arg("create");
        create.args(cluster.all_nodes().map(RedisServer::addr));
        create.args([
            "--cluster-replicas",
            &replicas_per_master.to_string(),
            "--cluster-yes",
        ]);
        let output = create
            .output()
            .unwrap_or_else(|e| panic!("fencelock-testkit: cannot run redis-cli: {e}"));
        assert!(
            output.status.success(),
            "fencelock-testkit: redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(cluster.running_nodes_ok() && cluster.replicas_linked()) {
            assert!(
                Instant::now() < deadline,
                "fencelock-testkit: the Redis Cluster did not reach cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // redis-cli makes the first `masters` nodes of the list the masters.
        for master in &cluster.nodes {
            let role = cluster.cli(master, &["role"]).unwrap_or_default();
            assert!(
                role.starts_with("master"),
                "fencelock-testkit: node {} was created as a {role:?}",
                master.addr()
            );
        }
        cluster
    }

    /// `redis-cli` with the TLS options and the password, if any, and no warning about
    /// the password.
    fn cli_command(&self) -> Command {
        let mut command = Command::new(require_program("redis-cli", "redis-tools"));
        command.args(&self.cli_tls);
        if let Some(password) = &self.password {
            command.args(["--no-auth-warning", "-a", password]);
        }
        command
    }

    /// Runs `redis-cli -p PORT ARGS...` against `node` (with the cluster's password, and
    /// over TLS for a [`RedisCluster::start_tls`] cluster) and returns its standard output, or `None` if it could not run, failed, or printed an
    /// error reply (`ERR`, `NOAUTH`, ... or a refused connection).
    pub fn cli(&self, node: &RedisServer, args: &[&str]) -> Option<String> {
        let output = self
            .cli_command()
            .args(["-p", &node.port().to_string()])
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

    fn all_nodes(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes.iter().chain(&self.replicas)
    }

    /// Whether `node` reports `cluster_state:ok` and all 16384 slots assigned and ok.
    fn node_ok(&self, node: &RedisServer) -> bool {
        self.cli(node, &["cluster", "info"]).is_some_and(|text| {
            text.contains("cluster_state:ok") && text.contains("cluster_slots_ok:16384")
        })
    }

    /// Whether every master as created reports `cluster_state:ok` and agrees on all slots.
    pub fn is_ok(&self) -> bool {
        self.nodes.iter().all(|node| self.node_ok(node))
    }

    /// Whether every node still running (masters and replicas, whatever their role now)
    /// reports `cluster_state:ok` and agrees on all slots: after a master was killed, a
    /// completed failover.
    pub fn running_nodes_ok(&self) -> bool {
        self.all_nodes()
            .filter(|node| node.is_running())
            .all(|node| self.node_ok(node))
    }

    /// Whether every running node that is a replica now has its link to its master up.
    fn replicas_linked(&self) -> bool {
        self.all_nodes()
            .filter(|node| node.is_running())
            .all(|node| {
                self.cli(node, &["info", "replication"])
                    .is_some_and(|text| {
                        text.contains("role:master") || text.contains("master_link_status:up")
                    })
            })
    }

    /// The masters as created (after a failover some may be replicas or killed).
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The replicas as created ([`RedisCluster::start_with_replicas`]; empty otherwise).
    pub fn replicas(&self) -> &[RedisServer] {
        &self.replicas
    }

    /// The password every node requires ([`RedisCluster::start_with_password`]).
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The cluster's view of its nodes (`CLUSTER NODES`) as the first running node that
    /// answers sees it: `(node id, port, flags, master id, slot ranges)` per node.
    fn cluster_nodes(&self) -> Option<Vec<NodeLine>> {
        let text = self
            .all_nodes()
            .filter(|node| node.is_running())
            .find_map(|node| self.cli(node, &["cluster", "nodes"]))?;
        Some(text.lines().filter_map(NodeLine::parse).collect())
    }

    /// The node on `port`, or behind the proxy on `port`.
    fn server_on(&self, port: u16) -> Option<&RedisServer> {
        self.all_nodes()
            .zip(
                self.proxies
                    .iter()
                    .map(|p| Some(p.port()))
                    .chain(std::iter::repeat(None)),
            )
            .find(|(node, proxy)| node.port() == port || *proxy == Some(port))
            .map(|(node, _)| node)
    }

    /// The node that is master of `slot` now, as the cluster sees it (a master not
    /// flagged `fail`), if it is one of this cluster's servers.
    pub fn master_of_slot(&self, slot: u16) -> Option<&RedisServer> {
        let lines = self.cluster_nodes()?;
        let line = lines.iter().find(|line| {
            line.flags.iter().any(|f| f == "master")
                && !line.flags.iter().any(|f| f == "fail" || f == "fail?")
                && line.slots.iter().any(|&(lo, hi)| lo <= slot && slot <= hi)
        })?;
        self.server_on(line.port)
    }

    /// The nodes that are replicas of `master` now, as the cluster sees it.
    pub fn replicas_of(&self, master: &RedisServer) -> Vec<&RedisServer> {
        let Some(lines) = self.cluster_nodes() else {
            return Vec::new();
        };
        let Some(id) = lines
            .iter()
            .find(|line| {
                self.server_on(line.port)
                    .is_some_and(|n| n.port() == master.port())
            })
            .map(|line| line.id.clone())
        else {
            return Vec::new();
        };
        lines
            .iter()
            .filter(|line| line.master == id)
            .filter_map(|line| self.server_on(line.port))
            .collect()
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...` (the masters as created), or
    /// `rediss+cluster://...` for a [`RedisCluster::start_tls`] cluster.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(RedisServer::addr).collect();
        let scheme = if self.is_tls() {
            "rediss+cluster"
        } else {
            "redis+cluster"
        };
        format!("{scheme}://{}", hosts.join(","))
    }

    /// Whether the nodes speak only TLS ([`RedisCluster::start_tls`]).
    pub fn is_tls(&self) -> bool {
        !self.cli_tls.is_empty()
    }
}

/// One line of `CLUSTER NODES`.
struct NodeLine {
    id: String,
    port: u16,
    flags: Vec<String>,
    /// The master's id, or `-`.
    master: String,
    /// Slot ranges served (masters only), inclusive.
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    /// `<id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch> <link> <slot>...`
    fn parse(line: &str) -> Option<NodeLine> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 8 {
            return None;
        }
        let address = fields[1].split('@').next()?;
        let port = address.rsplit_once(':')?.1.parse().ok()?;
        let slots = fields[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
                None => s.parse().ok().map(|n| (n, n)),
            })
            .collect();
        Some(NodeLine {
            id: fields[0].to_owned(),
            port,
            flags: fields[2].split(',').map(str::to_owned).collect(),
            master: fields[3].to_owned(),
            slots,
        })
    }
}
