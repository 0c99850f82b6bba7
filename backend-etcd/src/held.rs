//! A lock held in etcd: the guard's state and its release; its key watch in
//! [`watch`], the extension of a fixed lease in [`extend`].

mod extend;
mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use fencelock_core::{Error, HeldLock, Liveness, LossCause};
use tokio::time::Instant;

use crate::cleanup::{Armed, Cleanup, KeyState};
use crate::error::timed_out;
use crate::leases::FixedLeases;
use crate::session::Session;
use watch::watch_held;

/// The backend side of an etcd guard.
#[derive(Debug)]
pub(crate) struct EtcdHeld {
    name: String,
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
    released: AtomicBool,
    /// An earlier `release()` could not confirm the delete and left it to the
    /// background: a retried release must not call that a loss.
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

impl EtcdHeld {
    /// Wraps a fresh grant (`fixed`: on its own fixed lease, which may be extended) of
    /// `client` and starts watching its key for deletion by anyone else.
    pub(crate) fn start(
        name: &str,
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
            move || -> crate::delayed::Work { Box::pin(watch_held(shared, watches, etcd)) }
        };
        client.delayed.schedule(shared.liveness.clone(), work);
        EtcdHeld {
            name: name.to_owned(),
            shared,
            session,
            registration,
            extending: fixed.is_some().then(Arc::default),
            fixed,
            released: AtomicBool::new(false),
            handed_off: AtomicBool::new(false),
        }
    }

    fn stop(&self) -> Option<Cleanup> {
        self.shared.releasing.store(true, Ordering::SeqCst);
        if let Some(id) = self.registration {
            self.session.unregister(id);
        }
        self.shared.take_cleanup()
    }
}

#[async_trait]
impl HeldLock for EtcdHeld {
    #[tracing::instrument(name = "fencelock.etcd.release", level = "debug", skip_all, fields(lock = %self.name))]
    async fn release(&self) -> Result<(), Error> {
        if self.released.load(Ordering::SeqCst) {
            return Ok(());
        }
        let Some(cleanup) = self.stop() else {
            if self.handed_off.load(Ordering::SeqCst) {
                return Err(Error::unavailable(
                    crate::error::BACKEND,
                    "an earlier release could not be confirmed; its delete goes on in the background",
                ));
            }
            return Err(Error::lost(&self.name, "the lock was already given up"));
        };
        // Armed until the delete is confirmed: a release future dropped at the await
        // below leaves the delete to the background instead of the key to the session,
        // and a retried release is told so (not "lost").
        self.handed_off.store(true, Ordering::SeqCst);
        let mut armed = Armed::new(cleanup);
        let attempt = {
            let cleanup = armed.get();
            tokio::time::timeout(
                cleanup.timeout,
                cleanup
                    .batcher
                    .delete_incarnation(&cleanup.key, self.shared.revision),
            )
            .await
        };
        let outcome = match attempt {
            Ok(Ok(true)) => {
                self.released.store(true, Ordering::SeqCst);
                let cleanup = armed.get();
                let maybe = std::mem::take(&mut cleanup.moved_maybe);
                for lease in cleanup.fixed_lease.take().into_iter().chain(maybe) {
                    let client = cleanup.client.clone();
                    cleanup
                        .runtime
                        .spawn(async move { client.lease_client().revoke(lease).await });
                }
                Ok(())
            }
            Ok(Ok(false)) => {
                self.shared
                    .liveness
                    .mark_lost(LossCause::KeyGone, "the key was gone at release");
                Err(Error::lost(
                    &self.name,
                    "the key was gone at release (expired or deleted)",
                ))
            }
            Ok(Err(error)) => Err(error),
            Err(_) => Err(timed_out("the release")),
        };
        match outcome {
            // The line's front can go as soon as the key is known to be gone.
            Ok(()) => drop(armed.disarm()),
            // Gone already; only a dedicated lease may be left to revoke.
            Err(Error::Lost { .. }) => {
                self.handed_off.store(false, Ordering::SeqCst);
                armed.get().state = KeyState::Absent;
            }
            // Unknown: keep trying in the background before anyone reuses the key.
            Err(_) => drop(armed),
        }
        outcome
    }

    fn release_in_background(&self) {
        if let Some(cleanup) = self.stop() {
            // A release called after this one is told its delete went to the background.
            self.handed_off.store(true, Ordering::SeqCst);
            cleanup.spawn();
        }
    }

    fn backend_key(&self) -> Option<&str> {
        Some(&self.shared.key)
    }

    fn can_extend(&self) -> Result<(), Error> {
        match self.fixed {
            Some(_) => Ok(()),
            None => Err(Error::not_a_fixed_lease()),
        }
    }

    fn check_extension(&self, lease: Duration) -> Result<(), Error> {
        self.can_extend()?;
        fencelock_core::validate_lease(lease, crate::config::MIN_LEASE)?;
        crate::config::lease_seconds(lease).map(drop)
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
    #[tracing::instrument(name = "fencelock.etcd.extend", level = "debug", skip_all, fields(lock = %self.name))]
    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        self.move_to_new_lease(lease).await
    }
}
