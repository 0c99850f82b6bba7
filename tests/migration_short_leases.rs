//! The migration layer over legs with the shortest leases their backends allow, on real
//! servers: an etcd leg with `?lease=2s`, a ZooKeeper leg with `?session_timeout=2s`,
//! and a Redis leg with a 2 s lease from the options (its URL sets no default lease).
//! Acquired with the caller's default options, the migration guard must follow the
//! legs' own leases: held for several of them without reporting loss, while direct
//! clients of each leg are refused.
#![cfg(all(feature = "redis", feature = "etcd", feature = "zookeeper"))]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, DistributedLockExt, MigrationPhase};
use fencelock_testkit::{EtcdServer, RedisServer, ZkServer};
use tokio::time::Instant;

/// The legs' lease: etcd's minimum, and the shortest session the test ZooKeeper server
/// (`minSessionTimeout=1000`) and the backend's `min_lease=2s` allow together.
const LEG_LEASE: Duration = Duration::from_secs(2);

/// How long each guard is held: several leg leases, so the legs renew many times.
const HOLD: Duration = Duration::from_secs(7);

/// A number unique to this test process, for ZooKeeper chroots and lock names.
fn run() -> u64 {
    static RUN: OnceLock<u64> = OnceLock::new();
    *RUN.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id())
    })
}

/// An etcd leg whose configured default lease is 2 s.
fn etcd_url() -> String {
    format!(
        "etcd://{}/fencelock-short-leases?lease=2s",
        EtcdServer::shared().endpoint()
    )
}

/// A ZooKeeper leg whose configured session timeout (its default lease) is 2 s.
fn zk_url() -> String {
    format!(
        "zk://{}/fencelock-short-leases-{:016x}?session_timeout=2s&min_lease=2s",
        ZkServer::shared().connect_string(),
        run()
    )
}

/// A Redis leg: its URL sets no default lease, so it takes the options' lease.
fn redis_url() -> String {
    RedisServer::shared().url()
}

/// A lock name unique to this run and case.
fn unique(case: &str) -> String {
    format!("short-leases/{case}-{:x}", run())
}

/// Connects `url`, naming it in the panic message if that fails.
async fn connect(url: &str) -> Arc<dyn DistributedLock> {
    fencelock::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"))
}

/// Takes the migration lock over `legacy` and `target` in `phase` with `options`, holds
/// it for [`HOLD`] and checks that it is never reported lost, that its deadline follows
/// the legs' short leases, and that direct clients of both legs are refused throughout;
/// then releases it and checks that both legs are free.
async fn hold_through_short_leases(
    phase: MigrationPhase,
    legacy: &str,
    target: &str,
    options: AcquireOptions,
    case: &str,
) {
    let case = format!("{case} ({phase})");
    let name = unique(&case.replace([' ', '(', ')'], "-"));
    let locks = connect(&format!(
        "{}&second_leg_wait=1s",
        fencelock::migration_url(phase, legacy, target)
    ))
    .await;
    let (direct_legacy, direct_target) = (connect(legacy).await, connect(target).await);

    let guard = locks
        .acquire(&name, options)
        .await
        .unwrap_or_else(|e| panic!("{case}: acquire: {e}"));
    let start = Instant::now();
    let lost = guard.lost_token();
    let step = Duration::from_millis(500);
    while start.elapsed() < HOLD {
        let held = tokio::time::timeout(step, guard.lost()).await;
        assert!(
            held.is_err(),
            "{case}: the guard reported loss after {:?} while both legs held: {:?}",
            start.elapsed(),
            guard.lost_reason()
        );
        let now = Instant::now();
        assert!(!guard.is_lost() && !lost.is_cancelled(), "{case}");
        assert!(
            guard.valid_until() > now,
            "{case}: the deadline fell behind the legs' renewals"
        );
        assert!(
            guard.valid_until() <= now + LEG_LEASE,
            "{case}: the deadline is later than the legs' leases allow"
        );
    }
    assert!(
        direct_legacy.try_lock(&name).await.unwrap().is_none(),
        "{case}: a direct client of the legacy leg got the lock after {:?}",
        start.elapsed()
    );
    assert!(
        direct_target.try_lock(&name).await.unwrap().is_none(),
        "{case}: a direct client of the target leg got the lock after {:?}",
        start.elapsed()
    );
    assert!(!guard.is_lost(), "{case}: {:?}", guard.lost_reason());
    guard
        .release()
        .await
        .unwrap_or_else(|e| panic!("{case}: release: {e}"));
    for (role, direct) in [("legacy", &direct_legacy), ("target", &direct_target)] {
        let again = direct
            .try_lock(&name)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{case}: the {role} leg is still held after release"));
        again.release().await.unwrap();
    }
}

/// ZooKeeper and etcd legs, both with 2 s leases from their URLs, in either role and
/// both two-leg phases, with the caller's default options (a 30 s lease the legs do not
/// use).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_and_etcd_legs_with_2s_leases_hold_with_default_options() {
    let (zk, etcd) = (zk_url(), etcd_url());
    let options = AcquireOptions::new();
    tokio::join!(
        hold_through_short_leases(
            MigrationPhase::LegacyFirst,
            &zk,
            &etcd,
            options,
            "zk legacy, etcd target"
        ),
        hold_through_short_leases(
            MigrationPhase::TargetFirst,
            &zk,
            &etcd,
            options,
            "zk legacy, etcd target"
        ),
        hold_through_short_leases(
            MigrationPhase::LegacyFirst,
            &etcd,
            &zk,
            options,
            "etcd legacy, zk target"
        ),
        hold_through_short_leases(
            MigrationPhase::TargetFirst,
            &etcd,
            &zk,
            options,
            "etcd legacy, zk target"
        ),
    );
}

/// A Redis legacy leg (the options' default 30 s lease) and an etcd target leg with a
/// 2 s lease from its URL, in both two-leg phases, with the caller's default options.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_and_a_2s_etcd_leg_hold_with_default_options() {
    let (redis, etcd) = (redis_url(), etcd_url());
    let options = AcquireOptions::new();
    tokio::join!(
        hold_through_short_leases(
            MigrationPhase::LegacyFirst,
            &redis,
            &etcd,
            options,
            "redis legacy, etcd target"
        ),
        hold_through_short_leases(
            MigrationPhase::TargetFirst,
            &redis,
            &etcd,
            options,
            "redis legacy, etcd target"
        ),
    );
}

/// A 2 s renewing lease from the options on every leg (Redis, ZooKeeper), in both
/// two-leg phases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_2s_lease_from_the_options_holds_on_redis_and_zookeeper_legs() {
    let (redis, zk) = (redis_url(), zk_url());
    let options = AcquireOptions::new().lease(LEG_LEASE);
    tokio::join!(
        hold_through_short_leases(
            MigrationPhase::LegacyFirst,
            &redis,
            &zk,
            options,
            "redis legacy, zk target, 2s option"
        ),
        hold_through_short_leases(
            MigrationPhase::TargetFirst,
            &redis,
            &zk,
            options,
            "redis legacy, zk target, 2s option"
        ),
    );
}

/// A migration guard taken on a runtime that then shuts down (a `block_on` on a helper
/// thread) keeps following its legs, which renew on their clients' runtime: it is not
/// reported lost while both legs hold.
#[test]
fn a_guard_taken_on_a_runtime_that_ends_keeps_following_its_legs() {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let url = format!(
        "{}&second_leg_wait=1s",
        fencelock::migration_url(MigrationPhase::LegacyFirst, &redis_url(), &etcd_url())
    );
    let locks = main.block_on(connect(&url));
    let name = unique("short-lived-runtime");
    let guard = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let short = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                short.block_on(locks.acquire(&name, AcquireOptions::new().lease(LEG_LEASE)))
            })
            .join()
            .unwrap()
    })
    .unwrap_or_else(|e| panic!("acquire: {e}"));
    main.block_on(async {
        let start = Instant::now();
        while start.elapsed() < LEG_LEASE * 2 + LEG_LEASE / 2 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            assert!(
                !guard.is_lost(),
                "lost after {:?} while both legs held: {:?}",
                start.elapsed(),
                guard.lost_reason()
            );
            assert!(
                guard.valid_until() > Instant::now(),
                "the deadline fell behind the legs"
            );
        }
        guard.release().await.unwrap();
    });
}
