//! A held lock's grant: its nodes, their delete and the extension of a fixed lease, as
//! the kit's [`Grant`]; the kit's [`Held`](fencelock_core::kit::Held) keeps the release
//! state machine around it. The session renews it ([`crate::session`]) and the session's
//! watcher watches its nodes ([`crate::watcher`]), both through [`Tracked`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fencelock_core::kit::{Deleted, Extension, Grant};
use fencelock_core::{Error, Liveness, LossCause};
use zookeeper_client as zk;

use crate::error::{BACKEND, map, session_ended};
use crate::node::Node;
use crate::watcher::Watched;

/// The backend side of a ZooKeeper guard.
#[derive(Debug)]
pub(crate) struct ZkGrant {
    /// Shared with the guard.
    name: Arc<str>,
    /// The grant's nodes and liveness, shared with the session's watcher.
    tracked: Arc<Tracked>,
    registration: u64,
    /// Serializes deletes so that a repeated release sees the first one's outcome (each
    /// node keeps what a delete of ours learned).
    deleting: tokio::sync::Mutex<()>,
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
    /// Whether the grant has a fixed lease (and so may be extended). Kept here, in
    /// padding, rather than in the grant, whose `kit::Held` then fits a smaller
    /// allocation (16 B less per held lock).
    fixed: bool,
}

impl Tracked {
    pub(crate) fn new(
        node: Arc<Node>,
        extra: Vec<Arc<Node>>,
        liveness: Liveness,
        fixed: bool,
    ) -> Self {
        Tracked {
            node,
            extra,
            liveness,
            stopped: AtomicBool::new(false),
            given_up: AtomicBool::new(false),
            fixed,
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

impl ZkGrant {
    /// Takes over a granted node: registers it with the session monitor (renewal) and
    /// its watcher, which reports the node's deletion by anyone else and deletes it once
    /// the lock is lost (at the end of a fixed lease, or when the session deadline
    /// passed).
    pub(crate) fn start(
        name: Arc<str>,
        node: Node,
        liveness: Liveness,
        cap: Option<tokio::time::Instant>,
    ) -> Self {
        Self::start_many(name, node, Vec::new(), liveness, cap)
    }

    /// [`ZkGrant::start`] for a grant of several nodes (a semaphore's permits): each is
    /// watched, the loss of any loses the grant, and release deletes them all.
    pub(crate) fn start_many(
        name: Arc<str>,
        node: Node,
        extra: Vec<Node>,
        liveness: Liveness,
        cap: Option<tokio::time::Instant>,
    ) -> Self {
        let extra: Vec<Arc<Node>> = extra.into_iter().map(Arc::new).collect();
        let tracked = Arc::new(Tracked::new(Arc::new(node), extra, liveness, cap.is_some()));
        let session = &tracked.node.session;
        let registration = session.register(&tracked, cap);
        session.watch(&tracked);
        ZkGrant {
            name,
            tracked,
            registration,
            deleting: tokio::sync::Mutex::new(()),
        }
    }

    fn node(&self) -> &Arc<Node> {
        &self.tracked.node
    }
}

/// Which of two delete outcomes of one grant's nodes decides the release: a node found
/// gone (a loss at a first release) over one whose delete is unconfirmed, over one
/// deleted now.
fn worse(a: Deleted, b: Deleted) -> Deleted {
    let rank = |d| match d {
        Deleted::Now => 0,
        Deleted::Unconfirmed => 1,
        Deleted::AlreadyGone => 2,
    };
    if rank(b) > rank(a) { b } else { a }
}

impl Grant for ZkGrant {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn key(&self) -> Option<&str> {
        Some(&self.node().path)
    }

    fn extension(&self) -> Extension {
        if self.tracked.fixed {
            // As `acquire` checks it, before anything is sent.
            Extension::Fixed {
                min_lease: self.node().session.min_lease(),
            }
        } else {
            Extension::Renewing
        }
    }

    /// Stops watching and renewing: the deletion of the nodes from now on is ours.
    fn stop(&self) {
        self.tracked.stop();
        self.node().session.unregister(self.registration);
    }

    /// Deletes every node of the grant (a semaphore's further permits first, the main
    /// node last), each bounded by the session timeout. A node found gone decides the
    /// outcome over one whose delete is unconfirmed, over one deleted now (see
    /// [`Node::delete`]).
    ///
    /// An error leaves the nodes to background deletes: the caller learns that the
    /// release is unconfirmed, but the nodes must not outlive it, as the session (the
    /// lease) is shared and lives on.
    async fn delete(&self) -> Result<Deleted, Error> {
        let _serial = self.deleting.lock().await;
        let mut found = Deleted::Now;
        for other in &self.tracked.extra {
            match other.delete(Some(other.session.timeout())).await {
                Ok(deleted) => found = worse(found, deleted),
                Err(error) => {
                    self.delete_in_background();
                    return Err(error);
                }
            }
        }
        let node = self.node();
        match node.delete(Some(node.session.timeout())).await {
            Ok(deleted) => Ok(worse(found, deleted)),
            Err(error) => {
                node.delete_in_background();
                Err(error)
            }
        }
    }

    fn delete_in_background(&self) {
        for node in self.tracked.nodes() {
            node.delete_in_background();
        }
    }

    /// A fixed lease on ZooKeeper is this client's own cap on a node of its session: the
    /// extension checks that the node is still there and moves the cap to `lease` after
    /// that check was sent. The session's own deadline still applies.
    async fn extend(&self, lease: Duration) -> Result<tokio::time::Instant, Error> {
        let session = &self.node().session;
        let sent = tokio::time::Instant::now();
        let checked = tokio::time::timeout(
            session.timeout(),
            session.client.check_stat(&self.node().path),
        )
        .await
        .map_err(|_| Error::unavailable(BACKEND, "ZooKeeper did not answer the extend in time"))?;
        match checked {
            Ok(Some(_)) => {}
            Ok(None) => {
                // Through the watch's own path: a semaphore grant frees its other permits.
                self.tracked.lost(
                    LossCause::KeyGone,
                    "the lock node was gone when extending its lease".into(),
                );
                return Err(Error::lost(
                    &*self.name,
                    "the lock node was gone when extending its lease",
                ));
            }
            Err(err) if session_ended(&err) => {
                self.tracked.lost(
                    LossCause::SessionEnded,
                    format!("the ZooKeeper session ended: {err}"),
                );
                return Err(Error::lost(
                    &*self.name,
                    format!("the ZooKeeper session ended: {err}"),
                ));
            }
            Err(err) => return Err(map(err)),
        }
        let cap = sent + lease;
        if !session.set_cap(self.registration, cap) {
            return Err(Error::lost(
                &*self.name,
                "the lock was released or closed while extending",
            ));
        }
        Ok(cap.min(session.deadline(session.anchor())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node found gone decides a release over an unconfirmed delete, which decides it
    /// over a node deleted now, in whatever order the nodes answered.
    #[test]
    fn a_node_found_gone_decides_the_release() {
        use Deleted::{AlreadyGone, Now, Unconfirmed};
        for (a, b, expected) in [
            (Now, Now, Now),
            (Now, Unconfirmed, Unconfirmed),
            (Unconfirmed, Now, Unconfirmed),
            (Unconfirmed, AlreadyGone, AlreadyGone),
            (AlreadyGone, Now, AlreadyGone),
            (Now, AlreadyGone, AlreadyGone),
        ] {
            assert_eq!(worse(a, b), expected, "{a:?} then {b:?}");
        }
    }
}
