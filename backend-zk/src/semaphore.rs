//! Semaphores: Curator's `InterProcessSemaphoreV2` layout, all-or-nothing for several
//! permits, a czxid token, and the limit stored where Curator ignores it.
//!
//! Semaphore `name` lives in `{root}/%sem/{encoded name}` (see
//! [`names::semaphore_dir`]):
//!
//! - `…/locks/`: Curator's internal `InterProcessMutex` (`_c_<uuid>-lock-<seq>`), taken
//!   by a request while it adds its leases, as Curator does;
//! - `…/leases/`: one EPHEMERAL_SEQUENTIAL `_c_<uuid>-lease-<seq>` per permit held
//!   (Curator's protected names). The directory's **data** is `limit=<N>`, the limit
//!   Curator does not store.
//!
//! A request of `count` permits of `limit`:
//!
//! 1. reads the stored limit and fails with [`Error::InvalidConfig`] if leases are held
//!    under another one (before queueing);
//! 2. takes the internal mutex (FIFO among requests; honours no-wait and the timeout);
//! 3. holding it, reads the stored limit and the leases (with a children watch): another
//!    limit with leases held is [`Error::InvalidConfig`]; with none held the limit is
//!    (re)written. If `held + count <= limit`, one multi-op checks the directory's version
//!    (the limit read) and creates the `count` lease nodes, so the request gets all its
//!    permits or none; otherwise it waits for the leases to change (and fails with a
//!    retryable [`Error::Unavailable`] if it loses the mutex meanwhile);
//! 4. releases the mutex. The token is the czxid of the multi-op (the lease nodes'),
//!    larger than every earlier grant's of the semaphore.
//!
//! Curator instead creates its lease node first, then waits (still holding the mutex)
//! until the leases number at most its limit, and takes `count` permits as `count`
//! separate rounds. Both hold the mutex while adding leases, so together they never pass
//! the limit; but a Curator process holding part of a multi-permit request can block a
//! fencelock request (and the reverse) — as two Curator processes can block each other.

use std::sync::Arc;

use fencelock_core::kit::{Abandon, Claim, GiveUp, Held, Turn, Undo, until_turn};
use fencelock_core::{Error, FencingToken, Lease, Liveness, LockGuard};
use tokio::runtime::Handle;
use tokio::time::Instant;
use zookeeper_client as zk;

use crate::acquire::{self, Ask};
use crate::create;
use crate::error::{BACKEND, RETRY_PAUSE, connection_broke, map, retry, session_ended};
use crate::held::ZkGrant;
use crate::names::{self, Recipe};
use crate::node::Node;
use crate::session::{ZkSession, fixed_cap};

/// The lease nodes' name after the protection prefix, as Curator names them.
const LEASE_NAME: &str = "lease-";

/// The data of the leases directory for `limit`.
fn limit_data(limit: u32) -> Vec<u8> {
    format!("limit={limit}").into_bytes()
}

/// The limit stored in the leases directory's data (`None` if it holds none: created by
/// Curator, or by something else).
fn stored_limit(data: &[u8]) -> Option<u32> {
    std::str::from_utf8(data)
        .ok()?
        .strip_prefix("limit=")?
        .parse()
        .ok()
}

fn other_limit(name: &str, stored: u32, limit: u32) -> Error {
    Error::InvalidConfig(format!(
        "semaphore {name:?} is held with a limit of {stored} permits, not {limit}: every \
         client must ask with the same limit"
    ))
}

/// Takes `count` permits of semaphore `name` of `limit` on `session`, waiting as `ask`
/// says (its recipe and data are ignored).
pub(crate) async fn acquire(
    session: Arc<ZkSession>,
    name: &str,
    count: u32,
    limit: u32,
    ask: Ask<'_>,
) -> Result<LockGuard, Error> {
    let base = names::semaphore_dir(session.root(), name);
    let leases = format!("{base}/leases");
    check_request_size(name, &leases, count)?;
    // Fail fast on another limit, before queueing on the mutex.
    if let Some((stored, held)) = read_limit(&session, &leases).await?
        && stored != limit
        && held > 0
    {
        return Err(other_limit(name, stored, limit));
    }
    // The mutex lives as long as the session, whatever lease the permits will have: a
    // fixed lease starts at the grant, and must not run out on the mutex while waiting.
    let mutex = acquire::acquire_in(
        session.clone(),
        name,
        format!("{base}/locks"),
        Ask {
            recipe: Recipe::Lock,
            data: b"",
            lease: Lease::Renewing(session.timeout()),
            ..ask
        },
    )
    .await?;
    let granted = take_leases(&session, name, &leases, &mutex, count, limit, ask).await;
    // Whatever happened, the mutex goes (deleted in the background if this fails).
    let _ = mutex.release().await;
    granted
}

/// The most bytes the permits of one request may take in its multi-op: half the
/// server's default `jute.maxbuffer` (1 MiB). A larger request is refused by the server,
/// which closes the connection; sent again after each reconnect, it would never end.
const MAX_REQUEST_BYTES: usize = 512 * 1024;

/// Refuses, before any I/O, a request for more permits than one multi-op can create
/// (one node per permit; see [`MAX_REQUEST_BYTES`]).
fn check_request_size(name: &str, leases: &str, count: u32) -> Result<(), Error> {
    // The path of each node (`leases/_c_<uuid>-lease-`), its data, ACL and framing.
    let per_node = leases.len() + LEASE_NAME.len() + 48 + 64;
    let most = MAX_REQUEST_BYTES / per_node;
    if count as usize > most {
        return Err(Error::InvalidConfig(format!(
            "{count} permits of semaphore {name:?} in one request: ZooKeeper creates one \
             node per permit in one request, which fits at most {most} for this name"
        )));
    }
    Ok(())
}

/// The stored limit of `leases` and how many leases are held, if it stores one.
async fn read_limit(session: &ZkSession, leases: &str) -> Result<Option<(u32, usize)>, Error> {
    let (data, stat) = match retry(|| session.client.get_data(leases)).await {
        Ok(found) => found,
        Err(zk::Error::NoNode) => return Ok(None),
        Err(err) => return Err(map(err)),
    };
    Ok(stored_limit(&data).map(|limit| (limit, stat.num_children.max(0) as usize)))
}

/// Holding the internal mutex (`mutex`): waits until `count` more leases fit, then
/// creates them. Fails with a retryable [`Error::Unavailable`] if the mutex is lost
/// meanwhile (its node deleted, or the session's deadline passed): someone else may
/// hold it by now and queue ahead, and waiting on would be waiting outside its queue.
async fn take_leases(
    session: &Arc<ZkSession>,
    name: &str,
    leases: &str,
    mutex: &LockGuard,
    count: u32,
    limit: u32,
    ask: Ask<'_>,
) -> Result<LockGuard, Error> {
    let Some(mutex_path) = mutex.backend_key() else {
        return Err(Error::backend(
            BACKEND,
            false,
            "the semaphore's mutex has no node",
        ));
    };
    let ours = PendingLeases {
        session: session.clone(),
        dir: leases.to_owned(),
        prefix_name: format!("_c_{}-{LEASE_NAME}", uuid::Uuid::new_v4()),
    };
    let room = Room {
        session,
        name,
        leases,
        mutex,
        mutex_path,
        count,
        limit,
        lease: ask.lease,
        ours,
        pending: None,
    };
    let (room, (nodes, sent)) = until_turn(room, name, &ask.wait, ask.no_wait).await?;
    let granted = grant(session, name, nodes, ask, sent);
    if granted.is_ok() {
        // The guard owns the nodes now.
        if let Some(pending) = room.pending {
            pending.disarm();
        }
    }
    granted
}

/// Room for our leases under the semaphore's mutex: whether `count` more fit, creating
/// them if so ([`Claim::turn`]), and the wait for a lease to go ([`Claim::wait`]), in
/// the kit's loop ([`until_turn`]).
struct Room<'a> {
    session: &'a Arc<ZkSession>,
    name: &'a str,
    leases: &'a str,
    mutex: &'a LockGuard,
    mutex_path: &'a str,
    count: u32,
    limit: u32,
    lease: Lease,
    ours: PendingLeases,
    /// Armed once a multi-op that may create our lease nodes is sent.
    pending: Option<Undo<PendingLeases>>,
}

impl Claim for Room<'_> {
    /// The lease nodes, and when the multi-op that made them was sent.
    type Grant = (Vec<(String, zk::Stat)>, Instant);
    /// The watch on the leases directory's children.
    type Blocker = zk::OneshotWatcher;

    async fn turn(&mut self) -> Result<Turn<Self::Grant, zk::OneshotWatcher>, Error> {
        let (session, name, leases, limit) = (self.session, self.name, self.leases, self.limit);
        loop {
            let (data, stat) = match retry(|| session.client.get_data(leases)).await {
                Ok(found) => found,
                Err(zk::Error::NoNode) => {
                    create::ensure_dir_with(session, leases, &limit_data(limit)).await?;
                    continue;
                }
                Err(err) => return Err(acquire::waiting_error(name, err)),
            };
            let (children, watcher) =
                match retry(|| session.client.list_and_watch_children(leases)).await {
                    Ok(listed) => listed,
                    Err(zk::Error::NoNode) => continue,
                    Err(err) => return Err(acquire::waiting_error(name, err)),
                };
            match stored_limit(&data) {
                Some(stored) if stored == limit => {}
                Some(stored) if !children.is_empty() => {
                    return Err(other_limit(name, stored, limit));
                }
                // No limit stored (Curator made the directory) or another one with no
                // lease held: ours becomes the semaphore's. Holding the mutex, nobody
                // else adds.
                _ => {
                    match retry(|| {
                        session
                            .client
                            .set_data(leases, &limit_data(limit), Some(stat.version))
                    })
                    .await
                    {
                        Ok(_) | Err(zk::Error::BadVersion) | Err(zk::Error::NoNode) => continue,
                        Err(err) => return Err(acquire::waiting_error(name, err)),
                    }
                }
            }
            if children.len() as u64 + u64::from(self.count) > u64::from(limit) {
                return Ok(Turn::Behind(watcher));
            }
            let sent = Instant::now();
            let created = create_leases(
                session,
                &self.ours,
                &mut self.pending,
                stat.version,
                self.mutex_path,
                self.count,
            )
            .await;
            match created {
                Ok(Created::Nodes(nodes)) => {
                    if session.grant_deadline(self.lease, sent) <= Instant::now() {
                        return Err(Error::unavailable(
                            BACKEND,
                            "the lease ran out before the grant was confirmed (ZooKeeper answered too slowly)",
                        ));
                    }
                    return Ok(Turn::Granted((nodes, sent)));
                }
                // The limit changed under us (or the directory went): read again.
                Ok(Created::Changed) => continue,
                Ok(Created::MutexLost) => return Err(mutex_lost()),
                Err(err) => return Err(acquire::waiting_error(name, err)),
            }
        }
    }

    async fn wait(&mut self, watcher: zk::OneshotWatcher) -> Result<(), Error> {
        tokio::select! {
            _ = watcher.changed() => Ok(()),
            _ = self.session.ended() => {
                Err(Error::lost(self.name, "the ZooKeeper session ended while waiting"))
            }
            // Not only seen by the next multi-op (which checks the mutex node): with no
            // permit changing hands there would be none, and the request would wait for
            // ever outside the mutex's queue.
            () = self.mutex.lost() => Err(mutex_lost()),
        }
    }

    /// Nothing of ours was created while there was no room; leases a failed request
    /// may have made go in the background.
    async fn give_up(self, _why: GiveUp, error: Error) -> Error {
        error
    }
}

/// The semaphore's internal mutex was lost while waiting for permits.
fn mutex_lost() -> Error {
    Error::unavailable(
        BACKEND,
        "the semaphore's internal lock was lost while waiting (its node was deleted, or the \
         session's deadline passed); nothing was granted",
    )
}

/// What [`create_leases`] did.
enum Created {
    /// The lease nodes, created.
    Nodes(Vec<(String, zk::Stat)>),
    /// The leases directory changed (or went): nothing created.
    Changed,
    /// Our node of the internal mutex is gone (the session's deadline passed and the
    /// watcher deleted it): someone else may hold the mutex and count the leases, so
    /// nothing was created.
    MutexLost,
}

/// Creates `count` lease nodes in one multi-op that checks the leases directory is still
/// at `version` and that our node of the internal mutex (`mutex`) is still there: only
/// the mutex's holder may add leases, or two waiters could both see room for one.
async fn create_leases(
    session: &ZkSession,
    ours: &PendingLeases,
    pending: &mut Option<Undo<PendingLeases>>,
    version: i32,
    mutex: &str,
    count: u32,
) -> Result<Created, zk::Error> {
    let prefix = format!("{}/{}", ours.dir, ours.prefix_name);
    let options = zk::CreateMode::EphemeralSequential.with_acls(session.acls());
    loop {
        let mut multi = session.client.new_multi_writer();
        multi.add_check_version(&ours.dir, version)?;
        // Version -1: any version, the node must exist.
        multi.add_check_version(mutex, -1)?;
        for _ in 0..count {
            multi.add_create(&prefix, b"", &options)?;
        }
        // From here the nodes may exist: a dropped future deletes them by uuid.
        if pending.is_none() {
            *pending = Some(Undo::new(ours.clone()));
        }
        match multi.commit().await {
            Ok(results) => {
                let mut nodes = Vec::new();
                for result in results {
                    if let zk::MultiWriteResult::Create { path, stat } = result {
                        nodes.push((path, stat));
                    }
                }
                for (path, stat) in nodes.iter_mut() {
                    if stat.is_invalid() {
                        *stat = retry(|| session.client.get_data(path)).await?.1;
                    }
                }
                return Ok(Created::Nodes(nodes));
            }
            Err(zk::MultiWriteError::OperationFailed { index, .. }) => {
                // Nothing was created: a multi-op is all or nothing.
                if let Some(pending) = pending.take() {
                    pending.disarm();
                }
                return Ok(if index == 1 {
                    Created::MutexLost
                } else {
                    Created::Changed
                });
            }
            Err(zk::MultiWriteError::RequestFailed { source }) if connection_broke(&source) => {
                // Applied or not: a multi-op is all or nothing, so look for our nodes,
                // after a `sync`: the session may have reconnected to a server that has
                // not applied the multi yet, and sending it again would then create a
                // second set of leases (past the limit, the first set never released).
                retry(|| session.client.sync("/")).await?;
                let children = retry(|| session.client.list_children(&ours.dir)).await?;
                let mut own: Vec<String> = children
                    .into_iter()
                    .filter(|c| c.starts_with(&ours.prefix_name))
                    .collect();
                if own.is_empty() {
                    tokio::time::sleep(RETRY_PAUSE).await;
                    continue;
                }
                own.sort_unstable();
                let mut nodes = Vec::new();
                for child in own {
                    let path = format!("{}/{child}", ours.dir);
                    let stat = retry(|| session.client.get_data(&path)).await?.1;
                    nodes.push((path, stat));
                }
                return Ok(Created::Nodes(nodes));
            }
            Err(zk::MultiWriteError::RequestFailed { source }) => return Err(source),
        }
    }
}

/// Builds the guard over the granted lease nodes.
fn grant(
    session: &Arc<ZkSession>,
    name: &str,
    nodes: Vec<(String, zk::Stat)>,
    ask: Ask<'_>,
    sent: Instant,
) -> Result<LockGuard, Error> {
    let cap = fixed_cap(ask.lease, sent);
    let liveness = Liveness::new(session.grant_deadline(ask.lease, sent));
    let mut nodes = nodes
        .into_iter()
        .map(|(path, stat)| (Node::new(session.clone(), path, stat.version), stat.czxid));
    // A multi-op is one transaction: every node has its zxid.
    let Some((first, czxid)) = nodes.next() else {
        // `count` is at least one, so the multi-op created a node.
        return Err(Error::backend(
            BACKEND,
            true,
            "the lease multi-op created no node",
        ));
    };
    let extra = nodes.map(|(node, _)| node).collect();
    let name: Arc<str> = name.into();
    let grant = ZkGrant::start_many(name.clone(), first, extra, liveness.clone(), cap);
    let held = Arc::new(Held::new(grant, liveness.clone()));
    Ok(LockGuard::with_name(
        name,
        FencingToken::new(czxid as u64),
        BACKEND,
        liveness,
        held,
    ))
}

/// Lease nodes a request may have created and not handed to a guard: deleted by the
/// kit's [`Undo`] in the background (by uuid prefix) when dropped armed.
#[derive(Clone)]
struct PendingLeases {
    session: Arc<ZkSession>,
    dir: String,
    prefix_name: String,
}

impl Abandon for PendingLeases {
    fn runtime(&self) -> &Handle {
        self.session.runtime()
    }

    fn abandon(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let PendingLeases {
            session,
            dir,
            prefix_name,
        } = self;
        Some(async move {
            // Repeated until answered or the session ends (see `acquire::Pending`). After
            // a `sync`, so that a server behind the leader cannot hide nodes of ours.
            if retry(|| session.client.sync("/")).await.is_err() {
                return;
            }
            let children = match retry(|| session.client.list_children(&dir)).await {
                Ok(children) => children,
                Err(_) => return,
            };
            for child in children.iter().filter(|c| c.starts_with(&prefix_name)) {
                let path = format!("{dir}/{child}");
                match retry(|| session.client.delete(&path, None)).await {
                    Ok(()) | Err(zk::Error::NoNode) => {}
                    Err(err) if session_ended(&err) => return,
                    Err(error) => {
                        tracing::debug!(%path, %error, "could not delete an abandoned lease node");
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_round_trips_and_foreign_data_is_none() {
        assert_eq!(stored_limit(&limit_data(7)), Some(7));
        assert_eq!(stored_limit(b""), None);
        assert_eq!(stored_limit(b"10.0.0.1"), None);
        assert_eq!(stored_limit(b"limit=x"), None);
    }
}
