//! `connect_timeout` on every backend, with the same default (5 s): a server that accepts
//! the TCP connection but never answers fails `connect` within it, retryably. An
//! acquire that connects on its own is bounded by its wait instead.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::net::TcpListener;
use std::time::{Duration, Instant};

/// A listener that accepts connections (the kernel does, from its backlog) and never
/// answers; its port.
fn silent_server() -> (TcpListener, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    (listener, port)
}

async fn connect_fails_within(url: String, low: Duration, high: Duration) {
    let url = url.as_str();
    let started = Instant::now();
    let result = fencelock::connect(url).await;
    let took = started.elapsed();
    let err = match result {
        Ok(_) => panic!("{url}: connected to a silent server"),
        Err(err) => err,
    };
    assert!(err.is_retryable(), "{url}: {err:?}");
    assert!(
        took >= low && took <= high,
        "{url}: failed after {took:?}, not within {low:?}..{high:?}: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_server_fails_connect_within_connect_timeout() {
    let (_etcd, etcd) = silent_server();
    let (_zk, zk) = silent_server();
    let (_redis, redis) = silent_server();
    let second = Duration::from_secs(1);
    let slack = Duration::from_millis(900);
    tokio::join!(
        connect_fails_within(
            format!("etcd://127.0.0.1:{etcd}/x?connect_timeout=1s"),
            second / 2,
            second + slack
        ),
        connect_fails_within(
            format!("zk://127.0.0.1:{zk}/x?connect_timeout=1s"),
            second / 2,
            second + slack
        ),
        connect_fails_within(
            format!("redis://127.0.0.1:{redis}?connect_timeout=1s"),
            second / 2,
            second + slack
        ),
    );
    // The default is the same on every backend, 5 s (Redis's 2 s response timeout for
    // its first PING may end it sooner).
    let five = Duration::from_secs(5);
    tokio::join!(
        connect_fails_within(format!("etcd://127.0.0.1:{etcd}/x"), five / 2, five + slack),
        connect_fails_within(format!("zk://127.0.0.1:{zk}/x"), five / 2, five + slack),
        connect_fails_within(format!("redis://127.0.0.1:{redis}"), second, five + slack),
    );
}

/// An acquire that connects on its own (a ZooKeeper session or an etcd lease for a lease
/// duration the client has not used yet, a reconnection) is bounded by its wait, not by
/// the connect timeout: against a server stopped after `connect`, `wait_timeout(1s)`
/// gives up within the wait plus the backends' grace for the steps before waiting
/// (`ROUND_TRIP_GRACE`, 0.5 s, and 0.2 s to delete a waiting node), well before 5 s.
async fn wait_bounds_a_lazy_connect(server: &fencelock_testkit::Server, url: String) {
    use fencelock::{AcquireOptions, DistributedLock};
    let locks: std::sync::Arc<dyn DistributedLock> = fencelock::connect(&url).await.unwrap();
    server.pause();
    let wait = Duration::from_secs(1);
    let started = Instant::now();
    // A lease duration the client has no session or lease for yet.
    let options = AcquireOptions::new()
        .lease(Duration::from_secs(7))
        .wait_timeout(wait);
    let result = locks.acquire("lazy-connect", options).await;
    let took = started.elapsed();
    server.resume();
    assert!(result.is_err(), "{url}: acquired on a stopped server");
    let high = wait + Duration::from_millis(700) + Duration::from_millis(1000);
    assert!(
        took <= high,
        "{url}: gave up after {took:?}, not within {high:?}: {:?}",
        result.err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_bounds_a_lazy_connect_on_every_backend() {
    use fencelock_testkit::{EtcdServer, RedisServer, ZkServer};
    let etcd = EtcdServer::start();
    let zk = ZkServer::start();
    let redis = RedisServer::start();
    wait_bounds_a_lazy_connect(&etcd, format!("etcd://{}/lazy", etcd.endpoint())).await;
    wait_bounds_a_lazy_connect(&zk, format!("zk://{}/lazy", zk.connect_string())).await;
    wait_bounds_a_lazy_connect(&redis, redis.url()).await;
}
