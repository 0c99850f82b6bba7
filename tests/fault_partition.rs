//! F4, a partition of a running holder: the holder's client is cut from its servers
//! (every connection blackholed by a [`FaultProxy`]) for 6 s with a 2 s lease, then
//! healed. On every networked backend:
//!
//! - the holder reports loss before the heal, on its own timer, no later than its
//!   `valid_until` + 250 ms (C6);
//! - another client acquires within lease + 1 s of the partition, with a larger token,
//!   and never while the holder's guard still claimed to be valid (C1);
//! - the partitioned holder's late fenced write is rejected (C2);
//! - its `release()` after the heal is `Err(Lost)`;
//! - nothing of it remains: the name is free and has no waiters after the new holder
//!   releases, and within 3 s no key, node or subscribed channel of the scenario is
//!   left on the servers (C5).
//!
//! Sentinel and Cluster clients learn the servers' addresses from the deployment, so
//! there the servers announce their proxies (testkit's `start_behind_proxy` and
//! `start_behind_proxies`), every client connects through them, and the other client's
//! connections (and the servers' own links) are exempted from the fault before the
//! holder connects.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error};
use fencelock_testkit::checker::{Checker, LOSS_BOUND};
use fencelock_testkit::{EtcdServer, Fault, FaultProxy, RedisServer, ZkServer};
use tokio::time::Instant;

mod common;
use common::{Proxied, Servers};

const LEASE: Duration = Duration::from_secs(2);
const PARTITION: Duration = Duration::from_secs(6);

fn unique(name: &str) -> String {
    common::unique(&format!("f4-{name}"))
}

/// The scenario on `holder` (connected through `proxies`) and `other` (connected
/// directly).
async fn partition_of_a_running_holder(
    holder: &dyn DistributedLock,
    other: &dyn DistributedLock,
    proxies: &[&FaultProxy],
    name: &str,
    servers: &Servers<'_>,
) {
    let checker = Checker::new();
    let options = AcquireOptions::new().lease(LEASE).no_wait();
    let guard = holder
        .acquire(name, options)
        .await
        .expect("holder acquires");
    let token = guard.token().get();
    checker.enter("holder", token);
    assert!(checker.write("holder", token));
    // The leftover probe sees a held lock (so its empty answer at the end means
    // something).
    let held = tokio::task::block_in_place(|| servers.left());
    assert!(!held.is_empty(), "the probe does not see the holder's lock");
    // Let a renewal or two happen first.
    tokio::time::sleep(LEASE / 2).await;
    assert!(!guard.is_lost(), "lost before the partition");

    for proxy in proxies {
        proxy.set(Fault::Blackhole);
    }
    let partitioned_at = Instant::now();
    // Nothing passes the cut, but a renewal's reply already past the proxy may still be
    // handled after it (under load, well after it), moving the deadline once more. So
    // the deadline the guard had at the cut is the one it holds once it reports loss
    // (no reply handled later matters), checked independently of the guard: it lies
    // between the deadline sampled at the cut and one a renewal sent before the cut
    // can give (`valid_until` is a renewal's send instant + the lease - a margin).
    let sampled_at_cut = guard.valid_until();

    let loss = async {
        guard.lost().await;
        let lost_at = Instant::now();
        // The deadline the guard held when it reported loss.
        let valid_at_loss = guard.valid_until();
        checker.lost("holder", token, valid_at_loss.into_std());
        (lost_at, valid_at_loss)
    };
    let next = async {
        let next = other
            .acquire(
                name,
                AcquireOptions::new()
                    .lease(LEASE)
                    .wait_timeout(PARTITION + Duration::from_secs(10)),
            )
            .await
            .expect("another client acquires during the partition");
        let granted_at = Instant::now();
        checker.enter("other", next.token().get());
        assert!(checker.write("other", next.token().get()));
        (next, granted_at)
    };
    let ((lost_at, valid_at_cut), (next, granted_at)) = tokio::join!(loss, next);
    assert!(
        valid_at_cut >= sampled_at_cut,
        "the guard's deadline went back after the cut"
    );
    assert!(
        valid_at_cut <= partitioned_at + LEASE,
        "the guard's deadline moved {:?} past what a renewal sent before the cut can give",
        valid_at_cut - (partitioned_at + LEASE)
    );

    let lost_after = lost_at - partitioned_at;
    assert!(
        lost_after < PARTITION,
        "loss reported {lost_after:?} into the partition, not before the heal"
    );
    assert!(
        lost_at <= valid_at_cut + LOSS_BOUND,
        "loss reported {:?} after the deadline the guard had at the cut",
        lost_at - valid_at_cut
    );
    assert!(
        lost_at <= partitioned_at + LEASE + LOSS_BOUND,
        "loss reported {lost_after:?} into the partition, more than a lease"
    );
    // C1 by the clock, not only by the order the two were recorded in: the other
    // client's grant came after the holder's deadline.
    assert!(
        granted_at >= guard.valid_until(),
        "the other client was granted {:?} before the holder's deadline",
        guard.valid_until() - granted_at
    );
    let granted_after = granted_at - partitioned_at;
    assert!(
        granted_after <= LEASE + Duration::from_secs(1),
        "the other client acquired {granted_after:?} into the partition"
    );
    assert!(next.token().get() > token, "the new token is not larger");
    // The zombie's late write, with its old token.
    assert!(
        !checker.write("holder", token),
        "the partitioned holder's late write was accepted"
    );

    tokio::time::sleep_until(partitioned_at + PARTITION).await;
    for proxy in proxies {
        proxy.set(Fault::Pass);
    }
    let released = guard.release().await;
    assert!(
        matches!(released, Err(Error::Lost { .. })),
        "the partitioned holder's release after the heal: {released:?}"
    );
    checker.exit("other", next.token().get());
    next.release().await.expect("the new holder releases");

    checker.assert_no_overlap();
    checker.assert_no_stale_write_accepted();
    checker.assert_no_lost_update(2);
    checker.assert_tokens_increase();
    checker.assert_loss_reported_in_time();

    // Nothing of the partitioned holder remains.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let info = other.inspect(name).await.expect("inspect");
        if !info.is_held() && matches!(info.waiters, None | Some(0)) {
            break;
        }
        assert!(Instant::now() < deadline, "left behind: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    servers.assert_nothing_left_within("F4", Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_etcd() {
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = unique("etcd");
    let holder = fencelock::connect(&format!("etcd://{}/{prefix}?lease=2s", proxy.addr()))
        .await
        .unwrap();
    let other = fencelock::connect(&format!("etcd://{}/{prefix}?lease=2s", server.endpoint()))
        .await
        .unwrap();
    let servers = Servers::Etcd(server, &prefix);
    partition_of_a_running_holder(&*holder, &*other, &[&proxy], "stock", &servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_zookeeper() {
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let chroot = unique("zk");
    let url = |hosts: &str| format!("zk://{hosts}/{chroot}?session_timeout=2s&min_lease=2s");
    let holder = fencelock::connect(&url(&proxy.addr())).await.unwrap();
    let other = fencelock::connect(&url(&server.connect_string()))
        .await
        .unwrap();
    let servers = Servers::Zk(server, &chroot);
    partition_of_a_running_holder(&*holder, &*other, &[&proxy], "stock", &servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_redis() {
    let server = RedisServer::shared();
    let proxy = FaultProxy::start(&server.addr());
    let prefix = unique("redis");
    let holder = fencelock::connect(&format!("redis://{}?prefix={prefix}:", proxy.addr()))
        .await
        .unwrap();
    let other = fencelock::connect(&format!("{}?prefix={prefix}:", server.url()))
        .await
        .unwrap();
    let servers = Servers::redis(server, &prefix);
    partition_of_a_running_holder(&*holder, &*other, &[&proxy], "stock", &servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_redlock() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| FaultProxy::start(&s.addr()))
        .collect();
    let prefix = unique("redlock");
    let via = |addrs: Vec<String>| format!("redlock://{}?prefix={prefix}:", addrs.join(","));
    let holder = fencelock::connect(&via(proxies.iter().map(FaultProxy::addr).collect()))
        .await
        .unwrap();
    let other = fencelock::connect(&via(servers.iter().map(RedisServer::addr).collect()))
        .await
        .unwrap();
    let proxies: Vec<&FaultProxy> = proxies.iter().collect();
    let servers = Servers::Redis(servers.iter().map(RedisServer::port).collect(), &prefix);
    partition_of_a_running_holder(&*holder, &*other, &proxies, "stock", &servers).await;
}

/// F4 on a deployment behind announced proxies: the other client's connections (and the
/// servers' own links) are exempt, the holder's are cut.
async fn partition_behind_proxies(deployment: Proxied, tag: &str) {
    let prefix = unique(tag);
    let other = fencelock::connect(&deployment.url(&prefix)).await.unwrap();
    deployment.exempt();
    let holder = fencelock::connect(&deployment.cut_url(&prefix))
        .await
        .unwrap();
    let proxies = deployment.proxies();
    let servers = deployment.servers(&prefix);
    partition_of_a_running_holder(&*holder, &*other, &proxies, "stock", &servers).await;
    deployment.assert_no_failover();
}

/// Sentinel: the Sentinels name the master's proxy; the holder's connections to it are
/// cut (the Sentinels', the replica's and the other client's are exempt, so no failover
/// follows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_redis_sentinel() {
    partition_behind_proxies(Proxied::sentinel().await, "sentinel").await;
}

/// Cluster: every node announces its proxy; all of the holder's connections (commands
/// to every master, and unlock subscriptions through its seeds) are cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_redis_cluster() {
    partition_behind_proxies(Proxied::cluster().await, "cluster").await;
}

/// The migration layer in its mixed phases: both legs of the holder are cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_migration() {
    let redis = RedisServer::shared();
    let etcd = EtcdServer::shared();
    for phase in [
        fencelock::MigrationPhase::LegacyFirst,
        fencelock::MigrationPhase::TargetFirst,
    ] {
        let (redis_proxy, etcd_proxy) = (
            FaultProxy::start(&redis.addr()),
            FaultProxy::start(&etcd.endpoint()),
        );
        let prefix = unique("migrate");
        let url = |redis: &str, etcd: &str| {
            fencelock::migration_url(
                phase,
                &format!("redis://{redis}?layout=raw&prefix={prefix}:"),
                &format!("etcd://{etcd}/{prefix}?lease=2s"),
            )
        };
        let holder = fencelock::connect(&url(&redis_proxy.addr(), &etcd_proxy.addr()))
            .await
            .unwrap();
        let other = fencelock::connect(&url(&redis.addr(), &etcd.endpoint()))
            .await
            .unwrap();
        let servers = Servers::Both(
            Box::new(Servers::redis(redis, &prefix)),
            Box::new(Servers::Etcd(etcd, &prefix)),
        );
        partition_of_a_running_holder(
            &*holder,
            &*other,
            &[&redis_proxy, &etcd_proxy],
            "stock",
            &servers,
        )
        .await;
    }
}
