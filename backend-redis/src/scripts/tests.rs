//! The scripts run on a server: a re-sent member grant, a gone holder key.

use fencelock_testkit::RedisServer;
use redis::aio::MultiplexedConnection;

use super::{MEMBER_ACQUIRE, RELEASE, RENEW};
use crate::keys::{KeyLayout, PrimitiveKeys};

/// Runs the member grant for `owner` (one permit of 3): its reply `{granted, token}`.
async fn grant(conn: &mut MultiplexedConnection, keys: &PrimitiveKeys, owner: &str) -> (i64, u64) {
    let holder = keys.holder(owner);
    let (granted, token): (i64, String) = MEMBER_ACQUIRE
        .prepare_invoke()
        .key(&keys.index)
        .key(&holder.lock)
        .key(&keys.token)
        .key(&keys.waiters)
        .key(&keys.intent)
        .arg(owner)
        .arg(30_000)
        .arg(86_400_000)
        .arg(0)
        .arg("s")
        .arg(1)
        .arg(3)
        .arg(&keys.holders)
        .arg(format!("intent-{owner}"))
        .eval()
        .query_async(conn)
        .await
        .unwrap();
    (granted, token.parse().unwrap())
}

/// A semaphore grant sent again after its first send was applied (redis-rs re-sends
/// after a dropped connection, and on a cluster after a timeout) answers the token of
/// that first send, not the counter, which another holder's grant has moved on since:
/// two holders never carry one token. The holder key still renews and releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_member_grant_answers_its_own_token() {
    let server = RedisServer::shared();
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let name = format!("resent-{:x}", std::process::id());
    let keys = KeyLayout::default().primitive_keys(&name, "sem");
    let (granted, first) = grant(&mut conn, &keys, "a").await;
    assert_eq!(granted, 1);
    let (granted, other) = grant(&mut conn, &keys, "b").await;
    assert_eq!(granted, 1);
    assert!(other > first);
    let (granted, again) = grant(&mut conn, &keys, "a").await;
    assert_eq!(granted, 1);
    assert_eq!(again, first, "the re-sent grant answered another token");
    for owner in ["a", "b"] {
        let holder = keys.holder(owner);
        let renewed: Vec<i64> = RENEW
            .prepare_invoke()
            .key(&holder.lock)
            .arg(owner)
            .arg(30_000)
            .arg("")
            .eval()
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(renewed, [1], "{owner} renewed");
        let released: i64 = RELEASE
            .prepare_invoke()
            .key(&holder.lock)
            .key(&holder.waiters)
            .key(&holder.token)
            .arg(owner)
            .arg(&holder.channel)
            .arg("")
            .eval()
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(released, 1, "{owner} released");
    }
    let left: bool = redis::cmd("EXISTS")
        .arg(&keys.index)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!left, "the index outlived its last holder");
}

/// The release of a plain lock whose key is gone touches nothing else, whatever its
/// name: a raw-layout key ending in `:h:` + owner next to a hash of the user's that
/// lists that owner (what a holder key and its index look like) leaves the hash be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_lock_that_looks_like_a_holder_key_touches_no_hash() {
    let server = RedisServer::shared();
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let base = format!("user-hash-{}", std::process::id());
    let () = redis::cmd("HSET")
        .arg(&base)
        .arg("X")
        .arg("1")
        .query_async(&mut conn)
        .await
        .unwrap();
    let released: i64 = RELEASE
        .prepare_invoke()
        .key(format!("{base}:h:X"))
        .key(format!("{base}:waiters"))
        .key(format!("{base}:token"))
        .arg("X")
        .arg(format!("{base}:unlock"))
        .arg("")
        .eval()
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(released, 0);
    let kept: bool = redis::cmd("HEXISTS")
        .arg(&base)
        .arg("X")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(kept, "a user's hash lost a field to a lock's release");
}
