//! Retry: acquire again, after a backoff, when the lock service stumbles.
//!
//! [`Retry`] wraps any [`DistributedLock`] and repeats `acquire` (and `inspect`) when the
//! backend reports an error it marked retryable ([`Error::is_retryable`]: unavailable,
//! connection reset, no quorum). It never retries contention, timeouts, loss or bad
//! input, and it never stretches the caller's wait: a `Wait::Timeout(d)` stays `d` in
//! total, however many attempts fit into it.
//!
//! # Lost replies
//!
//! A retried acquire is a fresh, complete `acquire` call on the inner lock, never a
//! re-sent request. Whether the reply to a failed attempt was lost after the server
//! granted it is for the backend to resolve, and every backend does so before it returns
//! an error: the etcd and ZooKeeper backends find or delete their own key / node, Redis
//! deletes its owner value, all as part of `acquire`'s cancel-safety contract. A backend
//! that cannot tell reports the error as not retryable.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::time::Instant;

use crate::{
    AcquireOptions, Capabilities, DistributedLock, Error, HolderInfo, Leader, LeaderChanges,
    ListedLock, LockGuard, LockInfo, Permits, Wait,
};

/// When and how often [`Retry`] tries again.
///
/// The default is the seeds' schedule: up to **3 retries** after the first attempt,
/// waiting **200 ms, 500 ms and 1 s** before them (an exponential backoff from 200 ms
/// with factor 2.5, capped at 1 s, computed by the `backon` crate). Each delay is then
/// shortened by a random fraction of up to 20 % (jitter), so clients that failed together
/// do not retry in lockstep; the nominal delays are upper bounds.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::layer::retry::RetryPolicy;
///
/// let policy = RetryPolicy::default();
/// let delays: Vec<_> = policy.nominal_delays().collect();
/// assert_eq!(delays, [200, 500, 1000].map(Duration::from_millis));
///
/// let patient = RetryPolicy::default()
///     .max_retries(6)
///     .max_delay(Duration::from_secs(5))
///     .jitter(0.5);
/// assert_eq!(patient.nominal_delays().count(), 6);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    max_retries: usize,
    min_delay: Duration,
    max_delay: Duration,
    factor: f32,
    jitter: f32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_retries: 3,
            min_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(1),
            factor: 2.5,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// The default policy (3 retries: 200 ms, 500 ms, 1 s, 20 % jitter).
    pub fn new() -> Self {
        Self::default()
    }

    /// A policy that never retries: [`Retry`] then only forwards.
    pub fn never() -> Self {
        Self::default().max_retries(0)
    }

    /// How many times to retry after the first attempt (0 = never).
    pub fn max_retries(mut self, retries: usize) -> Self {
        self.max_retries = retries;
        self
    }

    /// The delay before the first retry. Default 200 ms. Each later delay grows from
    /// it, so it must be longer than zero.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a zero delay: every delay would then be zero, and a
    /// backend that fails fast would be retried in a busy loop.
    pub fn min_delay(mut self, delay: Duration) -> Result<Self, Error> {
        if delay.is_zero() {
            return Err(Error::InvalidConfig(
                "retry: the minimum delay must be longer than zero, or every retry would \
                 follow its failure at once"
                    .into(),
            ));
        }
        self.min_delay = delay;
        Ok(self)
    }

    /// The longest delay between two attempts. Default 1 s.
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// How much each delay grows over the previous one. Default 2.5. Values below 1 (and
    /// NaN) are taken as 1: a constant delay.
    pub fn factor(mut self, factor: f32) -> Self {
        self.factor = if factor >= 1.0 { factor } else { 1.0 };
        self
    }

    /// The largest random fraction by which a delay is shortened, from 0 (no jitter) to 1
    /// (anywhere between zero and the nominal delay). Default 0.2. Out-of-range values
    /// (and NaN) are clamped into `0..=1`.
    pub fn jitter(mut self, ratio: f32) -> Self {
        self.jitter = if ratio.is_nan() {
            0.0
        } else {
            ratio.clamp(0.0, 1.0)
        };
        self
    }

    /// The configured number of retries.
    pub fn retries(&self) -> usize {
        self.max_retries
    }

    /// The configured jitter ratio.
    pub fn jitter_ratio(&self) -> f32 {
        self.jitter
    }

    /// The configured delay before the first retry and the longest delay.
    pub fn delay_bounds(&self) -> (Duration, Duration) {
        (self.min_delay, self.max_delay)
    }

    /// The delays before each retry, before jitter.
    pub fn nominal_delays(&self) -> impl Iterator<Item = Duration> + use<> {
        ExponentialBuilder::new()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay.max(self.min_delay))
            .with_factor(self.factor)
            .with_max_times(self.max_retries)
            .build()
    }

    /// The delays before each retry, with jitter applied.
    fn delays(&self) -> impl Iterator<Item = Duration> + use<> {
        let jitter = self.jitter;
        self.nominal_delays().map(move |delay| {
            // In f64 and checked: `mul_f32` rounds a delay near `Duration::MAX` up past
            // it and panics.
            let factor = f64::from(1.0 - jitter * random_fraction()).clamp(0.0, 1.0);
            Duration::try_from_secs_f64(delay.as_secs_f64() * factor).unwrap_or(delay)
        })
    }
}

/// A uniformly distributed number in `0..1`, from the standard library's per-instance
/// random hasher keys (no extra dependency; not for cryptography).
fn random_fraction() -> f32 {
    let bits = RandomState::new().build_hasher().finish() >> 40;
    bits as f32 / (1u64 << 24) as f32
}

/// A lock that retries `acquire` and `inspect` on retryable backend errors.
///
/// See the [module documentation](self) for what is and is not retried. Put it inside a
/// metrics layer, so that retried acquisitions count once (see [`crate::layer`]).
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use fencelock_core::layer::retry::{Retry, RetryPolicy};
/// use fencelock_core::{DistributedLock, DistributedLockExt, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
/// let locks: Arc<dyn DistributedLock> =
///     Arc::new(Retry::new(Arc::new(MemoryLock::new()), RetryPolicy::default()));
/// let guard = locks.lock("nightly-report").await?;
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Retry {
    inner: Arc<dyn DistributedLock>,
    policy: RetryPolicy,
}

impl Retry {
    /// Wraps `inner`, retrying as `policy` says.
    pub fn new(inner: Arc<dyn DistributedLock>, policy: RetryPolicy) -> Self {
        #[cfg(feature = "metrics")]
        crate::layer::metrics::describe();
        Retry { inner, policy }
    }

    /// The wrapped lock.
    pub fn inner(&self) -> &Arc<dyn DistributedLock> {
        &self.inner
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Decides whether to try again after `error`: `Some(delay)` to sleep first, `None`
    /// to give up. Gives up when the delay would end at or past `deadline`.
    fn next_delay(
        &self,
        delays: &mut impl Iterator<Item = Duration>,
        error: &Error,
        deadline: Option<Instant>,
        (operation, name): (&'static str, &str),
        attempt: usize,
    ) -> Option<Duration> {
        if !error.is_retryable() {
            return None;
        }
        let delay = delays.next()?;
        if deadline.is_some_and(|deadline| {
            Instant::now()
                .checked_add(delay)
                .is_none_or(|at| at >= deadline)
        }) {
            return None;
        }
        tracing::warn!(
            backend = self.inner.backend(),
            lock = name,
            attempt,
            delay_ms = delay.as_millis() as u64,
            %error,
            "lock backend failed; retrying"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!(
            crate::layer::metrics::LOCK_RETRIES_TOTAL,
            "backend" => self.inner.backend(),
            "operation" => operation
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = operation;
        Some(delay)
    }
}

impl Retry {
    /// `attempt` (an acquire or a campaign), retried on retryable errors: with
    /// [`Wait::Timeout`], each attempt gets what is left of the caller's wait, and no retry
    /// starts whose delay would end past it.
    async fn retrying<F, Fut>(
        &self,
        name: &str,
        options: AcquireOptions,
        attempt: F,
    ) -> Result<LockGuard, Error>
    where
        F: Fn(AcquireOptions) -> Fut,
        Fut: std::future::Future<Output = Result<LockGuard, Error>>,
    {
        let wait = crate::WaitDeadline::new(options.wait_kind());
        tokio::select! {
            taken = self.attempts(name, options, attempt, wait) => taken,
            // An attempt against a backend that stopped answering: the whole acquire
            // still ends with the wait, or the round-trip grace.
            () = wait.bound_passed() => Err(wait.timed_out(name)),
        }
    }

    /// The attempts of [`retrying`](Self::retrying), until `wait` ends.
    async fn attempts<F, Fut>(
        &self,
        name: &str,
        options: AcquireOptions,
        attempt: F,
        wait: crate::WaitDeadline,
    ) -> Result<LockGuard, Error>
    where
        F: Fn(AcquireOptions) -> Fut,
        Fut: std::future::Future<Output = Result<LockGuard, Error>>,
    {
        let first = options;
        let deadline = wait.at();
        let mut delays = self.policy.delays();
        let mut attempts = 1;
        loop {
            let options = match deadline {
                Some(deadline) => {
                    options.wait_timeout(deadline.saturating_duration_since(Instant::now()))
                }
                None => options,
            };
            let error = match attempt(options).await {
                Ok(guard) => return Ok(guard),
                Err(error) => error,
            };
            match self.next_delay(&mut delays, &error, deadline, ("acquire", name), attempts) {
                Some(delay) => tokio::time::sleep(delay).await,
                // A later attempt's timeout was for what was left of the wait: the caller
                // learns the wait it asked for.
                None => {
                    return Err(match (error, first.wait_kind()) {
                        (Error::Timeout { name, .. }, Wait::Timeout(waited)) => {
                            Error::Timeout { name, waited }
                        }
                        (error, _) => error,
                    });
                }
            }
            attempts += 1;
        }
    }
}

#[async_trait]
impl DistributedLock for Retry {
    /// Acquires through the inner lock, retrying retryable errors.
    ///
    /// With [`Wait::Timeout`], each attempt gets what is left of the caller's wait, and no
    /// retry starts whose delay would end past it: the whole acquire ends after the wait
    /// asked for, or [`ROUND_TRIP_GRACE`](crate::ROUND_TRIP_GRACE) if that is later (as
    /// on every backend, see [`Wait::Timeout`]).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as the inner lock's `acquire`: dropping the future during an attempt
    /// drops that attempt; during a backoff sleep there is nothing to clean up.
    ///
    /// # Errors
    ///
    /// Non-retryable errors of the inner lock at once (contention, timeout, loss, bad
    /// input); a retryable error once the retries or the caller's wait are used up (the
    /// last one seen, so the caller learns the backend was unavailable rather than a
    /// misleading timeout).
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.retrying(name, options, |options| self.inner.acquire(name, options))
            .await
    }

    /// Campaigns through the inner lock, retrying retryable errors within the caller's
    /// wait, as [`acquire`](Self::acquire) does.
    ///
    /// # Cancel safety
    ///
    /// As `acquire`.
    ///
    /// # Errors
    ///
    /// As `acquire`.
    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        self.retrying(election, options, |options| {
            self.inner.campaign(election, value, options)
        })
        .await
    }

    /// Takes a read lock through the inner lock, retrying retryable errors within the
    /// caller's wait, as [`acquire`](Self::acquire) does.
    ///
    /// # Cancel safety
    ///
    /// As `acquire`.
    ///
    /// # Errors
    ///
    /// As `acquire`.
    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.retrying(name, options, |options| {
            self.inner.acquire_read(name, options)
        })
        .await
    }

    /// Takes a write lock through the inner lock, retrying retryable errors within the
    /// caller's wait, as [`acquire`](Self::acquire) does.
    ///
    /// # Cancel safety
    ///
    /// As `acquire`.
    ///
    /// # Errors
    ///
    /// As `acquire`.
    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.retrying(name, options, |options| {
            self.inner.acquire_write(name, options)
        })
        .await
    }

    /// Takes permits through the inner lock, retrying retryable errors within the
    /// caller's wait, as [`acquire`](Self::acquire) does.
    ///
    /// # Cancel safety
    ///
    /// As `acquire`.
    ///
    /// # Errors
    ///
    /// As `acquire`.
    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        self.retrying(name, options, |options| {
            self.inner.acquire_permits(name, permits, options)
        })
        .await
    }

    /// Forwards to the inner lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        self.inner.leader(election).await
    }

    /// Forwards to the inner lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        self.inner.observe(election).await
    }

    /// Inspects through the inner lock, retrying retryable errors (it only reads).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// As the inner lock's `inspect`, once retries are used up.
    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        let mut delays = self.policy.delays();
        let mut attempt = 1;
        loop {
            let error = match self.inner.inspect(name).await {
                Ok(info) => return Ok(info),
                Err(error) => error,
            };
            match self.next_delay(&mut delays, &error, None, ("inspect", name), attempt) {
                Some(delay) => tokio::time::sleep(delay).await,
                None => return Err(error),
            }
            attempt += 1;
        }
    }

    /// Lists through the inner lock, retrying retryable errors (it only reads).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// As the inner lock's `list`, once retries are used up.
    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        let mut delays = self.policy.delays();
        let mut attempt = 1;
        loop {
            let error = match self.inner.list(prefix).await {
                Ok(found) => return Ok(found),
                Err(error) => error,
            };
            match self.next_delay(&mut delays, &error, None, ("list", prefix), attempt) {
                Some(delay) => tokio::time::sleep(delay).await,
                None => return Err(error),
            }
            attempt += 1;
        }
    }

    /// Revokes through the inner lock, once: a revoke whose reply was lost may have
    /// freed the lock, and a retry would then take it from the next holder, whom the
    /// caller never meant to revoke.
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `revoke`.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        self.inner.revoke(name).await
    }

    /// Closes the inner lock.
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `close`.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn close(&self) -> Result<(), Error> {
        self.inner.close().await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn wrapped(&self) -> Option<&dyn DistributedLock> {
        Some(&*self.inner)
    }
}

#[cfg(test)]
mod tests {
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
}
