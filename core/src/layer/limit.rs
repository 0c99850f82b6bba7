//! Waiter limit: at most N acquires of one client waiting at once; the next is refused
//! at once with [`Error::TooManyWaiters`].
//!
//! Every waiting acquire costs the client memory and usually the server something too
//! (a queue key or node, a watch, a subscription). Under overload (a burst of requests
//! for one hot name, a holder that hangs) an unbounded number of tasks would queue up,
//! each holding its caller's resources, long after anyone still wants the answer.
//! [`WaiterLimit`] bounds them per client: an acquire that may wait (any
//! [`Wait`] other than [`Wait::NoWait`]) takes one of `limit` places for as long as it
//! runs, and when none is free it fails at once, before anything is sent. Tries that do
//! not wait are never refused: they cannot pile up.
//!
//! From a URL: `?max_waiters=N` on any scheme (`fencelock::connect`); in a config file,
//! `max_waiters = N`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;

use crate::{
    AcquireOptions, Capabilities, DistributedLock, Error, HolderInfo, Leader, LeaderChanges,
    ListedLock, LockGuard, LockInfo, Permits, Wait,
};

/// A lock that lets at most `limit` acquires wait at once; see the [module](self).
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use fencelock_core::layer::limit::WaiterLimit;
/// use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, Error, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Error> {
/// let locks = WaiterLimit::new(Arc::new(MemoryLock::new()), 1)?;
/// let held = locks.lock("hot").await?;
/// let waiting = locks.acquire("hot", AcquireOptions::new());
/// tokio::pin!(waiting);
/// // Let the first waiter take the only place.
/// let still_waiting = tokio::time::timeout(Duration::from_millis(20), &mut waiting).await;
/// assert!(still_waiting.is_err());
/// let refused = locks.acquire("hot", AcquireOptions::new()).await;
/// assert!(matches!(refused, Err(Error::TooManyWaiters { limit: 1, .. })));
/// held.release().await?;
/// waiting.await?.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct WaiterLimit {
    inner: Arc<dyn DistributedLock>,
    limit: usize,
    waiting: Arc<AtomicUsize>,
}

/// One waiting place, given back when dropped (also when the acquire is cancelled).
struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl WaiterLimit {
    /// Wraps `inner`, letting at most `limit` acquires wait at once.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when `limit` is 0 (no acquire could ever wait; use
    /// `no_wait()` tries instead).
    pub fn new(inner: Arc<dyn DistributedLock>, limit: usize) -> Result<Self, Error> {
        if limit == 0 {
            return Err(Error::InvalidConfig(
                "max_waiters must be at least 1".into(),
            ));
        }
        Ok(WaiterLimit {
            inner,
            limit,
            waiting: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// How many acquires are waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// A place for an acquire that may wait; `None` for one that does not.
    fn enter(&self, name: &str, options: &AcquireOptions) -> Result<Option<Place>, Error> {
        // Bad input is its own error, never `TooManyWaiters`: checked before a place is
        // taken (a lease not given is the backend's default, which it checks itself).
        crate::validate_name(name)?;
        if options.has_lease() {
            options.validate(self.inner.capabilities().min_lease)?;
        }
        if options.wait_kind() == Wait::NoWait {
            return Ok(None);
        }
        let taken = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            });
        match taken {
            Ok(_) => Ok(Some(Place(self.waiting.clone()))),
            Err(_) => Err(Error::TooManyWaiters {
                name: name.to_owned(),
                limit: self.limit,
            }),
        }
    }
}

#[async_trait]
impl DistributedLock for WaiterLimit {
    /// Acquires through the inner lock, if a waiting place is free (or it does not wait).
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `acquire`; a dropped call gives its place back.
    ///
    /// # Errors
    ///
    /// [`Error::TooManyWaiters`] at once when every place is taken; otherwise the inner
    /// lock's.
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let _place = self.enter(name, &options)?;
        self.inner.acquire(name, options).await
    }

    /// Campaigns through the inner lock, counted as a waiter like `acquire`.
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
        let _place = self.enter(election, &options)?;
        self.inner.campaign(election, value, options).await
    }

    /// Takes a read lock through the inner lock, counted as a waiter like `acquire`.
    ///
    /// # Cancel safety
    ///
    /// As `acquire`.
    ///
    /// # Errors
    ///
    /// As `acquire`.
    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let _place = self.enter(name, &options)?;
        self.inner.acquire_read(name, options).await
    }

    /// Takes a write lock through the inner lock, counted as a waiter like `acquire`.
    ///
    /// # Cancel safety
    ///
    /// As `acquire`.
    ///
    /// # Errors
    ///
    /// As `acquire`.
    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let _place = self.enter(name, &options)?;
        self.inner.acquire_write(name, options).await
    }

    /// Takes permits through the inner lock, counted as a waiter like `acquire`.
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
        let _place = self.enter(name, &options)?;
        self.inner.acquire_permits(name, permits, options).await
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

    /// Forwards to the inner lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        self.inner.inspect(name).await
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
    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        self.inner.list(prefix).await
    }

    /// Forwards to the inner lock.
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
    use std::time::Duration;

    use super::*;
    use crate::{DistributedLockExt, MemoryLock};

    /// Polls `future` for a moment: whether it is still waiting.
    async fn pending<F: std::future::Future + Unpin>(future: &mut F) -> bool {
        tokio::time::timeout(Duration::from_millis(20), future)
            .await
            .is_err()
    }

    #[tokio::test]
    async fn waiters_beyond_the_limit_are_refused_at_once_and_places_come_back() {
        let locks = WaiterLimit::new(Arc::new(MemoryLock::new()), 2).unwrap();
        let held = locks.lock("hot").await.unwrap();
        let a = locks.acquire("hot", AcquireOptions::new());
        let b = locks.acquire("hot", AcquireOptions::new());
        tokio::pin!(a, b);
        assert!(pending(&mut a).await);
        assert!(pending(&mut b).await);
        assert_eq!(locks.waiting(), 2);
        // Refused at once: the third waiter, whatever the primitive.
        let refused = locks.acquire("hot", AcquireOptions::new()).await;
        assert!(
            matches!(refused, Err(Error::TooManyWaiters { limit: 2, .. })),
            "{refused:?}"
        );
        let timeout = AcquireOptions::new().wait_timeout(Duration::from_secs(1));
        let refused = locks.acquire_read("other", timeout).await;
        assert!(
            matches!(refused, Err(Error::TooManyWaiters { .. })),
            "{refused:?}"
        );
        // Bad input is its own error even with every place taken.
        let bad = locks.acquire("", AcquireOptions::new()).await;
        assert!(matches!(bad, Err(Error::InvalidName { .. })), "{bad:?}");
        let bad = locks
            .acquire("x", AcquireOptions::new().lease(Duration::ZERO))
            .await;
        assert!(matches!(bad, Err(Error::InvalidConfig(_))), "{bad:?}");
        // A try that does not wait is never refused by the limit.
        let tried = locks.acquire("hot", AcquireOptions::new().no_wait()).await;
        assert!(matches!(tried, Err(Error::Contended { .. })), "{tried:?}");
        // A cancelled waiter gives its place back.
        b.set(locks.acquire("unused", AcquireOptions::new().no_wait()));
        assert_eq!(locks.waiting(), 1);
        held.release().await.unwrap();
        a.await.unwrap().release().await.unwrap();
        assert_eq!(locks.waiting(), 0);
        assert!(WaiterLimit::new(Arc::new(MemoryLock::new()), 0).is_err());
    }
}
