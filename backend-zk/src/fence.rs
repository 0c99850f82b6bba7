//! Fenced writes to ZooKeeper data: a multi-op that first checks the holder's node.

use fencelock_core::{Error, FencingToken};
use zookeeper_client as zk;

use crate::error::{connection_broke, map, session_ended};

/// Writes to ZooKeeper that are applied only while a lock is still held.
///
/// Each write is one multi-op (transaction): a version check of the holder's lock node,
/// then the write. If the node is gone (the session expired, the lock was released or
/// deleted), the whole multi fails and nothing is written: a paused ("zombie") holder
/// cannot overwrite what a newer holder wrote. This is the ZooKeeper counterpart of
/// etcd's `IsOwner()` compare. Obtained from [`ZkLock::fence`](crate::ZkLock::fence).
///
/// Writes go through the session that owns the lock node, so they also fail (with
/// [`Error::Lost`]) once that session has expired. Paths are absolute ZooKeeper paths
/// (not under the lock root).
///
/// # Examples
///
/// ```no_run
/// use fencelock_core::DistributedLockExt;
/// use fencelock_zk::{ZkConfig, ZkLock};
///
/// # #[tokio::main] async fn main() -> Result<(), fencelock_core::Error> {
/// let locks = ZkLock::connect(ZkConfig::from_url("zk://127.0.0.1:2181/locks")?).await?;
/// let guard = locks.lock("stock/SKU-8842").await?;
/// let fence = locks.fence(&guard).await?;
/// // Applied only if `guard`'s node still holds the lock at the moment of the write.
/// fence.set_data("/stock/SKU-8842", b"99", None).await?;
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ZkFence {
    client: zk::Client,
    acls: zk::Acls<'static>,
    name: String,
    token: FencingToken,
    node: String,
    version: i32,
}

impl ZkFence {
    pub(crate) fn new(
        client: zk::Client,
        acls: zk::Acls<'static>,
        name: &str,
        token: FencingToken,
        node: String,
        version: i32,
    ) -> Self {
        ZkFence {
            client,
            acls,
            name: name.to_owned(),
            token,
            node,
            version,
        }
    }

    /// The holder's lock node that every write checks.
    pub fn node_path(&self) -> &str {
        &self.node
    }

    /// The fencing token of the guard this fence was made for.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// A multi-op writer whose first op is the holder check; add writes and `commit`.
    /// A failed check surfaces as `CheckWriteError::CheckFailed`.
    ///
    /// # Errors
    ///
    /// A backend error if the node path is rejected (it never is for fences made by
    /// [`ZkLock::fence`](crate::ZkLock::fence)).
    pub fn writer(&self) -> Result<zk::CheckWriter<'_>, Error> {
        self.client
            .new_check_writer(&self.node, Some(self.version))
            .map_err(map)
    }

    /// Sets the data of `path` if the lock is still held.
    ///
    /// # Cancel safety
    ///
    /// The write is sent when the future is first polled; dropping it afterwards does not
    /// undo it.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] when the lock is no longer held: the holder check failed or the
    /// lock's session has ended. [`Error::Unavailable`] when the connection broke while
    /// the write was in flight and the session lives on: the write may or may not have
    /// been applied. Backend errors for the write itself (no node, bad version, no auth).
    ///
    /// Whatever the error, a write that was applied was applied while the lock was
    /// held: the holder check and the write are one transaction. (After a broken
    /// connection the client waits, up to the session timeout, to learn whether the
    /// session survived; if it did not, the answer is `Lost` even in the rare case where
    /// the write reached the server before the session expired.)
    pub async fn set_data(
        &self,
        path: &str,
        data: &[u8],
        expected_version: Option<i32>,
    ) -> Result<zk::Stat, Error> {
        let mut writer = self.writer()?;
        writer
            .add_set_data(path, data, expected_version)
            .map_err(map)?;
        let mut results = self.commit(writer).await?;
        match results.pop() {
            Some(zk::MultiWriteResult::SetData { stat }) => Ok(stat),
            _ => Err(unexpected()),
        }
    }

    /// Creates a persistent node `path` with `data` if the lock is still held, with the
    /// client's ACL policy (`acl=creator`: only the client's digest identity may change
    /// it, so others cannot write it without the fence either).
    ///
    /// # Cancel safety
    ///
    /// As [`set_data`](Self::set_data).
    ///
    /// # Errors
    ///
    /// As [`set_data`](Self::set_data).
    pub async fn create(&self, path: &str, data: &[u8]) -> Result<zk::Stat, Error> {
        let mut writer = self.writer()?;
        let options = zk::CreateMode::Persistent.with_acls(self.acls);
        writer.add_create(path, data, &options).map_err(map)?;
        let mut results = self.commit(writer).await?;
        match results.pop() {
            Some(zk::MultiWriteResult::Create { stat, .. }) => Ok(stat),
            _ => Err(unexpected()),
        }
    }

    /// Deletes `path` if the lock is still held.
    ///
    /// # Cancel safety
    ///
    /// As [`set_data`](Self::set_data).
    ///
    /// # Errors
    ///
    /// As [`set_data`](Self::set_data).
    pub async fn delete(&self, path: &str, expected_version: Option<i32>) -> Result<(), Error> {
        let mut writer = self.writer()?;
        writer.add_delete(path, expected_version).map_err(map)?;
        self.commit(writer).await.map(drop)
    }

    async fn commit(
        &self,
        writer: zk::CheckWriter<'_>,
    ) -> Result<Vec<zk::MultiWriteResult>, Error> {
        match writer.commit().await {
            Ok(results) => Ok(results),
            Err(zk::CheckWriteError::CheckFailed { source }) => Err(Error::lost(
                &self.name,
                format!(
                    "fenced write refused: the holder node {} is gone ({source})",
                    self.node
                ),
            )),
            Err(zk::CheckWriteError::RequestFailed { source }) if session_ended(&source) => {
                Err(Error::lost(
                    &self.name,
                    format!("fenced write refused: the lock's session ended ({source})"),
                ))
            }
            Err(zk::CheckWriteError::RequestFailed { source }) if connection_broke(&source) => {
                // The outcome is unknown. A paused ("zombie") holder typically gets here:
                // its first request after resuming goes out on the connection the server
                // dropped when it expired the session. Learn whether the session survived.
                match self.session_after_break().await {
                    Some(state) if state.is_terminated() => Err(Error::lost(
                        &self.name,
                        format!(
                            "fenced write not confirmed: the connection broke ({source}) and \
                             the lock's session ended ({state})"
                        ),
                    )),
                    _ => Err(map(source)),
                }
            }
            Err(zk::CheckWriteError::RequestFailed { source })
            | Err(zk::CheckWriteError::OperationFailed { source, .. }) => Err(map(source)),
        }
    }

    /// After a broken connection: waits until the client has reconnected or its session
    /// has ended, at most the session timeout twice (the client itself gives up
    /// reconnecting after 1.4 session timeouts). The state then, or `None` on timeout.
    async fn session_after_break(&self) -> Option<zk::SessionState> {
        let mut states = self.client.state_watcher();
        let settled = async {
            let mut state = self.client.state();
            while state == zk::SessionState::Disconnected {
                state = states.changed().await;
            }
            state
        };
        tokio::time::timeout(self.client.session_timeout() * 2, settled)
            .await
            .ok()
    }
}

fn unexpected() -> Error {
    Error::backend(
        crate::error::BACKEND,
        false,
        "unexpected multi-op reply from ZooKeeper",
    )
}
