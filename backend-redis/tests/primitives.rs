//! Semaphores and read-write locks on Redis, beyond the conformance suite: permits come
//! back when a crashed holder's lease ends (and its keys go), a request with another
//! limit is refused while the semaphore has holders, tokens are not re-issued when the
//! counter is set back (what a failover to a lagging replica does) or the server restarts
//! from an older snapshot, every key of a name is in the lock's slot on a Cluster, and
//! Redlock refuses both with `Unsupported`.

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Error, FencingToken, Permits};
use fencelock_redis::{RedisConfig, RedisLock};
use fencelock_testkit::{RedisCluster, RedisServer};

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn locks(url: &str) -> RedisLock {
    RedisLock::connect(RedisConfig::from_url(url).unwrap())
        .await
        .unwrap()
}

async fn keys(server: &RedisServer, pattern: &str) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut raw(server).await)
        .await
        .unwrap();
    keys.sort();
    keys
}

fn of(count: u32, limit: u32) -> Permits {
    Permits::new(count, limit).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holders_permits_come_back_and_its_keys_go() {
    let server = RedisServer::start();
    let a = locks(&server.url()).await;
    let b = locks(&server.url()).await;
    let lease = Duration::from_millis(600);
    // A "crash": the guard is never released and its client goes away without closing.
    let crashed = a
        .acquire_permits("pool", of(2, 3), AcquireOptions::new().fixed_lease(lease))
        .await
        .unwrap();
    let crashed_token = crashed.token();
    std::mem::forget(crashed);
    drop(a);
    let start = tokio::time::Instant::now();
    let one = b
        .acquire_permits("pool", of(1, 3), AcquireOptions::new().no_wait())
        .await
        .expect("one permit is still free");
    let two = b
        .acquire_permits(
            "pool",
            of(2, 3),
            AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("granted once the crashed holder's lease ended");
    assert!(start.elapsed() + Duration::from_millis(50) >= lease);
    assert!(two.token() > one.token() && one.token() > crashed_token);
    one.release().await.unwrap();
    two.release().await.unwrap();
    // Only the token counter is left: the crashed holder's key expired and its index
    // entry was pruned; the index went with the last holder.
    assert_eq!(
        keys(&server, "fencelock:{pool}*").await,
        ["fencelock:{pool}:sem:token"]
    );

    // The same for a crashed writer: a reader gets in after its lease.
    let c = locks(&server.url()).await;
    let writer = c
        .acquire_write("doc", AcquireOptions::new().fixed_lease(lease))
        .await
        .unwrap();
    std::mem::forget(writer);
    drop(c);
    let reader = b
        .acquire_read(
            "doc",
            AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("a reader once the crashed writer's lease ended");
    reader.release().await.unwrap();
    assert_eq!(
        keys(&server, "fencelock:{doc}*").await,
        ["fencelock:{doc}:rw:token"]
    );
}

/// A holder whose lease ran out beside another that kept renewing: once both have
/// released (the first told it lost the lock), no index is left behind. It used to stay,
/// with the expired holder's entry, for as long as the renewed holder's lease (a year
/// with `MAX_LEASE`). Also when the expired holder never releases (crashed): the last
/// release prunes its entry. (Found by `tests/random_calls.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_holders_entry_goes_with_the_last_release() {
    let server = RedisServer::start();
    let locks = locks(&server.url()).await;
    let short = AcquireOptions::new().fixed_lease(Duration::from_millis(100));
    let long = AcquireOptions::new().lease(Duration::from_secs(30));

    let expired = locks.acquire_read("doc", short).await.unwrap();
    let renewed = locks.acquire_read("doc", long).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(expired.release().await, Err(Error::Lost { .. })));
    renewed.release().await.unwrap();
    assert_eq!(
        keys(&server, "fencelock:{doc}*").await,
        ["fencelock:{doc}:rw:token"],
        "read-write lock, both released"
    );

    let crashed = locks
        .acquire_permits("pool", of(1, 3), short)
        .await
        .unwrap();
    std::mem::forget(crashed);
    let renewed = locks.acquire_permits("pool", of(1, 3), long).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    renewed.release().await.unwrap();
    assert_eq!(
        keys(&server, "fencelock:{pool}*").await,
        ["fencelock:{pool}:sem:token"],
        "semaphore, one holder crashed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_limit_is_refused_while_held_and_accepted_when_idle() {
    let server = RedisServer::start();
    let a = locks(&server.url()).await;
    let held = a
        .acquire_permits("pool", of(1, 3), AcquireOptions::new())
        .await
        .unwrap();
    for (count, limit) in [(1, 2), (1, 4), (3, 5)] {
        let refused = a
            .acquire_permits("pool", of(count, limit), AcquireOptions::new().no_wait())
            .await;
        match refused {
            Err(Error::InvalidConfig(message)) => assert!(message.contains("3"), "{message}"),
            other => panic!("{other:?}"),
        }
    }
    held.release().await.unwrap();
    let five = a
        .acquire_permits("pool", of(5, 5), AcquireOptions::new().no_wait())
        .await
        .expect("an idle semaphore takes a new limit");
    five.release().await.unwrap();
}

/// The limit is kept while anyone *waits* too (`Permits`' docs): a request waiting for 2
/// of 5 while the semaphore's holders vanish, and before it tries again, keeps a request
/// for 1 of 3 from making the semaphore one of 3 under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_limit_is_refused_while_a_request_waits() {
    let server = RedisServer::start();
    let (a, b, c) = (
        locks(&server.url()).await,
        locks(&server.url()).await,
        locks(&server.url()).await,
    );
    let held = a
        .acquire_permits(
            "pool",
            of(4, 5),
            AcquireOptions::new().lease(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    let waiting = tokio::spawn(async move {
        b.acquire_permits(
            "pool",
            of(2, 5),
            AcquireOptions::new().wait_timeout(Duration::from_secs(20)),
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the request for 2 of 5 waits");
    // The holder's grant vanishes without a release message (an operator's delete, an
    // eviction): the waiter sleeps on, its intent recorded.
    let mut conn = raw(&server).await;
    for key in keys(&server, "fencelock:{pool}:sem*").await {
        if !key.ends_with(":intent") && !key.ends_with(":token") {
            let _: () = redis::cmd("DEL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
    let other = c
        .acquire_permits("pool", of(1, 3), AcquireOptions::new().no_wait())
        .await;
    match other {
        Err(Error::InvalidConfig(message)) => assert!(message.contains('5'), "{message}"),
        other => panic!("a request for 1 of 3 while one for 2 of 5 waits: {other:?}"),
    }
    waiting.abort();
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewed_permits_outlive_their_first_lease() {
    let server = RedisServer::start();
    let a = locks(&server.url()).await;
    // Long enough that a busy machine (2 shared cores) does not delay a renewal past it.
    let lease = Duration::from_secs(1);
    let held = a
        .acquire_permits("pool", of(3, 3), AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    let reader = a
        .acquire_read("doc", AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    tokio::time::sleep(lease * 3).await;
    assert!(!held.is_lost() && !reader.is_lost());
    assert!(matches!(
        a.acquire_permits("pool", of(1, 3), AcquireOptions::new().no_wait())
            .await,
        Err(Error::Contended { .. })
    ));
    assert!(matches!(
        a.acquire_write("doc", AcquireOptions::new().no_wait())
            .await,
        Err(Error::Contended { .. })
    ));
    held.release().await.unwrap();
    reader.release().await.unwrap();
}

/// Takes and releases a semaphore permit, a read lock and a write lock of `name`.
async fn grant(locks: &RedisLock, name: &str) -> Vec<FencingToken> {
    let permit = locks
        .acquire_permits(name, of(1, 2), AcquireOptions::new())
        .await
        .unwrap();
    let reader = locks
        .acquire_read(name, AcquireOptions::new())
        .await
        .unwrap();
    let tokens = vec![permit.token(), reader.token()];
    permit.release().await.unwrap();
    reader.release().await.unwrap();
    let writer = locks
        .acquire_write(name, AcquireOptions::new())
        .await
        .unwrap();
    let tokens = [tokens, vec![writer.token()]].concat();
    writer.release().await.unwrap();
    tokens
}

/// Like [`grant`], retrying while the client reconnects after a restart.
async fn grant_after_restart(locks: &RedisLock, name: &str) -> Vec<FencingToken> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match locks
            .acquire_permits(name, of(1, 2), AcquireOptions::new().no_wait())
            .await
        {
            Ok(guard) => {
                guard.release().await.unwrap();
                return grant(locks, name).await;
            }
            Err(error) if tokio::time::Instant::now() < deadline => {
                assert!(error.is_retryable(), "{error:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("no grant after the restart: {error:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_counters_reissue_no_semaphore_or_rw_token() {
    let server = RedisServer::start();
    let locks = locks(&server.url()).await;
    let mut issued = grant(&locks, "stock").await;
    let _: () = redis::cmd("SAVE")
        .query_async(&mut raw(&server).await)
        .await
        .unwrap();
    issued.extend(grant(&locks, "stock").await);
    // The counters set back (a failover to a lagging replica does that).
    for key in ["fencelock:{stock}:sem:token", "fencelock:{stock}:rw:token"] {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(issued[0].get())
            .query_async(&mut raw(&server).await)
            .await
            .unwrap();
    }
    let highest = *issued.iter().max().unwrap();
    let after = grant(&locks, "stock").await;
    assert!(after.iter().all(|t| *t > highest), "{after:?} {issued:?}");
    issued.extend(after);
    // A restart from the older snapshot.
    server.restart();
    let highest = *issued.iter().max().unwrap();
    let after = grant_after_restart(&locks, "stock").await;
    assert!(after.iter().all(|t| *t > highest), "{after:?} {issued:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_of_a_name_is_in_the_lock_slot_on_a_cluster() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3))
        .await
        .unwrap();
    let locks = locks(&cluster.url()).await;
    let node = &cluster.nodes()[0];
    let slot_of = |key: &str| {
        cluster
            .cli(node, &["CLUSTER", "KEYSLOT", key])
            .unwrap()
            .trim()
            .to_owned()
    };
    // Names spread over the three masters, one with a brace in it.
    for name in ["a", "b", "c", "orders/SKU-8842", "x}y", "锁"] {
        let lock = locks.acquire(name, AcquireOptions::new()).await.unwrap();
        let slot = slot_of(lock.backend_key().unwrap());
        let permits = locks
            .acquire_permits(name, of(2, 2), AcquireOptions::new())
            .await
            .unwrap();
        let reader = locks
            .acquire_read(name, AcquireOptions::new())
            .await
            .unwrap();
        for guard in [&permits, &reader] {
            let key = guard.backend_key().unwrap();
            assert_eq!(slot_of(key), slot, "{key}");
        }
        for key in [
            format!("fencelock:{{{name}}}:sem"),
            format!("fencelock:{{{name}}}:sem:token"),
            format!("fencelock:{{{name}}}:rw:intent"),
        ] {
            let key = key.replace("x}y", "x%7Dy");
            assert_eq!(slot_of(&key), slot, "{key}");
        }
        reader.release().await.unwrap();
        permits.release().await.unwrap();
        let writer = locks
            .acquire_write(name, AcquireOptions::new().no_wait())
            .await
            .unwrap();
        writer.release().await.unwrap();
        lock.release().await.unwrap();
    }
    // The raw layout without a prefix: a name starting with `}` gives its keys the empty
    // tag `{}`, so they would hash apart; refused before any I/O, not failed by CROSSSLOT.
    let raw = self::locks(&format!("{}?layout=raw&prefix=", cluster.url())).await;
    for name in ["}", "}x"] {
        let permits = raw
            .acquire_permits(name, of(1, 2), AcquireOptions::new().no_wait())
            .await;
        assert!(
            matches!(permits, Err(Error::InvalidName { .. })),
            "{name}: {permits:?}"
        );
        let reader = raw
            .acquire_read(name, AcquireOptions::new().no_wait())
            .await;
        assert!(
            matches!(reader, Err(Error::InvalidName { .. })),
            "{name}: {reader:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_semaphores_and_rw_locks() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let locks = locks(&format!("redlock://{}", hosts.join(","))).await;
    let caps = locks.capabilities();
    assert!(!caps.semaphore && !caps.rw_lock);
    assert!(matches!(
        locks
            .acquire_permits("pool", of(1, 3), AcquireOptions::new())
            .await,
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        locks.acquire_read("doc", AcquireOptions::new()).await,
        Err(Error::Unsupported { .. })
    ));
    assert!(matches!(
        locks.acquire_write("doc", AcquireOptions::new()).await,
        Err(Error::Unsupported { .. })
    ));
    let single = self::locks(&servers[0].url()).await.capabilities();
    assert!(single.semaphore && single.rw_lock);
}

/// A client that always holds a permit (it takes the next one before giving back the
/// last) would starve a request for all of them forever; the waiting request's intent
/// makes its next request wait instead, until it gives its permit back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_request_is_not_starved_by_smaller_ones() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let server = RedisServer::start();
    let small = locks(&server.url()).await;
    let large = locks(&server.url()).await;
    let stop = AtomicBool::new(false);
    let grants = AtomicUsize::new(0);
    let churn = async {
        let mut held: Option<fencelock_core::LockGuard> = None;
        while !stop.load(Ordering::SeqCst) {
            let next = small
                .acquire_permits(
                    "pool",
                    of(1, 3),
                    AcquireOptions::new().wait_timeout(Duration::from_millis(300)),
                )
                .await;
            match next {
                Ok(next) => {
                    grants.fetch_add(1, Ordering::SeqCst);
                    if let Some(last) = held.replace(next) {
                        last.release().await.unwrap();
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(Error::Timeout { .. }) => {
                    if let Some(last) = held.take() {
                        last.release().await.unwrap();
                    }
                }
                Err(error) => panic!("{error:?}"),
            }
        }
        if let Some(last) = held {
            last.release().await.unwrap();
        }
    };
    let waiter = async {
        while grants.load(Ordering::SeqCst) < 4 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let all = large
            .acquire_permits(
                "pool",
                of(3, 3),
                AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
            )
            .await;
        stop.store(true, Ordering::SeqCst);
        all.expect("all three permits despite the smaller requests")
            .release()
            .await
            .unwrap();
    };
    tokio::join!(churn, waiter);
}
