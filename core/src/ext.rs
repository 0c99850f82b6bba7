//! Conveniences on top of [`DistributedLock`], for every backend at once.

use std::future::Future;
use std::time::Duration;

use crate::{AcquireOptions, DistributedLock, Error, FencingToken, LockGuard};

/// Conveniences for every [`DistributedLock`], including `dyn DistributedLock`.
///
/// Implemented for all locks by a blanket impl, so backends and layers cannot override
/// them and wrappers never lose behaviour.
pub trait DistributedLockExt: DistributedLock {
    /// Takes the lock with the default options: a renewing 30 s lease, waiting forever.
    ///
    /// # Cancel safety
    ///
    /// As [`DistributedLock::acquire`]: dropping the future leaves nothing behind.
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::acquire`], except never `Contended` or `Timeout`.
    ///
    /// # Examples
    ///
    /// ```
    /// use fencelock_core::{DistributedLockExt, MemoryLock};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let guard = MemoryLock::new().lock("invoices").await?;
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    fn lock<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Future<Output = Result<LockGuard, Error>> + Send + 'a {
        self.acquire(name, AcquireOptions::new())
    }

    /// Takes the lock if it is free right now, with the default renewing lease.
    ///
    /// Returns `Ok(None)` when someone else holds it.
    ///
    /// # Cancel safety
    ///
    /// As [`DistributedLock::acquire`].
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::acquire`]; contention is `Ok(None)`, not an error.
    ///
    /// # Examples
    ///
    /// ```
    /// use fencelock_core::{DistributedLockExt, MemoryLock};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let locks = MemoryLock::new();
    /// let first = locks.try_lock("cron").await?.expect("free");
    /// assert!(locks.try_lock("cron").await?.is_none());
    /// first.release().await?;
    /// # Ok(()) }
    /// ```
    fn try_lock<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Future<Output = Result<Option<LockGuard>, Error>> + Send + 'a {
        async move {
            match self.acquire(name, AcquireOptions::new().no_wait()).await {
                Ok(guard) => Ok(Some(guard)),
                Err(Error::Contended { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        }
    }

    /// Runs `work` while holding the lock, with the default options.
    ///
    /// See [`with_lock_opts`](Self::with_lock_opts).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops `work` and the guard (released in the background).
    ///
    /// # Errors
    ///
    /// As [`with_lock_opts`](Self::with_lock_opts).
    ///
    /// # Examples
    ///
    /// ```
    /// use fencelock_core::{DistributedLockExt, MemoryLock};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let locks = MemoryLock::new();
    /// let written = locks
    ///     .with_lock("ledger", |token| async move {
    ///         // write to the resource, passing `token` so it can reject stale writers
    ///         token.get()
    ///     })
    ///     .await?;
    /// assert!(written > 0);
    /// # Ok(()) }
    /// ```
    fn with_lock<'a, F, Fut, T>(
        &'a self,
        name: &'a str,
        work: F,
    ) -> impl Future<Output = Result<T, Error>> + Send + 'a
    where
        F: FnOnce(FencingToken) -> Fut + Send + 'a,
        Fut: Future<Output = T> + Send + 'a,
        T: Send + 'a,
    {
        self.with_lock_opts(name, AcquireOptions::new(), work)
    }

    /// Takes the lock with `options`, runs `work(token)`, and releases.
    ///
    /// If the lock is lost while `work` runs, `work` is dropped at its next await point
    /// and the result is [`Error::Lost`]. If `work` completes but the release finds the
    /// lock already gone, the result is also [`Error::Lost`]: the work may have
    /// overlapped with another holder, and only the fencing token protected it. A release
    /// that fails for any other reason (backend unreachable) does not discard the result:
    /// the lock was valid throughout and expires by its lease.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops `work` and the guard (released in the background).
    ///
    /// # Errors
    ///
    /// The errors of [`DistributedLock::acquire`], and [`Error::Lost`] as above.
    fn with_lock_opts<'a, F, Fut, T>(
        &'a self,
        name: &'a str,
        options: AcquireOptions,
        work: F,
    ) -> impl Future<Output = Result<T, Error>> + Send + 'a
    where
        F: FnOnce(FencingToken) -> Fut + Send + 'a,
        Fut: Future<Output = T> + Send + 'a,
        T: Send + 'a,
    {
        async move {
            let guard = self.acquire(name, options).await?;
            run_under(guard, name, work).await
        }
    }

    /// Takes the lock if it is free right now, with the default renewing lease, and
    /// waits at most `wait` for it: `Ok(None)` when the wait ran out (the holder kept it),
    /// instead of [`Error::Timeout`].
    ///
    /// # Cancel safety
    ///
    /// As [`DistributedLock::acquire`].
    ///
    /// # Errors
    ///
    /// As [`DistributedLock::acquire`]; running out of `wait` is `Ok(None)`.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use fencelock_core::{DistributedLockExt, MemoryLock};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let locks = MemoryLock::new();
    /// let held = locks.lock("report").await?;
    /// assert!(locks.lock_within("report", Duration::from_millis(10)).await?.is_none());
    /// held.release().await?;
    /// # Ok(()) }
    /// ```
    fn lock_within<'a>(
        &'a self,
        name: &'a str,
        wait: Duration,
    ) -> impl Future<Output = Result<Option<LockGuard>, Error>> + Send + 'a {
        async move {
            match self
                .acquire(name, AcquireOptions::new().wait_timeout(wait))
                .await
            {
                Ok(guard) => Ok(Some(guard)),
                Err(Error::Timeout { .. }) => Ok(None),
                Err(error) => Err(error),
            }
        }
    }

    /// Runs `work` under the lock only if the lock is free right now (a cron job that
    /// another host already runs is skipped, not queued): `Ok(None)` when it is held,
    /// otherwise as [`with_lock`](Self::with_lock).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops `work` and the guard (released in the background).
    ///
    /// # Errors
    ///
    /// As [`with_lock_opts`](Self::with_lock_opts); contention is `Ok(None)`.
    ///
    /// # Examples
    ///
    /// ```
    /// use fencelock_core::{DistributedLockExt, MemoryLock};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let locks = MemoryLock::new();
    /// assert_eq!(locks.try_with_lock("nightly", |_| async { 1 }).await?, Some(1));
    /// let held = locks.lock("nightly").await?;
    /// assert_eq!(locks.try_with_lock("nightly", |_| async { 2 }).await?, None);
    /// held.release().await?;
    /// # Ok(()) }
    /// ```
    fn try_with_lock<'a, F, Fut, T>(
        &'a self,
        name: &'a str,
        work: F,
    ) -> impl Future<Output = Result<Option<T>, Error>> + Send + 'a
    where
        F: FnOnce(FencingToken) -> Fut + Send + 'a,
        Fut: Future<Output = T> + Send + 'a,
        T: Send + 'a,
    {
        async move {
            let guard = match self.acquire(name, AcquireOptions::new().no_wait()).await {
                Ok(guard) => guard,
                Err(Error::Contended { .. }) => return Ok(None),
                Err(error) => return Err(error),
            };
            run_under(guard, name, work).await.map(Some)
        }
    }
}

/// Runs `work(token)` while `guard` holds its lock, then releases it; see
/// [`DistributedLockExt::with_lock_opts`].
async fn run_under<F, Fut, T>(guard: LockGuard, name: &str, work: F) -> Result<T, Error>
where
    F: FnOnce(FencingToken) -> Fut,
    Fut: Future<Output = T>,
{
    let outcome = tokio::select! {
        biased;
        _ = guard.lost() => None,
        value = work(guard.token()) => Some(value),
    };
    let Some(value) = outcome else {
        let reason = guard
            .lost_reason()
            .unwrap_or("lost while working")
            .to_owned();
        drop(guard);
        return Err(Error::lost(name, reason));
    };
    match guard.release().await {
        Ok(()) => Ok(value),
        Err(lost @ Error::Lost { .. }) => Err(lost),
        Err(error) => {
            tracing::warn!(lock = name, %error, "release failed; the lock expires with its lease");
            Ok(value)
        }
    }
}

impl<L: DistributedLock + ?Sized> DistributedLockExt for L {}
