//! The proof of ownership a caller holds while it has the lock.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{Error, FencingToken, Liveness, LossCause};

/// The backend side of a held lock: what a [`LockGuard`] calls to let go.
///
/// Implemented by backends and layers; applications never need it.
///
/// # Contract
///
/// - [`release`](Self::release) is checked against owner *and* incarnation: it deletes
///   exactly the grant this handle stands for and never a newer holder's, however late
///   or often it is called. Once a call has returned `Ok`, later calls return `Ok` too.
///   When the grant is gone for another reason (expired, deleted), it returns
///   [`Error::Lost`].
/// - [`release_in_background`](Self::release_in_background) is called when a guard is
///   dropped without `release`: it stops renewal at once, returns without blocking, and
///   releases best-effort in the background with a bounded timeout.
#[async_trait]
pub trait HeldLock: Send + Sync + fmt::Debug + 'static {
    /// Releases the lock. See the trait's contract.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped, the release may or may not have happened; calling it
    /// again is safe.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] when the lock was no longer held; backend errors when the backend
    /// could not be reached (the lock then expires with its lease).
    async fn release(&self) -> Result<(), Error>;

    /// Stops renewal and releases in the background. Must not block.
    fn release_in_background(&self);

    /// Where the grant lives in the backend (the etcd key, the ZooKeeper node path, the
    /// Redis key), for fenced writes that check it. `None` when the backend has no such
    /// thing.
    fn backend_key(&self) -> Option<&str> {
        None
    }
}

/// Ownership of a lock, with its fencing token.
///
/// Holding a guard means the backend granted the lock and, as far as this client can
/// tell, has not taken it back. That can change at any time without any action from the
/// caller (lease expiry, partition, someone deleting the key), so:
///
/// - pass [`token`](Self::token) to every resource you modify and let the resource reject
///   stale tokens: that is what keeps a paused holder from overwriting newer work;
/// - watch [`lost`](Self::lost) (or [`lost_token`](Self::lost_token)) and stop working
///   when it fires, or use [`with_lock`](crate::DistributedLockExt::with_lock), which
///   does it for you.
///
/// # Releasing
///
/// Call [`release`](Self::release) to let go and learn whether the lock was still held.
/// Dropping the guard stops renewal at once and releases **in the background, best
/// effort**: the lock becomes free a round trip later, or when its lease expires if the
/// backend is unreachable. The in-memory backend releases on drop synchronously.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    name: String,
    token: FencingToken,
    backend: &'static str,
    liveness: Liveness,
    held: Arc<dyn HeldLock>,
    finished: bool,
}

impl LockGuard {
    /// Assembles a guard. For backends and layers.
    pub fn new(
        name: impl Into<String>,
        token: FencingToken,
        backend: &'static str,
        liveness: Liveness,
        held: Arc<dyn HeldLock>,
    ) -> Self {
        let name = name.into();
        liveness.set_identity(&name, token.get(), backend);
        LockGuard {
            name,
            token,
            backend,
            liveness,
            held,
            finished: false,
        }
    }

    /// The lock name, as given to `acquire`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fencing token of this grant: larger than every token granted before for this
    /// name.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The short name of the backend that granted the lock (`"mem"`, `"etcd"`, ...).
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// Whether ownership can no longer be guaranteed.
    ///
    /// True once the backend reported the lock gone or the local deadline
    /// ([`valid_until`](Self::valid_until)) has passed. Final.
    pub fn is_lost(&self) -> bool {
        self.liveness.is_lost()
    }

    /// Completes when ownership can no longer be guaranteed.
    ///
    /// Fires at the latest at [`valid_until`](Self::valid_until) if renewals stop
    /// succeeding, and earlier when the backend reports the lock gone.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes; use it in `select!`.
    ///
    /// # Examples
    ///
    /// ```
    /// # use fencelock_core::{MemoryLock, DistributedLockExt};
    /// # async fn work() {}
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let locks = MemoryLock::new();
    /// let guard = locks.lock("report").await?;
    /// tokio::select! {
    ///     _ = guard.lost() => eprintln!("lost the lock, stopping"),
    ///     _ = work() => {}
    /// }
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// None: it only waits.
    pub async fn lost(&self) {
        self.liveness.lost().await
    }

    /// A [`CancellationToken`] cancelled when the lock is lost (including by deadline),
    /// for handing to code that takes one.
    pub fn lost_token(&self) -> CancellationToken {
        self.liveness.lost_token()
    }

    /// Why the lock was lost, once it is: the backend's words (see
    /// [`lost_cause`](Self::lost_cause) for the kind).
    pub fn lost_reason(&self) -> Option<&str> {
        self.liveness.lost_reason()
    }

    /// The kind of loss, once the lock is lost.
    pub fn lost_cause(&self) -> Option<LossCause> {
        self.liveness.lost_cause()
    }

    /// The conservative local deadline of this grant on the monotonic clock: the instant
    /// the last successful renewal (or the acquire) was *sent*, plus the lease, minus the
    /// backend's drift margin. The backend cannot have given the lock to anyone else
    /// before it. Moves forward with each renewal.
    pub fn valid_until(&self) -> Instant {
        self.liveness.valid_until()
    }

    /// Whether the backend currently cannot confirm ownership although the lock is not
    /// lost yet (for example a ZooKeeper client that is disconnected within its session
    /// timeout). Work that is not fenced should pause while this is true.
    pub fn is_at_risk(&self) -> bool {
        self.liveness.is_at_risk()
    }

    /// Where the grant lives in the backend (the etcd key, the ZooKeeper node path, the
    /// Redis key), for fenced writes that check it; see each backend's fencing helpers.
    pub fn backend_key(&self) -> Option<&str> {
        self.held.backend_key()
    }

    /// The shared liveness record. For layers.
    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// The backend handle behind this guard. For layers and the conformance suite; its
    /// `release` can be called more than once (see [`HeldLock`]).
    pub fn held(&self) -> &Arc<dyn HeldLock> {
        &self.held
    }

    /// Releases the lock.
    ///
    /// # Cancel safety
    ///
    /// If the returned future is dropped before it completes, the guard is dropped with
    /// it, which releases in the background.
    ///
    /// # Errors
    ///
    /// - [`Error::Lost`] when the lock was no longer held (expired, deleted by someone
    ///   else) or the guard had already reported loss: anything done under it since then
    ///   may have overlapped with another holder. The lock is freed if still ours.
    /// - [`Error::Unavailable`] or [`Error::Backend`] when the backend could not be
    ///   told; the lock then frees itself when its lease expires.
    ///
    /// # Examples
    ///
    /// ```
    /// # use fencelock_core::{MemoryLock, DistributedLockExt};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let locks = MemoryLock::new();
    /// let guard = locks.lock("nightly-report").await?;
    /// // ... work, passing guard.token() to the resource ...
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    pub async fn release(mut self) -> Result<(), Error> {
        let was_lost = self.liveness.is_lost();
        let result = self.held.release().await;
        self.finished = true;
        self.liveness.end();
        match result {
            Ok(()) if was_lost => Err(Error::lost(
                &self.name,
                self.liveness.lost_reason().unwrap_or("lost before release"),
            )),
            other => other,
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if !self.finished {
            self.liveness.end();
            self.held.release_in_background();
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("backend", &self.backend)
            .field("lost", &self.liveness.is_lost())
            .finish_non_exhaustive()
    }
}
