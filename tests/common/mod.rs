//! What the fault tests share: unique names, and the server-side leftover check (C5) of
//! `fencelock_testkit::leftovers` for each kind of deployment.
#![allow(dead_code)]

use std::time::Duration;

use fencelock_testkit::{EtcdServer, RedisServer, ZkServer, leftovers};

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
