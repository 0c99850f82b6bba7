//! A lock held in etcd: the [`Grant`] of the kit's [`Held`](fencelock_core::kit::Held),
//! which keeps the release state machine; the key watch in [`watch`], the extension of a
//! fixed lease in [`extend`].

mod extend;
mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fencelock_core::kit::delayed::Work;
use fencelock_core::kit::{Deleted, Extension, Grant};
use fencelock_core::{Error, Liveness};
use tokio::time::Instant;

use crate::cleanup::{Armed, Cleanup, KeyState};
use crate::error::{BACKEND, timed_out};
use crate::leases::FixedLeases;
use crate::session::Session;
use watch::watch_held;

/// The backend side of an etcd guard: what only etcd knows of one held grant.
#[derive(Debug)]
pub(crate) struct EtcdGrant {
    /// Shared with the guard.
    name: Arc<str>,
    /// What the guard shares with its key watch.
    shared: Arc<Shared>,
    session: Arc<Session>,
    registration: Option<u64>,
    /// The client's registry of fixed leases, when this grant is on one (and so may be
    /// extended).
    fixed: Option<Arc<FixedLeases>>,
    /// Extends take turns (a fixed lease only): each moves the key from the lease the
    /// one before it left it on, also when the one before was dropped and goes on in its
    /// own task.
    extending: Option<Arc<tokio::sync::Mutex<()>>>,
    /// The clean-up went to the background (a release that could not confirm its
    /// delete, or a drop): a later release is told its delete goes on there, not that
    /// the lock was lost.
    handed_off: AtomicBool,
}

/// A held guard's state that its key watch shares: one allocation per held lock.
#[derive(Debug)]
struct Shared {
    key: Arc<str>,
    /// The create revision of our key (the token).
    revision: i64,
    liveness: Liveness,
    /// Set before our own release deletes the key: that deletion is not a loss.
    releasing: AtomicBool,
    /// Taken by whoever gives the key up first: the release, or the watch after a loss.
    cleanup: Mutex<Option<Cleanup>>,
    /// The guard has a deadline of its own (a fixed lease), watched with a timer.
    timed: bool,
}

impl Shared {
    fn take_cleanup(&self) -> Option<Cleanup> {
        self.cleanup
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl EtcdGrant {
    /// Wraps a fresh grant (`fixed`: on its own fixed lease, which may be extended) of
    /// `client` and starts watching its key for deletion by anyone else.
    pub(crate) fn start(
        name: Arc<str>,
        session: Arc<Session>,
        registration: Option<u64>,
        fixed: bool,
        liveness: Liveness,
        cleanup: Cleanup,
        client: &crate::lock::Inner,
    ) -> Self {
        let fixed = fixed.then(|| client.fixed.clone());
        let revision = match cleanup.state {
            KeyState::Created(revision) => revision,
            _ => 0,
        };
        let etcd = cleanup.client.clone();
        let shared = Arc::new(Shared {
            key: cleanup.key.clone(),
            revision,
            liveness,
            releasing: AtomicBool::new(false),
            cleanup: Mutex::new(Some(cleanup)),
            timed: fixed.is_some(),
        });
        // Short critical sections (most of them) end before this would start, and then
        // cost no watch at all.
        let work = {
            let (shared, watches) = (shared.clone(), client.watches.clone());
            move || -> Work { Box::pin(watch_held(shared, watches, etcd)) }
        };
        client.delayed.schedule(shared.liveness.clone(), work);
        EtcdGrant {
            name,
            shared,
            session,
            registration,
            extending: fixed.is_some().then(Arc::default),
            fixed,
            handed_off: AtomicBool::new(false),
        }
    }
}

impl Grant for EtcdGrant {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn key(&self) -> Option<&str> {
        Some(&self.shared.key)
    }

    fn extension(&self) -> Extension {
        match self.fixed {
            Some(_) => Extension::Fixed {
                min_lease: crate::config::MIN_LEASE,
            },
            None => Extension::Renewing,
        }
    }

    /// etcd leases are whole seconds.
    fn check_lease(&self, lease: Duration) -> Result<(), Error> {
        crate::config::lease_seconds(lease).map(drop)
    }

    /// From here a deletion of the key is our own (the watch does not call it a loss),
    /// and a renewing guard leaves its session.
    fn stop(&self) {
        self.shared.releasing.store(true, Ordering::SeqCst);
        if let Some(id) = self.registration {
            self.session.unregister(id);
        }
    }

    /// Deletes exactly our incarnation of the key, bounded by the clean-up timeout,
    /// taking the clean-up (which travels with the line's front): confirmed, the line's
    /// front goes and the fixed lease (and any an unconfirmed extend moved the key onto)
    /// is revoked in the background; unknown, the clean-up goes on in the background and
    /// a retried release is told so.
    async fn delete(&self) -> Result<Deleted, Error> {
        let Some(cleanup) = self.shared.take_cleanup() else {
            if self.handed_off.load(Ordering::SeqCst) {
                return Err(Error::unavailable(
                    BACKEND,
                    "an earlier release could not be confirmed; its delete goes on in the background",
                ));
            }
            // The key watch gave the key up after a loss.
            return Ok(Deleted::AlreadyGone);
        };
        // Armed until the delete is confirmed: a release future dropped at the await
        // below leaves the delete to the background instead of the key to the session,
        // and a retried release is told so (not "lost").
        self.handed_off.store(true, Ordering::SeqCst);
        let mut armed = Armed::new(cleanup);
        let attempt = {
            let cleanup = &*armed;
            tokio::time::timeout(
                cleanup.timeout,
                cleanup
                    .batcher
                    .delete_incarnation(&cleanup.key, self.shared.revision),
            )
            .await
        };
        match attempt {
            Ok(Ok(true)) => {
                let cleanup = &mut *armed;
                let maybe = std::mem::take(&mut cleanup.moved_maybe);
                for lease in cleanup.fixed_lease.take().into_iter().chain(maybe) {
                    let client = cleanup.client.clone();
                    cleanup
                        .runtime
                        .spawn(async move { client.lease_client().revoke(lease).await });
                }
                // The line's front can go as soon as the key is known to be gone.
                drop(armed.disarm());
                Ok(Deleted::Now)
            }
            Ok(Ok(false)) => {
                // Gone already; only a dedicated lease may be left to revoke.
                self.handed_off.store(false, Ordering::SeqCst);
                armed.state = KeyState::Absent;
                Ok(Deleted::AlreadyGone)
            }
            // Unknown: dropping `armed` keeps trying in the background before anyone
            // reuses the key.
            Ok(Err(error)) => Err(error),
            Err(_) => Err(timed_out("the release")),
        }
    }

    fn delete_in_background(&self) {
        if let Some(cleanup) = self.shared.take_cleanup() {
            // A release called after this one is told its delete went to the background.
            self.handed_off.store(true, Ordering::SeqCst);
            cleanup.spawn();
        }
    }

    /// An etcd lease's TTL cannot be changed, so the key moves onto a fresh lease of the
    /// new length (a put that keeps the create revision, so the token stays, checked
    /// against our incarnation and the lease it is on) and the old lease is revoked. The
    /// work runs in its own task. Extends of one guard take turns (a dropped call's task
    /// keeps its turn until it is done), so each moves the key from the lease the one
    /// before left it on.
    ///
    /// The guard's deadline is set by that task, not by the caller: once the move is
    /// confirmed, to the new lease's conservative end (the instant before its grant was
    /// sent, plus the lease, minus the drift margin), even when that is earlier than the
    /// deadline it had. A move whose outcome stays unknown leaves the key on the old
    /// lease or the new one: the deadline comes down to the new lease's conservative end
    /// if that is earlier, and otherwise stays. A key the task finds gone, or on a lease
    /// none of ours, marks the guard lost.
    ///
    /// # Cancel safety
    ///
    /// A call dropped before its turn came sent nothing. A call dropped after that
    /// leaves either the old lease or the new one, never both, and its task still does
    /// all of the above: the guard's deadline follows the lease the key is on (or may be
    /// on), also when nobody awaits the answer, and a loss the task finds is reported.
    ///
    /// # Errors
    ///
    /// As [`HeldLock::extend`](fencelock_core::HeldLock::extend): [`Error::Lost`] when
    /// the key is gone or no longer ours, [`Error::Unavailable`] when etcd did not
    /// confirm the move (the lock is still held until its current deadline), backend
    /// errors otherwise.
    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        self.move_to_new_lease(lease).await
    }
}
