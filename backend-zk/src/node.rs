//! The lock node of one grant and its delete: the one operation that removes exactly
//! this grant, whoever else uses the name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use fencelock_core::Error;
use fencelock_core::kit::Deleted;
use zookeeper_client as zk;

use crate::error::{RETRY_PAUSE, connection_broke, map, session_ended};
use crate::session::ZkSession;

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
/// The node is gone, and who removed it is unknown: see [`Node::delete`].
const GONE_UNCONFIRMED: u8 = 2;

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
    ///
    /// [`Deleted::Unconfirmed`]: the node is gone, but whether we removed it cannot be
    /// told: a delete whose connection broke before its answer came was sent again and
    /// found no node. The first may have deleted it, or someone else (an operator's
    /// revoke, a raw delete) may have before the first reached the server, or instead of
    /// it if it never did. ZooKeeper keeps no record of who deleted a node. What a delete
    /// learned for good (deleted, or gone unconfirmed) is kept: a repeated delete answers
    /// the same without asking.
    pub(crate) async fn delete(&self, limit: Option<Duration>) -> Result<Deleted, Error> {
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
