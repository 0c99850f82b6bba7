//! F22, bad input: a bad name, lease, leader value or prefix is a typed error before a
//! single byte reaches the servers. Each client talks to its servers through
//! [`FaultProxy`]s that count the bytes sent upstream; the client first takes and
//! releases a lock (so that sessions, leases and scripts are set up), then every bad
//! call is made and the count must not move.
//!
//! Background traffic (ZooKeeper pings, etcd keepalives) may land in the window by
//! chance: the batch is tried up to three times and passes if one try sends nothing. A
//! call that does I/O before it checks its input sends bytes on every try and fails.
//!
//! Names the policy accepts (`/`, `..`, `{tag}`, `*?[`, non-ASCII, a name of
//! [`MAX_NAME_LEN`] bytes) are each taken and released first (that each maps to a lock
//! of its own is the conformance case `odd_names_are_independent`); the empty name,
//! control characters (NUL, U+0001, CR, LF, DEL) and longer names are refused.
//!
//! On etcd, ZooKeeper, Redis single, Redlock and the migration layer (Sentinel and
//! Cluster clients take addresses from the deployment; their input checks are the same
//! code as Redis single's).
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::time::Duration;

use fencelock::{
    AcquireOptions, DistributedLock, DistributedLockExt, Error, LockGuard, MAX_LEADER_VALUE,
    MAX_LEASE, MAX_NAME_LEN, Permits,
};
use fencelock_testkit::{EtcdServer, FaultProxy, RedisServer, ZkServer};

mod common;

/// Every bad call, each checked for its typed error.
async fn bad_calls(backend: &str, lock: &dyn DistributedLock, held: &LockGuard) {
    let too_long = "x".repeat(MAX_NAME_LEN + 1);
    let huge = "y".repeat(2 << 20);
    let names = [
        "",
        "nul\0byte",
        "\u{1}",
        "new\nline",
        "cr\r\nlf",
        "\u{7f}",
        &too_long,
        &huge,
    ];
    for name in names {
        let what = short(name);
        let err = lock.try_lock(name).await.unwrap_err();
        assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
        let err = lock.inspect(name).await.unwrap_err();
        assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
        if lock.capabilities().election {
            let err = lock
                .campaign(name, "v", AcquireOptions::new().no_wait())
                .await
                .unwrap_err();
            assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
            let err = lock.leader(name).await.unwrap_err();
            assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
        }
        if lock.capabilities().semaphore {
            let one = Permits::one_of(2).expect("valid");
            let err = lock
                .acquire_permits(name, one, AcquireOptions::new().no_wait())
                .await
                .unwrap_err();
            assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
        }
        if lock.capabilities().rw_lock {
            let err = lock
                .acquire_read(name, AcquireOptions::new().no_wait())
                .await
                .unwrap_err();
            assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
            let err = lock
                .acquire_write(name, AcquireOptions::new().no_wait())
                .await
                .unwrap_err();
            assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
        }
        let err = lock.revoke(name).await.unwrap_err();
        assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
        if lock.capabilities().election {
            let err = lock.observe(name).await.unwrap_err();
            assert!(matches!(err, Error::InvalidName { .. }), "{what}: {err:?}");
        }
    }
    let name = "f22-good-name";
    let min = lock.capabilities().min_lease;
    let mut leases = vec![
        AcquireOptions::new().lease(Duration::ZERO),
        AcquireOptions::new().fixed_lease(Duration::ZERO),
        AcquireOptions::new().lease(Duration::from_nanos(2)),
        AcquireOptions::new().lease(MAX_LEASE + Duration::from_secs(1)),
        AcquireOptions::new().fixed_lease(Duration::MAX),
        AcquireOptions::new()
            .lease(Duration::MAX)
            .wait_timeout(Duration::MAX),
    ];
    if min > Duration::from_millis(1) {
        leases.push(AcquireOptions::new().fixed_lease(min / 2));
        leases.push(AcquireOptions::new().lease(min / 2));
    }
    if backend == "etcd" {
        // Whole seconds only: never rounded in silence.
        leases.push(AcquireOptions::new().lease(Duration::from_millis(2500)));
    }
    for options in leases {
        let err = lock.acquire(name, options).await.unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig(_)),
            "{options:?}: {err:?}"
        );
    }
    if lock.capabilities().election {
        let value = "v".repeat(MAX_LEADER_VALUE + 1);
        let err = lock
            .campaign(name, &value, AcquireOptions::new().no_wait())
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig(_)),
            "leader value: {err:?}"
        );
    }
    // A held guard (a fixed lease: no renewals to count) asked to extend by a bad lease.
    for bad in [
        Duration::ZERO,
        Duration::MAX,
        MAX_LEASE + Duration::from_secs(1),
    ] {
        let err = held.extend(bad).await.unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig(_)),
            "extend {bad:?}: {err:?}"
        );
    }
    let err = lock.list(&too_long).await.unwrap_err();
    assert!(
        matches!(err, Error::InvalidName { .. } | Error::InvalidConfig(_)),
        "list prefix: {err:?}"
    );
}

/// `name`, cut to 20 characters, for messages.
fn short(name: &str) -> String {
    format!("{:?}", name.chars().take(20).collect::<String>())
}

/// Takes and releases `name` (a name the policy accepts).
async fn take(lock: &dyn DistributedLock, name: &str) {
    let guard = lock
        .try_lock(name)
        .await
        .unwrap_or_else(|e| panic!("{}: {e:?}", short(name)))
        .unwrap_or_else(|| panic!("{}: taken", short(name)));
    guard
        .release()
        .await
        .unwrap_or_else(|e| panic!("{}: {e:?}", short(name)));
}

/// Every call [`bad_calls`] makes, once with good input: whatever a primitive sets up on
/// its first use (a connection, a script, a directory node) is done before counting.
async fn good_calls(lock: &dyn DistributedLock) {
    let name = "f22-warm-up";
    lock.inspect(name).await.expect("inspect");
    lock.list("f22").await.expect("list");
    let caps = lock.capabilities();
    if caps.election {
        let term = lock
            .campaign(name, "v", AcquireOptions::new().no_wait())
            .await
            .expect("campaign");
        lock.leader(name).await.expect("leader");
        term.release().await.expect("resign");
    }
    if caps.semaphore {
        let one = Permits::one_of(2).expect("valid");
        let permit = lock
            .acquire_permits(name, one, AcquireOptions::new().no_wait())
            .await
            .expect("a permit");
        permit.release().await.expect("release the permit");
    }
    if caps.rw_lock {
        let read = lock
            .acquire_read(name, AcquireOptions::new().no_wait())
            .await
            .expect("a read lock");
        read.release().await.expect("release the read lock");
    }
}

/// F22 on the client of `url`, whose every server connection goes through `proxies`.
async fn before_any_io(backend: &str, url: &str, proxies: &[&FaultProxy]) {
    let lock = fencelock::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e:?}"));
    // Sessions, leases, scripts and subscriptions set up, as in a running service.
    let longest = "z".repeat(MAX_NAME_LEN);
    let accepted = [
        "/", "a/../b", "..", ".", "a//b", "b/", "{tag}", "*?[", "é ü", &longest,
    ];
    for name in accepted {
        take(&*lock, name).await;
    }
    good_calls(&*lock).await;
    let fixed = AcquireOptions::new().fixed_lease(Duration::from_secs(60));
    let held = lock
        .acquire("f22-held", fixed.no_wait())
        .await
        .expect("held");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = || proxies.iter().map(|p| p.bytes_up()).sum::<u64>();
    let mut tries = Vec::new();
    for _ in 0..3 {
        let before = sent();
        bad_calls(backend, &*lock, &held).await;
        // Anything a bad call started without waiting for it reaches the proxy too.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let bytes = sent() - before;
        tries.push(bytes);
        if bytes == 0 {
            break;
        }
    }
    assert_eq!(
        tries.last(),
        Some(&0),
        "{backend}: bytes sent to the servers by calls with bad input, per try: {tries:?}"
    );
    // Still working, and the refused calls left nothing in the way.
    take(&*lock, "f22-good-name").await;
    assert!(!held.is_lost(), "{backend}: the held guard was lost");
    held.release().await.expect("release the held guard");
    lock.close().await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f22_etcd() {
    let proxy = FaultProxy::start(&EtcdServer::shared().endpoint());
    let prefix = common::unique("f22-etcd");
    let url = format!("etcd://{}/{prefix}", proxy.addr());
    before_any_io("etcd", &url, &[&proxy]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f22_zookeeper() {
    let proxy = FaultProxy::start(&ZkServer::shared().connect_string());
    let chroot = common::unique("f22-zk");
    let url = format!("zk://{}/{chroot}?session_timeout=30s", proxy.addr());
    before_any_io("zookeeper", &url, &[&proxy]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f22_redis() {
    let proxy = FaultProxy::start(&RedisServer::shared().addr());
    let prefix = common::unique("f22-redis");
    let url = format!("redis://{}?prefix={prefix}:", proxy.addr());
    before_any_io("redis", &url, &[&proxy]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f22_redlock() {
    let instances: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<FaultProxy> = instances
        .iter()
        .map(|s| FaultProxy::start(&s.addr()))
        .collect();
    let prefix = common::unique("f22-redlock");
    let hosts: Vec<String> = proxies.iter().map(FaultProxy::addr).collect();
    let url = format!("redlock://{}?prefix={prefix}:", hosts.join(","));
    let proxies: Vec<&FaultProxy> = proxies.iter().collect();
    before_any_io("redlock", &url, &proxies).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f22_migration() {
    let redis = FaultProxy::start(&RedisServer::shared().addr());
    let etcd = FaultProxy::start(&EtcdServer::shared().endpoint());
    let prefix = common::unique("f22-migrate");
    let url = fencelock::migration_url(
        fencelock::MigrationPhase::LegacyFirst,
        &format!("redis://{}?layout=raw&prefix={prefix}:", redis.addr()),
        &format!("etcd://{}/{prefix}", etcd.addr()),
    );
    before_any_io("migration", &url, &[&redis, &etcd]).await;
}
