//! The retry layer over a real Redis server that goes away and comes back: an acquire
//! that fails while the server is down (a retryable error) succeeds once it is back,
//! within the retry schedule.

#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencelock::{AcquireOptions, DistributedLock, Retry, RetryPolicy};
use fencelock_testkit::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_acquire_succeeds_after_the_server_restarts() {
    let server = Arc::new(RedisServer::start());
    let url = format!("{}?timeout=500ms", server.url());
    let inner = fencelock::connect(&url).await.unwrap();
    let opts = || AcquireOptions::new().wait_timeout(Duration::from_secs(20));
    inner
        .acquire("retry-warm-up", opts())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    server.kill();
    let err = Retry::new(inner.clone(), RetryPolicy::never())
        .acquire("retry-restart", opts())
        .await
        .unwrap_err();
    assert!(err.is_retryable(), "{err:?}");

    // Back after ~700 ms; the default schedule (200 / 500 / 1000 ms) waits up to 1.7 s.
    let restarter = {
        let server = server.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(700));
            server.restart();
        })
    };
    let locks = Retry::new(inner, RetryPolicy::default().max_retries(6));
    let start = Instant::now();
    let guard = locks.acquire("retry-restart", opts()).await.unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(500),
        "{:?}",
        start.elapsed()
    );
    guard.release().await.unwrap();
    restarter.join().unwrap();
}
