//! F24, many waiters and bounded resources: while a holder on another client keeps the
//! lock, [`WAITERS`] acquires of one client wait on it at once with a [`WAIT`] timeout.
//! Every one ends with `Err(Timeout)` (none granted, none failing otherwise), within the
//! wait and a bound; on ZooKeeper the server holds a handful of watches, not one per
//! waiter (one predecessor watch per client: no herd). Then the same with
//! `max_waiters=`[`CAP`]: the acquires past the cap fail at once with
//! `Err(TooManyWaiters)`, the others time out as before. After the holder's release,
//! nothing is left on the servers (C5) and the lock is free at once.
//!
//! On etcd, ZooKeeper, Redis single and Redlock.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, DistributedLockExt, Error};
use fencelock_testkit::{EtcdServer, RedisServer, ZkServer};
use tokio::time::Instant;

mod common;
use common::Servers;

/// Waiting acquires per phase.
const WAITERS: usize = 1000;
/// The cap of the second phase.
const CAP: usize = 500;
/// Each waiter's timeout.
const WAIT: Duration = Duration::from_secs(2);
/// How much later than its timeout a waiter may end.
const LATE: Duration = Duration::from_secs(2);
/// How soon an acquire over the cap fails.
const AT_ONCE: Duration = Duration::from_millis(500);

/// One phase: `WAITERS` acquires of `lock` on the held `name`; returns how many ended in
/// `TooManyWaiters` (asserting every other one timed out in time).
async fn wait_all(backend: &str, lock: &Arc<dyn DistributedLock>, name: &str) -> usize {
    let mut waiters = tokio::task::JoinSet::new();
    for _ in 0..WAITERS {
        let (lock, name) = (lock.clone(), name.to_owned());
        waiters.spawn(async move {
            // Each acquire's own start: spawning a thousand tasks on two threads takes
            // time of its own.
            let started = Instant::now();
            let outcome = lock
                .acquire(&name, AcquireOptions::new().wait_timeout(WAIT))
                .await;
            (outcome, started.elapsed())
        });
    }
    let mut refused = 0;
    while let Some(joined) = waiters.join_next().await {
        let (outcome, took) = joined.expect("a waiter task");
        match outcome {
            Err(Error::Timeout { .. }) => assert!(
                took >= WAIT && took <= WAIT + LATE,
                "{backend}: a waiter timed out after {took:?}"
            ),
            Err(Error::TooManyWaiters { .. }) => {
                refused += 1;
                assert!(
                    took <= AT_ONCE,
                    "{backend}: an acquire over the cap failed after {took:?}"
                );
            }
            other => panic!("{backend}: a waiter on a held lock: {other:?}"),
        }
    }
    refused
}

async fn many_waiters(backend: &str, url: &str, servers: &Servers<'_>, zk: Option<&ZkServer>) {
    let name = common::unique("f24");
    let holder_lock = fencelock::connect(url).await.expect("connect the holder");
    let holder = holder_lock.lock(&name).await.expect("the holder takes it");
    let waiting = fencelock::connect(url).await.expect("connect the waiters");

    // Uncapped: every waiter times out; ZooKeeper watches stay a handful all along (the
    // most of three samples across the wait, so a herd forming late is seen too).
    let watches = async {
        let Some(zk) = zk else { return 0 };
        let mut most = 0;
        for _ in 0..3 {
            tokio::time::sleep(WAIT / 4).await;
            most = most.max(tokio::task::block_in_place(|| total_watches(zk)));
        }
        most
    };
    let (refused, watches) = tokio::join!(wait_all(backend, &waiting, &name), watches);
    assert_eq!(refused, 0, "{backend}: TooManyWaiters without a cap");
    assert!(
        watches <= 5,
        "{backend}: {watches} watches on the server for {WAITERS} waiters of one client"
    );

    // Capped: the acquires past the cap fail at once, the others time out.
    let capped_url = format!(
        "{url}{}max_waiters={CAP}",
        if url.contains('?') { '&' } else { '?' }
    );
    let capped = fencelock::connect(&capped_url)
        .await
        .expect("connect with max_waiters");
    let refused = wait_all(backend, &capped, &name).await;
    assert_eq!(
        refused,
        WAITERS - CAP,
        "{backend}: acquires over the cap of {CAP}"
    );

    let info = holder_lock.inspect(&name).await.expect("inspect");
    assert_eq!(
        info.holder.as_ref().map(|h| h.token),
        Some(holder.token()),
        "{backend}: the holder kept the lock through it all"
    );
    assert!(
        matches!(info.waiters, None | Some(0)),
        "{backend}: waiters left: {info:?}"
    );
    holder.release().await.expect("release");
    let next = waiting
        .try_lock(&name)
        .await
        .expect("try_lock")
        .unwrap_or_else(|| panic!("{backend}: the lock is not free after the release"));
    next.release().await.expect("release");
    for lock in [&holder_lock, &waiting, &capped] {
        lock.close().await.expect("close");
    }
    servers.assert_nothing_left_within(&format!("{backend} F24"), Duration::from_secs(3));
    eprintln!(
        "F24 {backend}: {WAITERS} waiters timed out, {refused} over the cap refused, {watches} ZooKeeper watches"
    );
}

/// `Total watches:` of ZooKeeper's `wchs`.
fn total_watches(server: &ZkServer) -> usize {
    let answer = server.four_letter_word("wchs").expect("wchs");
    answer
        .lines()
        .find_map(|line| line.strip_prefix("Total watches:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no total in `wchs`: {answer}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f24_etcd() {
    let server = EtcdServer::shared();
    let prefix = common::unique("f24-etcd");
    let url = format!("etcd://{}/{prefix}", server.endpoint());
    many_waiters("etcd", &url, &Servers::Etcd(server, &prefix), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f24_zookeeper() {
    // A server of its own, so that every watch on it is this test's.
    let server = ZkServer::start();
    let chroot = common::unique("f24-zk");
    let url = format!("zk://{}/{chroot}", server.connect_string());
    many_waiters(
        "zookeeper",
        &url,
        &Servers::Zk(&server, &chroot),
        Some(&server),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f24_redis() {
    let server = RedisServer::shared();
    let prefix = common::unique("f24-redis");
    let url = format!("{}?prefix={prefix}:", server.url());
    many_waiters("redis", &url, &Servers::redis(server, &prefix), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f24_redlock() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let prefix = common::unique("f24-redlock");
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let url = format!("redlock://{}?prefix={prefix}:", hosts.join(","));
    let ports = servers.iter().map(RedisServer::port).collect();
    many_waiters("redlock", &url, &Servers::Redis(ports, &prefix), None).await;
}
