//! Shared pieces of the conformance cases.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use futures_util::future::join_all;

use tokio::time::Instant;

use crate::{DistributedLock, DistributedLockExt, FencedRegister};

/// A lock name unique to this process run and call: `fl-conformance-<random>/<case>-<n>`.
pub fn unique_name(case: &str) -> String {
    static RUN: OnceLock<String> = OnceLock::new();
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let run = RUN.get_or_init(|| format!("{:016x}", fastrand::u64(..)));
    format!(
        "fl-conformance-{run}/{case}-{}",
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Scheduling slack allowed on top of a deadline on a loaded machine.
pub(super) const SLACK: Duration = Duration::from_millis(300);

/// A short lease the backend accepts, for cases that wait for expiry.
pub(super) fn short_lease(lock: &dyn DistributedLock) -> Duration {
    lock.capabilities()
        .min_lease
        .max(Duration::from_millis(500))
}

/// Waits until `inspect` reports `n` waiters, or a fixed pause when the backend cannot
/// count them.
pub(super) async fn until_waiters(lock: &dyn DistributedLock, name: &str, n: usize) {
    if !lock.capabilities().counts_waiters {
        tokio::time::sleep(Duration::from_millis(200)).await;
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = lock.inspect(name).await.expect("inspect");
        if info.waiters == Some(n) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: expected {n} waiters, inspect says {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs `rounds` read-sleep-write critical sections on one fenced register from each of
/// `tasks` tasks, task `i` using `clients[i % clients.len()]`, and checks the outcome: no
/// two holders at once, no rejected write, the final count, and tokens unique and strictly
/// increasing in the order the writes happened.
pub(super) async fn fenced_counter(
    clients: &[&dyn DistributedLock],
    name: &str,
    tasks: usize,
    rounds: usize,
) {
    let register = FencedRegister::new(0u64);
    let inside = AtomicUsize::new(0);
    let tokens = Mutex::new(Vec::with_capacity(tasks * rounds));
    join_all((0..tasks).map(|i| {
        let (lock, register, inside, tokens) =
            (clients[i % clients.len()], &register, &inside, &tokens);
        async move {
            for _ in 0..rounds {
                let guard = lock.lock(name).await.expect("acquire");
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                let count = register.read();
                tokio::time::sleep(Duration::from_millis(1)).await;
                register
                    .write(guard.token(), count + 1)
                    .expect("a valid holder's write was rejected");
                tokens.lock().unwrap().push(guard.token());
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }
    }))
    .await;
    let tokens = tokens.into_inner().unwrap();
    assert_eq!(register.read(), (tasks * rounds) as u64);
    assert_eq!(register.rejections(), 0);
    assert_eq!(tokens.len(), tasks * rounds);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens are not strictly increasing in grant order"
    );
}
