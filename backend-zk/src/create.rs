//! Making the node that queues for a lock: in its directory, making the directory (a
//! container) in the same multi-op once the last release removed it, and adopting a
//! node whose create lost its reply (ZOOKEEPER-1262) instead of queueing twice.

use fencelock_core::Error;
use zookeeper_client as zk;

use crate::error::{RETRY_PAUSE, connection_broke, map, retry};
use crate::session::ZkSession;

/// Creates the lock (or latch) node with `data`, returning its path, its stat and the
/// czxid of `dir` if this call made the directory. The stat is invalid
/// ([`zk::Stat::is_invalid`]) when the node was made with `dir` in one multi-op by a
/// server that answers it without one: the caller's listing of `dir` gives it.
///
/// A `dir` removed by a release (see [`Node::with_dir`](crate::node::Node::with_dir))
/// between our `ensure_dir` and our create fails the create with `NoNode` (nothing was
/// created: no place in line is lost), and the directory is made again.
pub(crate) async fn create_node(
    session: &ZkSession,
    dir: &str,
    prefix_name: &str,
    data: &[u8],
) -> Result<(String, zk::Stat, Option<i64>), Error> {
    let mut made_dir = None;
    let prefix = format!("{dir}/{prefix_name}");
    let acls = session.acls();
    let options = zk::CreateMode::EphemeralSequential.with_acls(acls);
    let mut with_dir = true;
    loop {
        let from_multi = std::mem::take(&mut with_dir);
        let created = if from_multi {
            create_with_dir(session, dir, &prefix, data, &options).await
        } else {
            session
                .client
                .create(&prefix, data, &options)
                .await
                .map(|(stat, sequence)| (format!("{prefix}{sequence}"), stat))
        };
        match created {
            // Servers before 3.7.2 and 3.8.2 answer a create inside a multi-op without its
            // stat (ZOOKEEPER-4026): the listing that follows gives it (`acquire_in`), so
            // the uncontended acquire stays two round trips.
            Ok((path, stat)) if from_multi => return Ok((path, stat, made_dir)),
            Ok((path, stat)) => {
                if stat.is_invalid() {
                    // Servers older than 3.5 return no stat from create.
                    let (_, stat) = retry(|| session.client.get_data(&path))
                        .await
                        .map_err(map)?;
                    return Ok((path, stat, made_dir));
                }
                return Ok((path, stat, made_dir));
            }
            // From `create_with_dir`: the directory is there, create in it.
            Err(zk::Error::NodeExists) => {}
            Err(zk::Error::NoNode) => made_dir = ensure_dir(session, dir).await?,
            // The create may have been applied: look for the node by its uuid.
            Err(err) if connection_broke(&err) => {
                if let Some((path, stat)) = find_own(session, dir, prefix_name).await? {
                    return Ok((path, stat, made_dir));
                }
            }
            Err(err) => return Err(map(err)),
        }
    }
}

/// Creates `dir` (a container) and our node in it in one multi-op: the usual case once
/// the last release removed the directory, in the round trip a create alone takes. The
/// node's czxid is then the directory's (one transaction), which is how the grant knows
/// the directory is this acquire's. `NodeExists` when the directory is there or may not
/// be made by us (nothing was created), `NoNode` when its parent is missing (or the
/// server has no containers).
async fn create_with_dir(
    session: &ZkSession,
    dir: &str,
    prefix: &str,
    data: &[u8],
    options: &zk::CreateOptions<'_>,
) -> Result<(String, zk::Stat), zk::Error> {
    let mut multi = session.client.new_multi_writer();
    multi.add_create(
        dir,
        &[],
        &zk::CreateMode::Container.with_acls(session.acls()),
    )?;
    multi.add_create(prefix, data, options)?;
    let results = match multi.commit().await {
        Ok(results) => results,
        // A server without containers: `ensure_dir` makes a persistent directory.
        Err(zk::MultiWriteError::OperationFailed {
            index: 0,
            source: zk::Error::Unimplemented,
        }) => return Err(zk::Error::NoNode),
        Err(zk::MultiWriteError::OperationFailed {
            index: 0,
            source: zk::Error::NoNode,
        }) => return Err(zk::Error::NoNode),
        // The directory is there, or may not be made by us (no CREATE right on the
        // root, where an operator made the directories): the plain create decides.
        Err(zk::MultiWriteError::OperationFailed { index: 0, .. }) => {
            return Err(zk::Error::NodeExists);
        }
        Err(err) => return Err(err.into()),
    };
    match results.into_iter().nth(1) {
        Some(zk::MultiWriteResult::Create { path, stat }) => Ok((path, stat)),
        _ => Err(zk::Error::UnexpectedError(
            "a multi-op of two creates answered without the second".into(),
        )),
    }
}

/// Creates the lock directory as a container node (and the root above it, persistent;
/// the directories between them, such as `{root}/%sem/{name}`, as containers). The czxid
/// of `dir` when this call created it (`None`: it was there, or the answer was lost).
pub(crate) async fn ensure_dir(session: &ZkSession, dir: &str) -> Result<Option<i64>, Error> {
    ensure_dir_with(session, dir, &[]).await
}

/// [`ensure_dir`] with `data` on `dir` when this call creates it.
pub(crate) async fn ensure_dir_with(
    session: &ZkSession,
    dir: &str,
    data: &[u8],
) -> Result<Option<i64>, Error> {
    let acls = session.acls();
    let mut mode = zk::CreateMode::Container;
    loop {
        match session
            .client
            .create(dir, data, &mode.with_acls(acls))
            .await
        {
            // An invalid stat (servers older than 3.5) has czxid -1, no node's.
            Ok((stat, _)) => return Ok(Some(stat.czxid)),
            Err(zk::Error::NodeExists) => return Ok(None),
            Err(zk::Error::NoNode) if parent_below_root(session.root(), dir).is_some() => {
                if let Some(parent) = parent_below_root(session.root(), dir) {
                    Box::pin(ensure_dir(session, parent)).await?;
                }
            }
            Err(zk::Error::NoNode) if !session.root().is_empty() => {
                let root_options = zk::CreateMode::Persistent.with_acls(acls);
                match session.client.mkdir(session.root(), &root_options).await {
                    Ok(()) | Err(zk::Error::NodeExists) => {}
                    Err(err) if connection_broke(&err) => {}
                    Err(err) => return Err(map(err)),
                }
            }
            Err(zk::Error::Unimplemented) if mode == zk::CreateMode::Container => {
                mode = zk::CreateMode::Persistent;
            }
            Err(err) if connection_broke(&err) => tokio::time::sleep(RETRY_PAUSE).await,
            Err(err) => return Err(map(err)),
        }
    }
}

/// The parent of `dir` when it lies strictly below `root` (`None` for a lock's own
/// directory, whose parent is the root).
fn parent_below_root<'a>(root: &str, dir: &'a str) -> Option<&'a str> {
    let parent = &dir[..dir.rfind('/')?];
    (parent.len() > root.len() && parent.starts_with(root)).then_some(parent)
}

/// Finds the node a create with a lost reply may have made, by its uuid prefix.
///
/// After a `sync`: the session may have reconnected to a server that has not applied
/// the create yet, and creating again would then leave the first node, unknown to us,
/// in the queue for as long as the session lives.
async fn find_own(
    session: &ZkSession,
    dir: &str,
    prefix_name: &str,
) -> Result<Option<(String, zk::Stat)>, Error> {
    retry(|| session.client.sync("/")).await.map_err(map)?;
    let children = match retry(|| session.client.list_children(dir)).await {
        Ok(children) => children,
        Err(zk::Error::NoNode) => return Ok(None),
        Err(err) => return Err(map(err)),
    };
    let Some(child) = children.iter().find(|c| c.starts_with(prefix_name)) else {
        return Ok(None);
    };
    let path = format!("{dir}/{child}");
    match retry(|| session.client.get_data(&path)).await {
        Ok((_, stat)) => Ok(Some((path, stat))),
        Err(zk::Error::NoNode) => Ok(None),
        Err(err) => Err(map(err)),
    }
}
