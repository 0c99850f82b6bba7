//! The migration layer from Redis to etcd on real servers: fencing tokens across every
//! phase change, exclusion of hand-written `SET NX PX` locks, a second leg that cannot be
//! had, and the loss of one leg.
#![cfg(all(feature = "redis", feature = "etcd"))]

use std::sync::Arc;
use std::time::Duration;

use fencelock::{
    AcquireOptions, DistributedLock, DistributedLockExt, Error, FencedRegister, MigrationPhase,
};
use fencelock_testkit::{EtcdServer, RedisServer};

const PREFIX: &str = "lock:";

fn legacy_url() -> String {
    format!("{}?layout=raw&prefix={PREFIX}", RedisServer::shared().url())
}

fn target_url() -> String {
    format!(
        "etcd://{}/fencelock-migration-test",
        EtcdServer::shared().endpoint()
    )
}

async fn migration(phase: MigrationPhase) -> Arc<dyn DistributedLock> {
    fencelock::connect(&format!(
        "{}&second_leg_wait=200ms",
        fencelock::migration_url(phase, &legacy_url(), &target_url())
    ))
    .await
    .expect("connect migrate://")
}

fn unique(case: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("migration-test/{case}-{nanos:x}")
}

async fn raw_redis() -> redis::aio::MultiplexedConnection {
    redis::Client::open(RedisServer::shared().url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The seeds' hand-written lock: `SET key value NX PX ms`. Returns whether it was set.
async fn set_nx(conn: &mut redis::aio::MultiplexedConnection, key: &str, value: &str) -> bool {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(10_000)
        .query_async(conn)
        .await
        .unwrap();
    set.is_some()
}

/// The seeds' compare-and-delete release.
async fn compare_and_delete(conn: &mut redis::aio::MultiplexedConnection, key: &str, value: &str) {
    let deleted: i64 = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    )
    .key(key)
    .arg(value)
    .invoke_async(conn)
    .await
    .unwrap();
    assert_eq!(deleted, 1);
}

/// A resource that has seen tokens from Redis (the old fleet, using the Redis URL
/// directly) accepts the first holder of every phase and keeps refusing the tokens of
/// every holder before it, across each phase change, including the switch from Redis
/// tokens (about 1.7e15) to etcd revisions (small) at target-first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_across_every_phase_change() {
    let name = unique("tokens");
    let old_fleet = fencelock::connect(&legacy_url()).await.unwrap();
    let register = FencedRegister::new(0u64);
    let mut zombies = Vec::new();
    for _ in 0..3 {
        let guard = old_fleet.lock(&name).await.unwrap();
        register.write(guard.token(), 1).unwrap();
        zombies.push(guard.token());
        guard.release().await.unwrap();
    }
    assert!(
        zombies[0].get() > 1_000_000_000_000_000,
        "Redis tokens are µs"
    );
    for phase in MigrationPhase::ALL {
        let locks = migration(phase).await;
        for round in 0..2 {
            let guard = locks.lock(&name).await.unwrap();
            register
                .write(guard.token(), 2)
                .unwrap_or_else(|e| panic!("{phase}: holder {round} was refused: {e}"));
            for zombie in &zombies {
                assert!(
                    register.write(*zombie, 3).is_err(),
                    "{phase}: zombie token {zombie} accepted after {}",
                    guard.token()
                );
            }
            zombies.push(guard.token());
            guard.release().await.unwrap();
        }
        if phase == MigrationPhase::LegacyFirst {
            // Until target-first, the old fleet's tokens stay comparable: it still works.
            let guard = old_fleet.lock(&name).await.unwrap();
            register.write(guard.token(), 4).unwrap();
            zombies.push(guard.token());
            guard.release().await.unwrap();
        }
    }
    assert_eq!(register.read(), 2);
    assert!(
        zombies.last().unwrap().get() >> 56 == 1,
        "target era is epoch 1"
    );
}

/// Under every phase that takes the Redis lock, the migration lock and a hand-written
/// `SET NX PX` lock on `lock:` + name exclude each other, both ways; after `target`,
/// the Redis key is not taken any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_written_set_nx_locks_are_excluded_until_target() {
    let mut conn = raw_redis().await;
    let direct_etcd = fencelock::connect(&target_url()).await.unwrap();
    for phase in MigrationPhase::ALL {
        let name = unique(&format!("hand-{phase}"));
        let key = format!("{PREFIX}{name}");
        let locks = migration(phase).await;

        let guard = locks.lock(&name).await.unwrap();
        let got_in = set_nx(&mut conn, &key, "hand-1").await;
        assert_eq!(got_in, !phase.uses_legacy(), "{phase}: SET NX while held");
        if got_in {
            compare_and_delete(&mut conn, &key, "hand-1").await;
        }
        guard.release().await.unwrap();

        assert!(
            set_nx(&mut conn, &key, "hand-2").await,
            "{phase}: key left behind"
        );
        let attempt = locks.try_lock(&name).await.unwrap();
        assert_eq!(attempt.is_none(), phase.uses_legacy(), "{phase}");
        if let Some(guard) = attempt {
            guard.release().await.unwrap();
        }
        // A refused two-leg attempt leaves no etcd key behind.
        let etcd = direct_etcd.try_lock(&name).await.unwrap();
        assert!(etcd.is_some(), "{phase}: the target leg was left held");
        etcd.unwrap().release().await.unwrap();
        compare_and_delete(&mut conn, &key, "hand-2").await;
    }
}

/// Target-first with the Redis key held by hand: the acquire times out, and the etcd leg
/// it took first is released, not left half-held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_leg_timeout_releases_the_first() {
    let mut conn = raw_redis().await;
    let name = unique("second-leg");
    let key = format!("{PREFIX}{name}");
    let locks = migration(MigrationPhase::TargetFirst).await;
    assert!(set_nx(&mut conn, &key, "hand").await);
    let wait = Duration::from_millis(700);
    let err = locks
        .acquire(&name, AcquireOptions::new().wait_timeout(wait))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    let direct_etcd = fencelock::connect(&target_url()).await.unwrap();
    let etcd = direct_etcd
        .try_lock(&name)
        .await
        .unwrap()
        .expect("the etcd leg was released");
    etcd.release().await.unwrap();
    compare_and_delete(&mut conn, &key, "hand").await;
    let guard = locks.try_lock(&name).await.unwrap().expect("free again");
    guard.release().await.unwrap();
}

/// Someone deletes the Redis key under a two-leg guard: the Redis leg's next renewal
/// reports the loss, and the guard is lost with it, naming the leg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_redis_leg_loses_the_guard() {
    let mut conn = raw_redis().await;
    for phase in [MigrationPhase::LegacyFirst, MigrationPhase::TargetFirst] {
        let name = unique(&format!("loss-{phase}"));
        let locks = migration(phase).await;
        let lease = Duration::from_secs(3);
        let guard = locks
            .acquire(&name, AcquireOptions::new().lease(lease))
            .await
            .unwrap();
        let _: i64 = redis::cmd("DEL")
            .arg(format!("{PREFIX}{name}"))
            .query_async(&mut conn)
            .await
            .unwrap();
        tokio::time::timeout(lease / 3 + Duration::from_secs(1), guard.lost())
            .await
            .unwrap_or_else(|_| panic!("{phase}: the loss did not reach the guard"));
        let reason = guard.lost_reason().unwrap().to_owned();
        assert!(reason.starts_with("the legacy leg was lost"), "{reason}");
        assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
        let next = locks
            .try_lock(&name)
            .await
            .unwrap()
            .expect("free after release");
        next.release().await.unwrap();
    }
}

/// The etcd key of a legacy-first lock held alone (what a cancelled acquire whose etcd
/// reply was lost leaves until its lease ends): the lock is reported held, with a token
/// below the next grant's, so a resource fenced with it refuses no later holder. It was
/// reported as 2^56 + the key's revision (72057594037928052 in F9), above every Redis
/// token the phase hands out (1796607849902705 next).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_leg_held_alone_reports_no_token_above_the_next_grant() {
    let name = unique("etcd-alone");
    let locks = migration(MigrationPhase::LegacyFirst).await;
    let direct_etcd = fencelock::connect(&target_url()).await.unwrap();
    for how in ["inspect", "list", "revoke"] {
        let alone = direct_etcd.lock(&name).await.unwrap();
        let reported = match how {
            "inspect" => locks.inspect(&name).await.unwrap().holder,
            "list" => {
                let listed = locks.list(&name).await.unwrap();
                listed
                    .into_iter()
                    .find(|l| l.name == name)
                    .and_then(|l| l.info.holder)
            }
            _ => locks.revoke(&name).await.unwrap(),
        };
        let reported = reported
            .unwrap_or_else(|| panic!("{how}: the etcd key alone does not show as held"))
            .token;
        let _ = alone.release().await;
        let next = locks.lock(&name).await.unwrap();
        assert!(
            next.token() > reported,
            "{how}: reported token {reported}, above the next grant's {}",
            next.token()
        );
        next.release().await.unwrap();
    }
}
