//! F18: a Sentinel failover while a lock is held and replication is blocked, with and
//! without the replica check (`wait_replicas`).
//!
//! Each test starts its own master + replica + 3 Sentinels (`RedisSentinelSet`) and
//! touches nothing else: no firewall rule, no root. Replication is blocked from the
//! Redis side, on those servers only:
//!
//! 1. the replica is told to authenticate to its master as an ACL user that does not
//!    exist (`CONFIG SET masteruser` / `masterauth`), which does not affect the current
//!    link;
//! 2. the master drops the replica's link (`CLIENT KILL TYPE replica`);
//! 3. every reconnection attempt of the replica now fails at `AUTH` (`WRONGPASS`), so
//!    nothing written on the master from then on reaches the replica, while the replica
//!    stays a healthy failover candidate for the Sentinels (its link has been down for
//!    seconds, far below their `10 × down-after` limit).
//!
//! (Freezing the replica with SIGSTOP or `DEBUG SLEEP` does not block replication: the
//! stream still lands in its socket buffer and is applied on resume.)
//!
//! Then the master is killed (SIGKILL) and the test waits until all three Sentinels name
//! the replica as the master.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, FencedRegister};
use fencelock_testkit::{RedisSentinelSet, RedisServer};

/// A fresh connection to one of the servers the test started (fresh, because the
/// promotion kills normal clients of the promoted replica).
async fn conn(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn info_replication(server: &RedisServer) -> String {
    redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn(server).await)
        .await
        .unwrap()
}

async fn exists(server: &RedisServer, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(&mut conn(server).await)
        .await
        .unwrap()
        == 1
}

/// Waits (polling every 50 ms) until `check` holds, or panics after `limit`.
async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Blocks replication master → replica (see the module documentation) and waits until
/// both sides see the link down.
async fn block_replication(set: &RedisSentinelSet) {
    let mut replica = conn(set.replica()).await;
    for (parameter, value) in [
        ("masteruser", "fencelock-no-such-user"),
        ("masterauth", "replication-blocked"),
    ] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(parameter)
            .arg(value)
            .query_async(&mut replica)
            .await
            .unwrap();
    }
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut conn(set.master()).await)
        .await
        .unwrap();
    assert_eq!(killed, 1, "the master had one replica link to kill");
    wait_until("replication link down", Duration::from_secs(5), || async {
        info_replication(set.master())
            .await
            .contains("connected_slaves:0")
            && info_replication(set.replica())
                .await
                .contains("master_link_status:down")
    })
    .await;
}

/// Kills the master and waits until all three Sentinels name the replica as master and
/// the replica says it is one. Returns how long the failover took.
async fn fail_over(set: &Arc<RedisSentinelSet>) -> Duration {
    let s = set.clone();
    tokio::task::spawn_blocking(move || s.master().kill())
        .await
        .unwrap();
    let want = set.replica().addr();
    wait_until("Sentinel failover", Duration::from_secs(20), || {
        let (set, want) = (set.clone(), want.clone());
        async move {
            let sentinels = set.clone();
            let all = tokio::task::spawn_blocking(move || {
                sentinels
                    .sentinels()
                    .iter()
                    .all(|s| s.master_addr().as_deref() == Some(want.as_str()))
            })
            .await
            .unwrap();
            all && info_replication(set.replica())
                .await
                .contains("role:master")
        }
    })
    .await
}

async fn start_set() -> Arc<RedisSentinelSet> {
    Arc::new(
        tokio::task::spawn_blocking(RedisSentinelSet::start)
            .await
            .unwrap(),
    )
}

/// Without the replica check: A's grant exists only on the master when it dies; after
/// the failover B gets the same lock from the promoted replica while A's guard is still
/// valid: two holders. B's token is larger (same host clock: the promoted replica's
/// `TIME` is later than the master's was), so the fenced register accepts B's write and
/// rejects A's later one. A learns of the loss at its next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_without_replica_check_gives_a_second_holder_that_fencing_stops() {
    let set = start_set().await;
    let url = format!("{}?prefix=f18:", set.url());
    // A renews every lease / 3 = 10 s: well after the failover, so A's guard is still
    // valid (and not yet told) when B is granted.
    let lease = Duration::from_secs(30);
    let a_locks = fencelock_redis::connect(&url).await.unwrap();

    block_replication(&set).await;
    let a = a_locks
        .acquire("orders", AcquireOptions::new().lease(lease))
        .await
        .expect("without the check, A is granted although no replica has the key");
    let acquired = Instant::now();
    assert!(exists(set.master(), "f18:{orders}").await);
    assert!(
        !exists(set.replica(), "f18:{orders}").await,
        "replication was not blocked: the replica has A's key"
    );
    let register = FencedRegister::new(0u64);
    register
        .write(a.token(), 1)
        .expect("A writes while it holds");

    let failover = fail_over(&set).await;
    let b_locks = fencelock_redis::connect(&url).await.unwrap();
    let b = b_locks
        .acquire(
            "orders",
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("B is granted on the promoted replica, which never saw A's key");
    let b_granted = Instant::now();
    // Two holders at once: A's guard still claims the lock.
    assert!(
        !a.is_lost() && a.valid_until() > tokio::time::Instant::from_std(b_granted),
        "A already knew it lost the lock when B was granted ({:?})",
        a.lost_reason()
    );
    println!(
        "failover took {failover:?}; B granted {:?} after A; tokens A {} B {}",
        b_granted - acquired,
        a.token(),
        b.token()
    );
    assert!(
        b.token() > a.token(),
        "FINDING: the new holder's token {} is not larger than the stale holder's {}",
        b.token(),
        a.token()
    );
    register.write(b.token(), 2).expect("B's write");
    let stale = register
        .write(a.token(), 3)
        .expect_err("the stale holder's write after B's must be rejected");
    assert_eq!(stale.highest, b.token());
    assert_eq!(register.read(), 2);

    // A finds B's key at its next renewal (or at the latest at its local deadline).
    tokio::time::timeout(lease / 3 + Duration::from_secs(3), a.lost())
        .await
        .expect("A reports the loss at its next renewal");
    println!("A told of the loss: {:?}", a.lost_reason());
    assert!(
        a.release().await.is_err(),
        "A's late release must not be Ok"
    );
    assert!(!b.is_lost());
    b.release().await.unwrap();
}

/// With the replica check (`wait_replicas=1`): while replication works, acquiring waits
/// for the replica and the grant survives the failover (the promoted replica still has
/// the key, B is refused, the holder keeps renewing on the new master). While replication
/// is blocked, the acquire fails with a retryable error and leaves no key on the master,
/// so the failover cannot create a second holder. After the failover the new master has
/// no replica at all, so every acquire through a checking client fails: the check trades
/// availability for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_with_replica_check_refuses_the_unreplicated_grant() {
    let set = start_set().await;
    let checked_url = format!(
        "{}?prefix=f18w:&wait_replicas=1&wait_timeout=300ms",
        set.url()
    );
    let plain_url = format!("{}?prefix=f18w:", set.url());
    let a_locks = fencelock_redis::connect(&checked_url).await.unwrap();
    // Longer than the failover, so that `kept` survives it on its local deadline too.
    let lease = Duration::from_secs(12);

    // Replication healthy: the replica acknowledges, the grant is replicated.
    let kept = a_locks
        .acquire("kept", AcquireOptions::new().lease(lease))
        .await
        .expect("the replica acknowledges while replication works");
    assert!(exists(set.replica(), "f18w:{kept}").await);

    block_replication(&set).await;
    let started = Instant::now();
    let err = a_locks
        .acquire(
            "orders",
            AcquireOptions::new()
                .lease(lease)
                .wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect_err("with the check, an unreplicated grant must not be handed out");
    println!("refused after {:?}: {err:?}", started.elapsed());
    assert!(err.is_retryable(), "{err:?}");
    assert!(
        format!("{err:?}").contains("replicas acknowledged"),
        "{err:?}"
    );
    assert!(
        !exists(set.master(), "f18w:{orders}").await,
        "the refused grant was left on the master"
    );

    let failover = fail_over(&set).await;
    println!("failover took {failover:?}");
    let b_locks = fencelock_redis::connect(&plain_url).await.unwrap();
    let b = b_locks
        .try_lock("orders")
        .await
        .unwrap()
        .expect("nobody holds `orders`: B gets it, and it is the only holder");
    assert!(
        b_locks.try_lock("kept").await.unwrap().is_none(),
        "the replicated grant was lost in the failover"
    );
    // The holder of `kept` renews on the new master: its deadline moves on.
    let before = kept.valid_until();
    wait_until("a renewal on the new master", lease / 2, || async {
        kept.valid_until() > before
    })
    .await;
    assert!(!kept.is_lost(), "{:?}", kept.lost_reason());
    assert!(b_locks.try_lock("kept").await.unwrap().is_none());

    // The promoted master has no replica: the check now refuses every grant.
    let err = a_locks
        .try_lock("elsewhere")
        .await
        .expect_err("no replica left to acknowledge");
    assert!(err.is_retryable(), "{err:?}");

    kept.release().await.unwrap();
    b.release().await.unwrap();
}

/// A master that stalls past the Sentinels' down-after and returns after the failover
/// goes on acting as a master for about 10 s, until the Sentinels demote it. A client
/// connected to it before the stall, idle during it (so no command failed), must not be
/// granted a lock there while a client connected after the failover is granted the same
/// lock on the promoted replica: the client follows the Sentinels' `+switch-master` and
/// drops its connection to the old master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returning_old_master_grants_nothing_after_the_failover() {
    let set = start_set().await;
    let url = format!("{}?prefix=ret:", set.url());
    let early = fencelock_redis::connect(&url).await.unwrap();
    let warm = early.try_lock("warm").await.unwrap().expect("free");
    warm.release().await.unwrap();

    let s = set.clone();
    tokio::task::spawn_blocking(move || s.master().pause())
        .await
        .unwrap();
    let want = set.replica().addr();
    let failover = wait_until("Sentinel failover", Duration::from_secs(20), || {
        let (set, want) = (set.clone(), want.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                set.sentinels()
                    .iter()
                    .all(|s| s.master_addr().as_deref() == Some(want.as_str()))
            })
            .await
            .unwrap()
        }
    })
    .await;
    let s = set.clone();
    tokio::task::spawn_blocking(move || s.master().resume())
        .await
        .unwrap();
    // The scenario: the old master still believes it is one.
    assert!(
        info_replication(set.master()).await.contains("role:master"),
        "the old master was demoted at once"
    );
    println!("failover took {failover:?}");

    let late = fencelock_redis::connect(&url).await.unwrap();
    let lease = Duration::from_secs(2);
    let a = early
        .acquire("stock", AcquireOptions::new().lease(lease).no_wait())
        .await
        .expect("the early client acquires");
    assert!(
        exists(set.replica(), "ret:{stock}").await,
        "the early client was granted the lock on the old master, not the promoted replica"
    );
    let b = late.try_lock("stock").await.unwrap();
    assert!(
        b.is_none(),
        "two holders: the late client was granted it too"
    );
    let a_token = a.token();
    a.release().await.unwrap();
    let b = late
        .try_lock("stock")
        .await
        .unwrap()
        .expect("free after release");
    assert!(b.token() > a_token);
    b.release().await.unwrap();
}

/// An acquire in flight when the Sentinels switch masters is not handed out: its
/// request reached the master before the master stalled, the Sentinels promoted the
/// replica meanwhile (and the client learned of it), and the stalled master, back, runs
/// the request and grants the lock, still believing it is master. That grant is on a
/// server that is master no more; a client connected after the failover is granted the
/// same lock on the promoted replica. The acquire must fail (retryably) instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_in_flight_across_a_master_switch_is_not_granted() {
    let set = start_set().await;
    // A request may wait for the stalled master longer than the failover takes.
    let url = format!("{}?prefix=inflight:&timeout=30s", set.url());
    let early = fencelock_redis::connect(&url).await.unwrap();
    let warm = early.try_lock("warm").await.unwrap().expect("free");
    warm.release().await.unwrap();

    let s = set.clone();
    tokio::task::spawn_blocking(move || s.master().pause())
        .await
        .unwrap();
    let acquire = tokio::spawn(async move {
        let lease = Duration::from_secs(20);
        let outcome = early
            .acquire("stock", AcquireOptions::new().lease(lease).no_wait())
            .await;
        (early, outcome)
    });
    let want = set.replica().addr();
    let failover = wait_until("Sentinel failover", Duration::from_secs(20), || {
        let (set, want) = (set.clone(), want.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                set.sentinels()
                    .iter()
                    .all(|s| s.master_addr().as_deref() == Some(want.as_str()))
            })
            .await
            .unwrap()
        }
    })
    .await;
    println!("failover took {failover:?}");
    // The client's watcher hears of the switch at once, or asks within 2 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !acquire.is_finished(),
        "the acquire did not wait for the master"
    );
    let s = set.clone();
    tokio::task::spawn_blocking(move || s.master().resume())
        .await
        .unwrap();
    let (_early, outcome) = acquire.await.unwrap();
    let late = fencelock_redis::connect(&format!("{}?prefix=inflight:", set.url()))
        .await
        .unwrap();
    let b = late.try_lock("stock").await.unwrap();
    match outcome {
        Ok(a) => panic!(
            "granted by the old master after the switch (token {}); the late client {}",
            a.token(),
            if b.is_some() {
                "was granted it too: two holders"
            } else {
                "was refused"
            }
        ),
        Err(e) => {
            assert!(e.is_retryable(), "{e:?}");
            assert!(format!("{e:?}").contains("not trusted"), "{e:?}");
        }
    }
    b.expect("nobody holds `stock` on the promoted replica")
        .release()
        .await
        .unwrap();
}
