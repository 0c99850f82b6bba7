//! The one [`HeldLock`] of every backend: a [`Grant`] (what only the backend knows of
//! one held grant) inside [`Held`], which keeps the release state machine.
//!
//! Every backend's release used to keep its own flags (`released`, `release_sent`,
//! `handed_off`) and its own wording of an unconfirmed release. The states are the same
//! everywhere:
//!
//! ```text
//!   Held ──release / guard's drop──▶ Sent ──delete removed it──────────▶ Released
//!                                    │  ──gone before our first delete──▶ Lost
//!                                    │  ──gone after an earlier delete──▶ Unconfirmed
//!                                    └──error: stays Sent (a later release asks again)
//! ```
//!
//! A final state answers every later release the same way: `Ok` once released, the loss
//! once lost, "could not be confirmed" once unconfirmed.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{Error, HeldLock, Liveness, LossCause};

/// What one delete of a grant found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// This delete removed the grant.
    Now,
    /// The grant was gone when the delete reached the backend: expired, or deleted or
    /// taken over by someone else.
    AlreadyGone,
    /// The grant is gone, and whether this client's own earlier delete (whose answer was
    /// lost) or someone else removed it cannot be told.
    Unconfirmed,
}

/// Whether and how a grant's lease may be extended ([`HeldLock::extend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extension {
    /// A renewing lease: it renews itself and is never extended.
    Renewing,
    /// A fixed lease, extended by leases of at least `min_lease`.
    Fixed {
        /// The backend's shortest lease.
        min_lease: Duration,
    },
    /// The backend cannot extend this grant.
    Unsupported,
}

/// The backend side of one held grant: the few operations only the backend knows. Wrapped
/// in a [`Held`], which is the guard's [`HeldLock`].
///
/// # Contract
///
/// - [`delete`](Self::delete) removes exactly this incarnation (owner and incarnation
///   checked on the server), never a newer holder's, however late or often it is called.
/// - [`stop`](Self::stop) ends renewal and the loss watch at once: from then on a deletion
///   of the grant is this client's own, not a loss. It never blocks. [`Held`] calls it
///   when the first release starts, or when it is dropped never released, so a grant
///   needs no `Drop` of its own for it; two releases racing may both call it, so a
///   second call must be harmless.
pub trait Grant: Send + Sync + fmt::Debug + 'static {
    /// The backend's short name, for errors.
    fn backend(&self) -> &'static str;

    /// The lock's name, for errors.
    fn name(&self) -> &str;

    /// Where the grant lives in the backend (key, node path), for fenced writes.
    fn key(&self) -> Option<&str> {
        None
    }

    /// Whether the lease may be extended.
    fn extension(&self) -> Extension;

    /// The backend's own checks of an extension's `lease` beyond its range (e.g. whole
    /// seconds), without I/O.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a lease the backend cannot set.
    fn check_lease(&self, lease: Duration) -> Result<(), Error> {
        let _ = lease;
        Ok(())
    }

    /// Stops renewal and the loss watch. See the trait's contract.
    fn stop(&self);

    /// Deletes the grant once, bounded by the backend's own timeout. A backend that
    /// cannot tell the outcome (an error) keeps trying in the background if its grant
    /// would otherwise outlive the release (a shared session).
    ///
    /// # Cancel safety
    ///
    /// A dropped call may or may not have deleted the grant; calling it again is safe.
    ///
    /// # Errors
    ///
    /// Backend errors when the backend could not be reached or answered otherwise.
    fn delete(&self) -> impl Future<Output = Result<Deleted, Error>> + Send;

    /// Deletes in the background, best effort and bounded; returns at once.
    fn delete_in_background(&self);

    /// Moves the end of a fixed lease to `lease` after the request is sent; see
    /// [`HeldLock::extend`]. Called only for [`Extension::Fixed`], with `lease` checked.
    ///
    /// # Cancel safety
    ///
    /// As [`HeldLock::extend`].
    ///
    /// # Errors
    ///
    /// As [`HeldLock::extend`].
    fn extend(&self, lease: Duration) -> impl Future<Output = Result<Instant, Error>> + Send {
        let _ = lease;
        std::future::ready(Err(Error::Unsupported {
            backend: self.backend(),
            operation: "extending a fixed lease",
        }))
    }
}

/// Where a release stands. Final states never change again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Release {
    /// Nothing was sent.
    Held = 0,
    /// A delete was sent (by a release, or in the background); its outcome is unknown.
    Sent = 1,
    /// A delete of ours removed the grant.
    Released = 2,
    /// The grant was gone before our delete, or the guard had lost it before.
    Lost = 3,
    /// The grant is gone; whether by our earlier delete cannot be told.
    Unconfirmed = 4,
}

impl Release {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Release::Held,
            1 => Release::Sent,
            2 => Release::Released,
            3 => Release::Lost,
            _ => Release::Unconfirmed,
        }
    }
}

/// A held grant: the one [`HeldLock`] of the backends. See the [module](self) docs.
pub struct Held<G: Grant> {
    grant: G,
    liveness: Liveness,
    state: AtomicU8,
}

impl<G: Grant> Held<G> {
    /// Wraps `grant`, whose guard's record is `liveness`.
    pub fn new(grant: G, liveness: Liveness) -> Self {
        Held {
            grant,
            liveness,
            state: AtomicU8::new(Release::Held as u8),
        }
    }

    /// The backend's grant.
    pub fn grant(&self) -> &G {
        &self.grant
    }

    fn state(&self) -> Release {
        Release::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Stops the grant's renewal and loss watch unless a release did already: every
    /// state but `Held` was reached by a release that stopped the grant first.
    fn stop(&self) {
        if self.state() == Release::Held {
            self.grant.stop();
        }
    }

    /// Moves from `Held` to `Sent`; returns the state before.
    fn send(&self) -> Release {
        match self.state.compare_exchange(
            Release::Held as u8,
            Release::Sent as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(before) | Err(before) => Release::from_u8(before),
        }
    }

    /// Moves from `Held` or `Sent` to the final state `to`, unless another release got
    /// there first; returns the final state.
    fn finish(&self, to: Release) -> Release {
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            match Release::from_u8(current) {
                Release::Held | Release::Sent => {}
                done => return done,
            }
            match self.state.compare_exchange(
                current,
                to as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return to,
                Err(now) => current = now,
            }
        }
    }

    /// What a release answers in the final state `state`.
    fn answer(&self, state: Release) -> Result<(), Error> {
        match state {
            Release::Released => Ok(()),
            Release::Lost => Err(Error::lost(
                self.grant.name(),
                self.liveness
                    .lost_reason()
                    .unwrap_or("the lock was already gone at release"),
            )),
            _ => Err(Error::unavailable(
                self.grant.backend(),
                "the release could not be confirmed: a delete of this grant sent earlier was \
                 not answered, and the grant is gone now (removed by that delete, or expired \
                 or deleted before it); the lock is free of this grant",
            )),
        }
    }
}

#[async_trait]
impl<G: Grant> HeldLock for Held<G> {
    #[tracing::instrument(name = "fencelock.release", level = "debug", skip_all, fields(backend = self.grant.backend(), lock = %self.grant.name()))]
    async fn release(&self) -> Result<(), Error> {
        self.stop();
        let previous = self.send();
        match previous {
            Release::Held | Release::Sent => {}
            done => return self.answer(done),
        }
        let repeated = previous == Release::Sent;
        let lost_before = self.liveness.is_lost();
        let to = match self.grant.delete().await? {
            Deleted::Now if !lost_before => Release::Released,
            Deleted::Now | Deleted::Unconfirmed if !lost_before => Release::Unconfirmed,
            Deleted::AlreadyGone if repeated && !lost_before => Release::Unconfirmed,
            _ => Release::Lost,
        };
        if to == Release::Lost {
            self.liveness.mark_lost(
                LossCause::KeyGone,
                "the lock was already gone at release (expired, deleted or taken over)",
            );
        }
        self.answer(self.finish(to))
    }

    fn release_in_background(&self) {
        self.stop();
        // A release called after this one may find the grant deleted by it.
        if self.send() != Release::Released {
            self.grant.delete_in_background();
        }
    }

    fn backend_key(&self) -> Option<&str> {
        self.grant.key()
    }

    fn can_extend(&self) -> Result<(), Error> {
        match self.grant.extension() {
            Extension::Fixed { .. } => Ok(()),
            Extension::Renewing => Err(Error::not_a_fixed_lease()),
            Extension::Unsupported => Err(Error::Unsupported {
                backend: self.grant.backend(),
                operation: "extending a fixed lease",
            }),
        }
    }

    fn check_extension(&self, lease: Duration) -> Result<(), Error> {
        self.can_extend()?;
        if let Extension::Fixed { min_lease } = self.grant.extension() {
            crate::validate_lease(lease, min_lease)?;
        }
        self.grant.check_lease(lease)
    }

    #[tracing::instrument(name = "fencelock.extend", level = "debug", skip_all, fields(backend = self.grant.backend(), lock = %self.grant.name()))]
    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        self.check_extension(lease)?;
        if self.state() != Release::Held {
            return Err(Error::lost(self.grant.name(), "the lock was released"));
        }
        self.grant.extend(lease).await
    }
}

impl<G: Grant> Drop for Held<G> {
    /// A grant dropped never released (its guard releases it first when there is one)
    /// stops renewing and watching.
    fn drop(&mut self) {
        if Release::from_u8(*self.state.get_mut()) == Release::Held {
            self.grant.stop();
        }
    }
}

impl<G: Grant> fmt::Debug for Held<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("grant", &self.grant)
            .field("state", &self.state())
            .finish()
    }
}

#[cfg(test)]
mod tests;
