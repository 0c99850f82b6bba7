//! F21, a short disconnect without session loss: the holder's connections are
//! blackholed by a [`FaultProxy`] for 0.4 × its lease (ZooKeeper: its session timeout),
//! then healed (held data flows again, as TCP retransmission would deliver it). No false
//! alarm: the guard is never reported lost, it keeps its token, renewals go on after the
//! heal (it is still held two leases later), another client never gets the lock (C1),
//! no extra key or node appears on the servers (etcd re-uses the session's key, a
//! ZooKeeper session keeps its node), and the release is `Ok`.
//!
//! On etcd and ZooKeeper (the backends with sessions; Redis has no session to keep, and
//! its short cuts are the F5 stalls).
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, DistributedLockExt};
use fencelock_testkit::{EtcdServer, Fault, FaultProxy, ZkServer};
use tokio::time::Instant;

mod common;
use common::Servers;

const LEASE: Duration = Duration::from_secs(5);
/// 0.4 × the lease.
const CUT: Duration = Duration::from_secs(2);

async fn short_cut(
    backend: &str,
    holder: &dyn DistributedLock,
    other: &dyn DistributedLock,
    proxy: &FaultProxy,
    servers: &Servers<'_>,
) {
    let name = common::unique("f21");
    let guard = holder
        .acquire(&name, AcquireOptions::new().lease(LEASE).no_wait())
        .await
        .expect("the holder takes it");
    let token = guard.token();
    // Renewals run before the cut.
    tokio::time::sleep(LEASE / 2).await;
    let before = tokio::task::block_in_place(|| servers.left());
    assert!(
        !before.is_empty(),
        "{backend}: the probe does not see the lock"
    );

    proxy.set(Fault::Blackhole);
    let cut_at = Instant::now();
    while cut_at.elapsed() < CUT {
        assert!(
            !guard.is_lost(),
            "{backend}: lost {:?} into the cut",
            cut_at.elapsed()
        );
        assert!(
            other.try_lock(&name).await.expect("try_lock").is_none(),
            "{backend}: another client got the lock during the cut"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    proxy.set(Fault::Pass);
    // Two leases after the heal: only renewals that went through keep it.
    let healed_at = Instant::now();
    while healed_at.elapsed() < LEASE * 2 {
        assert!(
            !guard.is_lost(),
            "{backend}: lost {:?} after the heal ({:?})",
            healed_at.elapsed(),
            guard.lost_cause()
        );
        assert!(
            other.try_lock(&name).await.expect("try_lock").is_none(),
            "{backend}: another client got the lock after the heal"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let info = other.inspect(&name).await.expect("inspect");
    assert_eq!(
        info.holder.as_ref().map(|h| h.token),
        Some(token),
        "{backend}: the holder and its token after the heal"
    );
    let after = tokio::task::block_in_place(|| servers.left());
    assert_eq!(
        after, before,
        "{backend}: keys or nodes on the servers changed"
    );
    guard
        .release()
        .await
        .expect("the release after a short cut is Ok");
    servers.assert_nothing_left_within(&format!("{backend} F21"), Duration::from_secs(3));
    eprintln!("F21 {backend}: held through a {CUT:?} cut, token {token}, nothing extra");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f21_etcd() {
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = common::unique("f21-etcd");
    let url = |host: &str| format!("etcd://{host}/{prefix}?lease=5s");
    let holder = fencelock::connect(&url(&proxy.addr())).await.unwrap();
    let other = fencelock::connect(&url(&server.endpoint())).await.unwrap();
    short_cut(
        "etcd",
        &*holder,
        &*other,
        &proxy,
        &Servers::Etcd(server, &prefix),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f21_zookeeper() {
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let chroot = common::unique("f21-zk");
    let url = |hosts: &str| format!("zk://{hosts}/{chroot}?session_timeout=5s&min_lease=5s");
    let holder = fencelock::connect(&url(&proxy.addr())).await.unwrap();
    let other = fencelock::connect(&url(&server.connect_string()))
        .await
        .unwrap();
    short_cut(
        "zookeeper",
        &*holder,
        &*other,
        &proxy,
        &Servers::Zk(server, &chroot),
    )
    .await;
}
