//! Per-guard work that starts only once a guard has lived for a while.
//!
//! Each guard needs a watch on its own key and a task that deletes the key once the guard
//! is lost. Most critical sections are short; spawning that task at every grant (and
//! waking it at every release) cost a thread hand-off per lock, a large part of an
//! uncontended acquire+release. Instead a grant queues a small record here, and one task
//! per client, waking at most every [`TICK`], starts the real work for guards still alive
//! after [`DELAY`] and forgets the others. A deletion of the key in the meantime is not
//! missed: the watch replays history from the grant's revision.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fencelock_core::Liveness;
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
            runtime,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `work()` as a task after [`DELAY`] unless the guard behind `liveness` has
    /// ended by then.
    pub(crate) fn schedule(
        self: &Arc<Self>,
        liveness: Liveness,
        work: impl FnOnce() -> Work + Send + 'static,
    ) {
        let start = {
            let mut queue = self.lock();
            queue.entries.push_back(Entry {
                due: Instant::now() + DELAY,
                liveness,
                work: Box::new(work),
            });
            !std::mem::replace(&mut queue.running, true)
        };
        if start {
            let this = self.clone();
            self.runtime.spawn(async move { this.run().await });
        }
    }

    async fn run(self: Arc<Self>) {
        loop {
            tokio::time::sleep(TICK).await;
            let due = {
                let mut queue = self.lock();
                let now = Instant::now();
                let mut due = Vec::new();
                while queue.entries.front().is_some_and(|e| e.due <= now) {
                    due.extend(queue.entries.pop_front());
                }
                // Guards that ended meanwhile need nothing; drop them early.
                queue.entries.retain(|e| !e.liveness.is_ended());
                if due.is_empty() && queue.entries.is_empty() {
                    queue.running = false;
                    return;
                }
                due
            };
            for entry in due {
                if !entry.liveness.is_ended() {
                    self.runtime.spawn((entry.work)());
                }
            }
        }
    }
}
