//! F14, a server's clock jumping forward: the server expires a held lock early, while
//! its holder still counts on the rest of its lease.
//!
//! - **Redis** (single, Sentinel, Cluster, Redlock): libfaketime cannot run Debian's
//!   redis-server (jemalloc), so the test does what such a jump does where it can be
//!   seen: a connection of its own runs `PEXPIRE <lock key> 1` (on a Redlock majority).
//! - **ZooKeeper**: the server runs under libfaketime; its clock is moved 10 s forward
//!   while the lock is held, past every session's timeout, so it expires them all (the
//!   clients' pings held back across the jump: see `f14_zookeeper`).
//! - etcd is not tested: Go reads the clock from the vDSO, which libfaketime cannot
//!   reach, and etcd's leases run on the monotonic clock anyway.
//!
//! The holder renews a 2 s lease; a waiter on another client waits. Exclusion by lease
//! cannot survive a server that expires early (the waiter may be granted while the holder
//! still counts on its lease); what must hold is the rest: the holder reports the loss
//! within one renewal interval (Redis: lease / 3) or at once when the session is
//! expired (ZooKeeper), the waiter gets the lock with a larger token, the holder's writes
//! after the waiter's are refused by the fenced register (C2), no acknowledged
//! increment is lost (C3), the holder's release is `Err(Lost)`, and nothing is left on
//! the servers (C5).
#![cfg(all(feature = "zookeeper", feature = "redis"))]

use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error, FencedRegister};
use fencelock_testkit::checker::LOSS_BOUND;
use fencelock_testkit::{Fault, FaultProxy, RedisCluster, RedisSentinelSet, RedisServer, ZkServer};
use tokio::time::Instant;

mod common;
use common::Servers;

const LEASE: Duration = Duration::from_secs(2);
/// How long what a scenario left on the servers may take to go (C5).
const LEFT_BOUND: Duration = Duration::from_secs(3);

/// F14 on `url`: `expire(key)` makes the server(s) drop the holder's lock early; the
/// loss must be reported within `loss_within` of it.
async fn early_expiry<E, Fut>(
    backend: &str,
    url: &str,
    loss_within: Duration,
    servers: &Servers<'_>,
    expire: E,
) where
    E: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let name = common::unique("f14");
    let holder = fencelock::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e:?}"));
    let waiter = fencelock::connect(url).await.expect("connect");
    let register = Arc::new(FencedRegister::new(0u64));
    let options = AcquireOptions::new().lease(LEASE);
    let guard = holder
        .acquire(&name, options.no_wait())
        .await
        .expect("the holder takes the lock");
    let token_a = guard.token();
    register
        .update(token_a, |n| n + 1)
        .expect("the holder's write");
    let mut acked = 1;
    let waiting = tokio::spawn({
        let (waiter, name) = (waiter.clone(), name.clone());
        async move {
            let granted = waiter
                .acquire(&name, options.wait_timeout(Duration::from_secs(20)))
                .await;
            (Instant::now(), granted)
        }
    });
    // Past a renewal: the lock is held and renewed, the waiter waits.
    tokio::time::sleep(LEASE / 2).await;
    assert!(!guard.is_lost(), "{backend}: lost before the clock jump");
    assert!(!waiting.is_finished(), "{backend}: the waiter got in early");

    let key = guard.backend_key().expect("a backend key").to_owned();
    let jumped_at = Instant::now();
    expire(key).await;
    let lost_after = tokio::time::timeout(Duration::from_secs(10), guard.lost())
        .await
        .map(|()| jumped_at.elapsed())
        .unwrap_or_else(|_| panic!("{backend}: no loss reported within 10 s of the jump"));
    assert!(
        lost_after <= loss_within,
        "{backend}: loss reported {lost_after:?} after the early expiry (bound {loss_within:?})"
    );
    // The holder, not knowing yet, writes on; the waiter's grant comes with a larger
    // token, and from the waiter's first write on the holder's are refused.
    let (granted_at, granted) = waiting.await.expect("the waiter task");
    let (granted_at, next) = match granted {
        // On ZooKeeper the jump must have expired the waiter's session too (below): a
        // grant to its queued acquire would mean the jump did nothing, and the holder
        // was lost on its own timer.
        Ok(next) if backend != "zookeeper" => (granted_at, next),
        // A ZooKeeper jump expires the waiter's session too: its queued acquire is lost
        // (never granted); it asks again on its new session.
        Err(Error::Lost { .. }) if backend == "zookeeper" => {
            let next = waiter
                .acquire(&name, options.wait_timeout(Duration::from_secs(10)))
                .await
                .expect("the waiter asks again and gets it");
            (Instant::now(), next)
        }
        other => panic!(
            "{backend}: the waiter: {:?}",
            other.map(|guard| guard.token())
        ),
    };
    let granted_after = granted_at.saturating_duration_since(jumped_at);
    assert!(
        granted_after <= LEASE + Duration::from_secs(1),
        "{backend}: the waiter got it {granted_after:?} after the early expiry"
    );
    assert!(
        next.token() > token_a,
        "{backend}: token {} after {token_a}",
        next.token()
    );
    register
        .update(next.token(), |n| n + 1)
        .expect("the new holder's write");
    acked += 1;
    let late = register.update(token_a, |n| n + 1);
    assert!(
        late.is_err(),
        "{backend}: the old holder's write after the new holder's was accepted"
    );
    assert_eq!(
        register.read(),
        acked,
        "{backend}: an acknowledged increment was lost"
    );
    eprintln!(
        "F14 {backend}: loss reported {lost_after:?}, the waiter granted {granted_after:?} after \
         the early expiry"
    );
    let released = guard.release().await;
    assert!(
        matches!(released, Err(Error::Lost { .. })),
        "{backend}: the old holder's release: {released:?}"
    );
    assert!(!next.is_lost(), "{backend}: the new holder lost it");
    next.release().await.expect("the new holder releases");
    holder.close().await.expect("close");
    waiter.close().await.expect("close");
    servers.assert_nothing_left_within(&format!("{backend} F14"), LEFT_BOUND);
}

/// `PEXPIRE key 1` on the server at `url`; `false` if the key lives elsewhere (a
/// Cluster's `MOVED`).
async fn pexpire(url: &str, key: &str) -> bool {
    let client = redis::Client::open(url).expect("redis URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("a raw connection");
    let done: redis::RedisResult<i64> = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(1)
        .query_async(&mut conn)
        .await;
    match done {
        Ok(1) => true,
        Ok(_) => panic!("PEXPIRE {key} on {url}: no such key"),
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::Moved) => false,
        Err(e) => panic!("PEXPIRE {key} on {url}: {e}"),
    }
}

/// Redis: the holder's next renewal (lease / 3 after the last) finds the key gone.
fn redis_bound() -> Duration {
    LEASE / 3 + LOSS_BOUND
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f14_redis() {
    let server = RedisServer::shared();
    let prefix = common::unique("f14-redis");
    let url = format!("{}?prefix={prefix}:", server.url());
    let servers = Servers::redis(server, &prefix);
    early_expiry("redis", &url, redis_bound(), &servers, |key| async move {
        assert!(pexpire(&server.url(), &key).await);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f14_redis_sentinel() {
    let set = tokio::task::block_in_place(RedisSentinelSet::start);
    let prefix = common::unique("f14-sentinel");
    let url = format!("{}?prefix={prefix}:", set.url());
    let master = set.master().url();
    let servers = Servers::redis(set.master(), &prefix);
    early_expiry(
        "sentinel",
        &url,
        redis_bound(),
        &servers,
        |key| async move {
            assert!(pexpire(&master, &key).await);
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f14_redis_cluster() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
    let prefix = common::unique("f14-cluster");
    let url = format!("{}?prefix={prefix}:", cluster.url());
    let nodes: Vec<String> = cluster.nodes().iter().map(RedisServer::url).collect();
    let ports = cluster.nodes().iter().map(RedisServer::port).collect();
    let servers = Servers::Redis(ports, &prefix);
    early_expiry("cluster", &url, redis_bound(), &servers, |key| async move {
        let mut expired = 0;
        for node in &nodes {
            expired += usize::from(pexpire(node, &key).await);
        }
        assert_eq!(expired, 1, "the key on exactly one master");
    })
    .await;
}

/// Redlock: two of the three instances expire the key early (a majority): the holder's
/// next renewal reaches only one instance that still has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f14_redlock() {
    let instances: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let prefix = common::unique("f14-redlock");
    let hosts: Vec<String> = instances.iter().map(RedisServer::addr).collect();
    let url = format!("redlock://{}?prefix={prefix}:", hosts.join(","));
    let urls: Vec<String> = instances.iter().map(RedisServer::url).collect();
    let ports = instances.iter().map(RedisServer::port).collect();
    let servers = Servers::Redis(ports, &prefix);
    early_expiry("redlock", &url, redis_bound(), &servers, |key| async move {
        for url in &urls[..2] {
            assert!(pexpire(url, &key).await);
        }
    })
    .await;
}

/// ZooKeeper under libfaketime: the server's clock jumps 10 s, past every session's 2 s
/// timeout; it expires the holder's session (and the waiter's) at its next tick and says
/// so on the connection, so the loss is reported within a session timeout.
///
/// A ping that reached the server between the jump and that tick would renew its session
/// in the new time (and then nothing expires: nothing is lost, nothing to report; seen in
/// 2 of 4 runs), so the clients' connections are held by a proxy from 200 ms before the
/// jump to two ticks after it (1.2 s in all, less than the session timeout: not long
/// enough to expire anything by itself), then let through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f14_zookeeper() {
    let server = tokio::task::block_in_place(ZkServer::start_with_fake_clock);
    let proxy = FaultProxy::start(&server.connect_string());
    let chroot = common::unique("f14-zk");
    let url = format!(
        "zk://{}/{chroot}?session_timeout=2s&min_lease=2s",
        proxy.addr()
    );
    let servers = Servers::Zk(&server, &chroot);
    let bound = LEASE + LOSS_BOUND;
    early_expiry("zookeeper", &url, bound, &servers, |_| async {
        proxy.set(Fault::Blackhole);
        // A ping already past the proxy is handled before the jump.
        tokio::time::sleep(Duration::from_millis(200)).await;
        server.jump_clock(Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(1)).await;
        proxy.set(Fault::Pass);
    })
    .await;
}
