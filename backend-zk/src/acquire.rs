//! Taking a lock: Curator's `InterProcessMutex` protocol, with a czxid token; and
//! campaigning, the same protocol with Curator's `LeaderLatch` node name.
//!
//! 1. Create `{dir}/_c_<uuid>-lock-` (`-latch-` for a campaign, with the candidate's
//!    value as data) EPHEMERAL_SEQUENTIAL, together with the container `dir` in one
//!    multi-op (the last release removed it: see [`Node::with_dir`]); in an existing `dir`
//!    alone (creating the persistent root on `NoNode`). On connection loss, look for a
//!    child with our uuid (ZOOKEEPER-1262) and adopt it, or create again.
//! 2. List the children, sort them by sequence. First → granted, with the node's czxid
//!    as the token. Otherwise watch only the immediate predecessor (`getData` watch) and
//!    list again when it changes. Uncontended: two round trips (and one for the
//!    release, which also removes `dir` when it leaves it empty). A node of the other
//!    recipe before ours (a lock in an election's directory or the reverse) makes us
//!    give up with an error: see [`mixed_recipes`].
//!
//! Step 1 is [`create_node`]; step 2 is [`Queued`], the protocol's part of the kit's
//! claim/wait loop ([`until_turn`]), which decides when to refuse, wait and give up.
//!
//! Dropping the future at any point deletes whatever node it may have created, in the
//! background: by path when known, and every node with our uuid (listed after a `sync`).

use std::sync::Arc;

use fencelock_core::kit::{Abandon, Claim, GiveUp, Held, Turn, Undo, until_turn};
use fencelock_core::{Error, FencingToken, Lease, Liveness, LockGuard, WaitDeadline};
use tokio::runtime::Handle;
use tokio::time::Instant;
use zookeeper_client as zk;

use crate::create::create_node;
use crate::error::{BACKEND, RETRY_PAUSE, connection_broke, map, retry, session_ended};
use crate::held::ZkGrant;
use crate::names::{self, Recipe};
use crate::node::Node;
use crate::session::{ZkSession, fixed_cap};

/// What to take and how long to wait.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask<'a> {
    /// A lock (`InterProcessMutex` nodes) or a campaign (`LeaderLatch` nodes).
    pub(crate) recipe: Recipe,
    /// The node's data: empty for a lock, the candidate's value for a campaign.
    pub(crate) data: &'a [u8],
    pub(crate) lease: Lease,
    /// Give up with `Contended` instead of waiting.
    pub(crate) no_wait: bool,
    /// Give up with `Timeout` at its end.
    pub(crate) wait: WaitDeadline,
}

/// Acquires `name` on `session` (or campaigns for it, as `ask` says).
pub(crate) async fn acquire(
    session: Arc<ZkSession>,
    name: &str,
    ask: Ask<'_>,
) -> Result<LockGuard, Error> {
    let dir = names::lock_dir(session.root(), name);
    acquire_in(session, name, dir, ask).await
}

/// Acquires `name` with nodes in the directory `dir` (a lock's, a read-write lock's or
/// a semaphore's internal mutex). A reader ([`Recipe::Read`]) waits only for the writers
/// before it, and watches the nearest one; every other recipe waits for every node
/// before it and watches its immediate predecessor.
pub(crate) async fn acquire_in(
    session: Arc<ZkSession>,
    name: &str,
    dir: String,
    ask: Ask<'_>,
) -> Result<LockGuard, Error> {
    let Ask {
        recipe,
        data,
        lease,
        no_wait,
        wait,
    } = ask;
    // A request that may wait first waits behind this session's other waiters for
    // the directory: only the front has a node in the queue, so the one whose turn
    // comes lists as many children as there are waiting sessions, not tasks. The front
    // passes on when this returns (granted, refused or dropped).
    let _front = if no_wait {
        None
    } else {
        Some(
            wait.run_until(wait.at(), name, session.lines.front(&dir))
                .await?,
        )
    };
    let mut pending = Undo::new(Pending {
        session: session.clone(),
        dir,
        prefix_name: names::protected_prefix(recipe),
        path: None,
        gone: false,
    });
    let created_at = Instant::now();
    let (path, stat, made_dir) =
        create_node(&session, &pending.dir, &pending.prefix_name, data).await?;
    pending.path = Some(path.clone());
    let queued = Queued {
        session: &session,
        name,
        recipe,
        lease,
        until: if no_wait { None } else { wait.at() },
        no_wait,
        pending,
        path,
        stat,
        made_dir,
        created_at: Some(created_at),
    };
    let (queued, (sent, alone)) = until_turn(queued, name, &wait, no_wait).await?;
    let Queued {
        path,
        stat,
        pending,
        ..
    } = queued;
    let pending = pending.disarm();
    let dir = alone.then_some(pending.dir);
    Ok(grant(session, name, path, stat, lease, sent, dir))
}

/// Our node in the directory's queue, from its create to its grant: whose turn it is
/// ([`Claim::turn`]: list the directory, find the node before ours) and the wait for
/// it ([`Claim::wait`]: watch that node), in the kit's loop ([`until_turn`]).
struct Queued<'a> {
    session: &'a Arc<ZkSession>,
    name: &'a str,
    recipe: Recipe,
    lease: Lease,
    /// Until when a grant may wait for its session's deadline to be confirmed: the
    /// end of the wait (`None`, for a request that does not wait: not at all).
    until: Option<Instant>,
    no_wait: bool,
    /// Our node, deleted if the acquire does not end in a grant.
    pending: Undo<Pending>,
    path: String,
    stat: zk::Stat,
    /// The czxid of the directory, if our create made it.
    made_dir: Option<i64>,
    /// When the create was sent, until the first listing.
    created_at: Option<Instant>,
}

impl Claim for Queued<'_> {
    /// When the ownership of the node was confirmed, and whether it was the
    /// directory's only child.
    type Grant = (Instant, bool);
    /// The path of the node to wait for.
    type Blocker = String;

    async fn turn(&mut self) -> Result<Turn<(Instant, bool), String>, Error> {
        let (session, name) = (self.session, self.name);
        // The moment the session is proven alive at the leader: the create (a write the
        // leader committed for our session) on the first listing; later, a `sync` sent
        // before the listing. A follower cut off from the leader answers plain reads from
        // its old state for up to syncLimit × tickTime, possibly after the leader expired
        // our session and deleted our node; its `sync` fails instead.
        let sent = match self.created_at.take() {
            Some(created_at) => created_at,
            None => {
                let sent = Instant::now();
                if let Err(err) = retry(|| session.client.sync("/")).await {
                    return Err(waiting_error(name, err));
                }
                sent
            }
        };
        let dir = &self.pending.dir;
        let own = &self.path[dir.len() + 1..];
        let stat = &mut self.stat;
        // With the directory's stat: whether the release may remove the directory.
        let (mut children, alone) = match retry(|| session.client.get_children(dir)).await {
            Ok((children, dir)) => {
                if stat.is_invalid() && children.iter().any(|child| child == own) {
                    // Made with `dir` in one multi-op by a server that answers a multi's
                    // create without its stat (see `create_node`): one transaction, so
                    // one czxid, and this is that `dir` (our node has kept it since: a
                    // directory with a child cannot be deleted). A new node's version is 0.
                    stat.czxid = dir.czxid;
                    stat.version = 0;
                }
                let removable = !session.root().is_empty()
                    || dir.czxid == stat.czxid
                    || self.made_dir == Some(dir.czxid);
                (children, removable && dir.num_children == 1)
            }
            Err(zk::Error::NoNode) => (Vec::new(), false),
            Err(err) => return Err(waiting_error(name, err)),
        };
        // Only the recipes' nodes queue: another application's node in the directory
        // (`padlock-0000000001`, under the root `/`) is never a holder or predecessor,
        // as `inspect` and `leader` see it too.
        children.retain(|child| names::recipe_node(child).is_some());
        names::sort_children(&mut children);
        let Some(index) = children.iter().position(|c| c == own) else {
            // Nothing of ours to delete.
            self.pending.gone = true;
            return Err(Error::lost(
                name,
                "the lock node disappeared while waiting (session expired or node deleted)",
            ));
        };
        delete_own_orphans(session, &self.pending, own, &children);
        if let Some(other) = children[..index]
            .iter()
            .find_map(|c| names::recipe_node(c).filter(|r| !r.shares_dir(self.recipe)))
        {
            let refused = mixed_recipes(name, dir, other);
            if tokio::time::timeout(GIVE_UP_DELETE, self.pending.undo_now())
                .await
                .unwrap_or(false)
            {
                self.pending.gone = true;
            }
            return Err(refused);
        }
        // The node to wait for: for a reader the nearest writer before it (readers share),
        // for everyone else the immediate predecessor.
        let blocker = match self.recipe {
            Recipe::Read => children[..index]
                .iter()
                .rposition(|c| names::recipe_node(c) == Some(Recipe::Write)),
            _ => index.checked_sub(1),
        };
        if let Some(blocker) = blocker {
            return Ok(Turn::Behind(format!("{dir}/{}", children[blocker])));
        }
        let until = if self.no_wait {
            Some(Instant::now())
        } else {
            self.until
        };
        if session
            .confirmed_deadline(self.lease, sent, until)
            .await
            .is_none()
        {
            // Confirmed only after the lease ran out (slow replies, or a cut the
            // session's next probes did not confirm in time): not a grant; the armed
            // clean-up deletes our node.
            return Err(Error::unavailable(
                BACKEND,
                "the lease ran out before the grant was confirmed (ZooKeeper answered too slowly)",
            ));
        }
        Ok(Turn::Granted((sent, alone)))
    }

    async fn wait(&mut self, predecessor: String) -> Result<(), Error> {
        let session = self.session;
        match session.client.get_and_watch_data(&predecessor).await {
            Ok((_, _, watcher)) => {
                tokio::select! {
                    _ = watcher.changed() => Ok(()),
                    _ = session.ended() => {
                        Err(Error::lost(self.name, "the ZooKeeper session ended while waiting"))
                    }
                }
            }
            Err(zk::Error::NoNode) => Ok(()),
            Err(err) if connection_broke(&err) => {
                tokio::time::sleep(RETRY_PAUSE).await;
                Ok(())
            }
            Err(err) => Err(waiting_error(self.name, err)),
        }
    }

    async fn give_up(self, why: GiveUp, error: Error) -> Error {
        match why {
            // Not bounded: a try that does not wait deletes its node before answering.
            GiveUp::Refused => {
                self.pending.finish_now(std::time::Duration::MAX).await;
            }
            // A waiter whose time ran out deletes its node before returning, so a
            // process that exits right after the timeout leaves nothing that would
            // block the name until its session expires. Bounded by
            // [`GIVE_UP_DELETE`]; past it the background clean-up takes over.
            GiveUp::TimedOut => {
                self.pending.finish_now(GIVE_UP_DELETE).await;
            }
            // The session ended or the server failed: the clean-up goes on in the
            // background.
            GiveUp::Failed => {}
        }
        error
    }
}

/// Builds the guard for a granted node whose ownership was confirmed by a request sent
/// at `sent`. Its release also removes `dir` if it leaves it empty (see
/// [`Node::with_dir`]): `Some` only for a directory made by a recipe whose one child
/// was our node when the grant listed it.
///
/// Made by a recipe: never an application's node. Under a lock root of its own
/// (`zk://host/locks`) every directory is a lock's, made by fencelock or Curator as a
/// container, which the server reaps anyway once empty. Under the root `/` the
/// directory of lock `admin` is Kafka's `/admin`, and a client cannot tell a container
/// from a persistent node (the server shows both with `ephemeralOwner` 0), so only the
/// directory this acquire made itself (its czxid is the listed one) is removed; any other
/// is left to the server's reaper. Our node alone: with a waiter (or another node) there
/// the server would refuse the removal, at the cost of a second round trip; a node that
/// comes after the grant costs that round trip. The directory cannot be replaced
/// meanwhile: our node keeps it until the release.
fn grant(
    session: Arc<ZkSession>,
    name: &str,
    path: String,
    stat: zk::Stat,
    lease: Lease,
    sent: Instant,
    dir: Option<String>,
) -> LockGuard {
    let cap = fixed_cap(lease, sent);
    let liveness = Liveness::new(session.grant_deadline(lease, sent));
    let token = FencingToken::new(stat.czxid as u64);
    let name: Arc<str> = name.into();
    let grant = ZkGrant::start(
        name.clone(),
        Node::new(session, path, stat.version).with_dir(dir),
        liveness.clone(),
        cap,
    );
    let held = Arc::new(Held::new(grant, liveness.clone()));
    LockGuard::with_name(name, token, BACKEND, liveness, held)
}

/// Why a lock and an election never share a name: the directory of `name` already holds
/// a node of recipe `other` created before ours.
///
/// Curator's `InterProcessMutex` sorts the nodes of its directory by what follows
/// `lock-`, its `LeaderLatch` by what follows `latch-`; each puts the other's nodes last
/// (their whole names sort after any sequence number), so a Curator lock and a Curator
/// latch in one directory would both hold at once. Rather than queue both kinds in one
/// order that Curator does not share, the later of two nodes of different recipes
/// gives up (nodes are numbered from one counter, so exactly one of two live nodes is
/// the later): a lock and an election of the same name exclude each other, the later
/// one with this error. Not retryable: the name is used for two purposes.
pub(crate) fn mixed_recipes(name: &str, dir: &str, other: Recipe) -> Error {
    Error::backend(
        BACKEND,
        false,
        format!(
            "the ZooKeeper path {dir} of {name:?} is in use as {}: a lock and an election \
             cannot share a name (Curator would not see them exclude each other)",
            other.describe()
        ),
    )
}

pub(crate) fn waiting_error(name: &str, err: zk::Error) -> Error {
    if session_ended(&err) {
        Error::lost(
            name,
            format!("the ZooKeeper session ended while waiting: {err}"),
        )
    } else {
        map(err)
    }
}

/// A create that was retried after connection loss may have been applied twice: delete
/// every node with our uuid except the one we use.
fn delete_own_orphans(session: &ZkSession, pending: &Pending, own: &str, children: &[String]) {
    for orphan in children
        .iter()
        .filter(|c| c.starts_with(&pending.prefix_name) && c.as_str() != own)
    {
        let client = session.client.clone();
        let path = format!("{}/{orphan}", pending.dir);
        session.runtime().spawn(async move {
            // Repeated like every clean-up: a duplicate left in a live session would
            // block later waiters once this acquire is done.
            let _ = retry(|| client.delete(&path, None)).await;
        });
    }
}

/// The node an unfinished acquire may own; deleted by the kit's [`Undo`] in the
/// background if the acquire is dropped or gives up.
///
/// The background delete is repeated until it gets an answer or the session ends: a
/// node left behind in a live session would block every later waiter for as long as
/// the session lives (which, for a healthy client, is forever).
struct Pending {
    session: Arc<ZkSession>,
    dir: String,
    prefix_name: String,
    path: Option<String>,
    /// Known gone (the session took it, or it was deleted already): nothing to undo.
    gone: bool,
}

/// Upper bound on deleting a waiter's node before returning a timeout; past it the
/// deletion continues in the background. A healthy server answers in milliseconds; a
/// hung one must not stretch the caller's wait timeout by more than this.
pub(crate) const GIVE_UP_DELETE: std::time::Duration = std::time::Duration::from_millis(200);

impl Abandon for Pending {
    fn runtime(&self) -> &Handle {
        self.session.runtime()
    }

    /// Deletes the known node first, then every other node of our uuid: a create sent
    /// again after a lost reply may have made two, and the first is deleted by the
    /// acquire only at its first listing, which a dropped future may never reach. The
    /// listing follows a `sync`, so that a server behind the leader cannot hide a node
    /// of ours.
    fn abandon(self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let Pending {
            session,
            dir,
            prefix_name,
            path,
            gone,
        } = self;
        if gone {
            return None;
        }
        Some(async move {
            if let Some(path) = &path {
                if !delete_abandoned(&session, path).await {
                    return;
                }
            }
            if retry(|| session.client.sync("/")).await.is_err() {
                return;
            }
            let Ok(children) = retry(|| session.client.list_children(&dir)).await else {
                return;
            };
            for child in children.iter().filter(|c| c.starts_with(&prefix_name)) {
                if !delete_abandoned(&session, &format!("{dir}/{child}")).await {
                    return;
                }
            }
        })
    }

    /// Deletes the known node now (when giving up): done once it is gone, or the session
    /// ended (and took it).
    async fn undo_now(&mut self) -> bool {
        let Some(path) = &self.path else {
            return false;
        };
        let deleted = retry(|| self.session.client.delete(path, None)).await;
        matches!(deleted, Ok(()) | Err(zk::Error::NoNode))
            || deleted.as_ref().is_err_and(session_ended)
    }
}

/// Deletes a node of an abandoned acquire, repeating the delete while the connection
/// breaks; `false` once the session has ended (and taken its nodes with it).
async fn delete_abandoned(session: &ZkSession, path: &str) -> bool {
    match retry(|| session.client.delete(path, None)).await {
        Ok(()) | Err(zk::Error::NoNode) => true,
        Err(err) if session_ended(&err) => false,
        Err(error) => {
            tracing::debug!(%path, %error, "could not delete the node of an abandoned acquire");
            true
        }
    }
}
