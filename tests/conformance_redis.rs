//! The conformance suite on every Redis topology, reached through `fencelock::connect`:
//! a single server, Redlock over three instances, a 3-master Cluster, and a master with a
//! replica behind three Sentinels. Each topology is started once per test process.
#![cfg(feature = "redis")]

use std::sync::OnceLock;

use fencelock_testkit::{RedisCluster, RedisSentinelSet, RedisServer};

fn redlock_url() -> String {
    static SERVERS: OnceLock<Vec<RedisServer>> = OnceLock::new();
    let servers = SERVERS.get_or_init(|| (0..3).map(|_| RedisServer::start()).collect());
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    format!("redlock://{}", hosts.join(","))
}

fn cluster_url() -> String {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| RedisCluster::start(3)).url()
}

fn sentinel_url() -> String {
    static SET: OnceLock<RedisSentinelSet> = OnceLock::new();
    SET.get_or_init(RedisSentinelSet::start).url()
}

mod single {
    fencelock_core::conformance_suite!(
        fencelock::connect(&fencelock_testkit::RedisServer::shared().url())
            .await
            .expect("connect redis://")
    );
}

mod redlock {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::redlock_url())
            .await
            .expect("connect redlock://")
    );
}

mod cluster {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::cluster_url())
            .await
            .expect("connect redis+cluster://")
    );
}

mod sentinel {
    fencelock_core::conformance_suite!(
        fencelock::connect(&super::sentinel_url())
            .await
            .expect("connect redis+sentinel://")
    );
}
