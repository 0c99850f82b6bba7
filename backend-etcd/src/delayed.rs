//! Per-guard work that starts only once a guard has lived for a while.
//!
//! Each guard needs a watch on its own key and a task that deletes the key once the guard
//! is lost. Most critical sections are short; spawning that task at every grant (and
//! waking it at every release) cost a thread hand-off per lock, a large part of an
//! uncontended acquire+release. Instead a grant queues a small record here, and one task
//! per client, waking at most every [`TICK`], starts the real work for guards still alive
//! after [`DELAY`] and forgets the others. A deletion of the key in the meantime is not
//! missed: the watch replays history from the grant's revision.
//!
//! The work of the guards still alive runs in that same task, as futures it polls, not
//! as a task each: a held lock then costs its future, not a task around it too.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fencelock_core::Liveness;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::runtime::Handle;
use tokio::time::Instant;

/// How long a guard goes without its own watch.
pub(crate) const DELAY: Duration = Duration::from_millis(50);

/// How often the queue is looked at while it is not empty.
const TICK: Duration = Duration::from_millis(25);

/// The work of one guard, started if the guard is still alive after [`DELAY`].
pub(crate) type Work = Pin<Box<dyn Future<Output = ()> + Send>>;

struct Entry {
    due: Instant,
    liveness: Liveness,
    work: Box<dyn FnOnce() -> Work + Send>,
}

#[derive(Default)]
struct Queue {
    entries: VecDeque<Entry>,
    running: bool,
}

/// The queue of one client and its task.
pub(crate) struct Delayed {
    queue: Mutex<Queue>,
    /// Wakes the running task when a grant arrives while none waited.
    wake: tokio::sync::Notify,
    runtime: Handle,
}

impl std::fmt::Debug for Delayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delayed").finish_non_exhaustive()
    }
}

impl Delayed {
    pub(crate) fn new(runtime: Handle) -> Self {
        Delayed {
            queue: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            runtime,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts `work()` (polled by this queue's one task) after [`DELAY`] unless the
    /// guard behind `liveness` has ended by then.
    pub(crate) fn schedule(
        self: &Arc<Self>,
        liveness: Liveness,
        work: impl FnOnce() -> Work + Send + 'static,
    ) {
        let (start, wake) = {
            let mut queue = self.lock();
            let was_empty = queue.entries.is_empty();
            queue.entries.push_back(Entry {
                due: Instant::now() + DELAY,
                liveness,
                work: Box::new(work),
            });
            let start = !std::mem::replace(&mut queue.running, true);
            (start, was_empty && !start)
        };
        if start {
            let this = self.clone();
            self.runtime.spawn(async move { this.run().await });
        } else if wake {
            self.wake.notify_one();
        }
    }

    async fn run(self: Arc<Self>) {
        // However the task ends (a panic, or the runtime shutting down drops it), the
        // next grant starts a new one: `running` never stays set without a task.
        let mut task = NotRunning {
            delayed: &self,
            ended: false,
        };
        let mut running: FuturesUnordered<Work> = FuturesUnordered::new();
        let mut next_look = Some(Instant::now() + TICK);
        loop {
            tokio::select! {
                () = sleep_until(next_look) => {}
                () = self.wake.notified(), if next_look.is_none() => {}
                Some(()) = running.next(), if !running.is_empty() => {}
            }
            let now = Instant::now();
            let due = {
                let mut queue = self.lock();
                let mut due = Vec::new();
                if next_look.is_some_and(|at| at <= now) || next_look.is_none() {
                    while queue.entries.front().is_some_and(|e| e.due <= now) {
                        due.extend(queue.entries.pop_front());
                    }
                    // Guards that ended meanwhile need nothing; drop them early.
                    queue.entries.retain(|e| !e.liveness.is_ended());
                    next_look = None;
                }
                if due.is_empty() && queue.entries.is_empty() && running.is_empty() {
                    queue.running = false;
                    task.ended = true;
                    return;
                }
                // Looked at once per tick while grants wait; otherwise woken by the
                // next grant.
                if !queue.entries.is_empty() && next_look.is_none() {
                    next_look = Some(now + TICK);
                }
                due
            };
            for entry in due {
                if !entry.liveness.is_ended() {
                    running.push((entry.work)());
                }
            }
        }
    }
}

/// Clears `running` when the queue's task ends other than by deciding to (which clears
/// it under the same lock that saw nothing left).
struct NotRunning<'a> {
    delayed: &'a Delayed,
    ended: bool,
}

impl Drop for NotRunning<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.delayed.lock().running = false;
        }
    }
}

/// Sleeps until `at`, or forever without one.
pub(crate) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
