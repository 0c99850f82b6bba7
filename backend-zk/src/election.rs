//! Leader election in the layout of Apache Curator's `LeaderLatch`.
//!
//! Election `name` under root `/r` lives in the container node `/r/{encoded name}`, the
//! directory a lock of that name would use. Each candidate creates
//! `/r/{encoded name}/_c_<uuid>-latch-<seq>` (EPHEMERAL_SEQUENTIAL, Curator's protected
//! mode) with its value as the node's data, exactly as a Curator `LeaderLatch` on that
//! path creates its node with its participant id; the lowest sequence leads, and its
//! node's czxid is the term's token. Campaigning is [acquiring](crate::acquire) with the
//! latch node name, so the lock's queueing, cancellation and loss reporting apply
//! unchanged.
//!
//! Observers hold one persistent recursive watch (ZooKeeper 3.6+) on the directory: they
//! list and read the candidates once after setting it, then apply every creation and
//! deletion of a candidate node in the order the server reports them, so no leader whose
//! value could be read is skipped. See [`follow`] for what can still be missed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use fencelock_core::{Error, FencingToken, Leader, LeaderChange};
use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::error::{BACKEND, map, retry, session_ended};
use crate::names::{self, Rank, Recipe};
use crate::pool::SessionPool;
use crate::session::ZkSession;

/// The candidate (or other) nodes of one election directory, in Curator's order.
#[derive(Debug, Default)]
pub(crate) struct Candidates {
    /// (sort key, child name) → the candidate it describes; `None` for another recipe's
    /// node (a lock's). Nodes no recipe makes ([`names::recipe_node`]: an application's
    /// own, such as `mylatch-0000000001`) are left out.
    nodes: BTreeMap<(Rank, String), Option<Leader>>,
}

impl Candidates {
    /// The leader: the first node (oldest across a wrap of the sequence counter, see
    /// [`names::order_start`]), if it is a latch node.
    pub(crate) fn leader(&self) -> Option<Leader> {
        let (_, first) = names::order_start(self.nodes.keys().map(|(rank, _)| rank));
        self.nodes.values().nth(first).cloned().flatten()
    }

    fn key(child: &str) -> (Rank, String) {
        (names::rank(child), child.to_owned())
    }

    fn remove(&mut self, child: &str) {
        self.nodes.remove(&Self::key(child));
    }

    /// Reads `child` of `dir` and records it; a node already gone is left out (its
    /// deletion is reported after its creation, and a deletion of an unknown node
    /// changes nothing), as is a node no recipe makes.
    async fn read(&mut self, session: &ZkSession, dir: &str, child: &str) -> Result<(), zk::Error> {
        let Some(recipe) = names::recipe_node(child) else {
            return Ok(());
        };
        let candidate = if recipe == Recipe::Latch {
            let path = format!("{dir}/{child}");
            match retry(|| session.client.get_data(&path)).await {
                Ok((data, stat)) => Some(Leader::new(
                    String::from_utf8_lossy(&data),
                    FencingToken::new(stat.czxid as u64),
                )),
                Err(zk::Error::NoNode) => return Ok(()),
                Err(err) => return Err(err),
            }
        } else {
            None
        };
        self.nodes.insert(Self::key(child), candidate);
        Ok(())
    }

    /// Every node of `dir` now.
    pub(crate) async fn load(session: &ZkSession, dir: &str) -> Result<Self, zk::Error> {
        let children = match retry(|| session.client.list_children(dir)).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => Vec::new(),
            Err(err) => return Err(err),
        };
        let mut candidates = Candidates::default();
        for child in children {
            candidates.read(session, dir, &child).await?;
        }
        Ok(candidates)
    }
}

/// The leader of `dir` now: the first recipe node ([`names::recipe_node`]) in Curator's
/// order, if it is a latch node, with its data as the value and its czxid as the token.
/// `None` when nobody campaigns, or when the first node is a lock's (see
/// [`crate::acquire::mixed_recipes`]).
pub(crate) async fn leader(session: &ZkSession, dir: &str) -> Result<Option<Leader>, Error> {
    for _ in 0..16 {
        let mut children = match retry(|| session.client.list_children(dir)).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(err) => return Err(map(err)),
        };
        children.retain(|child| names::recipe_node(child).is_some());
        names::sort_children(&mut children);
        let Some(first) = children.first() else {
            return Ok(None);
        };
        if names::recipe_node(first) != Some(Recipe::Latch) {
            return Ok(None);
        }
        let path = format!("{dir}/{first}");
        match retry(|| session.client.get_data(&path)).await {
            Ok((data, stat)) => {
                return Ok(Some(Leader::new(
                    String::from_utf8_lossy(&data),
                    FencingToken::new(stat.czxid as u64),
                )));
            }
            // It resigned between the listing and the read: look again.
            Err(zk::Error::NoNode) => continue,
            Err(err) => return Err(map(err)),
        }
    }
    Err(Error::backend(
        BACKEND,
        true,
        "the election changed leaders too often to read",
    ))
}

/// A persistent recursive watch on `dir` and the candidates read after it was set.
pub(crate) async fn start(
    session: &ZkSession,
    dir: &str,
) -> Result<(zk::PersistentWatcher, Candidates), zk::Error> {
    let watcher = retry(|| {
        session
            .client
            .watch(dir, zk::AddWatchMode::PersistentRecursive)
    })
    .await?;
    let candidates = Candidates::load(session, dir).await?;
    Ok((watcher, candidates))
}

/// Pause before setting the watch up again after a failure.
const RESTART_PAUSE: Duration = Duration::from_millis(200);

/// Follows the election in `dir`, sending each change of leader to `changes` (the state
/// `candidates` describes was sent already), until `stop` is cancelled, nobody listens
/// any more, or the client is closed.
///
/// Each creation of a candidate node is followed by a read of its data; deletions are
/// applied as they come, in the server's order. So every candidate that led is reported,
/// in order, except one whose node was created and deleted before its data could be read
/// (a term shorter than one round trip that nobody waited behind), and except changes
/// while the connection was lost (ZooKeeper does not replay a persistent watch's events
/// on reconnection, ZOOKEEPER-4698): after a reconnection the watch is set again, and on
/// a new session after the session expired; then the directory is read again and the
/// leader then is reported if it differs.
pub(crate) async fn follow(
    pool: Arc<SessionPool>,
    session: Arc<ZkSession>,
    dir: String,
    watcher: zk::PersistentWatcher,
    candidates: Candidates,
    changes: UnboundedSender<LeaderChange>,
    stop: CancellationToken,
) {
    let stopped = follow_until_stopped(
        pool,
        session,
        dir,
        watcher,
        candidates,
        changes.clone(),
        stop.clone(),
    )
    .await;
    if stopped {
        // Stopped by the client's close: the stream ends with `Closed`, as on every
        // backend. (A dropped stream cancels `stop` too, but has no receiver left.) Not
        // after an error of its own: the stream ends with that one.
        let _ = changes.send(Err(Error::Closed { backend: BACKEND }));
    }
}

/// [`follow`] until `stop` is cancelled, the session or client is gone, or nobody
/// listens.
async fn follow_until_stopped(
    pool: Arc<SessionPool>,
    mut session: Arc<ZkSession>,
    dir: String,
    mut watcher: zk::PersistentWatcher,
    mut candidates: Candidates,
    changes: UnboundedSender<LeaderChange>,
    stop: CancellationToken,
) -> bool {
    let mut last = candidates.leader();
    let announce = |candidates: &Candidates, last: &mut Option<Leader>| {
        let now = candidates.leader();
        if now != *last {
            last.clone_from(&now);
            return changes.send(Ok(now)).is_ok();
        }
        !changes.is_closed()
    };
    let prefix = format!("{dir}/");
    loop {
        // Wait for the next event; after a terminal session state the watcher must not
        // be polled again, so it is replaced before the loop comes back here.
        let event = tokio::select! {
            () = stop.cancelled() => return true,
            event = watcher.changed() => event,
        };
        let outcome = match event.event_type {
            zk::EventType::Session => match event.session_state {
                zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                    // Reconnected. `zookeeper-client` 0.11 sets only one-shot watches
                    // again on a new connection (persistent ones are left out of its
                    // SetWatches request), and ZooKeeper does not replay the events
                    // missed meanwhile anyway: set the watch again, then read everything
                    // again. The old watcher is dropped after the new one is set, so the
                    // server-side watch is never removed.
                    match retry(|| {
                        session
                            .client
                            .watch(&dir, zk::AddWatchMode::PersistentRecursive)
                    })
                    .await
                    {
                        Ok(fresh) => {
                            watcher = fresh;
                            Candidates::load(&session, &dir).await.map(|fresh| {
                                candidates = fresh;
                            })
                        }
                        Err(err) => Err(err),
                    }
                }
                state if state.is_terminated() => Err(zk::Error::SessionExpired),
                _ => Ok(()),
            },
            zk::EventType::NodeCreated => match event.path.strip_prefix(&prefix) {
                Some(child) if !child.contains('/') => candidates.read(&session, &dir, child).await,
                _ => Ok(()),
            },
            zk::EventType::NodeDeleted => {
                if let Some(child) = event.path.strip_prefix(&prefix) {
                    candidates.remove(child);
                }
                Ok(())
            }
            zk::EventType::NodeDataChanged => match event.path.strip_prefix(&prefix) {
                Some(child) if !child.contains('/') => candidates.read(&session, &dir, child).await,
                _ => Ok(()),
            },
            zk::EventType::NodeChildrenChanged => Ok(()),
        };
        match outcome {
            Ok(()) => {}
            Err(err) if session_ended(&err) || !session.is_usable() => {
                // The session is over: start again on a live one, from a fresh read.
                loop {
                    let restarted = async {
                        let fresh = pool.get(pool.config().session_timeout()).await?;
                        let (w, c) = start(&fresh, &dir).await.map_err(map)?;
                        Ok::<_, Error>((fresh, w, c))
                    };
                    let restarted = tokio::select! {
                        () = stop.cancelled() => return true,
                        restarted = restarted => restarted,
                    };
                    match restarted {
                        Ok((fresh, w, c)) => {
                            (session, watcher, candidates) = (fresh, w, c);
                            break;
                        }
                        Err(Error::Closed { .. }) => return true,
                        Err(error) => {
                            tracing::debug!(%error, dir, "zookeeper election watch: restarting");
                            tokio::select! {
                                () = stop.cancelled() => return true,
                                () = tokio::time::sleep(RESTART_PAUSE) => {}
                            }
                        }
                    }
                }
            }
            Err(err) => {
                // A read failed for another reason (permissions, say): observing ends.
                let _ = changes.send(Err(map(err)));
                return false;
            }
        }
        if !announce(&candidates, &mut last) {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The leader is the oldest candidate, also after the directory's sequence counter
    /// ran past `2147483647` to `-2147483648` (which sorts first as text).
    #[test]
    fn the_oldest_candidate_leads_across_the_wrap_of_the_counter() {
        let mut candidates = Candidates::default();
        for (child, value, token) in [
            ("_c_b-latch--2147483648", "second", 2),
            ("_c_a-latch-2147483647", "first", 1),
            ("_c_c-latch--2147483646", "third", 3),
        ] {
            candidates.nodes.insert(
                Candidates::key(child),
                Some(Leader::new(value, FencingToken::new(token))),
            );
        }
        assert_eq!(
            candidates.leader().map(|l| l.value),
            Some("first".to_owned())
        );
        candidates.remove("_c_a-latch-2147483647");
        assert_eq!(
            candidates.leader().map(|l| l.value),
            Some("second".to_owned())
        );
        assert_eq!(Candidates::default().leader(), None);
    }
}
