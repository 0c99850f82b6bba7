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

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{
    AcquireOptions, Capabilities, DistributedLock, Error, HolderInfo, Leader, LeaderChanges,
    ListedLock, LockGuard, LockInfo, Permits, Wait,
};

mod policy;

pub use policy::RetryPolicy;

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
mod tests;
