//! Every malformed URL is an `InvalidUrl` before any I/O, on every scheme: a typo is not
//! an outage (which `retry=N` would retry, and the CLI would report as exit 69).
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::time::{Duration, Instant};

use fencelock::Error;

#[tokio::test]
async fn malformed_urls_are_invalid_before_any_io() {
    for url in [
        "redis://127.0.0.1:6379:1",
        "redis://[::1",
        "redis://host name:6379",
        "redis://:6379",
        "rediss://h:0",
        "redis://h:65536",
        "redlock://[::1,127.0.0.1:1,127.0.0.1:2",
        "redlock://a:1,,b:2",
        "redis+cluster://a:1,b:2:3",
        "redis+sentinel://a:1:2/master",
        "redis+sentinel://a b:1/master",
        "etcd://[::1/x",
        "etcd://h:99999/x",
        "etcd://host name/x",
        "etcds://a:1:2/x",
        "etcd://a:1,/x",
        "zk://[::1/x",
        "zk://h:1:2/x",
        "zookeeper://bad host/x",
        "zk://h:0/x",
        "migrate://?legacy=redis%3A%2F%2Fa%3A1%3A2&target=etcd%3A%2F%2Fh%3A1%2Fp&phase=legacy",
        "migrate://?legacy=redis%3A%2F%2Fh%3A1&target=etcd%3A%2F%2F%5B%3A%3A1%2Fp&phase=target",
        "mem://host:1",
        // A raw `/` or `?` in a password cuts the host list short.
        "redis://u:s3cr/et@h:1/0",
        "etcd://u:s3cr?et@h:1/x",
        "zk://u:s3cr/et@h:1/x",
    ] {
        let started = Instant::now();
        let err = match fencelock::connect(url).await {
            Ok(_) => panic!("{url}: connected"),
            Err(err) => err,
        };
        assert!(
            matches!(err, Error::InvalidUrl { .. }),
            "{url}: not InvalidUrl: {err:?}"
        );
        assert!(!err.is_retryable(), "{url}: retryable");
        assert!(!format!("{err} {err:?}").contains("s3cr"), "{url}: {err}");
        // Refused by the parser, not after a lookup or a connection attempt (which
        // would wait out a connect timeout of seconds; 1 s leaves room for a busy
        // machine).
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{url}: took {:?}",
            started.elapsed()
        );
    }
}

/// Durations have one syntax everywhere, and a bare number is refused, not guessed.
#[tokio::test]
async fn a_duration_without_a_unit_is_refused_everywhere() {
    for url in [
        "etcd://127.0.0.1:1/x?lease=30",
        "zk://127.0.0.1:1/x?session_timeout=5000",
        "redis://127.0.0.1:1?timeout=2",
        "mem://?retry=1&retry_min_delay=200",
    ] {
        let err = match fencelock::connect(url).await {
            Ok(_) => panic!("{url}: connected"),
            Err(err) => err,
        };
        assert!(
            matches!(err, Error::InvalidUrl { .. } | Error::InvalidConfig(_)),
            "{url}: {err:?}"
        );
        assert!(err.to_string().contains("unit"), "{url}: {err}");
    }
}

/// What a backend offers beyond the trait is reachable after `connect(url)`, through the
/// retry and metrics layers: the backend crates are re-exported, and `downcast_lock`
/// finds the concrete lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_behind_a_url_is_reachable() {
    let locks = fencelock::connect("mem://?retry=2").await.unwrap();
    assert!(fencelock::downcast_lock::<fencelock::MemoryLock>(&*locks).is_some());
    let endpoint = fencelock_testkit::EtcdServer::shared().endpoint();
    let locks = fencelock::connect(&format!("etcd://{endpoint}/downcast?retry=1"))
        .await
        .unwrap();
    let etcd = fencelock::downcast_lock::<fencelock::etcd::EtcdLock>(&*locks)
        .expect("the etcd lock behind the retry layer");
    assert_eq!(etcd.config().prefix, "downcast");
    assert!(fencelock::downcast_lock::<fencelock::redis::RedisLock>(&*locks).is_none());
}
