//! What the fault tests share: unique names, and the server-side leftover check (C5) of
//! `fencelock_testkit::leftovers` for each kind of deployment.
#![allow(dead_code)]

use std::time::Duration;

use fencelock_testkit::{
    EtcdServer, FaultProxy, RedisCluster, RedisSentinelSet, RedisServer, ZkServer, leftovers,
};

/// A name no other test run uses: `TAG-PID-NANOS` (hex).
pub fn unique(tag: &str) -> String {
    format!("{tag}-{:x}-{:x}", std::process::id(), nanos())
}

/// Nanoseconds of the wall clock (a seed for names and random delays).
pub fn nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A small xorshift generator (the tests need no crate for random delays).
#[allow(clippy::new_without_default)]
pub struct Rng(u64);

impl Rng {
    /// Seeded from the wall clock.
    pub fn new() -> Self {
        Rng(nanos() | 1)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Where a scenario's locks live on the servers, to look for what it left behind.
pub enum Servers<'a> {
    /// Keys under `PREFIX/` on etcd.
    Etcd(&'a EtcdServer, &'a str),
    /// Ephemeral nodes under `/CHROOT` on ZooKeeper.
    Zk(&'a ZkServer, &'a str),
    /// Keys (but token counters) and subscribed channels `*PREFIX*` on Redis servers (on
    /// every port given: a single server, Redlock's instances, a Cluster's masters).
    Redis(Vec<u16>, &'a str),
    /// Both legs of the migration layer.
    Both(Box<Servers<'a>>, Box<Servers<'a>>),
}

impl Servers<'_> {
    /// A Redis server and a key prefix.
    pub fn redis<'a>(server: &RedisServer, prefix: &'a str) -> Servers<'a> {
        Servers::Redis(vec![server.port()], prefix)
    }

    /// What is left, described.
    pub fn left(&self) -> Vec<String> {
        match self {
            Servers::Etcd(server, prefix) => {
                leftovers::etcd_keys(&server.endpoint(), &format!("{prefix}/"))
            }
            Servers::Zk(server, chroot) => {
                leftovers::zookeeper_ephemerals(server, &format!("/{chroot}"))
            }
            Servers::Redis(ports, prefix) => ports
                .iter()
                .flat_map(|&port| {
                    let pattern = format!("*{prefix}*");
                    let mut left = leftovers::redis_keys(port, &pattern);
                    left.extend(leftovers::redis_subscribed_channels(port, &pattern));
                    left
                })
                .collect(),
            Servers::Both(a, b) => {
                let mut left = a.left();
                left.extend(b.left());
                left
            }
        }
    }

    /// Asserts that nothing is left within `bound`, and stays so for
    /// `leftovers::SETTLE` (C5): polls the servers.
    pub fn assert_nothing_left_within(&self, what: &str, bound: Duration) {
        tokio::task::block_in_place(|| {
            leftovers::assert_none_within(what, bound, || self.left());
        });
    }
}

/// A Redis deployment whose servers announce [`FaultProxy`]s (Sentinel and Cluster
/// clients take the servers' addresses from the deployment, so a proxy in front of one
/// client would be bypassed): every client connects through the proxies; the ones that
/// must keep working connect first, [`Proxied::exempt`] spares their connections (and
/// the servers' own links), and the client to cut off connects after.
pub enum Proxied {
    /// Master + replica + 3 Sentinels monitoring the master's proxy.
    Sentinel(Box<RedisSentinelSet>),
    /// 3 masters, each announcing its proxy.
    Cluster(RedisCluster),
}

impl Proxied {
    /// Starts a Sentinel set behind a proxy.
    pub async fn sentinel() -> Proxied {
        Proxied::Sentinel(Box::new(
            tokio::task::spawn_blocking(RedisSentinelSet::start_behind_proxy)
                .await
                .unwrap(),
        ))
    }

    /// Starts a 3-master cluster behind proxies.
    pub async fn cluster() -> Proxied {
        Proxied::Cluster(
            tokio::task::spawn_blocking(|| RedisCluster::start_behind_proxies(3, 0))
                .await
                .unwrap(),
        )
    }

    /// The proxies.
    pub fn proxies(&self) -> Vec<&FaultProxy> {
        match self {
            Proxied::Sentinel(set) => vec![set.proxy().expect("a proxy in front of the master")],
            Proxied::Cluster(cluster) => cluster.proxies().iter().collect(),
        }
    }

    /// The URL of a client that keeps working (connect it before [`Proxied::exempt`]).
    pub fn url(&self, prefix: &str) -> String {
        match self {
            Proxied::Sentinel(set) => format!("{}?prefix={prefix}:", set.url()),
            Proxied::Cluster(cluster) => format!("{}?prefix={prefix}:", cluster.url()),
        }
    }

    /// The URL of the client to cut off (connect it after [`Proxied::exempt`]): on a
    /// cluster its seeds are the proxies too, so its unlock subscriptions are cut as well.
    pub fn cut_url(&self, prefix: &str) -> String {
        match self {
            Proxied::Sentinel(_) => self.url(prefix),
            Proxied::Cluster(cluster) => format!("{}?prefix={prefix}:", cluster.proxied_url()),
        }
    }

    /// Spares every connection open now from the faults; asserts each proxy carries one.
    pub fn exempt(&self) {
        for proxy in self.proxies() {
            let exempt = proxy.exempt_open_connections();
            assert!(exempt >= 1, "{}: no connection to exempt", proxy.addr());
        }
    }

    /// Where the locks of `prefix` live.
    pub fn servers<'a>(&'a self, prefix: &'a str) -> Servers<'a> {
        match self {
            Proxied::Sentinel(set) => Servers::redis(set.master(), prefix),
            Proxied::Cluster(cluster) => Servers::Redis(
                cluster.nodes().iter().map(RedisServer::port).collect(),
                prefix,
            ),
        }
    }

    /// Asserts that the fault caused no failover (the Sentinels still name the proxy).
    pub fn assert_no_failover(&self) {
        if let Proxied::Sentinel(set) = self {
            let proxy = set.proxy().expect("a proxy in front of the master");
            assert_eq!(
                set.sentinels()[0].master_addr(),
                Some(proxy.addr()),
                "a failover happened"
            );
        }
    }
}
