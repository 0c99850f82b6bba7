//! One watcher per session for the nodes of its held locks.
//!
//! A held lock needs a watch on its node (a deletion by anyone else is a loss) and, once
//! it is lost by deadline (a fixed lease ran out, or the session could not be confirmed
//! in time), a delete that frees the lock for others. A task per lock did this at the
//! cost of a spawn at every grant, a wake-up at every release and a timer and a task's
//! memory per held lock. Instead each session has one watcher task:
//!
//! - a grant queues a small record, and the task arms the watch only for locks still
//!   held [`WATCH_DELAY`] later: most critical sections are shorter and cost no watch
//!   request, no notification and no wake-up of their own. A deletion in between is not
//!   missed: arming then finds no node;
//! - armed watches are futures of that one task, and a release wakes nothing: it only
//!   sets a flag, and the watch fires on our own delete and is dropped then;
//! - deadlines are kept in one heap, looked at when the earliest is due.
//!
//! The task runs while the session has a lock to watch and ends when none is left.

use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::{BinaryHeap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use fencelock_core::{Liveness, LossCause};
use futures_util::StreamExt;
use futures_util::future::Either;
use futures_util::stream::FuturesUnordered;
use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::Instant;
use zookeeper_client as zk;

use crate::error::session_ended;

/// How long after the grant the watch on a held lock's node is armed.
pub(crate) const WATCH_DELAY: Duration = Duration::from_millis(10);

/// How often the queue of grants is looked at while it is not empty: arming happens
/// between [`WATCH_DELAY`] and `WATCH_DELAY + TICK` after the grant.
const TICK: Duration = Duration::from_millis(10);

/// The pause before arming again after a request failed without ending the session.
const REARM_PAUSE: Duration = Duration::from_millis(50);

/// A held grant as its session's watcher (and, at close, its session) sees it: the nodes
/// to watch, the guard's liveness, and what to do on a loss. Implemented by the guard's
/// record ([`crate::held`]); a trait so that the session, which owns this watcher, and
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

/// A step of one watch: its arming request answered, or its armed watch fired.
enum Step {
    Armed(
        Arc<dyn Watched>,
        usize,
        Result<zk::OneshotWatcher, zk::Error>,
    ),
    Fired(Arc<dyn Watched>, usize, zk::WatchedEvent),
}

/// Arming: boxed, as its request future is large and it lives only for a round trip.
type StepFuture = Pin<Box<dyn Future<Output = Step> + Send>>;

/// What a watch does next.
enum Next {
    Arm(StepFuture),
    Fire(Arc<dyn Watched>, usize, zk::OneshotWatcher),
}

fn arm(tracked: Arc<dyn Watched>, index: usize, pause: Option<Duration>) -> StepFuture {
    Box::pin(async move {
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        let (client, path) = tracked.node(index);
        let armed = client
            .get_and_watch_data(path)
            .await
            .map(|(_, _, watcher)| watcher);
        Step::Armed(tracked, index, armed)
    })
}

/// An armed watch, for as long as the lock is held: kept inline in the watcher's set,
/// not boxed, as every held lock has one.
async fn fire(tracked: Arc<dyn Watched>, index: usize, watcher: zk::OneshotWatcher) -> Step {
    Step::Fired(tracked, index, watcher.changed().await)
}

/// A lock's deadline in the heap, held weakly: a released guard's record goes with it.
struct Due {
    at: Instant,
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
struct Queue {
    /// Grants waiting for [`WATCH_DELAY`] to pass, in grant order.
    pending: VecDeque<(Instant, Weak<dyn Watched>)>,
    running: bool,
}

/// The watcher of one session.
pub(crate) struct Watcher {
    queue: Mutex<Queue>,
    /// Wakes the task when a grant arrives while it had none queued.
    wake: Notify,
    runtime: Handle,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").finish_non_exhaustive()
    }
}

impl Watcher {
    pub(crate) fn new(runtime: Handle) -> Self {
        Watcher {
            queue: Mutex::default(),
            wake: Notify::new(),
            runtime,
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Watches a fresh grant from [`WATCH_DELAY`] on, until it is stopped, lost, or its
    /// nodes are gone.
    pub(crate) fn watch<W: Watched + 'static>(self: &Arc<Self>, tracked: &Arc<W>) {
        let tracked = Arc::downgrade(tracked) as Weak<dyn Watched>;
        let (start, wake) = {
            let mut queue = self.queue();
            let was_empty = queue.pending.is_empty();
            queue
                .pending
                .push_back((Instant::now() + WATCH_DELAY, tracked));
            let start = !std::mem::replace(&mut queue.running, true);
            (start, was_empty && !start)
        };
        if start {
            self.runtime.spawn(self.clone().run());
        } else if wake {
            self.wake.notify_one();
        }
    }

    async fn run(self: Arc<Self>) {
        // However the task ends (a panic, or the runtime shutting down drops it), the
        // next grant starts a new one: `running` never stays set without a task.
        let mut running = NotRunning {
            watcher: &self,
            ended: false,
        };
        let mut watches = FuturesUnordered::new();
        let push = |watches: &mut FuturesUnordered<_>, next| match next {
            Next::Arm(arm) => watches.push(Either::Left(arm)),
            Next::Fire(tracked, index, watcher) => {
                watches.push(Either::Right(fire(tracked, index, watcher)));
            }
        };
        let mut deadlines: BinaryHeap<Reverse<Due>> = BinaryHeap::new();
        let mut next_look = Instant::now();
        loop {
            let now = Instant::now();
            // Deadlines that have passed.
            while deadlines.peek().is_some_and(|Reverse(due)| due.at <= now) {
                let Some(Reverse(due)) = deadlines.pop() else {
                    break;
                };
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
                    deadlines.push(Reverse(Due {
                        at: tracked.liveness().valid_until(),
                        tracked: due.tracked,
                    }));
                }
            }
            // Grants whose delay has passed (looked at once per tick at most).
            let next_pending;
            if now >= next_look {
                let due = {
                    let mut queue = self.queue();
                    let mut due = Vec::new();
                    while queue.pending.front().is_some_and(|(at, _)| *at <= now) {
                        due.extend(queue.pending.pop_front().map(|(_, tracked)| tracked));
                    }
                    if due.is_empty() && queue.pending.is_empty() && watches.is_empty() {
                        queue.running = false;
                        running.ended = true;
                        return;
                    }
                    next_pending = queue.pending.front().map(|(at, _)| *at);
                    due
                };
                for tracked in due.iter().filter_map(Weak::upgrade) {
                    if tracked.is_stopped() || tracked.liveness().is_ended() {
                        continue;
                    }
                    for index in 0..tracked.node_count() {
                        push(&mut watches, Next::Arm(arm(tracked.clone(), index, None)));
                    }
                    deadlines.push(Reverse(Due {
                        at: tracked.liveness().valid_until(),
                        tracked: Arc::downgrade(&tracked),
                    }));
                }
                next_look = now + TICK;
                if watches.is_empty() {
                    // Every lock due was released before its watch: nothing may be left
                    // to wake this task, so look again (the next pass ends it if the
                    // queue is empty too).
                    continue;
                }
            } else {
                let mut queue = self.queue();
                // The last watch ended between two looks at the queue: nothing is left.
                if queue.pending.is_empty() && watches.is_empty() {
                    queue.running = false;
                    running.ended = true;
                    return;
                }
                next_pending = queue.pending.front().map(|(at, _)| *at);
            }
            let wake_at = [
                next_pending.map(|at| at.max(next_look)),
                deadlines.peek().map(|Reverse(due)| due.at),
            ]
            .into_iter()
            .flatten()
            .min();
            tokio::select! {
                Some(step) = watches.next(), if !watches.is_empty() => {
                    if let Some(next) = handle(step) {
                        push(&mut watches, next);
                    }
                }
                () = sleep_until(wake_at) => {}
                () = self.wake.notified() => {}
            }
        }
    }
}

/// Clears `running` when the watcher's task ends other than by deciding to (which
/// clears it under the same lock that saw nothing left).
struct NotRunning<'a> {
    watcher: &'a Watcher,
    ended: bool,
}

impl Drop for NotRunning<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.watcher.queue().running = false;
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Acts on one step of a watch; returns the watch's next step, if it goes on.
fn handle(step: Step) -> Option<Next> {
    match step {
        Step::Armed(tracked, index, armed) => {
            if tracked.is_stopped() {
                return None;
            }
            match armed {
                Ok(watcher) => Some(Next::Fire(tracked, index, watcher)),
                Err(zk::Error::NoNode) => {
                    tracked.lost(LossCause::KeyGone, "the lock node was deleted".into());
                    None
                }
                Err(err) if session_ended(&err) => {
                    tracked.lost(
                        LossCause::SessionEnded,
                        format!("the ZooKeeper session ended: {err}"),
                    );
                    None
                }
                // The connection broke: arm again once it may be back, while the lock
                // can still be lost to a deletion.
                Err(_) if tracked.liveness().is_lost() => {
                    tracked.give_up();
                    None
                }
                Err(_) => Some(Next::Arm(arm(tracked, index, Some(REARM_PAUSE)))),
            }
        }
        Step::Fired(tracked, index, event) => {
            if tracked.is_stopped() {
                return None;
            }
            match event.event_type {
                zk::EventType::NodeDeleted => {
                    tracked.lost(
                        LossCause::KeyGone,
                        "the lock node was deleted by another client".into(),
                    );
                    None
                }
                zk::EventType::Session if event.session_state.is_terminated() => {
                    tracked.lost(
                        LossCause::SessionEnded,
                        format!("the ZooKeeper session ended: {}", event.session_state),
                    );
                    None
                }
                // Its data changed (Curator's revocation writes it) or the connection
                // came back: the node is still there, watch it again.
                _ if tracked.liveness().is_lost() => {
                    tracked.give_up();
                    None
                }
                _ => Some(Next::Arm(arm(tracked, index, None))),
            }
        }
    }
}
