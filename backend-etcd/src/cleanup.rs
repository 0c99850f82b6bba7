//! Undoing an abandoned grant: [`Cleanup`] records what an acquire did so far (our key,
//! a dedicated lease, the front of this client's line for the key), and [`Armed`] hands it to the background
//! when the acquire is dropped, fails or gives up. The release and a loss of a held lock
//! end with the same clean-up.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use fencelock_core::kit::{Abandon, Undo};
use fencelock_core::line::{Front, Lines};
use fencelock_core::{Error, LossCause};
use tokio::runtime::Handle;
use tokio::time::Instant;

use crate::batch::Batcher;
use crate::error::{map, timed_out};
use crate::session::Session;
use crate::txn::delete_incarnation;

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
/// revision when the create's answer never came), a dedicated fixed lease, the front of this client's
/// line for the key.
pub(crate) struct Cleanup {
    pub(crate) client: Arc<Client>,
    pub(crate) batcher: Arc<Batcher>,
    pub(crate) runtime: Handle,
    pub(crate) timeout: Duration,
    /// Shared with the guard and its key watch: one copy per held lock.
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
    /// The front of this client's line for the key (see [`Inner::lines`]): tasks of one
    /// client contending for one name would share the key, so they queue in the client
    /// and only the front puts a key in etcd. It travels with the guard and is given up
    /// only after the key is deleted, so a new incarnation of the key can never be
    /// confused with one whose deletion is still in flight.
    ///
    /// [`Inner::lines`]: crate::lock::Inner::lines
    pub(crate) permit: Option<Front>,
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
    /// Undoes everything in the background and gives the line's front up only afterwards.
    ///
    /// Each attempt is bounded by the clean-up timeout, so nothing hangs on an unreachable
    /// server. A create still in flight is waited for that long; if it has not answered
    /// by then the key is deleted by name, and the create's answer is still awaited
    /// while the session lives (holding the line's front, so this client's next acquire of
    /// the name waits for it) to delete the incarnation it made, which etcd may apply
    /// after the deletion. A create etcd answered with an error whose outcome is unknown
    /// (a timeout, a broken connection, a leader change: etcd may still apply it) has
    /// its key deleted by name, and then, for [`LATE_CREATE_WINDOW`], each incarnation of
    /// the key that appears on our session lease is deleted too (see
    /// [`sweep`](Self::sweep)); the line's front is given up before that.
    /// A key on a dedicated fixed lease gets one attempt: its lease expires anyway, and a
    /// create applied after the lease was revoked fails.
    /// A key on the shared session lease would live as long as the session, so attempts
    /// continue (with backoff) until one succeeds or the session is lost; if deleting keeps
    /// failing for three lease periods while the session stays alive, the session is
    /// abandoned so that its lease, and the key with it, expires.
    pub(crate) fn spawn(self) {
        let runtime = self.runtime.clone();
        if let Some(undo) = self.abandon() {
            runtime.spawn(undo);
        }
    }

    /// After the deletion by name of a key whose create etcd answered with an error
    /// (it may still apply it): for [`LATE_CREATE_WINDOW`], reads the key now and then
    /// and deletes each incarnation of it on our session lease that appears, which would
    /// otherwise hold the name for as long as the session lives (more than one may: two
    /// clean-ups of the key, each with a create etcd may still apply, each sweep). A key of a dedicated
    /// lease needs none of this: the lease is revoked, and a create on it fails.
    ///
    /// `reentry` holds the line of a key this client's acquires of the name share: a key
    /// found while one of them has its front is that one's (or one it deals with as a
    /// stale key of ours), and is left alone. Without a line (a queue key, used once)
    /// every incarnation found is the late create's.
    async fn sweep(&mut self, reentry: Option<Arc<Lines>>) {
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
                Some(lines) => match lines.try_front(&self.key) {
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
            // the line's front, so deleting by key is exact.
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
/// a timeout, a cancelled future at any await point) hands the clean-up to the background
/// (the kit's [`Undo`]). Everything that can leave a key or lease behind holds its
/// [`Cleanup`] through this, never as a bare local across an `.await`.
pub(crate) type Armed = Undo<Cleanup>;

/// Undoes everything now, for at most [`GIVE_UP_GRACE`] (or the clean-up timeout if
/// shorter): a waiter that gives up deletes its key before returning (a healthy etcd
/// answers in milliseconds), but its wait timeout is not stretched by a server that
/// hangs. If that attempt fails (or this future is dropped first), the clean-up goes on
/// in the background.
pub(crate) async fn give_up_now(pending: Armed) {
    let grace = GIVE_UP_GRACE.min(pending.timeout);
    // Done inline, the clean-up is dropped here, giving the line's front up.
    pending.finish_now(grace).await;
}

impl Abandon for Cleanup {
    fn runtime(&self) -> &Handle {
        &self.runtime
    }

    /// What [`Cleanup::spawn`] runs: see there. `None` when there is nothing to undo
    /// (the line's front is then given up at once).
    fn abandon(mut self) -> Option<impl Future<Output = ()> + Send + 'static> {
        if self.is_empty() {
            return None;
        }
        let permit = self.permit.take();
        Some(async move {
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
            // Our acquires of the name may go on; the sweep takes the line's front again
            // only to delete a key it finds.
            let reentry = permit.as_ref().map(|front| front.lines().clone());
            drop(permit);
            if late {
                self.sweep(reentry).await;
            }
        })
    }

    /// One attempt right away (the caller bounds it). Done when everything is undone;
    /// the clean-up stays armed otherwise.
    async fn undo_now(&mut self) -> bool {
        self.is_empty() || self.run().await.is_ok()
    }
}

#[cfg(test)]
mod tests;
