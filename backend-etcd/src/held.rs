//! A lock held in etcd: loss watch, release, extension of a fixed lease.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, GetOptions, LeaseGrantOptions, PutOptions, Txn, TxnOp,
};
use fencelock_core::{Error, HeldLock, Liveness, LossCause};
use tokio::time::Instant;

use crate::cleanup::{Armed, Cleanup, KeyState};
use crate::error::{map, timed_out};
use crate::session::{FixedLeases, Session, Unkept, drift_margin};
use crate::watches::{Ended, KeyWatch, KeyWatches};

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
        self.check_extension(lease)?;
        let (Some(fixed), Some(turns)) = (self.fixed.clone(), self.extending.clone()) else {
            return Err(Error::not_a_fixed_lease());
        };
        let seconds = crate::config::lease_seconds(lease)?;
        // Waited for before anything is read or sent: a call dropped here did nothing.
        let turn = turns.lock_owned().await;
        let (client, runtime, timeout, old, maybe) = {
            let cleanup = self
                .shared
                .cleanup
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match cleanup.as_ref().and_then(|c| c.fixed_lease.map(|l| (c, l))) {
                Some((c, old)) => (
                    c.client.clone(),
                    c.runtime.clone(),
                    c.timeout,
                    old,
                    c.moved_maybe.clone(),
                ),
                None => return Err(Error::lost(&self.name, "the lock was already given up")),
            }
        };
        let shared = self.shared.clone();
        let (key, revision) = (shared.key.clone(), shared.revision);
        let home = runtime.clone();
        let work = async move {
            // This guard's next extend starts when this one is done.
            let _turn = turn;
            let sent = Instant::now();
            // The conservative end of the new lease, anchored before its grant is sent.
            let end = sent + lease - drift_margin(lease);
            // The new lease's ID is chosen before the request: a grant that times out
            // after etcd applied it, or any exit below that does not keep the lease, has
            // it revoked in the background (with retries), instead of a keyless lease
            // living out its TTL (up to a year) unseen.
            let mut unkept = Unkept::new(&client, &home);
            let options = LeaseGrantOptions::new().with_id(unkept.id());
            let granted = match tokio::time::timeout(
                timeout,
                client.lease_client().grant(seconds, Some(options)),
            )
            .await
            {
                Err(_) => return Err(timed_out("granting the extended lease")),
                Ok(Err(error)) => {
                    if crate::error::is_lease_exists(&error) {
                        // Someone else's lease has this ID: never revoke it.
                        unkept.keep();
                    }
                    return Err(map(error));
                }
                Ok(Ok(granted)) => granted,
            };
            let new = granted.id();
            let revoke = |lease: i64| {
                let client = client.clone();
                tokio::spawn(async move { client.lease_client().revoke(lease).await })
            };
            if granted.ttl() != seconds {
                return Err(Error::InvalidConfig(format!(
                    "etcd granted a {} s lease when {seconds} s was asked; the server's minimum TTL is higher",
                    granted.ttl()
                )));
            }
            // The key is on `old`, or on one of the leases earlier extends moved it onto
            // without confirmation (`maybe`): moved from `old` first, and from the lease a
            // read finds it on if that is one of those.
            let mut from = old;
            let mut tries = maybe.len() + 1;
            let moved = loop {
                let txn = Txn::new()
                    .when([
                        Compare::create_revision(&*key, CompareOp::Equal, revision),
                        Compare::lease(&*key, CompareOp::Equal, from),
                    ])
                    .and_then([TxnOp::put(
                        &*key,
                        "",
                        Some(PutOptions::new().with_lease(new).with_ignore_value()),
                    )]);
                let answer = tokio::time::timeout(timeout, client.kv_client().txn(txn)).await;
                // `None`: etcd refused the move (our incarnation is not on `from`).
                // `unknown`: etcd may still apply it (a timeout, a broken connection),
                // whatever a read finds now.
                let (error, unknown) = match answer {
                    Ok(Ok(response)) if response.succeeded() => break true,
                    Ok(Ok(_)) => (None, false),
                    Ok(Err(error)) => {
                        let unknown = crate::error::outcome_unknown(&error);
                        (Some(map(error)), unknown)
                    }
                    Err(_) => (
                        Some(timed_out("moving the key onto the extended lease")),
                        true,
                    ),
                };
                if let Some(error) = &error {
                    tracing::debug!(%key, %error, unknown, "etcd extend: the move was not confirmed");
                }
                // Which lease is our incarnation on now (`None`: gone or replaced)?
                let mut kv = client.kv_client();
                let read = tokio::time::timeout(
                    timeout,
                    kv.get(&*key, Some(GetOptions::new().with_keys_only())),
                )
                .await;
                let on = match (read, error) {
                    (Ok(Ok(read)), error) => (
                        read.kvs()
                            .first()
                            .filter(|kv| kv.create_revision() == revision)
                            .map(|kv| kv.lease()),
                        error,
                    ),
                    // Refused, and where the key is now is unknown: not a loss.
                    (_, None) => return Err(not_confirmed()),
                    (_, Some(error)) => {
                        // Still unknown: the key may live on `new`.
                        if unknown {
                            keep_unconfirmed(&shared, &mut unkept, new, end);
                        }
                        return Err(error);
                    }
                };
                tries -= 1;
                match on {
                    (Some(lease), _) if lease == new => break true,
                    // Not moved yet, but etcd may still apply the move (its request may
                    // be on its way, or in etcd's log): the key may come to live on
                    // `new`, which is kept, and the deadline comes down to its end.
                    (Some(lease), Some(error)) if lease == from && unknown => {
                        keep_unconfirmed(&shared, &mut unkept, new, end);
                        return Err(error);
                    }
                    // Not moved, and never will be: the guard keeps its lease and
                    // deadline; `new` is revoked.
                    (Some(lease), Some(error)) if lease == from => return Err(error),
                    (Some(lease), None) if lease == from => return Err(not_confirmed()),
                    // An earlier extend's unconfirmed move did land: move it from there.
                    (Some(lease), _) if maybe.contains(&lease) => {
                        if tries == 0 {
                            return Err(not_confirmed());
                        }
                        from = lease;
                    }
                    // Gone, replaced, or on a lease no extend of ours put it on (whose
                    // end we cannot know).
                    _ => break false,
                }
            };
            if !moved {
                // Marked here, not by the caller: a dropped extend reports it too. Unless
                // the holder released meanwhile (which deleted the key): no loss then.
                let reason = "the key was gone (or no longer ours) when extending its lease";
                if !shared.releasing.load(Ordering::SeqCst) {
                    shared.liveness.mark_lost(LossCause::KeyGone, reason);
                }
                return Err(Error::lost(&*key, reason));
            }
            // The key lives on `new` now. A release that took the clean-up meanwhile
            // revokes `old` only, and a closed client registers nothing: revoke `new` too.
            let kept = {
                let mut cleanup = shared
                    .cleanup
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                match cleanup.as_mut() {
                    Some(c) if c.fixed_lease == Some(old) && fixed.replace(old, new) => {
                        c.fixed_lease = Some(new);
                        // No earlier unconfirmed move holds the key any more.
                        c.moved_maybe.retain(|lease| !maybe.contains(lease));
                        true
                    }
                    _ => false,
                }
            };
            if !kept {
                // A release took the clean-up: the holder gave the lock up, nothing was
                // lost. A close did: the lock goes with the client, which is a loss.
                let reason = "the lock was released or closed while extending";
                if !shared.releasing.load(Ordering::SeqCst) {
                    shared.liveness.mark_lost(LossCause::KeyGone, reason);
                }
                return Err(Error::lost(&*key, reason));
            }
            unkept.keep();
            // Set here, not by the caller: an extend whose future was dropped still
            // moved the key, and the deadline follows the new lease even when it ends
            // earlier than the old one did (by up to one drift margin).
            shared.liveness.confirm_extension(end);
            for lease in std::iter::once(old).chain(maybe) {
                revoke(lease);
            }
            Ok(end)
        };
        match runtime.spawn(work).await {
            // The task marked the guard lost.
            Ok(Err(Error::Lost { reason, .. })) => Err(Error::lost(&self.name, reason)),
            Ok(outcome) => outcome,
            Err(_) => Err(Error::unavailable(
                crate::error::BACKEND,
                "the extend task failed",
            )),
        }
    }
}

/// Keeps `new`, onto which a move of the key was sent whose outcome is unknown: the key
/// may live on it (now, or once etcd applies the move), and only this extend knows it.
/// The clean-up (release, drop, loss) then deletes the key itself, not only by revoking
/// the fixed lease, and revokes `new`; so does the next extend that moves the key. With
/// the clean-up already taken (a release or a loss meanwhile) `new` is revoked at once:
/// that deletes the key if the move lands first, and makes the move fail after it.
///
/// The key is on the lease it was on or on `new`, whichever etcd applied: the guard's
/// deadline comes down to `end`, the conservative end of `new`, when that is earlier
/// than the one it has (a shorter lease, or one whose conservative end lies within the
/// drift margin before the old deadline), and otherwise stays.
fn keep_unconfirmed(shared: &Shared, unkept: &mut Unkept, new: i64, end: Instant) {
    // Only extends move a fixed lease's deadline, and they take turns (this one has
    // it): nothing raises the deadline between the read and the write.
    if end < shared.liveness.valid_until() {
        shared.liveness.confirm_extension(end);
    }
    if let Some(c) = shared
        .cleanup
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_mut()
    {
        c.moved_maybe.push(new);
        unkept.keep();
    }
}

/// An extend that could not learn whether it moved the key, while the key is still ours:
/// not a loss; the guard keeps the deadline it had (lowered first if the key may be on a
/// lease that ends earlier, see [`keep_unconfirmed`]).
fn not_confirmed() -> Error {
    Error::unavailable(
        crate::error::BACKEND,
        "etcd did not confirm the extension; the lock is still held until its current deadline",
    )
}

/// Watches a held guard's key until the guard ends, and gives the key up if the guard
/// is lost first.
///
/// - A deletion by anyone but our own release (an operator, lease expiry) marks the
///   guard lost. The watch runs on the client's shared stream from the grant's revision,
///   so nothing since the grant is missed; if etcd compacted that history, the key is
///   read instead and watched again from the read's revision.
/// - Once the guard is lost (key deleted, session lost, deadline passed), its key is
///   deleted in the background right away, so the lock does not stay blocked by a key
///   nobody uses, and the client's turn for the name is passed on.
///
/// A guard with a fixed lease is watched with a timer. A guard on the session lease is
/// marked lost by the session at their shared deadline, so it needs no timer: with
/// 100,000 held locks, that saves as many timers.
///
/// One flat future (every held lock keeps one): the futures it waits on are made in
/// place each round, not nested and moved, which kept several copies of their state.
async fn watch_held(shared: Arc<Shared>, watches: Arc<KeyWatches>, client: Arc<Client>) {
    let mut watch = Some(watches.watch(shared.key.clone(), shared.revision + 1));
    loop {
        let ended = tokio::select! {
            biased;
            () = shared.liveness.ended() => return,
            () = lost(&shared) => break,
            ended = ended_of(&mut watch) => ended,
        };
        watch = None;
        let reason = "the lock's key was deleted (lease expired or removed by someone else)";
        match ended {
            Ended::Deleted => {
                if !shared.releasing.load(Ordering::SeqCst) {
                    shared.liveness.mark_lost(LossCause::KeyGone, reason);
                }
            }
            Ended::Refused(refusal) => {
                tracing::warn!(key = %shared.key, reason = %refusal, "etcd refused to watch a held lock's key; its loss is found by its deadline only");
            }
            Ended::Compacted(_) => {
                // Boxed: the read's future is large, and every held lock's watch would
                // carry its room otherwise.
                let read = tokio::select! {
                    biased;
                    () = shared.liveness.ended() => return,
                    () = lost(&shared) => break,
                    read = Box::pin(read_incarnation(&client, &shared.key, shared.revision)) => read,
                };
                match read {
                    Some(now) => watch = Some(watches.watch(shared.key.clone(), now + 1)),
                    None if !shared.releasing.load(Ordering::SeqCst) => {
                        shared.liveness.mark_lost(LossCause::KeyGone, reason);
                    }
                    None => {}
                }
            }
        }
    }
    if shared.liveness.is_ended() {
        return;
    }
    if let Some(cleanup) = shared.take_cleanup() {
        cleanup.spawn();
    }
}

/// Completes when the guard is lost: at its own deadline for a fixed lease, when marked
/// lost otherwise.
async fn lost(shared: &Shared) {
    if shared.timed {
        // Boxed: a timer is large, and only fixed-lease guards carry one.
        Box::pin(shared.liveness.lost()).await;
    } else {
        shared.liveness.marked_lost().await;
    }
}

/// How the key watch ended; pending once there is none (the loss or the end of the
/// guard is awaited then).
async fn ended_of(watch: &mut Option<KeyWatch>) -> Ended {
    match watch {
        Some(watch) => watch.ended().await,
        None => std::future::pending().await,
    }
}

/// Reads `key` until etcd answers: the revision of the answer if the key is still the
/// incarnation created at `revision`, `None` if it is gone or replaced.
async fn read_incarnation(client: &Client, key: &str, revision: i64) -> Option<i64> {
    loop {
        let read = client
            .kv_client()
            .get(key, Some(GetOptions::new().with_keys_only()))
            .await;
        match read {
            Ok(read) if read.kvs().first().map(|kv| kv.create_revision()) == Some(revision) => {
                return read.header().map(|h| h.revision());
            }
            Ok(_) => return None,
            Err(error) => {
                tracing::debug!(%key, %error, "etcd: reading a held lock's key after a compaction failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
