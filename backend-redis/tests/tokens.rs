//! Fencing tokens never repeat when a Redis server's counter is present but stale: the
//! counter set back (what a failover to a lagging replica does), and a restart that loads
//! an older `dump.rdb`. On a single server and on one instance of a Redlock of three.

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, Error, FencingToken};
use fencelock_redis::{RedisConfig, RedisLock};
use fencelock_testkit::RedisServer;

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

/// Takes and releases `name` `n` times; returns the tokens.
async fn grant(locks: &dyn DistributedLock, name: &str, n: usize) -> Vec<FencingToken> {
    let mut tokens = Vec::new();
    for _ in 0..n {
        let guard = locks.lock(name).await.expect("acquire");
        tokens.push(guard.token());
        guard.release().await.expect("release");
    }
    tokens
}

/// The first acquire after a restart: the client may need a moment to reconnect.
async fn grant_after_restart(locks: &dyn DistributedLock, name: &str) -> FencingToken {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match locks.try_lock(name).await {
            Ok(Some(guard)) => {
                let token = guard.token();
                guard.release().await.expect("release");
                return token;
            }
            Ok(None) => panic!("{name} is held by nobody, yet refused"),
            Err(error) if tokio::time::Instant::now() < deadline => {
                assert!(error.is_retryable(), "{error:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("no acquire after the restart: {error:?}"),
        }
    }
}

/// The counter key of `name` on `server` (the only `*:token` key there).
async fn counter_key(server: &RedisServer) -> String {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:token")
        .query_async(&mut raw(server).await)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    keys.into_iter().next().unwrap()
}

async fn set_counter(server: &RedisServer, key: &str, token: FencingToken) {
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(token.get())
        .query_async(&mut raw(server).await)
        .await
        .unwrap();
}

async fn save(server: &RedisServer) {
    let _: () = redis::cmd("SAVE")
        .query_async(&mut raw(server).await)
        .await
        .unwrap();
}

fn assert_new(token: FencingToken, issued: &[FencingToken]) {
    let highest = issued.iter().max().unwrap();
    assert!(
        token > *highest,
        "token {token} after a stale counter is not above every issued one ({issued:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_set_back_issues_no_old_token() {
    let server = RedisServer::start();
    let locks = locks(&server.url()).await;
    let issued = grant(&locks, "stock", 4).await;
    set_counter(&server, &counter_key(&server).await, issued[0]).await;
    let [token] = grant(&locks, "stock", 1).await[..] else {
        unreachable!()
    };
    assert_new(token, &issued);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_an_older_snapshot_issues_no_old_token() {
    let server = RedisServer::start();
    let locks = locks(&server.url()).await;
    let mut issued = grant(&locks, "stock", 1).await;
    save(&server).await;
    issued.extend(grant(&locks, "stock", 3).await);
    // SIGKILL, then start on the same directory: it loads the dump of the first grant.
    server.restart();
    let token = grant_after_restart(&locks, "stock").await;
    assert_new(token, &issued);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_with_one_stale_instance_issues_no_old_token() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let locks = locks(&format!("redlock://{}", hosts.join(","))).await;

    // The counter of one instance set back.
    let mut issued = grant(&locks, "stock", 4).await;
    set_counter(&servers[0], &counter_key(&servers[0]).await, issued[0]).await;
    let token = grant(&locks, "stock", 1).await[0];
    assert_new(token, &issued);
    issued.push(token);

    // One instance restarted from an older snapshot.
    save(&servers[0]).await;
    issued.extend(grant(&locks, "stock", 3).await);
    servers[0].restart();
    let token = grant_after_restart(&locks, "stock").await;
    assert_new(token, &issued);
}

/// An acquire sent again after its first send was applied (redis-rs re-sends a request
/// after a dropped connection) finds its own owner value on the lock: it is granted, with
/// the token the first send recorded, instead of being refused by itself and leaving the
/// key for a full lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_acquire_is_granted_not_refused_by_itself() {
    let server = RedisServer::start();
    let locks = locks(&server.url()).await;
    let mut conn = raw(&server).await;
    // Owner values are `client id:attempt`; the probe shows this client's and the next.
    let probe = locks.try_lock("probe").await.unwrap().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let probe_key = keys
        .iter()
        .find(|k| k.ends_with("{probe}"))
        .unwrap_or_else(|| panic!("{keys:?}"))
        .clone();
    let owner: String = redis::cmd("GET")
        .arg(&probe_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    probe.release().await.unwrap();
    let (client, attempt) = owner.rsplit_once(':').unwrap();
    let next_owner = format!("{client}:{}", attempt.parse::<u64>().unwrap() + 1);

    // What the first send of the next attempt did: the lock with its owner, the token.
    let lock_key = probe_key.replace("{probe}", "{x}");
    let _: () = redis::cmd("SET")
        .arg(&lock_key)
        .arg(&next_owner)
        .arg("PX")
        .arg(300)
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(format!("{lock_key}:token"))
        .arg(4242)
        .query_async(&mut conn)
        .await
        .unwrap();
    let guard = locks
        .try_lock("x")
        .await
        .unwrap()
        .expect("the re-sent acquire is refused by its own first send");
    assert_eq!(guard.token(), FencingToken::new(4242));
    // The lease restarted with the re-send: the key outlives the first send's 300 ms.
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&lock_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(pttl > 1000, "pttl {pttl}");
    guard.release().await.unwrap();
}

/// A release sent again after its first send was applied (the key is gone, and the
/// counter still holds the guard's token: nobody was granted since) is not a loss; a key
/// gone with another grant since is; and in the raw layout, where hand-written lockers
/// do not move the counter, a gone key is always a loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_release_is_not_a_loss_but_a_taken_over_key_is() {
    let server = RedisServer::start();
    let mut conn = raw(&server).await;
    let locks = locks(&server.url()).await;
    let del_all_locks = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("*")
                .query_async(&mut conn)
                .await
                .unwrap();
            for key in keys.iter().filter(|k| k.ends_with('}')) {
                let _: () = redis::cmd("DEL")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
        }
    };

    // The first send's effect, then the re-sent release.
    let guard = locks.lock("x").await.unwrap();
    del_all_locks(&mut conn).await;
    guard
        .release()
        .await
        .expect("a re-sent release is not a loss");

    // Gone, and another holder came and went since: a loss.
    let guard = locks.lock("x").await.unwrap();
    del_all_locks(&mut conn).await;
    let other = locks.lock("x").await.unwrap();
    other.release().await.unwrap();
    let outcome = guard.release().await;
    assert!(matches!(outcome, Err(Error::Lost { .. })), "{outcome:?}");

    // Raw layout: a gone key is a loss.
    let raw_locks = locks_raw(&server).await;
    let guard = raw_locks.lock("y").await.unwrap();
    let _: () = redis::cmd("DEL")
        .arg("lock:y")
        .query_async(&mut conn)
        .await
        .unwrap();
    let outcome = guard.release().await;
    assert!(matches!(outcome, Err(Error::Lost { .. })), "{outcome:?}");
}

async fn locks_raw(server: &RedisServer) -> RedisLock {
    locks(&format!("{}?layout=raw&prefix=lock:", server.url())).await
}

/// Redlock elections: when the granting instances answer different tokens (one counter
/// ahead), the guard takes the highest and records it on a majority. The term line that
/// observers read must carry that token on every granting instance too, or an observer
/// reading a majority without the instance that was ahead reports a smaller token than
/// the leader's guard holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_terms_record_the_guards_token_on_every_granting_instance() {
    use fencelock_core::AcquireOptions;
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let locks = locks(&format!("redlock://{}", hosts.join(","))).await;

    let first = locks
        .campaign("leader", "one", AcquireOptions::new().no_wait())
        .await
        .unwrap();
    let first_token = first.token();
    first.release().await.unwrap();
    // One instance's counter far ahead of the others and of any client's clock.
    let ahead = FencingToken::new(first_token.get() * 2);
    set_counter(&servers[0], &counter_key(&servers[0]).await, ahead).await;

    let term = locks
        .campaign("leader", "two", AcquireOptions::new().no_wait())
        .await
        .unwrap();
    assert_eq!(term.token().get(), ahead.get() + 1);
    for (i, server) in servers.iter().enumerate() {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*{leader}")
            .query_async(&mut raw(server).await)
            .await
            .unwrap();
        let stored: String = redis::cmd("GET")
            .arg(&keys[0])
            .query_async(&mut raw(server).await)
            .await
            .unwrap();
        let line: Vec<&str> = stored.splitn(3, '\n').collect();
        assert_eq!(
            line[1..],
            [term.token().get().to_string().as_str(), "two"],
            "instance {i}'s term line"
        );
    }
    assert_eq!(
        locks.leader("leader").await.unwrap().map(|l| l.token),
        Some(term.token())
    );
    term.release().await.unwrap();
}

/// The counter's TTL at `key` on `server`, in ms.
async fn counter_pttl(server: &RedisServer, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut raw(server).await)
        .await
        .unwrap()
}

/// A `token_ttl` shorter than a grant's lease still keeps the counter for that lease: a
/// re-sent acquire (see above) finds its own key only with the counter it recorded, and
/// a counter gone while its lock lives would turn that re-send into a refusal by itself,
/// the key left for a lease. On a single server, and on Redlock where the instances
/// disagreed and the highest token was written back to the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counter_outlives_its_grants_lease_whatever_token_ttl() {
    let lease = Duration::from_secs(5);
    let options = AcquireOptions::new().fixed_lease(lease).no_wait();
    let server = RedisServer::start();
    let single = locks(&format!("{}?token_ttl=1s", server.url())).await;
    let guard = single.acquire("short", options).await.unwrap();
    let pttl = counter_pttl(&server, &counter_key(&server).await).await;
    assert!(
        pttl > 4_000,
        "the counter expires in {pttl} ms, the lock in 5 s"
    );
    guard.release().await.unwrap();

    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let redlock = locks(&format!("redlock://{}?token_ttl=1s", hosts.join(","))).await;
    let first = grant(&redlock, "short", 1).await[0];
    let key = counter_key(&servers[0]).await;
    // One instance ahead: the grant writes the highest token back to the others.
    let ahead = FencingToken::new(first.get() + 1_000_000_000_000);
    set_counter(&servers[0], &key, ahead).await;
    let guard = redlock.acquire("short", options).await.unwrap();
    assert!(guard.token() > ahead, "{} after {ahead}", guard.token());
    for (i, server) in servers.iter().enumerate() {
        let pttl = counter_pttl(server, &key).await;
        assert!(
            pttl > 4_000,
            "instance {i}: the counter expires in {pttl} ms, the lock in 5 s"
        );
    }
    guard.release().await.unwrap();
}

/// A lock renewed for longer than `token_ttl` keeps its counter: the renewals refresh
/// the counter's TTL as well as the lock key's. A counter that expired while its lock
/// was held would leave Redlock's next token to the clients' clocks (every instance
/// forgot the last token), make a re-sent acquire refused by itself, and a release that
/// finds its key expired unable to tell an expiry nobody followed from a loss. On a
/// single server and on every instance of a Redlock of three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_renewed_past_token_ttl_keeps_its_counter() {
    // Renewed every 200 ms; held 2.5 s, the counter's TTL being 1 s from the grant.
    let options = AcquireOptions::new()
        .lease(Duration::from_millis(600))
        .no_wait();
    let server = RedisServer::start();
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    for (what, url, on) in [
        (
            "single",
            format!("{}?token_ttl=1s", server.url()),
            std::slice::from_ref(&server),
        ),
        (
            "redlock",
            format!("redlock://{}?token_ttl=1s", hosts.join(",")),
            &servers[..],
        ),
    ] {
        let locks = locks(&url).await;
        let guard = locks.acquire("held-long", options).await.unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(!guard.is_lost(), "{what}: {:?}", guard.lost_reason());
        for (i, server) in on.iter().enumerate() {
            let pttl = counter_pttl(server, "fencelock:{held-long}:token").await;
            assert!(
                pttl > 0,
                "{what}, instance {i}: the counter of a held lock is gone ({pttl})"
            );
        }
        guard.release().await.unwrap();
    }
}
