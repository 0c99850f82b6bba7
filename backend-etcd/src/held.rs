//! A lock held in etcd: loss watch, release, background clean-up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, GetOptions, LeaseGrantOptions, PutOptions, Txn, TxnOp,
};
use fencelock_core::{Error, HeldLock, Liveness, LossCause};
use tokio::runtime::Handle;
use tokio::time::Instant;

use crate::error::{map, timed_out};
use crate::gate::{GatePermit, Reentry};
use crate::session::{FixedLeases, Session, Unkept, drift_margin};
use crate::watches::{Ended, KeyWatch, KeyWatches};

/// Deletes `key` if it is still the incarnation created at `revision` (etcd #22082: a
/// late delete must never remove a newer key). Returns whether it deleted it.
pub(crate) async fn delete_incarnation(
    client: &Client,
    key: &str,
    revision: i64,
) -> Result<bool, Error> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, revision)])
        .and_then([TxnOp::delete(key, None)]);
    Ok(client.kv_client().txn(txn).await.map_err(map)?.succeeded())
}

/// What is known of our key in etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyState {
    /// No create was sent (or etcd answered that it created nothing).
    Absent,
    /// A create was sent but its answer never came.
    Unknown,
    /// Created at this revision.
    Created(i64),
}

/// What must be undone if a grant is abandoned: our key (at a known revision, or of unknown
/// revision when the create's answer never came), a dedicated fixed lease, the gate turn.
pub(crate) struct Cleanup {
    pub(crate) client: Arc<Client>,
    pub(crate) batcher: Arc<crate::batch::Batcher>,
    pub(crate) runtime: Handle,
    pub(crate) timeout: Duration,
    /// Shared with the guard, its key watch and its gate turn: one copy per held lock.
    pub(crate) key: Arc<str>,
    /// What is known of our key.
    pub(crate) state: KeyState,
    /// The session lease the key is attached to, or `None` for a dedicated fixed lease.
    pub(crate) session: Option<Arc<Session>>,
    pub(crate) fixed_lease: Option<i64>,
    /// The new leases of extensions whose move onto them went unconfirmed: the key may be
    /// on one of them, so the clean-up also deletes the key (by incarnation) after
    /// revoking `fixed_lease`, and then revokes these leases too. The next extension that
    /// moves the key takes them over (and revokes them).
    pub(crate) moved_maybe: Vec<i64>,
    pub(crate) permit: Option<GatePermit>,
    /// A create that was sent and is still running in its own task: it is never
    /// abandoned, so the clean-up learns from its answer exactly which incarnation of our
    /// key exists (`Some(revision)`), or that none does (`None`). `Err` means etcd
    /// answered with an error whose outcome is unknown: then the key is deleted by name,
    /// and looked for a while longer in case etcd applies the create late.
    pub(crate) create: Option<InFlightCreate>,
}

/// A create sent in its own task; see [`Cleanup::create`].
pub(crate) type InFlightCreate = tokio::task::JoinHandle<Result<Option<i64>, ()>>;

impl std::fmt::Debug for Cleanup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cleanup")
            .field("key", &self.key)
            .field("state", &self.state)
            .field("fixed_lease", &self.fixed_lease)
            .finish_non_exhaustive()
    }
}

impl Cleanup {
    /// Undoes everything in the background and returns the gate turn only afterwards.
    ///
    /// Each attempt is bounded by the clean-up timeout, so nothing hangs on an unreachable
    /// server. A create still in flight is waited for that long; if it has not answered
    /// by then the key is deleted by name, and the create's answer is still awaited
    /// while the session lives (holding the gate turn, so this client's next acquire of
    /// the name waits for it) to delete the incarnation it made, which etcd may apply
    /// after the deletion. A create etcd answered with an error whose outcome is unknown
    /// (a timeout, a broken connection, a leader change: etcd may still apply it) has
    /// its key deleted by name, and then, for [`LATE_CREATE_WINDOW`], each incarnation of
    /// the key that appears on our session lease is deleted too (see
    /// [`sweep`](Self::sweep)); the gate turn is returned before that.
    /// A key on a dedicated fixed lease gets one attempt: its lease expires anyway, and a
    /// create applied after the lease was revoked fails.
    /// A key on the shared session lease would live as long as the session, so attempts
    /// continue (with backoff) until one succeeds or the session is lost; if deleting keeps
    /// failing for three lease periods while the session stays alive, the session is
    /// abandoned so that its lease, and the key with it, expires.
    pub(crate) fn spawn(mut self) {
        if self.is_empty() {
            return;
        }
        let permit = self.permit.take();
        let runtime = self.runtime.clone();
        runtime.spawn(async move {
            // A create etcd answered with an error may still be applied: its key is
            // looked for after the deletion by name. (`Unknown` without a create running:
            // the caller had the error.)
            let mut late = self.state == KeyState::Unknown && self.create.is_none();
            // A create still in flight would race a delete by name (etcd may apply it
            // after the delete): wait for its answer and delete exactly what it made.
            let mut create = self.create.take();
            if let Some(running) = create.as_mut() {
                match tokio::time::timeout(self.timeout, running).await {
                    Ok(Ok(Ok(Some(revision)))) => {
                        self.state = KeyState::Created(revision);
                        create = None;
                    }
                    Ok(Ok(Ok(None))) => {
                        self.state = KeyState::Absent;
                        create = None;
                    }
                    // An error, whose outcome is unknown: the key is deleted by name, and
                    // looked for afterwards.
                    Ok(_) => {
                        create = None;
                        late = true;
                    }
                    // Still running (a partition, or queued behind a slow create in the
                    // batcher's lane): deleted by name now, and by its answer later.
                    Err(_) => {}
                }
            }
            self.undo().await;
            if let Some(running) = create {
                // The create may be applied after the deletion by name, and its key would
                // then hold the name for as long as the session lives: its answer says
                // which incarnation to delete. Waited for while the session (the key's
                // lease) lives; a dedicated lease expires by itself.
                let answer = match &self.session {
                    Some(session) => tokio::select! {
                        answer = running => Some(answer),
                        () = session.lost() => None,
                    },
                    None => None,
                };
                match answer {
                    Some(Ok(Ok(Some(revision)))) => {
                        self.state = KeyState::Created(revision);
                        self.undo().await;
                    }
                    Some(Ok(Ok(None))) | None => {}
                    // Answered with an error at last: it may still be applied.
                    Some(_) => late = true,
                }
            }
            // Our acquires of the name may go on; the sweep enters the gate again only
            // to delete a key it finds.
            let reentry = permit.as_ref().map(GatePermit::reentry);
            drop(permit);
            if late {
                self.sweep(reentry).await;
            }
        });
    }

    /// After the deletion by name of a key whose create etcd answered with an error
    /// (it may still apply it): for [`LATE_CREATE_WINDOW`], reads the key now and then
    /// and deletes each incarnation of it on our session lease that appears, which would
    /// otherwise hold the name for as long as the session lives (more than one may: two
    /// clean-ups of the key, each with a create etcd may still apply, each sweep). A key of a dedicated
    /// lease needs none of this: the lease is revoked, and a create on it fails.
    ///
    /// `reentry` is the gate of a key this client's acquires of the name share: a key
    /// found while one of them has the turn is that one's (or one it deals with as a
    /// stale key of ours), and is left alone. Without a gate (a queue key, used once)
    /// every incarnation found is the late create's.
    async fn sweep(&mut self, reentry: Option<Reentry>) {
        // Held weakly: a client dropped meanwhile lets its session (and the key on its
        // lease) end, as it would without a sweep.
        let Some(session) = self.session.take().as_ref().map(Arc::downgrade) else {
            return;
        };
        // Done by the first clean-up (or left to expire): only the key is looked for.
        self.fixed_lease = None;
        self.moved_maybe.clear();
        let until = Instant::now() + LATE_CREATE_WINDOW;
        let mut pause = Duration::from_millis(250);
        loop {
            let now = Instant::now();
            let live = session.upgrade().filter(|s| !s.is_lost());
            if now >= until || live.is_none() {
                return;
            }
            drop(live);
            tokio::time::sleep(pause.min(until - now)).await;
            pause = (pause * 2).min(Duration::from_secs(2));
            let mut kv = self.client.kv_client();
            let options = GetOptions::new().with_keys_only();
            let read = tokio::time::timeout(self.timeout, kv.get(&*self.key, Some(options))).await;
            let Some(found) = read
                .ok()
                .and_then(Result::ok)
                .and_then(|read| read.kvs().first().cloned())
            else {
                continue;
            };
            let Some(live) = session.upgrade() else {
                return;
            };
            if found.lease() != live.lease_id() {
                continue;
            }
            let turn = match &reentry {
                Some(reentry) => match reentry.try_enter() {
                    Some(turn) => Some(turn),
                    // One of our acquires has the name: the key is its business.
                    None => continue,
                },
                None => None,
            };
            tracing::warn!(key = %self.key, revision = found.create_revision(), "etcd: a create applied after its error was answered left a key; deleting it");
            self.session = Some(live);
            self.state = KeyState::Created(found.create_revision());
            self.undo().await;
            self.state = KeyState::Absent;
            // Held weakly again while looking on.
            self.session = None;
            drop(turn);
            // Looked for until the window ends: this create's key may have been an
            // earlier clean-up's of the same key (each runs a sweep), deleted here; this
            // clean-up's own create may still land.
        }
    }

    /// Deletes (or revokes) until done. Each attempt is bounded by the clean-up timeout;
    /// see [`Cleanup::spawn`] for when it gives up.
    async fn undo(&self) {
        if self.is_empty() {
            return;
        }
        let give_up = self.session.as_ref().map(|s| Instant::now() + s.ttl() * 3);
        let mut backoff = Duration::from_millis(100);
        loop {
            let attempt = tokio::time::timeout(self.timeout, self.run()).await;
            let error = match attempt {
                Ok(Ok(())) => break,
                // A delete RBAC refuses would be refused forever; a key we may not
                // delete is one we could not have created.
                Ok(Err(error)) if crate::error::is_refused(&error) => break,
                Ok(Err(error)) => error,
                Err(_) => timed_out("a clean-up"),
            };
            let (Some(session), Some(give_up)) = (&self.session, give_up) else {
                tracing::warn!(key = %self.key, %error, "etcd clean-up failed; the key expires with its fixed lease");
                break;
            };
            if session.is_lost() {
                break;
            }
            if Instant::now() >= give_up {
                tracing::error!(key = %self.key, %error, "cannot delete a released key; abandoning the session so it expires");
                session.mark_lost(
                    LossCause::ClientClosed,
                    "a released key could not be deleted; the session was abandoned",
                );
                break;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Whether there is nothing to undo.
    fn is_empty(&self) -> bool {
        self.state == KeyState::Absent && self.fixed_lease.is_none() && self.moved_maybe.is_empty()
    }

    /// One attempt right away, bounded by `limit`. Returns whether everything is undone;
    /// the caller keeps the clean-up armed otherwise.
    async fn try_once(&self, limit: Duration) -> bool {
        self.is_empty() || matches!(tokio::time::timeout(limit, self.run()).await, Ok(Ok(())))
    }

    async fn run(&self) -> Result<(), Error> {
        if let Some(lease) = self.fixed_lease {
            // Revoking a dedicated lease deletes exactly the keys attached to it: ours.
            match self.client.lease_client().revoke(lease).await {
                Ok(_) => {}
                // Already expired: nothing left to delete.
                Err(etcd_client::Error::GRpcStatus(status))
                    if status.message().contains("not found") => {}
                Err(error) => return Err(map(error)),
            }
            if self.session.is_none() && self.moved_maybe.is_empty() {
                return Ok(());
            }
            // A queued key moving to its fixed lease: it may still be on the session lease.
        }
        match self.state {
            KeyState::Absent => {}
            KeyState::Created(revision) => {
                delete_incarnation(&self.client, &self.key, revision).await?;
            }
            // The create's answer was lost: no newer incarnation can exist while we hold
            // the gate turn, so deleting by key is exact.
            KeyState::Unknown => {
                self.client
                    .kv_client()
                    .delete(&*self.key, None)
                    .await
                    .map_err(map)?;
            }
        }
        for &lease in &self.moved_maybe {
            // The key is gone: the leases it may have been moved onto hold nothing now.
            match self.client.lease_client().revoke(lease).await {
                Ok(_) => {}
                Err(etcd_client::Error::GRpcStatus(status))
                    if status.message().contains("not found") => {}
                Err(error) => return Err(map(error)),
            }
        }
        Ok(())
    }
}

/// How long after a create that etcd answered with an error (a request timeout, a
/// broken connection, a leader change) its clean-up looks for the key that create may
/// still make. etcd gives up waiting for a proposal after its request timeout (5 s plus
/// twice the election timeout: 7 s by default), and an entry the old leader replicated
/// is committed within about an election after that.
pub(crate) const LATE_CREATE_WINDOW: Duration = Duration::from_secs(10);

/// How long past its wait timeout a waiter that gives up may spend deleting its key
/// before returning; the rest goes to the background.
pub(crate) const GIVE_UP_GRACE: Duration = Duration::from_millis(200);

/// A clean-up that stays armed until its work is confirmed done: dropping it (an error,
/// a timeout, a cancelled future at any await point) hands the clean-up to the background.
/// Everything that can leave a key or lease behind holds its [`Cleanup`] through this,
/// never as a bare local across an `.await`.
pub(crate) struct Armed(Option<Cleanup>);

impl Armed {
    pub(crate) fn new(cleanup: Cleanup) -> Self {
        Armed(Some(cleanup))
    }

    /// The clean-up, to record what was done so far.
    pub(crate) fn get(&mut self) -> &mut Cleanup {
        self.0
            .as_mut()
            .expect("an armed clean-up is present until disarmed")
    }

    /// Undoes everything now, for at most [`GIVE_UP_GRACE`]: a waiter that gives up
    /// deletes its key before returning (a healthy etcd answers in milliseconds), but
    /// its wait timeout is not stretched by a server that hangs. If that attempt fails
    /// (or this future is dropped first), the clean-up goes on in the background.
    pub(crate) async fn finish_now(mut self) {
        if let Some(cleanup) = &self.0 {
            if cleanup.try_once(GIVE_UP_GRACE.min(cleanup.timeout)).await {
                // Done: dropping it now returns the gate turn.
                self.0 = None;
            }
        }
    }

    /// The clean-up, no longer armed: its work is done or now owned elsewhere.
    pub(crate) fn disarm(mut self) -> Cleanup {
        self.0
            .take()
            .expect("an armed clean-up is present until disarmed")
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let Some(cleanup) = self.0.take() {
            cleanup.spawn();
        }
    }
}

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
            // The gate turn can go as soon as the key is known to be gone.
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use etcd_client::{Client, GetOptions, PutOptions};
    use tokio::runtime::Handle;
    use tokio::time::Instant;

    use super::{Cleanup, InFlightCreate, KeyState};
    use crate::batch::Batcher;
    use crate::gate::{GatePermit, Gates};
    use crate::session::Session;

    /// A client, its session, and a key of ours on the session lease.
    struct Setup {
        client: Arc<Client>,
        session: Arc<Session>,
        gates: Arc<Gates>,
        names: String,
        key: Arc<str>,
    }

    impl Setup {
        async fn new(test: &str) -> Self {
            let server = fencelock_testkit::EtcdServer::shared();
            let client = Arc::new(Client::connect([server.endpoint()], None).await.unwrap());
            let ttl = Duration::from_secs(10);
            let session = Session::grant(&client, ttl, &Handle::current(), true)
                .await
                .unwrap();
            let names = format!("held-unit-{test}-{:x}/x/", std::process::id());
            let key = crate::keys::own_key(&names, session.lease_id()).into();
            Setup {
                client,
                session,
                gates: Arc::default(),
                names,
                key,
            }
        }

        fn turn(&self) -> Option<GatePermit> {
            self.gates.try_enter(&self.key, &self.names)
        }

        /// The clean-up of an acquire whose create etcd answered with an error.
        fn cleanup(&self, permit: GatePermit, create: Option<InFlightCreate>) -> Cleanup {
            Cleanup {
                client: self.client.clone(),
                batcher: Arc::new(Batcher::new(self.client.clone(), Handle::current())),
                runtime: Handle::current(),
                timeout: Duration::from_secs(1),
                key: self.key.clone(),
                state: KeyState::Unknown,
                session: Some(self.session.clone()),
                fixed_lease: None,
                moved_maybe: Vec::new(),
                permit: Some(permit),
                create,
            }
        }

        /// What a create etcd applies late does: our key, on our session lease.
        async fn put_key(&self) {
            let options = PutOptions::new().with_lease(self.session.lease_id());
            self.client
                .kv_client()
                .put(&*self.key, "", Some(options))
                .await
                .unwrap();
        }

        async fn exists(&self) -> bool {
            let options = GetOptions::new().with_count_only();
            let read = self.client.kv_client().get(&*self.key, Some(options)).await;
            read.unwrap().count() > 0
        }

        async fn gone_within(&self, limit: Duration) -> bool {
            let deadline = Instant::now() + limit;
            while self.exists().await {
                if Instant::now() >= deadline {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            true
        }
    }

    /// A create answered with an error after 300 ms (a timeout: etcd may still apply
    /// it) and applied at 500 ms, after its clean-up deleted the key by name: the key
    /// is deleted too. It used to stay on the session lease, first under the name, for
    /// as long as the client lived.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_create_applied_after_its_error_leaves_no_key() {
        let setup = Setup::new("late").await;
        let create = tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Err(())
        });
        setup.cleanup(setup.turn().unwrap(), Some(create)).spawn();
        tokio::time::sleep(Duration::from_millis(500)).await;
        setup.put_key().await;
        assert!(
            setup.gone_within(Duration::from_secs(3)).await,
            "the late create's key was left"
        );
    }

    /// The same when the caller had the error (no create running any more); and a key
    /// found while one of this client's acquires of the name has the gate turn is that
    /// acquire's, left alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_key_is_left_to_an_acquire_that_has_the_name() {
        let setup = Setup::new("turn").await;
        setup.cleanup(setup.turn().unwrap(), None).spawn();
        // The clean-up deletes by name, then gives the turn back: an acquire takes it.
        let deadline = Instant::now() + Duration::from_secs(2);
        let turn = loop {
            if let Some(turn) = setup.turn() {
                break turn;
            }
            assert!(Instant::now() < deadline, "the turn was never given back");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        setup.put_key().await;
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        assert!(
            setup.exists().await,
            "the key of an acquire that had the turn was deleted"
        );
        drop(turn);
        assert!(
            setup.gone_within(Duration::from_secs(3)).await,
            "the late create's key was left"
        );
    }

    /// Two late creates of the key (two clean-ups of it, each with a create whose outcome
    /// is unknown) landing at different times within the window: both keys are deleted.
    /// The sweep used to stop after its first deletion, leaving the second key on the
    /// session lease for as long as the client lived.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn late_creates_landing_one_after_another_leave_no_key() {
        let setup = Setup::new("twice").await;
        setup.cleanup(setup.turn().unwrap(), None).spawn();
        tokio::time::sleep(Duration::from_millis(400)).await;
        setup.put_key().await;
        assert!(
            setup.gone_within(Duration::from_secs(2)).await,
            "the first late create's key was left"
        );
        setup.put_key().await;
        assert!(
            setup.gone_within(Duration::from_secs(3)).await,
            "the second late create's key was left"
        );
    }
}
