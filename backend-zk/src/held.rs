//! A held lock: its nodes, release and extension. Its watch is the session's
//! ([`crate::watcher`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use fencelock_core::{Error, HeldLock, Liveness, LossCause};
use zookeeper_client as zk;

use crate::error::{BACKEND, RETRY_PAUSE, connection_broke, map, session_ended};
use crate::session::ZkSession;
use crate::watcher::Tracked;

/// The backend side of a ZooKeeper guard.
#[derive(Debug)]
pub(crate) struct ZkHeld {
    name: String,
    /// The grant's nodes and liveness, shared with the session's watcher.
    tracked: Arc<Tracked>,
    registration: u64,
    /// Whether the grant has a fixed lease (and so may be extended).
    fixed: bool,
    /// Serializes releases so repeated calls see each other's outcome.
    releasing: tokio::sync::Mutex<()>,
    /// A release returned `Ok`: later ones do too.
    released: AtomicBool,
    /// A release sent its deletes (its future may have been dropped before the answers
    /// came): a node a repeated release finds gone may be one that release removed.
    release_sent: AtomicBool,
}

/// The lock node of one grant. Its path holds a fresh uuid, so it names this grant and
/// no other, ever.
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) session: Arc<ZkSession>,
    pub(crate) path: String,
    pub(crate) version: i32,
    /// The directory to remove together with the node when the node is its last child
    /// (see [`Node::with_dir`]); `None`: only the node is deleted.
    dir: Option<String>,
    /// What a delete of ours learned for good: [`PRESENT`], [`DELETED`] or
    /// [`GONE_UNCONFIRMED`]. Kept so that a repeated release answers as the first did.
    gone: AtomicU8,
}

/// No delete of ours has found the node gone (it may still be there).
const PRESENT: u8 = 0;
/// A delete of ours removed the node.
const DELETED: u8 = 1;
/// The node is gone, and who removed it is unknown: see [`Deleted::Unconfirmed`].
const GONE_UNCONFIRMED: u8 = 2;

/// What a delete found.
enum Deleted {
    /// Our delete removed the node.
    Now,
    /// The node was already gone when we asked.
    AlreadyGone,
    /// The node is gone, but whether we removed it cannot be told: a delete whose
    /// connection broke before its answer came was sent again and found no node. The
    /// first may have deleted it, or someone else (an operator's revoke, a raw delete)
    /// may have before the first reached the server, or instead of it if it never did.
    /// ZooKeeper keeps no record of who deleted a node.
    Unconfirmed,
}

impl Node {
    pub(crate) fn new(session: Arc<ZkSession>, path: String, version: i32) -> Self {
        Node {
            session,
            path,
            version,
            dir: None,
            gone: AtomicU8::new(PRESENT),
        }
    }

    /// The node, whose delete also removes its directory `dir` if the node is the last
    /// child there: one multi-op of both deletes (as many round trips as the node's delete
    /// alone). When the directory still holds another node (a waiter, an application's
    /// node) the server refuses the whole multi-op, and the node is deleted alone.
    ///
    /// Without this, every lock name leaves an empty container node behind, which the
    /// server reaps at a bounded rate (10,000 a minute by default): a service that locks
    /// per entity would grow the server without bound. `dir` must be a container (made by
    /// a recipe, and reaped anyway once empty), never an application's node: see
    /// [`crate::acquire`].
    pub(crate) fn with_dir(mut self, dir: Option<String>) -> Self {
        self.dir = dir;
        self
    }

    /// One delete of the node at `version`, with its directory while `with_dir` is
    /// `Some`. `Ok(false)`: the directory was not removed with it because the multi-op
    /// failed at the directory's delete (it still has children, or we may not delete it):
    /// nothing was deleted, and the caller deletes the node alone.
    async fn delete_once(
        &self,
        version: Option<i32>,
        with_dir: Option<&str>,
    ) -> Result<bool, zk::Error> {
        let client = &self.session.client;
        let Some(dir) = with_dir else {
            return client.delete(&self.path, version).await.map(|()| true);
        };
        let mut multi = client.new_multi_writer();
        multi.add_delete(&self.path, version)?;
        multi.add_delete(dir, None)?;
        match multi.commit().await {
            Ok(_) => Ok(true),
            Err(zk::MultiWriteError::OperationFailed { index: 0, source }) => Err(source),
            Err(zk::MultiWriteError::OperationFailed { source, .. }) => {
                tracing::trace!(%dir, %source, "the lock directory stays");
                Ok(false)
            }
            Err(zk::MultiWriteError::RequestFailed { source }) => Err(source),
        }
    }

    /// Deletes the node with a version check (one round trip), repeating it while the
    /// connection breaks, for at most `limit` (`None`: until the session ends). A version
    /// mismatch (someone wrote data to our node, as Curator's revocation does) still
    /// deletes: the path alone identifies this grant.
    async fn delete(&self, limit: Option<Duration>) -> Result<Deleted, Error> {
        match self.gone.load(Ordering::Acquire) {
            DELETED => return Ok(Deleted::Now),
            GONE_UNCONFIRMED => return Ok(Deleted::Unconfirmed),
            _ => {}
        }
        let mut retried = false;
        let mut version = Some(self.version);
        let mut with_dir = self.dir.as_deref();
        let attempt = async {
            loop {
                match self.delete_once(version, with_dir).await {
                    Ok(true) => return Ok(Deleted::Now),
                    Ok(false) => with_dir = None,
                    Err(zk::Error::NoNode) if retried => return Ok(Deleted::Unconfirmed),
                    Err(zk::Error::NoNode) => return Ok(Deleted::AlreadyGone),
                    // An ended session took its ephemeral nodes with it.
                    Err(err) if session_ended(&err) => return Ok(Deleted::AlreadyGone),
                    Err(zk::Error::BadVersion) => version = None,
                    // The delete may or may not have been applied: ask again.
                    Err(err) if connection_broke(&err) => {
                        retried = true;
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                    Err(err) => return Err(err),
                }
            }
        };
        let outcome = match limit {
            Some(limit) => tokio::time::timeout(limit, attempt)
                .await
                .unwrap_or(Err(zk::Error::Timeout)),
            None => attempt.await,
        };
        match outcome {
            Ok(Deleted::Now) => {
                self.gone.store(DELETED, Ordering::Release);
                Ok(Deleted::Now)
            }
            Ok(Deleted::Unconfirmed) => {
                self.gone.store(GONE_UNCONFIRMED, Ordering::Release);
                Ok(Deleted::Unconfirmed)
            }
            Ok(Deleted::AlreadyGone) => Ok(Deleted::AlreadyGone),
            Err(err) => Err(map(err)),
        }
    }

    /// Deletes in the background, repeating the delete while the connection breaks
    /// until the session ends.
    ///
    /// Not bounded by a timeout: the node lives as long as the session, and a healthy
    /// session lives forever, so giving up would block every later waiter for good.
    /// The task ends when the node is deleted or the session ends (requests wait in the
    /// client's queue while it reconnects, and fail for good once the session expired).
    pub(crate) fn delete_in_background(self: &Arc<Self>) {
        if self.gone.load(Ordering::Acquire) != PRESENT {
            return;
        }
        let node = self.clone();
        self.session.runtime().spawn(async move {
            if let Err(error) = node.delete(None).await {
                tracing::debug!(path = %node.path, %error, "background delete of a lock node failed; it expires with the session");
            }
        });
    }
}

impl ZkHeld {
    /// Takes over a granted node: registers it with the session monitor (renewal) and
    /// its watcher, which reports the node's deletion by anyone else and deletes it once
    /// the lock is lost (at the end of a fixed lease, or when the session deadline
    /// passed).
    pub(crate) fn start(
        name: &str,
        node: Node,
        liveness: Liveness,
        cap: Option<tokio::time::Instant>,
    ) -> Self {
        Self::start_many(name, node, Vec::new(), liveness, cap)
    }

    /// [`ZkHeld::start`] for a grant of several nodes (a semaphore's permits): each is
    /// watched, the loss of any loses the grant, and release deletes them all.
    pub(crate) fn start_many(
        name: &str,
        node: Node,
        extra: Vec<Node>,
        liveness: Liveness,
        cap: Option<tokio::time::Instant>,
    ) -> Self {
        let extra: Vec<Arc<Node>> = extra.into_iter().map(Arc::new).collect();
        let tracked = Arc::new(Tracked::new(Arc::new(node), extra, liveness));
        let session = &tracked.node.session;
        let registration = session.register(&tracked, cap);
        session.watcher().watch(&tracked);
        ZkHeld {
            name: name.to_owned(),
            tracked,
            registration,
            fixed: cap.is_some(),
            releasing: tokio::sync::Mutex::new(()),
            released: AtomicBool::new(false),
            release_sent: AtomicBool::new(false),
        }
    }

    fn node(&self) -> &Arc<Node> {
        &self.tracked.node
    }

    fn stop_tracking(&self) {
        self.tracked.stop();
        self.node().session.unregister(self.registration);
    }
}

#[async_trait]
impl HeldLock for ZkHeld {
    #[tracing::instrument(name = "fencelock.zookeeper.release", level = "debug", skip_all, fields(lock = %self.name))]
    async fn release(&self) -> Result<(), Error> {
        self.stop_tracking();
        let _serial = self.releasing.lock().await;
        if self.released.load(Ordering::Acquire) {
            return Ok(());
        }
        let lost_before = self.tracked.liveness.is_lost();
        // After a release whose future was dropped, a node found gone may be its doing:
        // not a known loss, but not a confirmed release either.
        let repeated = self.release_sent.swap(true, Ordering::AcqRel);
        let gone = if repeated {
            Deleted::Unconfirmed
        } else {
            Deleted::AlreadyGone
        };
        let mut extra_gone = false;
        let mut unconfirmed = false;
        for other in &self.tracked.extra {
            match other.delete(Some(other.session.timeout())).await {
                Ok(Deleted::Now) => {}
                Ok(Deleted::AlreadyGone) if repeated => unconfirmed = true,
                Ok(Deleted::AlreadyGone) => extra_gone = true,
                Ok(Deleted::Unconfirmed) => unconfirmed = true,
                Err(error) => {
                    for node in self.tracked.nodes() {
                        node.delete_in_background();
                    }
                    return Err(error);
                }
            }
        }
        let node = self.node();
        let deleted = match node.delete(Some(node.session.timeout())).await {
            Ok(Deleted::AlreadyGone) => gone,
            Ok(deleted) => deleted,
            Err(error) => {
                // The caller learns that the release is unconfirmed, but the node must
                // not outlive it: the session (the lease) is shared and lives on.
                node.delete_in_background();
                return Err(error);
            }
        };
        match deleted {
            Deleted::Now if !lost_before && !extra_gone && !unconfirmed => {
                self.released.store(true, Ordering::Release);
                Ok(())
            }
            // Neither a confirmed release nor a known loss: the lock is free now, but it
            // may have been lost before the release, so the release is not confirmed.
            Deleted::Now | Deleted::Unconfirmed if !lost_before && !extra_gone => {
                Err(Error::unavailable(
                    BACKEND,
                    "the release could not be confirmed: its delete was repeated after the \
                     connection broke and found the lock node gone, which our first delete \
                     or someone else's may have done (the lock may have been lost before \
                     the release); the lock is free now",
                ))
            }
            _ => {
                // Told once, told again: a repeated release answers the same.
                self.tracked.liveness.mark_lost(
                    LossCause::KeyGone,
                    "the lock node was already gone at release",
                );
                Err(Error::lost(
                    &self.name,
                    self.tracked
                        .liveness
                        .lost_reason()
                        .unwrap_or("the lock node was already gone at release"),
                ))
            }
        }
    }

    fn release_in_background(&self) {
        self.stop_tracking();
        // A release called after this one may find the nodes deleted by it.
        self.release_sent.store(true, Ordering::Release);
        for node in self.tracked.nodes() {
            node.delete_in_background();
        }
    }

    fn backend_key(&self) -> Option<&str> {
        Some(&self.node().path)
    }

    fn can_extend(&self) -> Result<(), Error> {
        if self.fixed {
            Ok(())
        } else {
            Err(Error::not_a_fixed_lease())
        }
    }

    fn check_extension(&self, lease: Duration) -> Result<(), Error> {
        self.can_extend()?;
        // As `acquire` checks it, before anything is sent.
        fencelock_core::validate_lease(lease, self.node().session.min_lease())
    }

    /// A fixed lease on ZooKeeper is this client's own cap on a node of its session: the
    /// extension checks that the node is still there and moves the cap to `lease` after
    /// that check was sent. The session's own deadline still applies. A lease shorter
    /// than the client's `min_lease` is [`Error::InvalidConfig`], with nothing sent.
    #[tracing::instrument(name = "fencelock.zookeeper.extend", level = "debug", skip_all, fields(lock = %self.name))]
    async fn extend(&self, lease: Duration) -> Result<tokio::time::Instant, Error> {
        self.check_extension(lease)?;
        let session = &self.node().session;
        let sent = tokio::time::Instant::now();
        let checked = tokio::time::timeout(
            session.timeout(),
            session.client.check_stat(&self.node().path),
        )
        .await
        .map_err(|_| {
            Error::unavailable(
                crate::error::BACKEND,
                "ZooKeeper did not answer the extend in time",
            )
        })?;
        match checked {
            Ok(Some(_)) => {}
            Ok(None) => {
                // Through the watch's own path: a semaphore grant frees its other permits.
                self.tracked.lost(
                    LossCause::KeyGone,
                    "the lock node was gone when extending its lease",
                );
                return Err(Error::lost(
                    &self.name,
                    "the lock node was gone when extending its lease",
                ));
            }
            Err(err) if session_ended(&err) => {
                self.tracked.lost(
                    LossCause::SessionEnded,
                    format!("the ZooKeeper session ended: {err}"),
                );
                return Err(Error::lost(
                    &self.name,
                    format!("the ZooKeeper session ended: {err}"),
                ));
            }
            Err(err) => return Err(map(err)),
        }
        let cap = sent + lease;
        if !session.set_cap(self.registration, cap) {
            return Err(Error::lost(
                &self.name,
                "the lock was released or closed while extending",
            ));
        }
        Ok(cap.min(session.deadline(session.anchor())))
    }
}

impl Drop for ZkHeld {
    fn drop(&mut self) {
        self.stop_tracking();
    }
}
