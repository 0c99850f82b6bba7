//! Shared pieces of the conformance cases.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::DistributedLock;

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
