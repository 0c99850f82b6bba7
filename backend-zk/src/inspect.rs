//! Reading and revoking other holders: `inspect`, `list` and `revoke`, each after a
//! `sync` ([`synced`]) so that it agrees with the grants and releases that have returned.

use fencelock_core::{Error, FencingToken, HolderInfo, ListedLock, LockInfo};
use zookeeper_client as zk;

use crate::error::{BACKEND, map, retry};
use crate::names;
use crate::session::ZkSession;

/// A `sync` before a read, so that it sees every write completed before it began, on
/// any server (ZooKeeper's plain reads may lag behind the leader): `inspect`, `list`,
/// `revoke` and `leader` then agree with the grants and releases that have returned.
pub(crate) async fn synced(session: &ZkSession) -> Result<(), Error> {
    retry(|| session.client.sync("/")).await.map_err(map)
}

/// The lock `name`'s holder and waiters, as [`DistributedLock::inspect`] reports them.
///
/// [`DistributedLock::inspect`]: fencelock_core::DistributedLock::inspect
pub(crate) async fn inspect(session: &ZkSession, name: &str) -> Result<LockInfo, Error> {
    let dir = names::lock_dir(session.root(), name);
    synced(session).await?;
    Ok(match holder(session, &dir).await? {
        None => LockInfo::free(Some(0)),
        Some(found) => describe(found),
    })
}

/// The held locks whose names start with `prefix`, as [`DistributedLock::list`] reports
/// them.
///
/// [`DistributedLock::list`]: fencelock_core::DistributedLock::list
pub(crate) async fn list(session: &ZkSession, prefix: &str) -> Result<Vec<ListedLock>, Error> {
    let root = session.root();
    let at_root = root.is_empty();
    synced(session).await?;
    let children = match retry(|| {
        session
            .client
            .list_children(if at_root { "/" } else { root })
    })
    .await
    {
        Ok(children) => children,
        Err(zk::Error::NoNode) => return Ok(Vec::new()),
        Err(err) => return Err(map(err)),
    };
    let mut names: Vec<String> = children
        .iter()
        .filter_map(|segment| names::decode_name(segment, at_root))
        .filter(|name| name.starts_with(prefix))
        .collect();
    names.sort_unstable();
    let mut found = Vec::new();
    for name in names {
        let dir = names::lock_dir(root, &name);
        // Only directories with a node of the lock recipes are listed: lock
        // directories are containers that outlive their last lock until the server
        // reaps them, and under the root `/` other applications' nodes (`/kafka`,
        // `/admin`) have names a lock could have.
        if let Some(found_holder) = holder(session, &dir).await? {
            found.push(ListedLock::new(name, describe(found_holder)));
        }
    }
    Ok(found)
}

/// Deletes the holder node of `name`, as [`DistributedLock::revoke`] describes; returns
/// the holder it removed.
///
/// [`DistributedLock::revoke`]: fencelock_core::DistributedLock::revoke
pub(crate) async fn revoke(session: &ZkSession, name: &str) -> Result<Option<HolderInfo>, Error> {
    let dir = names::lock_dir(session.root(), name);
    synced(session).await?;
    let Some(found) = holder(session, &dir).await? else {
        return Ok(None);
    };
    let path = found.0.clone();
    // The path names this grant alone (it holds the grant's uuid): a holder that
    // took the name since has another node and keeps it.
    match retry(|| session.client.delete(&path, None)).await {
        Ok(()) => {
            tracing::warn!(lock = name, node = %path, "zookeeper: lock revoked");
            Ok(describe(found).holder)
        }
        Err(zk::Error::NoNode) => Ok(None),
        Err(err) => Err(map(err)),
    }
}

/// The holder node of `dir` (path, stat, number of waiters), if any: the first of its
/// recipe nodes ([`names::recipe_node`]). Other nodes (another application's, in a
/// directory that is no lock's) are neither holders nor waiters, so `inspect` reports
/// them as no lock, `list` leaves their directory out and `revoke` never deletes them.
async fn holder(
    session: &ZkSession,
    dir: &str,
) -> Result<Option<(String, zk::Stat, usize)>, Error> {
    for _ in 0..16 {
        let mut children = match retry(|| session.client.list_children(dir)).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(err) => return Err(map(err)),
        };
        children.retain(|child| names::recipe_node(child).is_some());
        if children.is_empty() {
            return Ok(None);
        }
        names::sort_children(&mut children);
        let path = format!("{dir}/{}", children[0]);
        match retry(|| session.client.get_data(&path)).await {
            // With the tasks of this client that wait behind its own node (see
            // `fencelock_core::line`), as etcd's inspect counts them.
            Ok((_, stat)) => {
                let local = session.lines.waiting_behind(dir);
                return Ok(Some((path, stat, children.len() - 1 + local)));
            }
            Err(zk::Error::NoNode) => continue,
            Err(err) => return Err(map(err)),
        }
    }
    Err(Error::backend(
        BACKEND,
        true,
        "the lock changed hands too often to inspect",
    ))
}

/// What `inspect` reports of a holder found by [`holder`].
fn describe((path, stat, waiters): (String, zk::Stat, usize)) -> LockInfo {
    let node = path.rsplit('/').next().unwrap_or_default();
    LockInfo::held(
        HolderInfo::new(
            format!("session {:#x} node {node}", stat.ephemeral_owner),
            FencingToken::new(stat.czxid as u64),
            None,
        ),
        Some(waiters),
    )
}
