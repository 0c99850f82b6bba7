//! Real etcd, ZooKeeper and Redis servers for fencelock's tests.
//!
//! Every server runs on free loopback ports in its own temporary directory, is waited
//! for until it answers, and is killed (SIGKILL, then reaped) when its handle is
//! dropped. Servers are spawned from one long-lived thread with
//! `PR_SET_PDEATHSIG(SIGKILL)`, so they die with the test process even if that process
//! is killed. A missing server binary is a panic naming the Debian package, never a
//! skipped test: run `./scripts/test` to install them.
//!
//! For fault tests: [`FaultProxy`] puts partitions, delays and lost replies between a
//! client and a server, [`checker`] records fenced writes and checks the history, and
//! [`leftovers`] reads what a scenario left on the servers.
//! [`EtcdCluster::start_isolated`] and [`ZkEnsemble::start_isolated`] put each member in
//! its own network namespace ([`NetLab`]), so a member can be cut from its peers while
//! its clients stay connected. [`ZkServer::start_with_fake_clock`] runs ZooKeeper under
//! libfaketime, so [`ZkServer::jump_clock`] can move its clocks forward.
//!
//! [`bench`](mod@bench) is the shared harness of the backend benchmarks: hdrhistogram latencies,
//! kinds interleaved round by round, medians and ratios over repeats, and the process's
//! own CPU time.
//!
//! The library uses only std, `libc`, `tempfile` and `hdrhistogram`: no async runtime,
//! no clients.
//! [`TestCertificates`] makes a private CA and certificates for TLS servers with the
//! `openssl` command-line tool.

pub mod bench;
mod binaries;
pub mod checker;
mod etcd;
mod etcd_cluster;
mod launch;
pub mod leftovers;
mod net;
mod netns;
mod port;
mod process;
mod proxy;
mod redis;
mod redis_cluster;
mod redis_sentinel;
mod scratch;
mod server;
mod tls;
mod zk_ensemble;
mod zookeeper;

pub use etcd::EtcdServer;
pub use etcd_cluster::EtcdCluster;
pub use netns::NetLab;
pub use port::{free_port, free_ports, port_open};
pub use process::process_alive;
pub use proxy::{Fault, FaultProxy};
pub use redis::RedisServer;
pub use redis_cluster::RedisCluster;
pub use redis_sentinel::{RedisSentinel, RedisSentinelSet, SENTINEL_SERVICE};
pub use server::Server;
pub use tls::TestCertificates;
pub use zk_ensemble::ZkEnsemble;
pub use zookeeper::{ZkSecurity, ZkServer};
