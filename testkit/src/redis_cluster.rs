//! A throwaway Redis Cluster of masters on loopback ports.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::RedisServer;
use crate::binaries::require_program;

/// A Redis Cluster of `n` masters (no replicas), created with
/// `redis-cli --cluster create`, each master a [`RedisServer`] in cluster mode. Killed
/// when dropped.
///
/// ```no_run
/// let cluster = fencelock_testkit::RedisCluster::start(3);
/// println!("connect to {}", cluster.url());
/// ```
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `n` (at least 3) masters, creates the cluster and waits until every node
    /// reports `cluster_state:ok`. Panics if that does not happen within 30 s.
    pub fn start(n: usize) -> Self {
        assert!(n >= 3, "a Redis Cluster needs at least 3 masters");
        let nodes: Vec<RedisServer> = (0..n)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ])
            })
            .collect();
        let cli = require_program("redis-cli", "redis-tools");
        let mut create = Command::new(&cli);
        create.arg("--cluster").arg("create");
        create.args(nodes.iter().map(RedisServer::addr));
        create.args(["--cluster-replicas", "0", "--cluster-yes"]);
        let output = create
            .output()
            .unwrap_or_else(|e| panic!("fencelock-testkit: cannot run redis-cli: {e}"));
        assert!(
            output.status.success(),
            "fencelock-testkit: redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster.is_ok() {
            assert!(
                Instant::now() < deadline,
                "fencelock-testkit: the Redis Cluster did not reach cluster_state:ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    /// Whether every node reports `cluster_state:ok` and agrees on all slots.
    pub fn is_ok(&self) -> bool {
        let cli = require_program("redis-cli", "redis-tools");
        self.nodes.iter().all(|node| {
            Command::new(&cli)
                .args(["-p", &node.port().to_string(), "cluster", "info"])
                .output()
                .is_ok_and(|o| {
                    let text = String::from_utf8_lossy(&o.stdout);
                    text.contains("cluster_state:ok") && text.contains("cluster_slots_ok:16384")
                })
        })
    }

    /// The masters.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(RedisServer::addr).collect();
        format!("redis+cluster://{}", hosts.join(","))
    }
}
