//! The proof of ownership a caller holds while it has the lock.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

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

    /// Moves the end of a fixed lease to `lease` after the request is sent, on the
    /// server, and returns the grant's new conservative `valid_until` (the send instant
    /// plus `lease`, minus the backend's drift margin). Checked against owner and
    /// incarnation like [`release`](Self::release). The default says the backend cannot.
    ///
    /// # Cancel safety
    ///
    /// Backends make it so: a dropped call either extended the lease or left it as it
    /// was, and leaves nothing behind (no extra lease, task or key).
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] when the grant was no longer held; [`Error::InvalidConfig`] when
    /// the lease renews itself or `lease` is out of the backend's range;
    /// [`Error::Unsupported`] when the backend cannot extend; backend errors when it
    /// could not be reached (the lease then ends as it would have).
    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        let _ = lease;
        self.can_extend()?;
        Err(Error::Unsupported {
            backend: "unknown",
            operation: "extending a fixed lease",
        })
    }

    /// Whether [`extend`](Self::extend) may be asked at all, without I/O:
    /// [`Error::InvalidConfig`] for a renewing lease
    /// ([`Error::not_a_fixed_lease`]), [`Error::Unsupported`] (the default) for a
    /// backend that cannot extend.
    ///
    /// # Errors
    ///
    /// As said above.
    fn can_extend(&self) -> Result<(), Error> {
        Err(Error::Unsupported {
            backend: "unknown",
            operation: "extending a fixed lease",
        })
    }

    /// Whether [`extend`](Self::extend) may be asked to extend by `lease`, without I/O:
    /// [`can_extend`](Self::can_extend) (the default), and `lease` within the backend's
    /// own range ([`Error::InvalidConfig`]: shorter than its minimum, not in its
    /// granularity). [`LockGuard::extend`] asks this before anything else, also when the
    /// lease would not move the deadline, so a lease the backend refuses is refused
    /// whatever is left of the current one.
    ///
    /// # Errors
    ///
    /// As said above.
    fn check_extension(&self, lease: Duration) -> Result<(), Error> {
        let _ = lease;
        self.can_extend()
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
    /// Shared with the liveness record, which names the guard when it logs a loss.
    name: Arc<str>,
    token: FencingToken,
    backend: &'static str,
    liveness: Liveness,
    held: Arc<dyn HeldLock>,
    /// Taken by [`extend`](Self::extend) for the whole call, so the server applies
    /// concurrent extensions in the order their replies set the deadline.
    extending: tokio::sync::Mutex<()>,
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
        Self::with_name(Arc::from(name.into()), token, backend, liveness, held)
    }

    /// [`new`](Self::new) with a name the backend shares already (its grant's record of
    /// the lock, say): one copy of the name per held lock.
    pub fn with_name(
        name: Arc<str>,
        token: FencingToken,
        backend: &'static str,
        liveness: Liveness,
        held: Arc<dyn HeldLock>,
    ) -> Self {
        liveness.set_shared_identity(name.clone(), token.get(), backend);
        LockGuard {
            name,
            token,
            backend,
            liveness,
            held,
            extending: tokio::sync::Mutex::new(()),
            finished: false,
        }
    }

    /// The lock name, as given to `acquire`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fencing token of this grant: larger than every token granted before for this
    /// name (for a semaphore's permits and a read lock, which others hold at the same
    /// time: larger than that of every grant completed before this one was requested).
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
    ///
    /// Taken inside a temporary runtime (a `Runtime::new().block_on(...)` that then
    /// ends), it still fires at the deadline while the runtime the lock was acquired on
    /// runs: see [`Liveness::lost_token`].
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

    /// Extends a fixed lease ([`AcquireOptions::fixed_lease`](crate::AcquireOptions::fixed_lease)):
    /// the grant now ends `lease` after this request is sent, on the server and in
    /// [`valid_until`](Self::valid_until). An extension that would end no later than
    /// [`valid_until`](Self::valid_until) already does changes nothing and returns
    /// `Ok`. One that is sent replaces the server's lease, and `valid_until` becomes the
    /// backend's conservative end of the new one (send instant plus `lease`, minus the
    /// backend's drift margin): usually later, but earlier by less than that margin when
    /// the new end lay within it of the old deadline, so that `valid_until` is never
    /// past what the server's current lease guarantees. The token
    /// stays the same. This is the explicit counterpart of the automatic renewal of a
    /// renewing lease: a holder that knows its work takes longer asks for more time,
    /// and a holder that stops asking loses the lock when the lease ends.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use fencelock_core::{AcquireOptions, DistributedLock, MemoryLock};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
    /// let locks = MemoryLock::new();
    /// let guard = locks
    ///     .acquire("import", AcquireOptions::new().fixed_lease(Duration::from_secs(10)))
    ///     .await?;
    /// // ... the import turns out to be large ...
    /// guard.extend(Duration::from_secs(60)).await?;
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call either extended the lease or left it as it was, and
    /// leaves nothing behind. `valid_until` moves only once the extension is confirmed,
    /// by the call, or on a backend that finishes an extension in a task of its own
    /// (etcd, whose key moves onto a new lease) by that task after the call was dropped;
    /// an extension whose outcome stays unknown may move it back, never forward, to the
    /// end of the shorter of the leases the server may now hold. Calls made at once on
    /// one guard take turns: each is sent after the one before it has been answered. A
    /// call that finds the deadline already far enough sends nothing; if a dropped
    /// call's task is still finishing then, the deadline it sets may end up to one drift
    /// margin short of what the later call asked (never past the server's lease).
    ///
    /// # Errors
    ///
    /// - [`Error::Lost`] when the lock is lost already, or was no longer held on the
    ///   server (then the guard reports the loss too).
    /// - [`Error::InvalidConfig`] when the lease renews itself (only fixed leases are
    ///   extended) or `lease` is zero, longer than 365 days or shorter than the backend's
    ///   minimum; nothing is sent then.
    /// - [`Error::Unsupported`] on a backend or layer that cannot extend.
    /// - [`Error::Unavailable`], [`Error::Backend`] when the backend could not be
    ///   reached: the lease then ends as it would have, and the guard reports it.
    pub async fn extend(&self, lease: Duration) -> Result<(), Error> {
        if self.finished {
            return Err(Error::lost(&*self.name, "the guard was released"));
        }
        if self.liveness.is_lost() {
            return Err(Error::lost(
                &*self.name,
                self.liveness.lost_reason().unwrap_or("lost before extend"),
            ));
        }
        crate::validate_lease(lease, Duration::ZERO)?;
        self.held
            .check_extension(lease)
            .map_err(|error| self.own_unsupported(error))?;
        // One extension at a time: two in flight at once could reach the server in one
        // order and set the deadline in the other, leaving it at the longer lease while
        // the server holds the shorter.
        let _turn = self.extending.lock().await;
        if self.liveness.is_lost() {
            return Err(Error::lost(
                &*self.name,
                self.liveness.lost_reason().unwrap_or("lost before extend"),
            ));
        }
        match extend_held(&*self.held, &self.liveness, lease).await {
            Ok(_) => {
                if self.liveness.is_lost() {
                    return Err(Error::lost(
                        &*self.name,
                        self.liveness.lost_reason().unwrap_or("lost during extend"),
                    ));
                }
                Ok(())
            }
            // The server says the grant is gone: the guard reports it now, on every
            // backend, not at the end of the lease it had (as its docs promise).
            Err(Error::Lost { reason, .. }) => {
                self.liveness.mark_lost(LossCause::KeyGone, reason.clone());
                Err(Error::lost(&*self.name, reason))
            }
            Err(error) => Err(self.own_unsupported(error)),
        }
    }

    /// An [`Error::Unsupported`] of the backend handle, named after this guard's backend.
    fn own_unsupported(&self, error: Error) -> Error {
        match error {
            Error::Unsupported { operation, .. } => Error::Unsupported {
                backend: self.backend,
                operation,
            },
            other => other,
        }
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
    ///   That holds whatever the backend answered, even when it could not be reached.
    /// - [`Error::Unavailable`] or [`Error::Backend`] when the backend could not be
    ///   told; the lock then frees itself when its lease ends.
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
        // Lost before the release: the work done under the guard may have overlapped
        // another holder's, whatever the backend answers now (it may not be reachable).
        // A deadline passing while the release is out is no loss: the work ended when
        // the release began.
        let was_lost = self.liveness.is_lost();
        let result = self.held.release().await;
        self.finished = true;
        self.liveness.end();
        match result {
            Err(error @ Error::Lost { .. }) => Err(error),
            _ if was_lost => Err(Error::lost(
                &*self.name,
                self.liveness.lost_reason().unwrap_or("lost before release"),
            )),
            other => other,
        }
    }
}

/// Extends `held`, whose deadline `liveness` keeps, by `lease`, never shorter: when
/// `lease` from now ends no later than the deadline already promised, nothing is sent and
/// `Ok(None)` is returned. Otherwise the server's lease is replaced by one of `lease`
/// from the send, and `liveness` takes the backend's conservative deadline for it
/// ([`Liveness::confirm_extension`]) even when that is earlier than the one it had: the
/// old deadline lay within the drift margin of the new lease's end, which is no longer
/// covered. Used by [`LockGuard::extend`] and by layers for each lock they hold.
pub(crate) async fn extend_held(
    held: &dyn HeldLock,
    liveness: &Liveness,
    lease: Duration,
) -> Result<Option<Instant>, Error> {
    if Instant::now()
        .checked_add(lease)
        .is_some_and(|end| end <= liveness.valid_until())
    {
        return Ok(None);
    }
    let valid_until = held.extend(lease).await?;
    liveness.confirm_extension(valid_until);
    Ok(Some(valid_until))
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

#[cfg(test)]
mod tests;
