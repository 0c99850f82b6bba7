//! The watch on the nodes of a held lock, and the deletes after a loss by deadline.
//!
//! A held lock needs a watch on its node (a deletion by anyone else is a loss) and, once
//! it is lost by deadline (a fixed lease ran out, or the session could not be confirmed
//! in time), a delete that frees the lock for others. A task per lock did this at the
//! cost of a spawn at every grant, a wake-up at every release and a timer and a task's
//! memory per held lock. Instead:
//!
//! - the watch is the grant's work on its session's [`Delayed`] (core's one
//!   delayed-watch mechanism): armed only for locks still held [`WATCH_DELAY`] later,
//!   so most critical sections, which are shorter, cost no watch request, no
//!   notification and no wake-up of their own. A deletion in between is not missed:
//!   arming then finds no node. Armed watches are futures of the queue's one task, and
//!   a release wakes nothing: it only sets a flag, and the watch fires on our own delete
//!   and ends then;
//! - the deadlines of watched locks are kept in one heap per session ([`Deadlines`]),
//!   looked at when the earliest is due, by one more future of that same task, which
//!   runs while the heap is not empty: a timer in each lock's watch would cost its
//!   memory per held lock.

use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use fencelock_core::kit::Delayed;
use fencelock_core::kit::delayed::{Work, sleep_until};
use fencelock_core::{Liveness, LossCause};
use tokio::sync::Notify;
use tokio::time::Instant;
use zookeeper_client as zk;

use crate::error::session_ended;

/// How long after the grant the watch on a held lock's node is armed.
pub(crate) const WATCH_DELAY: Duration = Duration::from_millis(10);

/// How often the queue of grants is looked at while it is not empty: arming happens
/// between [`WATCH_DELAY`] and `WATCH_DELAY + TICK` after the grant.
pub(crate) const TICK: Duration = Duration::from_millis(10);

/// The pause before arming again after a request failed without ending the session.
const REARM_PAUSE: Duration = Duration::from_millis(50);

/// A held grant as its session's watcher (and, at close, its session) sees it: the nodes
/// to watch, the guard's liveness, and what to do on a loss. Implemented by the guard's
/// record ([`crate::held`]); a trait so that the session, which owns the watches, and
/// the nodes, which belong to the session, do not depend on each other in a loop.
pub(crate) trait Watched: Send + Sync {
    /// The guard's liveness.
    fn liveness(&self) -> &Liveness;

    /// How many nodes the grant has (one, or a semaphore's permits): each is watched.
    fn node_count(&self) -> usize;

    /// The client and path to watch node `index` (`0..node_count()`) with.
    fn node(&self, index: usize) -> (&zk::Client, &str);

    /// The paths of the grant's nodes, the main one last.
    fn paths(&self) -> Vec<String>;

    /// Whether the guard stopped watching (it is being released or was dropped): the
    /// deletion of its nodes from now on is its own, not a loss.
    fn is_stopped(&self) -> bool;

    /// Marks the grant lost (the first cause marked stays), unless it is stopped.
    fn lost(&self, cause: LossCause, reason: String);

    /// The grant is lost by deadline (or given up at close): deletes its nodes in the
    /// background, once, so it does not stay blocked by nodes nobody uses.
    fn give_up(&self);
}

/// Watches a fresh grant from [`WATCH_DELAY`] on (on `watches`, the session's queue),
/// until it is stopped, lost, or its nodes are gone; its deadline goes into `deadlines`
/// then.
pub(crate) fn watch<W: Watched + 'static>(
    watches: &Arc<Delayed>,
    deadlines: &Arc<Deadlines>,
    tracked: &Arc<W>,
) {
    let (weak, deadlines) = (Arc::downgrade(tracked), deadlines.clone());
    watches.schedule(tracked.liveness().clone(), move || -> Work {
        let Some(tracked) = weak.upgrade().filter(|tracked| !tracked.is_stopped()) else {
            return Box::pin(async {});
        };
        deadlines.add(
            Arc::downgrade(&tracked) as Weak<dyn Watched>,
            tracked.liveness(),
        );
        // The watch holds the record alone: it is every held lock's, so kept small.
        Box::pin(async move {
            match tracked.node_count() {
                1 => watch_node(&*tracked, 0).await,
                count => {
                    let nodes = (0..count).map(|index| watch_node(&*tracked, index));
                    futures_util::future::join_all(nodes).await;
                }
            }
        })
    });
}

/// Arms a watch on `path`, after `pause` if one is given.
async fn arm(
    client: &zk::Client,
    path: &str,
    pause: Option<Duration>,
) -> Result<zk::OneshotWatcher, zk::Error> {
    if let Some(pause) = pause {
        tokio::time::sleep(pause).await;
    }
    let (_, _, watcher) = client.get_and_watch_data(path).await?;
    Ok(watcher)
}

/// Watches node `index` of `tracked` until the watch tells of a loss, the grant is
/// stopped, or it is lost and its nodes given up.
async fn watch_node<W: Watched>(tracked: &W, index: usize) {
    let mut paused = false;
    loop {
        let (client, path) = tracked.node(index);
        // Boxed: its request future is large and lives only for a round trip, while the
        // armed watch below lives as long as the lock is held.
        let pause = std::mem::take(&mut paused).then_some(REARM_PAUSE);
        let armed = Box::pin(arm(client, path, pause)).await;
        if tracked.is_stopped() {
            return;
        }
        let watcher = match armed {
            Ok(watcher) => watcher,
            Err(zk::Error::NoNode) => {
                tracked.lost(LossCause::KeyGone, "the lock node was deleted".into());
                return;
            }
            Err(err) if session_ended(&err) => {
                tracked.lost(
                    LossCause::SessionEnded,
                    format!("the ZooKeeper session ended: {err}"),
                );
                return;
            }
            // The connection broke: arm again once it may be back, while the lock
            // can still be lost to a deletion.
            Err(_) if tracked.liveness().is_lost() => {
                tracked.give_up();
                return;
            }
            Err(_) => {
                paused = true;
                continue;
            }
        };
        let event = watcher.changed().await;
        if tracked.is_stopped() {
            return;
        }
        match event.event_type {
            zk::EventType::NodeDeleted => {
                tracked.lost(
                    LossCause::KeyGone,
                    "the lock node was deleted by another client".into(),
                );
                return;
            }
            zk::EventType::Session if event.session_state.is_terminated() => {
                tracked.lost(
                    LossCause::SessionEnded,
                    format!("the ZooKeeper session ended: {}", event.session_state),
                );
                return;
            }
            // Its data changed (Curator's revocation writes it) or the connection
            // came back: the node is still there, watch it again.
            _ if tracked.liveness().is_lost() => {
                tracked.give_up();
                return;
            }
            _ => {}
        }
    }
}

/// A lock's deadline in the heap, held weakly: a released guard's record goes with it.
struct Due {
    /// The deadline, in nanoseconds after [`Deadlines::base`]: 8 bytes, not an
    /// `Instant`'s 16, in a heap of one entry per held lock.
    at: u64,
    tracked: Weak<dyn Watched>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        self.at.cmp(&other.at)
    }
}

#[derive(Default)]
struct Heap {
    due: BinaryHeap<Reverse<Due>>,
    running: bool,
}

/// The deadlines of one session's watched locks: a lock found lost at its deadline is
/// given up ([`Watched::give_up`]), one renewed since is looked at again at its new one.
pub(crate) struct Deadlines {
    heap: Mutex<Heap>,
    /// Wakes the task when a deadline earlier than every other arrives.
    wake: Notify,
    /// The session's queue, whose task polls the heap's future too.
    watches: Arc<Delayed>,
    /// What [`Due::at`] counts from: before every deadline of the session's locks.
    base: Instant,
}

impl std::fmt::Debug for Deadlines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deadlines").finish_non_exhaustive()
    }
}

impl Deadlines {
    /// Deadlines looked at by a future of the task of `watches` (the session's queue
    /// of watches, so that watching held locks costs the session one task).
    pub(crate) fn new(watches: Arc<Delayed>) -> Self {
        Deadlines {
            heap: Mutex::default(),
            wake: Notify::new(),
            watches,
            base: Instant::now(),
        }
    }

    /// `at` as a [`Due::at`]. An instant before the base (none is) would be looked at
    /// at once: early, never late.
    fn offset(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    /// A [`Due::at`] as an instant.
    fn instant(&self, at: u64) -> Instant {
        // Past every instant a lease reaches (a deadline is at most years away).
        let far = Duration::from_secs(100 * 365 * 24 * 3600);
        self.base + Duration::from_nanos(at).min(far)
    }

    fn heap(&self) -> std::sync::MutexGuard<'_, Heap> {
        self.heap.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Looks at `tracked` at the deadline of `liveness` (its own).
    fn add(self: &Arc<Self>, tracked: Weak<dyn Watched>, liveness: &Liveness) {
        self.push(Due {
            at: self.offset(liveness.valid_until()),
            tracked,
        });
    }

    fn push(self: &Arc<Self>, due: Due) {
        let (start, wake) = {
            let mut heap = self.heap();
            let earliest = heap
                .due
                .peek()
                .is_none_or(|Reverse(first)| due.at < first.at);
            heap.due.push(Reverse(due));
            let start = !std::mem::replace(&mut heap.running, true);
            (start, earliest && !start)
        };
        if start {
            // Started after the queue's delay, a few milliseconds: a deadline is added
            // when its lock's watch starts, and lies a lease (at least a second) later.
            let running = NotRunning {
                deadlines: self.clone(),
                ended: false,
            };
            let never = Liveness::new(Instant::now() + Duration::from_secs(365 * 24 * 3600));
            self.watches
                .schedule(never, move || -> Work { Box::pin(run(running)) });
        } else if wake {
            self.wake.notify_one();
        }
    }
}

/// Looks at the deadlines of `running.deadlines` until none is left. However it ends (a
/// panic, or the runtime shutting down drops it, started or not), the next deadline
/// starts another: `running` never stays set without it.
async fn run(mut running: NotRunning) {
    let this = running.deadlines.clone();
    loop {
        let now = this.offset(Instant::now());
        let mut passed = Vec::new();
        let next = {
            let mut heap = this.heap();
            while heap.due.peek().is_some_and(|Reverse(due)| due.at <= now) {
                passed.extend(heap.due.pop().map(|Reverse(due)| due));
            }
            match heap.due.peek() {
                Some(Reverse(due)) => Some(this.instant(due.at)),
                None if passed.is_empty() => {
                    heap.running = false;
                    running.ended = true;
                    return;
                }
                None => None,
            }
        };
        for due in passed {
            let Some(tracked) = due.tracked.upgrade() else {
                continue;
            };
            if tracked.is_stopped() {
                continue;
            }
            if tracked.liveness().is_lost() {
                tracked.give_up();
            } else {
                // Renewed since: look again at the new deadline.
                this.push(Due {
                    at: this.offset(tracked.liveness().valid_until()),
                    tracked: due.tracked,
                });
            }
        }
        if next.is_none() {
            // Every deadline passed: look again (the next pass ends this future unless
            // one was looked at again).
            continue;
        }
        tokio::select! {
            () = sleep_until(next) => {}
            () = this.wake.notified() => {}
        }
    }
}

/// Clears `running` when the heap's future ends other than by deciding to (which clears
/// it under the same lock that saw nothing left), or is dropped before it started.
struct NotRunning {
    deadlines: Arc<Deadlines>,
    ended: bool,
}

impl Drop for NotRunning {
    fn drop(&mut self) {
        if !self.ended {
            self.deadlines.heap().running = false;
        }
    }
}
