use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::MemoryLock;

/// A lock that fails its first `failures` calls with `error`, then forwards to memory,
/// and records the wait each call was given.
#[derive(Debug)]
struct Flaky {
    failures: usize,
    error: fn() -> Error,
    calls: AtomicUsize,
    waits: Mutex<Vec<Wait>>,
    memory: MemoryLock,
}

impl Flaky {
    fn new(failures: usize, error: fn() -> Error) -> Arc<Self> {
        Arc::new(Flaky {
            failures,
            error,
            calls: AtomicUsize::new(0),
            waits: Mutex::new(Vec::new()),
            memory: MemoryLock::new(),
        })
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl DistributedLock for Flaky {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.waits.lock().unwrap().push(options.wait_kind());
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
            return Err((self.error)());
        }
        self.memory.acquire(name, options).await
    }
    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
            return Err((self.error)());
        }
        self.memory.inspect(name).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
            return Err((self.error)());
        }
        self.memory.list(prefix).await
    }
    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
            return Err((self.error)());
        }
        self.memory.revoke(name).await
    }
    async fn close(&self) -> Result<(), Error> {
        self.memory.close().await
    }
    fn capabilities(&self) -> Capabilities {
        self.memory.capabilities()
    }
    fn backend(&self) -> &'static str {
        "flaky"
    }
}

fn unavailable() -> Error {
    Error::unavailable("flaky", std::io::Error::other("connection reset"))
}

fn retry(inner: &Arc<Flaky>, policy: RetryPolicy) -> Retry {
    Retry::new(inner.clone(), policy)
}

#[test]
fn default_schedule_is_the_seeds_200_500_1000_ms() {
    let delays: Vec<_> = RetryPolicy::default().nominal_delays().collect();
    assert_eq!(delays, [200, 500, 1000].map(Duration::from_millis));
    for _ in 0..100 {
        for (jittered, nominal) in RetryPolicy::default().delays().zip(&delays) {
            assert!(jittered <= *nominal && jittered >= nominal.mul_f32(0.8));
        }
    }
    assert_eq!(RetryPolicy::never().nominal_delays().count(), 0);
    assert_eq!(RetryPolicy::default().jitter(f32::NAN).jitter_ratio(), 0.0);
    assert_eq!(RetryPolicy::default().jitter(7.0).jitter_ratio(), 1.0);
}

/// A zero minimum delay made every delay zero: with a backend that fails fast,
/// acquire retried in a busy loop.
#[test]
fn a_zero_minimum_delay_is_refused() {
    let refused = RetryPolicy::default()
        .max_retries(1000)
        .min_delay(Duration::ZERO);
    assert!(
        matches!(refused, Err(Error::InvalidConfig(_))),
        "{refused:?}"
    );
    let policy = RetryPolicy::default()
        .max_retries(1000)
        .min_delay(Duration::from_nanos(1))
        .unwrap();
    assert!(policy.nominal_delays().all(|d| !d.is_zero()));
}

#[tokio::test(start_paused = true)]
async fn retries_unavailable_with_backoff_then_succeeds() {
    let flaky = Flaky::new(3, unavailable);
    let locks = retry(&flaky, RetryPolicy::default().jitter(0.0));
    let start = Instant::now();
    let guard = locks.acquire("a", AcquireOptions::new()).await.unwrap();
    // The paused clock's timer wheel may round each sleep up by a millisecond.
    let elapsed = start.elapsed();
    assert!(elapsed >= Duration::from_millis(1700), "{elapsed:?}");
    assert!(elapsed < Duration::from_millis(1710), "{elapsed:?}");
    assert_eq!(flaky.calls(), 4);
    assert_eq!(guard.backend(), "mem");
    guard.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn gives_up_after_max_retries_with_the_backend_error() {
    let flaky = Flaky::new(usize::MAX, unavailable);
    let locks = retry(&flaky, RetryPolicy::default().max_retries(2));
    let err = locks.acquire("a", AcquireOptions::new()).await.unwrap_err();
    assert!(matches!(err, Error::Unavailable { .. }));
    assert_eq!(flaky.calls(), 3);
}

#[tokio::test(start_paused = true)]
async fn never_retries_contention_timeouts_loss_or_bad_input() {
    let errors: [fn() -> Error; 5] = [
        || Error::Contended { name: "a".into() },
        || Error::Timeout {
            name: "a".into(),
            waited: Duration::from_secs(1),
        },
        || Error::lost("a", "session expired"),
        || Error::InvalidConfig("zero lease".into()),
        || Error::backend("flaky", false, std::io::Error::other("permission denied")),
    ];
    for error in errors {
        let flaky = Flaky::new(1, error);
        let locks = retry(&flaky, RetryPolicy::default());
        let start = Instant::now();
        assert!(locks.acquire("a", AcquireOptions::new()).await.is_err());
        assert_eq!(flaky.calls(), 1);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }
}

#[tokio::test(start_paused = true)]
async fn real_contention_is_reported_without_retry() {
    let flaky = Flaky::new(0, unavailable);
    let locks = retry(&flaky, RetryPolicy::default());
    let held = locks.acquire("a", AcquireOptions::new()).await.unwrap();
    let err = locks
        .acquire("a", AcquireOptions::new().no_wait())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Contended { .. }));
    assert_eq!(flaky.calls(), 2);
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn the_callers_wait_budget_is_never_exceeded() {
    let flaky = Flaky::new(usize::MAX, unavailable);
    let locks = retry(&flaky, RetryPolicy::default().jitter(0.0));
    let start = Instant::now();
    let opts = AcquireOptions::new().wait_timeout(Duration::from_millis(600));
    let err = locks.acquire("a", opts).await.unwrap_err();
    assert!(err.is_retryable());
    assert!(start.elapsed() <= Duration::from_millis(600));
    // 0 ms: attempt; 200 ms: attempt; a 500 ms delay would end past 600 ms: give up.
    assert_eq!(flaky.calls(), 2);
    let waits = flaky.waits.lock().unwrap().clone();
    assert_eq!(waits[0], Wait::Timeout(Duration::from_millis(600)));
    let Wait::Timeout(second) = waits[1] else {
        panic!("{waits:?}")
    };
    assert!(second <= Duration::from_millis(400) && second >= Duration::from_millis(390));
}

#[tokio::test(start_paused = true)]
async fn a_timeout_after_a_retry_uses_only_the_remaining_wait() {
    let flaky = Flaky::new(1, unavailable);
    let locks = retry(&flaky, RetryPolicy::default().jitter(0.0));
    let _held = flaky
        .memory
        .acquire("a", AcquireOptions::new())
        .await
        .unwrap();
    let start = Instant::now();
    let opts = AcquireOptions::new().wait_timeout(Duration::from_secs(1));
    let err = locks.acquire("a", opts).await.unwrap_err();
    // The wait the caller asked for, not what was left of it for the last attempt.
    assert!(
        matches!(err, Error::Timeout { waited, .. } if waited == Duration::from_secs(1)),
        "{err:?}"
    );
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(995) && elapsed <= Duration::from_millis(1010),
        "{elapsed:?}"
    );
}

/// Delays near `Duration::MAX` (a policy built in code, not parsed) are no panic.
#[tokio::test(start_paused = true)]
async fn huge_delays_do_not_panic() {
    let policy = RetryPolicy::default()
        .jitter(0.0)
        .min_delay(Duration::MAX)
        .unwrap()
        .max_delay(Duration::MAX);
    let delays: Vec<Duration> = policy.delays().take(3).collect();
    assert_eq!(delays.len(), 3);
    let policy = RetryPolicy::default()
        .max_retries(80)
        .max_delay(Duration::MAX);
    assert_eq!(policy.delays().count(), 80);
}

#[tokio::test(start_paused = true)]
async fn inspect_is_retried_too() {
    let flaky = Flaky::new(2, unavailable);
    let locks = retry(&flaky, RetryPolicy::default());
    assert!(!locks.inspect("a").await.unwrap().is_held());
    assert_eq!(flaky.calls(), 3);
    assert_eq!(locks.backend(), "flaky");
}

#[tokio::test(start_paused = true)]
async fn list_is_retried_but_revoke_is_not() {
    let unavailable = || Error::unavailable("flaky", std::io::Error::other("down"));
    let flaky = Flaky::new(1, unavailable);
    let retry = Retry::new(flaky.clone(), RetryPolicy::default());
    assert!(retry.list("").await.unwrap().is_empty());
    assert_eq!(flaky.calls(), 2);

    let flaky = Flaky::new(1, unavailable);
    let retry = Retry::new(flaky.clone(), RetryPolicy::default());
    assert!(retry.revoke("a").await.unwrap_err().is_retryable());
    assert_eq!(
        flaky.calls(),
        1,
        "a revoke whose reply was lost is not sent again"
    );
}
