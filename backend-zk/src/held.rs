//! A held lock: its nodes, release and extension. The session renews it
//! ([`crate::session`]) and the session's watcher watches its nodes ([`crate::watcher`]),
//! both through [`Tracked`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use fencelock_core::{Error, HeldLock, Liveness, LossCause};
use zookeeper_client as zk;

use crate::error::{BACKEND, map, session_ended};
use crate::node::{Deleted, Node};
use crate::watcher::Watched;

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

/// A held lock as its session and the session's watcher see it: the nodes of the grant
/// and the guard's liveness.
#[derive(Debug)]
pub(crate) struct Tracked {
    pub(crate) node: Arc<Node>,
    /// A semaphore grant's further lease nodes (one per permit past the first).
    pub(crate) extra: Vec<Arc<Node>>,
    pub(crate) liveness: Liveness,
    /// Set when the guard is being released or was dropped: the deletion of its nodes
    /// from now on is ours, not a loss, and nothing is watched or deleted for it any more.
    stopped: AtomicBool,
    /// Set once the nodes were handed to background deletes after a loss by deadline.
    given_up: AtomicBool,
}

impl Tracked {
    pub(crate) fn new(node: Arc<Node>, extra: Vec<Arc<Node>>, liveness: Liveness) -> Self {
        Tracked {
            node,
            extra,
            liveness,
            stopped: AtomicBool::new(false),
            given_up: AtomicBool::new(false),
        }
    }

    /// Every node of the grant, the main one last.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = &Arc<Node>> {
        self.extra.iter().chain(std::iter::once(&self.node))
    }

    /// Stops watching: called before our own release deletes the nodes.
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }
}

impl Watched for Tracked {
    fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    fn node_count(&self) -> usize {
        self.extra.len() + 1
    }

    fn node(&self, index: usize) -> (&zk::Client, &str) {
        let node = self.extra.get(index).unwrap_or(&self.node);
        (&node.session.client, &node.path)
    }

    fn paths(&self) -> Vec<String> {
        self.nodes().map(|node| node.path.clone()).collect()
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// A node of a semaphore's grant gone loses the whole grant: its other nodes are
    /// deleted, whichever path marked the loss first.
    fn lost(&self, cause: LossCause, reason: String) {
        if self.is_stopped() {
            return;
        }
        if !self.liveness.is_lost() {
            self.liveness.mark_lost(cause, reason);
        }
        if cause == LossCause::KeyGone && !self.extra.is_empty() {
            self.give_up();
        }
    }

    fn give_up(&self) {
        if !self.is_stopped() && !self.given_up.swap(true, Ordering::AcqRel) {
            for node in self.nodes() {
                node.delete_in_background();
            }
        }
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
                    "the lock node was gone when extending its lease".into(),
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
