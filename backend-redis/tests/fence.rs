//! `FencedValue`, the resource-side token check for data kept in Redis, on real servers:
//! the paused holder's read-modify-write is refused, tokens compare exactly over the
//! whole `u64` range (also where doubles cannot tell them apart), `clear` keeps the
//! fence, a key of another type is a typed error, and a Cluster connection works with
//! any key.

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Error, FencingToken, StaleToken};
use fencelock_redis::{FenceError, FencedValue, RedisConfig, RedisLock};
use fencelock_testkit::{RedisCluster, RedisServer};

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

fn t(n: u64) -> FencingToken {
    FencingToken::new(n)
}

fn stale(err: FenceError) -> StaleToken {
    match err {
        FenceError::Stale(stale) => stale,
        other => panic!("expected a stale token, got {other:?}"),
    }
}

/// The zombie of the incident: A reads with token 7 and pauses; B (token 8) reads the
/// same value; A wakes and writes. A's write is refused, B's lands: no lost update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holders_read_modify_write_is_refused() {
    let server = RedisServer::start();
    let mut conn = raw(&server).await;
    let stock = FencedValue::new("stock/SKU-8842");
    stock.write(&mut conn, t(6), b"50").await.unwrap();

    let seen_by_a = stock.read(&mut conn, t(7)).await.unwrap();
    let seen_by_b = stock.read(&mut conn, t(8)).await.unwrap();
    assert_eq!(seen_by_a.as_deref(), Some(&b"50"[..]));
    assert_eq!(seen_by_b.as_deref(), Some(&b"50"[..]));
    let refused = stale(stock.write(&mut conn, t(7), b"49").await.unwrap_err());
    assert_eq!((refused.token, refused.highest), (t(7), t(8)));
    stock.write(&mut conn, t(8), b"49").await.unwrap();
    // The same holder may write again; a refused read records nothing.
    stock.write(&mut conn, t(8), b"48").await.unwrap();
    stale(stock.read(&mut conn, t(7)).await.unwrap_err());
    assert_eq!(
        stock.peek(&mut conn).await.unwrap(),
        (Some(b"48".to_vec()), Some(t(8)))
    );
}

/// Tokens of the migration layer reach 2^56 and above, where Lua's doubles round
/// neighbours together; short tokens must not beat long ones as strings would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_compare_exactly_over_the_whole_range() {
    let server = RedisServer::start();
    let mut conn = raw(&server).await;
    let value = FencedValue::new("exact");
    value.write(&mut conn, t(9), b"a").await.unwrap();
    value.write(&mut conn, t(10), b"b").await.unwrap();
    assert_eq!(
        stale(value.write(&mut conn, t(9), b"c").await.unwrap_err()).highest,
        t(10)
    );
    let era = 1u64 << 56;
    assert_eq!((era + 43) as f64, (era + 42) as f64, "the doubles collide");
    value.write(&mut conn, t(era + 43), b"d").await.unwrap();
    let refused = stale(value.write(&mut conn, t(era + 42), b"e").await.unwrap_err());
    assert_eq!((refused.token, refused.highest), (t(era + 42), t(era + 43)));
    value.write(&mut conn, t(u64::MAX), b"f").await.unwrap();
    stale(
        value
            .write(&mut conn, t(u64::MAX - 1), b"g")
            .await
            .unwrap_err(),
    );
    assert_eq!(
        value.peek(&mut conn).await.unwrap(),
        (Some(b"f".to_vec()), Some(t(u64::MAX)))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_keeps_the_fence_and_bad_keys_are_typed_errors() {
    let server = RedisServer::start();
    let mut conn = raw(&server).await;
    let value = FencedValue::new("cleared");
    assert_eq!(value.peek(&mut conn).await.unwrap(), (None, None));
    assert_eq!(value.read(&mut conn, t(3)).await.unwrap(), None);
    value.write(&mut conn, t(4), b"x").await.unwrap();
    value.clear(&mut conn, t(5)).await.unwrap();
    assert_eq!(value.peek(&mut conn).await.unwrap(), (None, Some(t(5))));
    stale(value.write(&mut conn, t(4), b"y").await.unwrap_err());
    stale(value.clear(&mut conn, t(4)).await.unwrap_err());

    let _: () = redis::cmd("SET")
        .arg("a-string")
        .arg("v")
        .query_async(&mut conn)
        .await
        .unwrap();
    let wrong_type = FencedValue::new("a-string");
    assert!(matches!(
        wrong_type.write(&mut conn, t(1), b"v").await,
        Err(FenceError::Backend(Error::Backend { .. }))
    ));
    assert!(wrong_type.peek(&mut conn).await.is_err());
    let _: () = redis::cmd("HSET")
        .arg("garbled")
        .arg("fence")
        .arg("not-a-token")
        .query_async(&mut conn)
        .await
        .unwrap();
    let garbled = FencedValue::new("garbled");
    let err = garbled.write(&mut conn, t(1), b"v").await.unwrap_err();
    let mut chain = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        chain += &format!(": {cause}");
        source = cause.source();
    }
    assert!(
        chain.contains("not a token"),
        "a garbled fence is named: {chain}"
    );
    assert!(garbled.peek(&mut conn).await.is_err());
}

/// The whole story with real lock tokens: the holder's fixed lease runs out while it is
/// paused, a new holder takes the lock and reads, and the old holder's write is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_lock_holders_write_is_refused() {
    let server = RedisServer::start();
    let locks = RedisLock::connect(RedisConfig::from_url(&server.url()).unwrap())
        .await
        .unwrap();
    let mut conn = raw(&server).await;
    let stock = FencedValue::new("stock/zombie");
    let zombie = locks
        .acquire(
            "stock/zombie",
            AcquireOptions::new().fixed_lease(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert_eq!(stock.read(&mut conn, zombie.token()).await.unwrap(), None);
    zombie.lost().await;
    let next = locks
        .acquire(
            "stock/zombie",
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    assert!(next.token() > zombie.token());
    stock.read(&mut conn, next.token()).await.unwrap();
    let refused = stale(
        stock
            .write(&mut conn, zombie.token(), b"99")
            .await
            .unwrap_err(),
    );
    assert_eq!(refused.highest, next.token());
    stock.write(&mut conn, next.token(), b"99").await.unwrap();
    next.release().await.unwrap();
}

/// One key, one slot: any key name works on a Cluster connection, with the script
/// loaded on whichever master owns the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn works_on_a_cluster_for_keys_on_every_master() {
    let cluster = RedisCluster::start(3);
    let urls: Vec<String> = cluster.nodes().iter().map(RedisServer::url).collect();
    let mut conn = redis::cluster::ClusterClient::new(urls)
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    // Enough names to land on all three masters.
    for i in 0..30u64 {
        let value = FencedValue::new(format!("cluster/{i}"));
        value.write(&mut conn, t(i + 2), b"v").await.unwrap();
        stale(value.read(&mut conn, t(i + 1)).await.unwrap_err());
        assert_eq!(
            value.read(&mut conn, t(i + 2)).await.unwrap().as_deref(),
            Some(&b"v"[..])
        );
    }
}

/// The documented ACL is enough, on a server that does not know the script yet (the
/// first call gets `NOSCRIPT` and is sent again as `EVAL`, never `SCRIPT LOAD`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_is_enough_on_a_fresh_server() {
    let server = RedisServer::start();
    let mut admin = raw(&server).await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("fencer")
        .arg("reset")
        .arg("on")
        .arg(">s3cret")
        .arg("~data:*")
        .arg("-@all")
        .arg("+evalsha")
        .arg("+eval")
        .arg("+hget")
        .arg("+hset")
        .arg("+hdel")
        .arg("+hmget")
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut conn = redis::Client::open(format!("redis://fencer:s3cret@{}", server.addr()))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let value = FencedValue::new("data:stock");
    assert_eq!(value.read(&mut conn, t(1)).await.unwrap(), None);
    value.write(&mut conn, t(2), b"v").await.unwrap();
    stale(value.write(&mut conn, t(1), b"w").await.unwrap_err());
    value.clear(&mut conn, t(3)).await.unwrap();
    assert_eq!(value.peek(&mut conn).await.unwrap(), (None, Some(t(3))));
    // A leading zero is not a token (it would compare as longer than it is).
    let _: () = redis::cmd("HSET")
        .arg("data:zero")
        .arg("fence")
        .arg("007")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(matches!(
        FencedValue::new("data:zero")
            .write(&mut conn, t(8), b"v")
            .await,
        Err(FenceError::Backend(_))
    ));
}
