//! The trait every backend implements.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    AcquireOptions, Capabilities, Error, FencingToken, Leader, LeaderChanges, LockGuard, Permits,
};

/// A distributed lock service: etcd, ZooKeeper, Redis, memory, or a layer over one.
///
/// Application code holds an `Arc<dyn DistributedLock>` (what
/// `fencelock::connect` returns) and uses the conveniences of
/// [`DistributedLockExt`](crate::DistributedLockExt): `lock`, `try_lock`, `with_lock`.
///
/// # Contract
///
/// Every implementation keeps these promises, checked by the conformance suite:
///
/// 1. **Mutual exclusion**: for one name, at most one guard is valid at any instant, within
///    the limits [`capabilities`](Self::capabilities) states.
/// 2. **Fencing**: each guard's token is larger than every token granted before for the
///    same name.
/// 3. **Leases**: a renewing lease is renewed at least every third of its duration while
///    the guard lives; a fixed lease is never renewed.
/// 4. **Loss is reported** through the guard, at the latest at its `valid_until()`.
/// 5. **Release** deletes only this grant, never a newer holder's.
/// 6. **Cancellation**: dropping an `acquire` future at any await point leaves nothing
///    behind (no key, no queue entry, no task), promptly.
/// 7. **Waiting** does not poll: waiters are woken by the backend. (The exceptions are
///    documented where they are: Redis's raw layout, whose hand-written holders publish
///    nothing on release, is polled at a bounded, growing interval; a Redis lock key
///    without an expiry, set by hand, is looked at again every second.)
/// 8. **Names**: every name accepted by [`validate_name`](crate::validate_name) works and
///    is independent of every other name; bad names fail before any I/O.
/// 9. **Not reentrant**: a lock held by a guard is held for its own client and task too:
///    a second `acquire` of the name waits (or is refused) like anyone else's. Pass the
///    guard (or its token) down instead of locking again.
#[async_trait]
pub trait DistributedLock: Send + Sync + fmt::Debug + 'static {
    /// Takes the lock `name`, waiting as `options` allow.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if the future is dropped at any point, nothing is left behind. A
    /// grant that was already made is released (in the background for remote backends).
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidName`], [`Error::InvalidConfig`] for bad input, before any I/O;
    /// - [`Error::Contended`] with [`Wait::NoWait`](crate::Wait::NoWait) when held;
    /// - [`Error::Timeout`] when the wait ran out;
    /// - [`Error::Lost`] when the backend session ended while waiting;
    /// - [`Error::Closed`] after [`close`](Self::close);
    /// - [`Error::TooManyWaiters`] when a waiter cap (`max_waiters=`) is reached;
    /// - [`Error::Unavailable`] / [`Error::Backend`] for backend failures
    ///   ([`Error::is_retryable`] tells which are worth retrying).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use fencelock_core::{AcquireOptions, DistributedLock, MemoryLock};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let locks = MemoryLock::new();
    /// let opts = AcquireOptions::new().wait_timeout(Duration::from_secs(5));
    /// let guard = locks.acquire("orders/SKU-8842", opts).await?;
    /// println!("holding with token {}", guard.token());
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error>;

    /// Reports who holds `name` and how many wait, as far as the backend can tell.
    ///
    /// For operators and tests; the answer can be stale by the time it arrives.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a bad name; [`Error::Closed`] after
    /// [`close`](Self::close); backend errors as for `acquire`.
    async fn inspect(&self, name: &str) -> Result<LockInfo, Error>;

    /// The locks whose names start with `prefix` (`""`: all) that someone holds or waits
    /// for now, sorted by name, each as [`inspect`](Self::inspect) would report it.
    ///
    /// For operators (`fencelock list`); like `inspect`, the answer can be stale by the
    /// time it arrives, and it is not one atomic snapshot. It reads every matching key
    /// or node, so its cost grows with the number of locks under `prefix`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for a prefix [`validate_prefix`](crate::validate_prefix)
    /// refuses, before any I/O; [`Error::Closed`] after [`close`](Self::close); backend
    /// errors as for `acquire`.
    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error>;

    /// Takes `name` away from whoever holds it, as an operator deleting the lock's key
    /// would, and returns who that was (`None` when nobody held it). The holder's guard
    /// reports loss ([`LossCause::KeyGone`](crate::LossCause::KeyGone)), as soon as its
    /// backend notices ([`Capabilities::loss_detection`]); the next waiter is granted the
    /// lock with a larger token. Only the grant seen is deleted: a holder that took the
    /// lock in the meantime keeps it.
    ///
    /// For operators (`fencelock revoke`), to free a lock whose holder is stuck but alive.
    /// The revoked holder may go on working until it notices; only a resource that
    /// checks fencing tokens refuses it at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the delete either reached the backend or not; nothing is left behind.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] before any I/O; [`Error::Closed`] after
    /// [`close`](Self::close); backend errors as for `acquire`.
    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error>;

    /// Closes the client gracefully: every lock held through it is released (its
    /// guard reports loss with [`LossCause::ClientClosed`](crate::LossCause::ClientClosed),
    /// since the holder can no longer rely on it), renewals stop, waiting acquires fail with
    /// [`Error::Closed`], observations of elections end with [`Error::Closed`], sessions
    /// and connections are closed, and every later call fails with [`Error::Closed`].
    /// Closing again does nothing. Clones and layers share the
    /// client they wrap: closing any of them closes it for all.
    ///
    /// Call it at shutdown so the names are free at once, instead of after the leases
    /// run out.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe in the sense that a dropped `close` may leave some locks held
    /// until their leases expire (they are released on the server as the backend
    /// allows); the client is closed for new acquires from the first poll.
    ///
    /// # Errors
    ///
    /// A backend error when a release could not be confirmed; the locks concerned expire
    /// with their leases, and the client is closed regardless.
    async fn close(&self) -> Result<(), Error>;

    /// Takes `permits.count()` of the `permits.limit()` permits of semaphore `name`,
    /// waiting as `options` allow, with the lock's lease and loss rules; the guard's
    /// release gives them back, and a crashed holder's permits come back when its lease
    /// ends. Every grant has a token larger than that of every grant of that semaphore
    /// completed before this request was made (permits held together may carry tokens
    /// in either order: on etcd they follow the queue).
    /// Semaphores are a namespace of their own: a semaphore and a lock of the same name
    /// are unrelated. Capabilities say whether the backend has them
    /// ([`Capabilities::semaphore`]); waiting is FIFO where
    /// [`Capabilities::fifo`] says so.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire): a dropped request leaves no permit and no queue
    /// entry behind.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire); [`Error::InvalidConfig`] when the semaphore exists
    /// with another limit; [`Error::Unsupported`] on a backend without semaphores.
    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let _ = (name, permits, options);
        Err(Error::Unsupported {
            backend: self.backend(),
            operation: "semaphores",
        })
    }

    /// Takes the read lock of read-write lock `name`: held together with every other
    /// reader, never with a writer. A reader that comes after a waiting writer waits
    /// behind it, so a stream of readers never starves a writer (on backends with FIFO
    /// waiting, [`Capabilities::fifo`], every request is served in order; on the others,
    /// Redis, a waiting writer holds back later readers, and writers race each other). The guard
    /// has a token larger than that of every grant of `name` completed before this
    /// request was made (readers held together may carry tokens in either order; a
    /// writer's is larger than every earlier grant's), and the lock's lease,
    /// wait, loss and cancellation rules. Read-write locks are a namespace of their own:
    /// unrelated to the lock or the semaphore of the same name. Capabilities say whether
    /// the backend has them ([`Capabilities::rw_lock`]).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire); [`Error::Unsupported`] on a backend without
    /// read-write locks.
    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let _ = (name, options);
        Err(Error::Unsupported {
            backend: self.backend(),
            operation: "read-write locks",
        })
    }

    /// Takes the write lock of read-write lock `name`: held alone, with no reader and no
    /// other writer; see [`acquire_read`](Self::acquire_read). Successive writers'
    /// tokens increase, so a resource fenced by writers' tokens refuses a deposed writer.
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire).
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire); [`Error::Unsupported`] on a backend without
    /// read-write locks.
    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let _ = (name, options);
        Err(Error::Unsupported {
            backend: self.backend(),
            operation: "read-write locks",
        })
    }

    /// Campaigns for leadership of `election` with `value` (for example the instance's
    /// address), waiting as `options` allow; returns the term once elected.
    ///
    /// The term is a [`LockGuard`]: its token is larger than every earlier term's (pass
    /// it with every write a leader makes, so a deposed leader's writes are refused),
    /// [`lost`](LockGuard::lost) tells the leader it was deposed (lease expired, session
    /// ended, revoked), and [`release`](LockGuard::release) resigns. Campaigning and
    /// locking the same name exclude each other: an election is a lock whose holder
    /// publishes a value. Capabilities say whether the backend has elections
    /// ([`Capabilities::election`]).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](Self::acquire): a dropped campaign leaves nothing behind.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire); [`Error::InvalidConfig`] for a value longer than
    /// [`MAX_LEADER_VALUE`](crate::MAX_LEADER_VALUE), before any I/O;
    /// [`Error::Unsupported`] on a backend without elections.
    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let _ = (election, value, options);
        Err(Error::Unsupported {
            backend: self.backend(),
            operation: "leader election",
        })
    }

    /// The leader of `election` now, if any, as far as the backend can tell.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// As [`inspect`](Self::inspect); [`Error::Unsupported`] on a backend without
    /// elections.
    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        let _ = election;
        Err(Error::Unsupported {
            backend: self.backend(),
            operation: "leader election",
        })
    }

    /// Observes `election`: the leader now, then every change, in order, pushed by the
    /// backend (no polling). Observing does not take part in the election.
    ///
    /// The stream ends after an error: when observing fails for good, and when this
    /// client is closed ([`close`](Self::close)), whose last item is [`Error::Closed`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call or stream leaves no watch behind.
    ///
    /// # Errors
    ///
    /// As [`inspect`](Self::inspect); [`Error::Unsupported`] on a backend without
    /// elections.
    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        let _ = election;
        Err(Error::Unsupported {
            backend: self.backend(),
            operation: "leader election",
        })
    }

    /// What this backend guarantees.
    fn capabilities(&self) -> Capabilities;

    /// A short static name of the backend (`"mem"`, `"etcd"`, `"zookeeper"`, `"redis"`,
    /// ...), used in errors and metrics.
    fn backend(&self) -> &'static str;

    /// This lock as [`Any`](std::any::Any), so that [`downcast_lock`] can reach a
    /// concrete backend's own API. Backends return `Some(self)`; the default is `None`.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// The lock this one wraps (the retry and metrics layers), so that
    /// [`downcast_lock`] looks through layers. `None` for backends, and for the
    /// migration layer, which has two.
    fn wrapped(&self) -> Option<&dyn DistributedLock> {
        None
    }
}

/// The concrete backend `T` behind `lock`, looking through the retry and metrics
/// layers: how code that connected by URL reaches what a backend offers beyond the trait
/// (`EtcdLock::client`, `ZkLock`'s fencing helpers, ...). `None` when `lock` is another
/// backend, or a migration layer.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
/// use std::sync::Arc;
/// use fencelock_core::{DistributedLock, MemoryLock, Retry, RetryPolicy, downcast_lock};
///
/// let lock: Arc<dyn DistributedLock> =
///     Arc::new(Retry::new(Arc::new(MemoryLock::new()), RetryPolicy::default()));
/// assert!(downcast_lock::<MemoryLock>(&*lock).is_some());
/// // The layers themselves can be reached too.
/// assert_eq!(downcast_lock::<Retry>(&*lock).unwrap().policy(), &RetryPolicy::default());
/// # Ok(()) }
/// ```
pub fn downcast_lock<T: DistributedLock>(lock: &dyn DistributedLock) -> Option<&T> {
    let mut current = lock;
    loop {
        if let Some(found) = current.as_any().and_then(|any| any.downcast_ref::<T>()) {
            return Some(found);
        }
        current = current.wrapped()?;
    }
}

/// One lock found by [`DistributedLock::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListedLock {
    /// The lock name.
    pub name: String,
    /// Its holder and waiters, as [`DistributedLock::inspect`] reports them.
    pub info: LockInfo,
}

impl ListedLock {
    /// Describes a listed lock.
    pub fn new(name: impl Into<String>, info: LockInfo) -> Self {
        ListedLock {
            name: name.into(),
            info,
        }
    }
}

/// What [`DistributedLock::inspect`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The current holder, if any.
    pub holder: Option<HolderInfo>,
    /// How many are waiting, where the backend can tell.
    pub waiters: Option<usize>,
}

impl LockInfo {
    /// A lock nobody holds.
    pub fn free(waiters: Option<usize>) -> Self {
        LockInfo {
            holder: None,
            waiters,
        }
    }

    /// A held lock.
    pub fn held(holder: HolderInfo, waiters: Option<usize>) -> Self {
        LockInfo {
            holder: Some(holder),
            waiters,
        }
    }

    /// Whether someone holds the lock.
    pub fn is_held(&self) -> bool {
        self.holder.is_some()
    }
}

/// The holder of a lock, as [`DistributedLock::inspect`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderInfo {
    /// A backend-specific identity of the owner (lease id, session id, owner value).
    pub owner: String,
    /// The holder's fencing token.
    pub token: FencingToken,
    /// Time left before the backend expires the lock unless renewed, where known.
    pub remaining_lease: Option<Duration>,
}

impl HolderInfo {
    /// Describes a holder.
    pub fn new(
        owner: impl Into<String>,
        token: FencingToken,
        remaining_lease: Option<Duration>,
    ) -> Self {
        HolderInfo {
            owner: owner.into(),
            token,
            remaining_lease,
        }
    }
}

macro_rules! forward {
    ($($ty:ty),*) => {$(
        #[async_trait]
        impl<T: DistributedLock + ?Sized> DistributedLock for $ty {
            async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
                (**self).acquire(name, options).await
            }
            async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
                (**self).inspect(name).await
            }
            async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
                (**self).list(prefix).await
            }
            async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
                (**self).revoke(name).await
            }
            async fn close(&self) -> Result<(), Error> {
                (**self).close().await
            }
            async fn campaign(
                &self,
                election: &str,
                value: &str,
                options: AcquireOptions,
            ) -> Result<LockGuard, Error> {
                (**self).campaign(election, value, options).await
            }
            async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
                (**self).leader(election).await
            }
            async fn acquire_permits(
                &self,
                name: &str,
                permits: Permits,
                options: AcquireOptions,
            ) -> Result<LockGuard, Error> {
                (**self).acquire_permits(name, permits, options).await
            }
            async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
                (**self).acquire_read(name, options).await
            }
            async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
                (**self).acquire_write(name, options).await
            }
            async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
                (**self).observe(election).await
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
            fn backend(&self) -> &'static str {
                (**self).backend()
            }
            fn as_any(&self) -> Option<&dyn std::any::Any> {
                (**self).as_any()
            }
            fn wrapped(&self) -> Option<&dyn DistributedLock> {
                (**self).wrapped()
            }
        }
    )*};
}

forward!(Arc<T>, Box<T>);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryLock;

    #[test]
    fn is_dyn_compatible_and_forwards_through_arc_and_box() {
        let lock: Arc<dyn DistributedLock> = Arc::new(MemoryLock::new());
        let boxed: Box<dyn DistributedLock> = Box::new(lock.clone());
        assert_eq!(boxed.backend(), "mem");
        assert_eq!(boxed.capabilities(), lock.capabilities());
        fn needs_lock<L: DistributedLock>(_: &L) {}
        needs_lock(&lock);
        needs_lock(&boxed);
    }
}
