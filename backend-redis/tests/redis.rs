//! Redis-specific behaviour on real servers: the raw key layout against a hand-written
//! `SET NX PX` lock, authentication, the replica check, loss on a deleted or overwritten
//! key (that lock's alone), nothing left behind by dropped guards, unlock messages only
//! for awaited locks, `list` past keys that are not UTF-8, and Redlock instances that
//! are one server (told apart by `run_id`) refused.

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, Error};
use fencelock_redis::{RedisConfig, RedisLock};
use fencelock_testkit::RedisServer;
use redis::AsyncCommands;

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

const COMPARE_AND_DELETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

/// Issue 6's legacy lock: `SET lock:order:SKU-8842 <random> NX PX 5000` and a Lua
/// compare-and-delete. Under `layout=raw&prefix=lock:` fencelock and it exclude each
/// other both ways. The legacy release publishes nothing; a fencelock waiter gets the
/// lock at its next poll (see
/// `a_waiter_polls_a_hand_written_lock_and_gets_it_soon_after_its_release`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_layout_excludes_hand_written_set_nx() {
    let server = RedisServer::shared();
    let mut legacy = raw(server).await;
    let locks = locks(&format!("{}?layout=raw&prefix=lock:", server.url())).await;
    let key = "lock:order:SKU-8842";

    // Legacy holds → fencelock is refused.
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg("legacy-7f3a")
        .arg("NX")
        .arg("PX")
        .arg(1500)
        .query_async(&mut legacy)
        .await
        .unwrap();
    assert_eq!(set.as_deref(), Some("OK"));
    assert!(locks.try_lock("order:SKU-8842").await.unwrap().is_none());

    // A fencelock waiter gets it after the legacy compare-and-delete.
    let waiter = locks.acquire(
        "order:SKU-8842",
        AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
    );
    let release = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let deleted: i64 = redis::Script::new(COMPARE_AND_DELETE)
            .key(key)
            .arg("legacy-7f3a")
            .invoke_async(&mut legacy.clone())
            .await
            .unwrap();
        assert_eq!(deleted, 1);
    };
    let (guard, ()) = tokio::join!(waiter, release);
    let guard = guard.expect("fencelock acquires after the legacy release");

    // fencelock holds → the legacy SET NX is refused, its compare-and-delete is a no-op.
    let value: String = legacy.get(key).await.unwrap();
    assert_ne!(value, "legacy-7f3a");
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg("legacy-8b1c")
        .arg("NX")
        .arg("PX")
        .arg(5000)
        .query_async(&mut legacy)
        .await
        .unwrap();
    assert_eq!(set, None, "the legacy lock got in while fencelock held");
    guard.release().await.unwrap();
    let exists: bool = legacy.exists(key).await.unwrap();
    assert!(!exists, "release left the key");
}

/// A wrong password fails at connect; no password for a server that needs one too; and
/// no lock command ever reaches the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_auth_is_a_hard_error_at_connect() {
    let server = RedisServer::start_with(&["--requirepass", "right-one"]);
    let port = server.port();
    for url in [
        format!("redis://:wrong-one@127.0.0.1:{port}"),
        format!("redis://127.0.0.1:{port}"),
        format!("redlock://:wrong-one@127.0.0.1:{port}"),
    ] {
        let err = fencelock_redis::connect(&url).await.unwrap_err();
        assert!(!err.is_retryable(), "{url}: {err:?}");
        let text = format!("{err} {err:?}");
        assert!(!text.contains("wrong-one"), "{text}");
    }
    let mut admin = redis::Client::open(format!("redis://:right-one@127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut admin)
        .await
        .unwrap();
    for command in ["evalsha", "eval", "set", "script"] {
        assert!(
            !stats.contains(&format!("cmdstat_{command}:")),
            "{command} was sent: {stats}"
        );
    }
    let locks = fencelock_redis::connect(&format!("redis://:right-one@127.0.0.1:{port}"))
        .await
        .unwrap();
    assert!(!format!("{locks:?}").contains("right-one"));
    let guard = locks.lock("auth-ok").await.unwrap();
    guard.release().await.unwrap();
}

/// The replica check on a server without replicas: the acquire fails (retryable) and
/// leaves no key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_check_fails_without_replicas_and_releases() {
    let server = RedisServer::shared();
    let locks = locks(&format!(
        "{}?wait_replicas=1&wait_timeout=100ms&prefix=rc:",
        server.url()
    ))
    .await;
    let err = locks.try_lock("replicated").await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    assert!(err.to_string().contains("redis"), "{err}");
    let mut conn = raw(server).await;
    let exists: bool = conn.exists("rc:{replicated}").await.unwrap();
    assert!(!exists, "a failed replica check left the key");
}

/// The replica check holds for semaphores and read-write locks as for locks: on a server
/// without replicas a permit, a read and a write each fail as the lock does (a retryable
/// backend error), and leave neither a holder key nor an index entry. The check used to
/// run on the lock path only, so these were granted without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_check_holds_for_semaphores_and_rw_locks() {
    let server = RedisServer::shared();
    let locks = locks(&format!(
        "{}?wait_replicas=1&wait_timeout=100ms&prefix=rcm:",
        server.url()
    ))
    .await;
    let lock_error = locks.try_lock("replicated").await.unwrap_err();
    let no_wait = AcquireOptions::new().no_wait();
    let permits = fencelock_core::Permits::new(1, 3).unwrap();
    for (what, outcome) in [
        (
            "permits",
            locks.acquire_permits("pool", permits, no_wait).await,
        ),
        ("read", locks.acquire_read("doc", no_wait).await),
        ("write", locks.acquire_write("doc", no_wait).await),
    ] {
        let err = outcome.expect_err(what);
        assert!(
            matches!(
                (&err, &lock_error),
                (Error::Backend { .. }, Error::Backend { .. })
            ),
            "{what}: {err:?}, the lock's: {lock_error:?}"
        );
        assert!(err.is_retryable(), "{what}: {err:?}");
        assert!(format!("{err:?}").contains("replicas"), "{what}: {err:?}");
    }
    let mut conn = raw(server).await;
    let left: Vec<String> = conn.keys("rcm:*").await.unwrap();
    let left: Vec<&String> = left.iter().filter(|k| !k.ends_with(":token")).collect();
    assert!(left.is_empty(), "failed replica checks left {left:?}");
}

/// `list` skips keys that are not UTF-8 (no lock name is) instead of failing on them: in
/// the raw layout, whose empty prefix scans every key of the database, and in the tagged
/// layout, whose pattern matches any bytes between the braces. Database 2, so that only
/// this test's keys are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_skips_keys_that_are_not_utf8() {
    let server = RedisServer::shared();
    let db = format!("{}/2", server.url());
    let mut conn = redis::Client::open(db.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let binary: [&[u8]; 2] = [b"\xff\xfe", b"fencelock:{\xff}"];
    for key in binary {
        let () = conn.set(key, 1).await.unwrap();
    }
    for layout in ["raw", "tagged"] {
        let locks = locks(&format!("{db}?layout={layout}")).await;
        let guard = locks.try_lock("listed").await.unwrap().unwrap();
        let listed = locks
            .list("")
            .await
            .unwrap_or_else(|e| panic!("{layout}: {e:?}"));
        let names: Vec<&str> = listed.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["listed"], "{layout}");
        guard.release().await.unwrap();
    }
    let _: i64 = conn.del(&binary[..]).await.unwrap();
}

/// Someone deletes the key (or the server clock jumps and it expires): the holder's next
/// renewal reports the loss at once, long before its deadline; a late release is `Lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_reports_a_deleted_key_at_once() {
    let server = RedisServer::shared();
    let locks = locks(&format!("{}?prefix=del:", server.url())).await;
    let lease = Duration::from_secs(3);
    let guard = locks
        .acquire("victim", AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    let mut conn = raw(server).await;
    let _: i64 = conn.del("del:{victim}").await.unwrap();
    let next = locks
        .try_lock("victim")
        .await
        .unwrap()
        .expect("free after DEL");
    assert!(next.token() > guard.token());
    tokio::time::timeout(lease / 3 + Duration::from_millis(500), guard.lost())
        .await
        .expect("loss reported at the next renewal");
    assert!(guard.lost_reason().unwrap().contains("renewal"));
    assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
    assert!(!next.is_lost());
    next.release().await.unwrap();
}

/// Dropped guards and released guards leave no key and no renewal entry; tokens of one
/// name strictly increase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_guards_leave_nothing() {
    let server = RedisServer::shared();
    let locks = locks(&format!("{}?prefix=drop:", server.url())).await;
    let mut last = None;
    for i in 0..20 {
        let guard = locks
            .acquire("d", AcquireOptions::new().lease(Duration::from_millis(600)))
            .await
            .unwrap();
        assert!(last < Some(guard.token()));
        last = Some(guard.token());
        assert_eq!(locks.renewing(), 1);
        if i % 2 == 0 {
            drop(guard);
        } else {
            guard.release().await.unwrap();
        }
        assert_eq!(locks.renewing(), 0);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut conn = raw(server).await;
    let exists: bool = conn.exists("drop:{d}").await.unwrap();
    assert!(!exists);
}

/// An uncontended release publishes no unlock message (it is a plain compare-and-delete);
/// a release with a client waiting publishes one, the waiter gets the lock at once (long
/// before the holder's 30 s lease would have run out), and the waiter marker is gone with
/// the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_awaited_releases_publish() {
    use futures_util::StreamExt;

    let server = RedisServer::shared();
    let locks = locks(&format!("{}?prefix=pub:", server.url())).await;
    let mut pubsub = redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    pubsub.subscribe("pub:{q}:unlock").await.unwrap();
    let mut messages = pubsub.into_on_message();

    for _ in 0..3 {
        locks.lock("q").await.unwrap().release().await.unwrap();
    }
    let quiet = tokio::time::timeout(Duration::from_millis(300), messages.next()).await;
    assert!(quiet.is_err(), "an uncontended release published");

    let lease = AcquireOptions::new().lease(Duration::from_secs(30));
    let holder = locks.acquire("q", lease).await.unwrap();
    let other = fencelock_redis::connect(&format!("{}?prefix=pub:", server.url()))
        .await
        .unwrap();
    let waiter = tokio::spawn(async move {
        let guard = other
            .acquire("q", lease.wait_timeout(Duration::from_secs(20)))
            .await
            .unwrap();
        let token = guard.token();
        guard.release().await.unwrap();
        token
    });
    let mut conn = raw(server).await;
    let marked = async {
        while !conn.exists::<_, bool>("pub:{q}:waiters").await.unwrap() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), marked)
        .await
        .expect("the waiter never marked the lock");
    let released = tokio::time::Instant::now();
    let token = holder.token();
    holder.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter was not woken by the release")
        .unwrap();
    assert!(next > token);
    assert!(released.elapsed() < Duration::from_secs(5));
    tokio::time::timeout(Duration::from_secs(1), messages.next())
        .await
        .expect("the awaited release published nothing");
    for key in ["pub:{q}", "pub:{q}:waiters"] {
        let exists: bool = conn.exists(key).await.unwrap();
        assert!(!exists, "{key} was left behind");
    }
}

/// `backend_key()` names the Redis key of the grant (as the docs say; it was `None`),
/// so fenced writes and `fencelock run`'s `FENCELOCK_KEY` can use it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_names_its_key() {
    let server = RedisServer::shared();
    let tagged = locks(&format!("{}?prefix=bk:", server.url())).await;
    let guard = tagged.lock("named").await.unwrap();
    assert_eq!(guard.backend_key(), Some("bk:{named}"));
    let mut conn = raw(server).await;
    let exists: bool = conn.exists("bk:{named}").await.unwrap();
    assert!(exists);
    guard.release().await.unwrap();
    let raw_layout = locks(&format!("{}?layout=raw&prefix=bk:raw:", server.url())).await;
    let guard = raw_layout.lock("named").await.unwrap();
    assert_eq!(guard.backend_key(), Some("bk:raw:named"));
    guard.release().await.unwrap();
}

/// A server that forgot the scripts (`SCRIPT FLUSH`, as after a restart or on a replica
/// promoted by a failover) costs no lock call: renewal, release and acquire each answer
/// `NOSCRIPT` once and are sent again as `EVAL`, to the same server. No `SCRIPT LOAD` is
/// sent (on a cluster it would go wherever the client's outdated view sends it, and the
/// retried `EVALSHA` failed again on the promoted replica).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_forgot_the_scripts_gets_them_as_eval() {
    let server = RedisServer::start();
    let locks = locks(&format!("{}?prefix=fx:", server.url())).await;
    let mut conn = raw(&server).await;
    let flush = async |conn: &mut redis::aio::MultiplexedConnection| {
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(conn)
            .await
            .unwrap();
    };
    let lease = Duration::from_millis(1500);
    let guard = locks
        .acquire("forgetful", AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    flush(&mut conn).await;
    // Renewals (every lease / 3) run against the flushed cache; without them the key
    // would be gone by now.
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    let pttl: i64 = conn.pttl("fx:{forgetful}").await.unwrap();
    assert!(pttl > 500, "the renewal did not reach the key: PTTL {pttl}");
    flush(&mut conn).await;
    let token = guard.token();
    guard.release().await.unwrap();
    flush(&mut conn).await;
    let next = locks.try_lock("forgetful").await.unwrap().expect("free");
    assert!(next.token() > token);
    next.release().await.unwrap();

    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        !stats.contains("cmdstat_script|load"),
        "a SCRIPT LOAD was sent:\n{stats}"
    );
    assert!(
        stats.contains("cmdstat_eval:"),
        "no EVAL was sent:\n{stats}"
    );
    let keys: Vec<String> = conn.keys("*forgetful*").await.unwrap();
    assert!(keys.iter().all(|k| k.ends_with(":token")), "{keys:?}");
}

/// A hand-written `SET NX PX` locker publishes nothing when it deletes its key, so in
/// the raw layout a waiter looks again after a growing interval (`poll_min` 50 ms
/// doubling to `poll_max` 1 s): it gets the lock within that interval of the release,
/// not when the key's 10 s TTL would have run out. Bad poll settings are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_polls_a_hand_written_lock_and_gets_it_soon_after_its_release() {
    let server = RedisServer::shared();
    let mut legacy = raw(server).await;
    let prefix = format!("lock:{}:", std::process::id());
    let locks = locks(&format!("{}?layout=raw&prefix={prefix}", server.url())).await;
    let key = format!("{prefix}poll");
    let set: Option<String> = redis::cmd("SET")
        .arg(&key)
        .arg("legacy-1")
        .arg("NX")
        .arg("PX")
        .arg(10_000)
        .query_async(&mut legacy)
        .await
        .unwrap();
    assert_eq!(set.as_deref(), Some("OK"));

    let waiter = async {
        let guard = locks
            .acquire(
                "poll",
                AcquireOptions::new().wait_timeout(Duration::from_secs(8)),
            )
            .await
            .expect("the waiter gets the lock after the hand-written release");
        (guard, tokio::time::Instant::now())
    };
    let release = async {
        // Long enough for the waiter's interval to have grown past its first steps.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let deleted: i64 = redis::Script::new(COMPARE_AND_DELETE)
            .key(&key)
            .arg("legacy-1")
            .invoke_async(&mut legacy.clone())
            .await
            .unwrap();
        assert_eq!(deleted, 1);
        tokio::time::Instant::now()
    };
    let ((guard, granted), released) = tokio::join!(waiter, release);
    let after = granted.saturating_duration_since(released);
    assert!(
        after <= Duration::from_millis(1000) + Duration::from_millis(300),
        "the waiter took {after:?} after the release (poll_max is 1 s)"
    );
    guard.release().await.unwrap();

    for query in ["poll_min=0s", "poll_min=2s&poll_max=1s", "poll_max=soon"] {
        assert!(
            RedisConfig::from_url(&format!("{}?layout=raw&{query}", server.url())).is_err(),
            "{query} must be refused"
        );
    }
    let config = RedisConfig::from_url(&format!(
        "{}?layout=raw&poll_min=10ms&poll_max=250ms",
        server.url()
    ))
    .unwrap();
    assert_eq!(
        (config.poll_min, config.poll_max),
        (Duration::from_millis(10), Duration::from_millis(250))
    );
}

/// A lock released while a renewal of it is in flight is not reported lost: the
/// renewal finds its key gone because of the release, not because someone took it.
/// (It used to mark such locks lost: a loss warning and a cancelled `lost_token()` for
/// a lock that was released normally.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releasing_during_renewal_rounds_reports_no_loss() {
    let server = RedisServer::shared();
    let locks = locks(&server.url()).await;
    let options = AcquireOptions::new()
        .no_wait()
        .lease(Duration::from_millis(300));
    let prefix = format!("release-renew-{:x}", std::process::id());
    let mut false_losses = 0;
    for round in 0..5 {
        let mut guards = Vec::new();
        for i in 0..2_000 {
            guards.push(
                locks
                    .acquire(&format!("{prefix}-{round}-{i}"), options)
                    .await
                    .unwrap(),
            );
        }
        // Renewed every 100 ms: release them while rounds are running.
        tokio::time::sleep(Duration::from_millis(95)).await;
        let tokens: Vec<_> = guards.iter().map(|g| g.lost_token()).collect();
        let releases = guards
            .into_iter()
            .map(|guard| tokio::spawn(async move { guard.release().await }));
        for release in futures_util::future::join_all(releases).await {
            release.unwrap().unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        false_losses += tokens.iter().filter(|t| t.is_cancelled()).count();
    }
    assert_eq!(
        false_losses, 0,
        "locks released normally were reported lost"
    );
}

/// The client's renewal task runs on the client's runtime, not on the one of the first
/// renewing acquire: that runtime ending (a `block_on`, another test's runtime) used to
/// end the task and leave `running` set, so no lock of the client was renewed again.
#[test]
fn renewal_outlives_the_runtime_of_the_first_renewing_acquire() {
    let runtime = |threads| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .unwrap()
    };
    let main = runtime(2);
    let server = RedisServer::shared();
    let locks = main.block_on(locks(&server.url()));
    let options = AcquireOptions::new()
        .no_wait()
        .lease(Duration::from_millis(300));
    let prefix = format!("renew-runtime-{:x}", std::process::id());
    let short = runtime(1);
    let first = short
        .block_on(locks.acquire(&format!("{prefix}-first"), options))
        .unwrap();
    short.block_on(first.release()).unwrap();
    drop(short);
    main.block_on(async {
        let guard = locks
            .acquire(&format!("{prefix}-second"), options)
            .await
            .unwrap();
        // Five leases: renewed all along.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
        guard.release().await.unwrap();
    });
}

/// A lock key overwritten with another type (a hash, by someone else's code) is that
/// lock's loss, and only that lock's: the other locks renewed in the same call stay held.
/// (The `GET` of the renewal script failed on the wrong type and took the whole call
/// with it, so every lock renewed beside it was retried until its deadline and reported
/// lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clobbered_key_loses_only_its_own_lock_at_renewal() {
    let server = RedisServer::shared();
    let locks = locks(&format!("{}?prefix=clobber:", server.url())).await;
    let lease = Duration::from_millis(900);
    let options = AcquireOptions::new().no_wait().lease(lease);
    let mut bystanders = Vec::new();
    for i in 0..5 {
        bystanders.push(
            locks
                .acquire(&format!("bystander-{i}"), options)
                .await
                .unwrap(),
        );
    }
    let victim = locks.acquire("victim", options).await.unwrap();
    let mut conn = raw(server).await;
    let _: () = redis::pipe()
        .atomic()
        .del("clobber:{victim}")
        .hset("clobber:{victim}", "field", "value")
        .pexpire("clobber:{victim}", 10_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::timeout(lease / 3 + Duration::from_millis(500), victim.lost())
        .await
        .expect("the clobbered lock's loss reported at its next renewal");
    assert!(victim.lost_reason().unwrap().contains("renewal"));
    // Several leases on, every other lock is still held.
    tokio::time::sleep(lease * 3).await;
    for guard in &bystanders {
        assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    }
    for guard in bystanders {
        guard.release().await.unwrap();
    }
    let _: i64 = conn.del("clobber:{victim}").await.unwrap();
}

/// Release and extend of a lock whose key someone overwrote with another type report
/// the loss (`Lost`), as for a deleted key, not a script error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clobbered_key_is_lost_at_release_and_extend() {
    let server = RedisServer::shared();
    let locks = locks(&format!("{}?prefix=clobber2:", server.url())).await;
    let mut conn = raw(server).await;
    let clobber = |key: &'static str| {
        redis::pipe()
            .atomic()
            .del(key)
            .hset(key, "field", "value")
            .pexpire(key, 10_000)
            .to_owned()
    };
    let options = AcquireOptions::new()
        .no_wait()
        .fixed_lease(Duration::from_secs(30));

    let released = locks.acquire("released", options).await.unwrap();
    let _: () = clobber("clobber2:{released}")
        .query_async(&mut conn)
        .await
        .unwrap();
    let outcome = released.release().await;
    assert!(matches!(outcome, Err(Error::Lost { .. })), "{outcome:?}");

    let extended = locks.acquire("extended", options).await.unwrap();
    let _: () = clobber("clobber2:{extended}")
        .query_async(&mut conn)
        .await
        .unwrap();
    let outcome = extended.extend(Duration::from_secs(30)).await;
    assert!(matches!(outcome, Err(Error::Lost { .. })), "{outcome:?}");
    assert!(extended.is_lost());
    let _: i64 = conn
        .del(&["clobber2:{released}", "clobber2:{extended}"])
        .await
        .unwrap();
}

/// A release retried after one whose future was dropped once its script was sent is not
/// told "lost", on either layout: the first deleted the key (the raw layout keeps no
/// counter to tell), and on the standard layout another client may then have been
/// granted the name, moving the counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_retried_after_a_dropped_one_is_not_a_loss() {
    let server = RedisServer::shared();
    for (url, taken_meanwhile) in [
        (
            format!("{}?layout=raw&prefix=dropped:raw:", server.url()),
            false,
        ),
        (format!("{}?prefix=dropped:std:", server.url()), true),
    ] {
        let locks = locks(&url).await;
        let guard = locks.lock("x").await.unwrap();
        let handle = guard.held().clone();
        // Polled once (the script is sent), then dropped; the server runs it meanwhile.
        let _ = tokio::time::timeout(Duration::ZERO, handle.release()).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let next = if taken_meanwhile {
            let other = self::locks(&url).await;
            Some(other.lock("x").await.unwrap())
        } else {
            None
        };
        let retried = handle.release().await;
        assert!(
            !matches!(retried, Err(Error::Lost { .. })),
            "{url}: a retried release said the lock was lost: {retried:?}"
        );
        drop(guard);
        if let Some(next) = next {
            assert!(!next.is_lost());
            next.release().await.unwrap();
        }
    }
}

/// Two names of one server in a Redlock URL (`localhost` and `127.0.0.1`, which
/// `RedisConfig::check_instances` cannot tell apart without resolving them) would count
/// that server twice toward the majority: its grant alone would make two of three.
/// `connect` reads each instance's `run_id` (`INFO server`) and refuses the pair with
/// `InvalidConfig` naming both endpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_two_names_of_one_server() {
    let (one, other) = (RedisServer::start(), RedisServer::start());
    let (p1, p2) = (one.port(), other.port());
    let url = format!("redlock://localhost:{p1},127.0.0.1:{p1},127.0.0.1:{p2}");
    match fencelock_redis::connect(&url).await {
        Ok(locks) => panic!("{url}: connected, one server counted twice: {locks:?}"),
        Err(Error::InvalidConfig(message)) => {
            assert!(
                message.contains(&format!("localhost:{p1}"))
                    && message.contains(&format!("127.0.0.1:{p1}")),
                "{message}"
            );
            assert!(!message.contains(&format!(":{p2}")), "{message}");
        }
        Err(other) => panic!("{url}: {other:?}"),
    }
    // Three distinct servers are accepted (the check needs no more than the URL's user).
    let third = RedisServer::start();
    let distinct = format!(
        "redlock://localhost:{p1},127.0.0.1:{p2},127.0.0.1:{}",
        third.port()
    );
    let locks = fencelock_redis::connect(&distinct).await.unwrap();
    locks
        .lock("distinct")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A TCP forwarder from a loopback port to a Redis server that can be pointed at
/// another one, as a DNS name moved to another address would be: [`Alias::point_at`]
/// closes the open connections, so the client's next connection reaches the new server.
struct Alias {
    port: u16,
    upstream: std::sync::Arc<std::sync::atomic::AtomicU16>,
    open: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl Alias {
    async fn start(upstream: u16) -> Alias {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(upstream));
        let open = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (to, tasks) = (target.clone(), open.clone());
        let accepting = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let to = to.load(Ordering::SeqCst);
                let task = tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                tasks.lock().unwrap().push(task.abort_handle());
            }
        });
        Alias {
            port,
            upstream: target,
            open,
            accepting,
        }
    }

    fn point_at(&self, upstream: u16) {
        self.upstream
            .store(upstream, std::sync::atomic::Ordering::SeqCst);
        for task in self.open.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

impl Drop for Alias {
    fn drop(&mut self) {
        self.accepting.abort();
        self.point_at(0);
    }
}

/// An instance whose connection is re-made to the server of another instance (its name
/// now resolves elsewhere) is refused at its first request on the new connection: with a
/// third server down, the one server left behind two instances must not grant a
/// "majority" of two. Every try fails, with `InvalidConfig` naming both endpoints once
/// the new connection has been checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_refuses_an_instance_reconnected_to_another_instances_server() {
    let (a, b, c) = (
        RedisServer::start(),
        RedisServer::start(),
        RedisServer::start(),
    );
    let alias = Alias::start(c.port()).await;
    let url = format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}?timeout=500ms",
        alias.port,
        a.port(),
        b.port()
    );
    let locks = fencelock_redis::connect(&url).await.unwrap();
    locks.lock("moved").await.unwrap().release().await.unwrap();

    alias.point_at(a.port());
    b.kill();
    let mut refused = None;
    for _ in 0..10 {
        match locks.try_lock("moved").await {
            Ok(Some(guard)) => panic!("granted by one server behind two instances: {guard:?}"),
            Ok(None) => println!("refused as held"),
            Err(Error::InvalidConfig(message)) => refused = Some(message),
            Err(other) => println!("before the check: {other}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let message = refused.expect("the re-made connection was never refused");
    assert!(
        message.contains(&format!("127.0.0.1:{}", alias.port))
            && message.contains(&format!("127.0.0.1:{}", a.port())),
        "{message}"
    );
    // Pointed back at its own server, the instance is trusted again.
    alias.point_at(c.port());
    let mut granted = false;
    for _ in 0..20 {
        if let Ok(Some(guard)) = locks.try_lock("moved").await {
            guard.release().await.unwrap();
            granted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(granted, "never granted again by two distinct servers");
}

/// Redlock reads each instance's `run_id` with `INFO server`: a user without `+info`
/// cannot connect, and the non-retryable error says what to allow. With `+info` the
/// same user connects and locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_needs_info_and_says_so() {
    let server = RedisServer::start();
    let mut admin = raw(&server).await;
    let rules = "reset on >app-pw ~fencelock:* &fencelock:* -@all +evalsha +eval +ping +get \
                 +set +del +pexpire +pttl +time +publish +subscribe +unsubscribe +hgetall \
                 +hset +hdel +hlen +hexists";
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg("app");
    setuser.arg(rules.split_whitespace().collect::<Vec<_>>());
    let () = setuser.query_async(&mut admin).await.unwrap();
    let url = format!("redlock://app:app-pw@127.0.0.1:{}", server.port());
    let err = fencelock_redis::connect(&url).await.unwrap_err();
    assert!(
        matches!(err, Error::Backend { .. }) && !err.is_retryable(),
        "{err:?}"
    );
    let why = std::error::Error::source(&err).map(ToString::to_string);
    assert!(
        why.as_deref().is_some_and(|why| why.contains("+info")),
        "{why:?}"
    );

    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("app")
        .arg("+info")
        .query_async(&mut admin)
        .await
        .unwrap();
    let locks = fencelock_redis::connect(&url).await.unwrap();
    locks
        .lock("with-info")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// The raw layout maps names to keys injectively, as the tagged one does: a name whose
/// key would be another name's token counter, waiter marker, semaphore or read-write
/// index, or a sibling's counter (`{t}x` and `{t}x:token`), is refused with
/// `InvalidName` before anything is sent, or is independent of it. Never does taking one
/// overwrite the other's keys (the holder losing its lock) or fail on their type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_names_never_land_on_another_names_keys() {
    let server = RedisServer::shared();
    let locks = locks(&format!("{}?layout=raw&prefix=", server.url())).await;
    let u = fencelock_core::conformance::unique_name("collide").replace(['{', '}'], "");
    let lease = || {
        AcquireOptions::new()
            .lease(Duration::from_secs(3))
            .no_wait()
    };
    let permit = || fencelock_core::Permits::new(1, 2).unwrap();
    // Each request in turn: first the name on another name's keys, then that name.
    // Granted guards (with what was asked) and the requests refused with `InvalidName`.
    let mut held = Vec::new();
    let mut refused = Vec::new();
    let mut granted = |what: String, result: Result<fencelock_core::LockGuard, Error>| match result
    {
        Ok(guard) => held.push((what, guard)),
        Err(Error::InvalidName { .. }) => refused.push(what),
        Err(other) => panic!("{what}: {other:?}"),
    };
    for kind in ["token", "waiters"] {
        let owner = format!("{u}-{kind}");
        let squatter = format!("{{{owner}}}:fencelock-{kind}:{owner}");
        granted(squatter.clone(), locks.acquire(&squatter, lease()).await);
        let taken = locks.acquire(&owner, lease()).await;
        granted(format!("lock {owner} beside {squatter}"), taken);
    }
    for kind in ["sem", "rw"] {
        let owner = format!("{u}-{kind}");
        let squatter = format!("{{{owner}}}:fencelock-{kind}:{owner}");
        granted(squatter.clone(), locks.acquire(&squatter, lease()).await);
        let taken = if kind == "sem" {
            locks.acquire_permits(&owner, permit(), lease()).await
        } else {
            locks.acquire_read(&owner, lease()).await
        };
        granted(format!("{kind} {owner} beside {squatter}"), taken);
    }
    for suffix in ["token", "waiters", "unlock", "h:x"] {
        let base = format!("{{{u}}}x{suffix}");
        let sibling = format!("{base}:{suffix}");
        granted(
            base.clone(),
            locks.acquire_permits(&base, permit(), lease()).await,
        );
        granted(
            format!("semaphore {sibling}"),
            locks.acquire_permits(&sibling, permit(), lease()).await,
        );
    }
    // Past a renewal (every second), which finds an overwritten key.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for (what, guard) in held {
        assert!(!guard.is_lost(), "{what} was lost (refused: {refused:?})");
        guard
            .release()
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
    }
    assert!(
        !refused.is_empty(),
        "no name was refused: the squatters above did land on other names' keys"
    );
}
