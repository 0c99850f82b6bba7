//! F16, a client crash: the holder is a child process (this test binary, run as
//! `crash_holder_child`) holding a renewing lock with a [`LEASE`] lease (ZooKeeper: a
//! session timeout of [`LEASE`]). It keeps the lock past its first lease (renewals work,
//! so a waiter on another client is still waiting), then is killed with SIGKILL: no
//! release, no close, its connections dropped by the kernel. The waiter gets the lock
//! within lease + 1 s of the kill (session timeout + 1 s on ZooKeeper), with a larger
//! token, and once it has released, nothing of either is left on the servers (C5: keys,
//! nodes, subscribed channels; on etcd, leases too).
//!
//! On etcd, ZooKeeper, and Redis single, Sentinel, Cluster and Redlock.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock};
use fencelock_testkit::{
    EtcdServer, RedisCluster, RedisSentinelSet, RedisServer, ZkServer, leftovers,
};
use tokio::time::Instant;

mod common;
use common::Servers;

const LEASE: Duration = Duration::from_secs(2);
/// The bound on the hand-over after the kill, beyond the lease (F16: TTL + 1 s).
const SLACK: Duration = Duration::from_secs(1);
/// How long what the crash left on the servers may take to go, after the waiter's
/// release (C5).
const LEFT_BOUND: Duration = Duration::from_secs(3);
/// The environment variable that makes `crash_holder_child` the holder: `NAME|URL`.
const HOLDER: &str = "FENCELOCK_FAULT_CRASH_HOLDER";

/// The holder, when run as a child with [`HOLDER`] set: takes the lock, prints
/// `token N`, and holds it (renewing) until it is killed or its stdin closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_holder_child() {
    let Ok(setting) = std::env::var(HOLDER) else {
        return;
    };
    let (name, url) = setting.split_once('|').expect("NAME|URL");
    let lock = fencelock::connect(url).await.expect("connect");
    let guard = lock
        .acquire(name, AcquireOptions::new().lease(LEASE).no_wait())
        .await
        .expect("the holder takes the lock");
    println!("token {}", guard.token().get());
    // Until the parent goes away (it kills us first).
    tokio::task::spawn_blocking(|| for _ in std::io::stdin().lock().lines() {})
        .await
        .unwrap();
    drop(guard);
}

/// The child holder process; killed (SIGKILL) when dropped, if still running.
struct Holder(std::process::Child);

impl Holder {
    /// Starts the holder of `name` on `url`; returns it and its token once it holds.
    fn start(name: &str, url: &str) -> (Holder, u64) {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "crash_holder_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HOLDER, format!("{name}|{url}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the holder");
        let stdout = child.stdout.take().expect("piped stdout");
        let holder = Holder(child);
        let token = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|line| {
                // libtest prints `test crash_holder_child ... ` before the first line.
                let line = line.trim_start_matches("test crash_holder_child ... ");
                line.strip_prefix("token ")
                    .map(|t| t.trim().parse().expect("a token"))
            })
            .expect("the holder prints its token");
        (holder, token)
    }

    fn kill(&mut self) {
        self.0.kill().expect("SIGKILL the holder");
        self.0.wait().expect("reap the holder");
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// F16 on `url`: the holder a child process, the waiter a client of this process.
async fn crash(backend: &str, url: &str, servers: &Servers<'_>) {
    let name = common::unique("f16");
    let waiter_lock = fencelock::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e:?}"));
    let (mut holder, token) = tokio::task::block_in_place(|| Holder::start(&name, url));
    let started = Instant::now();
    let waiter = tokio::spawn({
        let name = name.clone();
        async move {
            let guard = waiter_lock
                .acquire(
                    &name,
                    AcquireOptions::new()
                        .lease(LEASE)
                        .wait_timeout(Duration::from_secs(30)),
                )
                .await;
            (Instant::now(), guard, waiter_lock)
        }
    });
    // Past the first lease: renewals keep the lock, and the waiter waits.
    tokio::time::sleep(LEASE + LEASE / 2).await;
    assert!(
        !waiter.is_finished(),
        "{backend}: the waiter finished while the holder was alive and renewing"
    );
    let killed_at = Instant::now();
    tokio::task::block_in_place(|| holder.kill());
    let (granted_at, guard, waiter_lock) = waiter.await.expect("the waiter task");
    let guard = guard.unwrap_or_else(|e| panic!("{backend}: the waiter after the crash: {e:?}"));
    let after = granted_at - killed_at;
    assert!(
        after <= LEASE + SLACK,
        "{backend}: the lock passed {after:?} after the holder was killed (bound {:?})",
        LEASE + SLACK
    );
    assert!(
        guard.token().get() > token,
        "{backend}: token {} after the crashed holder's {token}",
        guard.token()
    );
    eprintln!(
        "F16 {backend}: held {:?} before the kill, handed over {after:?} after it",
        killed_at - started
    );
    guard.release().await.expect("the waiter releases");
    waiter_lock.close().await.expect("close");
    servers.assert_nothing_left_within(&format!("{backend} F16"), LEFT_BOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_etcd() {
    // A server of its own, so that its leases can be counted.
    let server = EtcdServer::start();
    let prefix = common::unique("f16-etcd");
    let url = format!("etcd://{}/{prefix}?lease=2s", server.endpoint());
    crash("etcd", &url, &Servers::Etcd(&server, &prefix)).await;
    tokio::task::block_in_place(|| {
        leftovers::assert_none_within("etcd F16 leases", LEFT_BOUND, || {
            leftovers::etcd_leases(&server.endpoint())
        });
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_zookeeper() {
    let server = ZkServer::shared();
    let chroot = common::unique("f16-zk");
    let url = format!(
        "zk://{}/{chroot}?session_timeout=2s&min_lease=2s",
        server.connect_string()
    );
    crash("zookeeper", &url, &Servers::Zk(server, &chroot)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_redis() {
    let server = RedisServer::shared();
    let prefix = common::unique("f16-redis");
    let url = format!("{}?prefix={prefix}:", server.url());
    crash("redis", &url, &Servers::redis(server, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_redis_sentinel() {
    let set = tokio::task::block_in_place(RedisSentinelSet::start);
    let prefix = common::unique("f16-sentinel");
    let url = format!("{}?prefix={prefix}:", set.url());
    crash(
        "sentinel",
        &url,
        &Servers::Redis(vec![set.master().port()], &prefix),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_redis_cluster() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
    let prefix = common::unique("f16-cluster");
    let url = format!("{}?prefix={prefix}:", cluster.url());
    let ports = cluster.nodes().iter().map(RedisServer::port).collect();
    crash("cluster", &url, &Servers::Redis(ports, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_redlock() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let prefix = common::unique("f16-redlock");
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let url = format!("redlock://{}?prefix={prefix}:", hosts.join(","));
    let ports = servers.iter().map(RedisServer::port).collect();
    crash("redlock", &url, &Servers::Redis(ports, &prefix)).await;
}
