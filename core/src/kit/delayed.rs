//! The one delayed-watch mechanism: per-guard work (a loss watch) that starts only once
//! a guard has lived for a while.
//!
//! Each guard needs a watch on its own key or node, and something that frees it once the
//! guard is lost. Most critical sections are short; spawning a task at every grant (and
//! waking it at every release) cost a thread hand-off per lock, a large part of an
//! uncontended acquire+release. Instead a grant queues a small record here, and one task
//! per client, waking at most every tick while records wait, starts the real work for
//! guards still alive after the backend's delay and forgets the others. The backend makes
//! sure a deletion in the meantime is not missed (etcd's watch replays history from the
//! grant's revision; a ZooKeeper watch armed late finds no node).
//!
//! The work of the guards still alive runs in that same task, as futures it polls, not
//! as a task each: a held lock then costs its future, not a task around it too.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::Liveness;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::runtime::Handle;
use tokio::time::Instant;

/// The work of one guard, started if the guard is still alive after the delay.
pub type Work = Pin<Box<dyn Future<Output = ()> + Send>>;

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
pub struct Delayed {
    queue: Mutex<Queue>,
    /// Wakes the running task when a grant arrives while none waited.
    wake: tokio::sync::Notify,
    runtime: Handle,
    /// How long a guard goes without its own work.
    delay: Duration,
    /// How often the queue is looked at while it is not empty.
    tick: Duration,
}

impl std::fmt::Debug for Delayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delayed").finish_non_exhaustive()
    }
}

impl Delayed {
    /// A queue whose task runs on `runtime` and starts each guard's work `delay` after
    /// it was scheduled (between `delay` and `delay + tick`: the queue is looked at every
    /// `tick` while it is not empty).
    pub fn new(runtime: Handle, delay: Duration, tick: Duration) -> Self {
        Delayed {
            queue: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            runtime,
            delay,
            tick,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts `work()` (polled by this queue's one task) after the delay unless the
    /// guard behind `liveness` has ended by then. The work ends when its future does:
    /// it watches `liveness` itself.
    pub fn schedule(
        self: &Arc<Self>,
        liveness: Liveness,
        work: impl FnOnce() -> Work + Send + 'static,
    ) {
        let (start, wake) = {
            let mut queue = self.lock();
            let was_empty = queue.entries.is_empty();
            queue.entries.push_back(Entry {
                due: Instant::now() + self.delay,
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
        let mut next_look = Some(Instant::now() + self.tick);
        let mut look_again = false;
        loop {
            if !std::mem::take(&mut look_again) {
                tokio::select! {
                    () = sleep_until(next_look) => {}
                    () = self.wake.notified(), if next_look.is_none() => {}
                    Some(()) = running.next(), if !running.is_empty() => {}
                }
            }
            let now = Instant::now();
            let due = {
                let mut queue = self.lock();
                let mut due = Vec::new();
                // Whether grants came since the last look: the task then looks again a
                // tick later even if they all ended meanwhile, rather than ending and
                // being spawned again by the next grant (a spawn, from outside the
                // runtime, every tick of a run of short critical sections).
                let mut granted = false;
                if next_look.is_some_and(|at| at <= now) || next_look.is_none() {
                    granted = !queue.entries.is_empty();
                    while queue.entries.front().is_some_and(|e| e.due <= now) {
                        due.extend(queue.entries.pop_front());
                    }
                    // Guards that ended meanwhile need nothing; drop them early.
                    queue.entries.retain(|e| !e.liveness.is_ended());
                    next_look = None;
                }
                if !granted && due.is_empty() && queue.entries.is_empty() && running.is_empty() {
                    queue.running = false;
                    task.ended = true;
                    return;
                }
                // Looked at once per tick while grants wait or came; otherwise woken by
                // the next grant.
                if (granted || !queue.entries.is_empty()) && next_look.is_none() {
                    next_look = Some(now + self.tick);
                }
                due
            };
            for entry in due {
                if !entry.liveness.is_ended() {
                    running.push((entry.work)());
                }
            }
            // Every guard due had ended and none waits: nothing may be left to wake this
            // task, so look again (that look ends it unless a grant came meanwhile).
            if running.is_empty() && next_look.is_none() {
                look_again = true;
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
///
/// # Cancel safety
///
/// Cancel safe: it only waits.
///
/// # Errors
///
/// None: it only waits.
pub async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Only guards still alive after the delay get their work started, and it runs in
    /// the queue's one task, which ends once nothing is left.
    #[tokio::test(start_paused = true)]
    async fn work_starts_only_for_guards_alive_after_the_delay() {
        let delayed = Arc::new(Delayed::new(
            Handle::current(),
            Duration::from_millis(50),
            Duration::from_millis(25),
        ));
        let started = Arc::new(AtomicUsize::new(0));
        let schedule = |liveness: &Liveness| {
            let (started, watched) = (started.clone(), liveness.clone());
            delayed.schedule(liveness.clone(), move || -> Work {
                Box::pin(async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    watched.ended().await;
                })
            });
        };
        let far = Instant::now() + Duration::from_secs(60);
        let (short, long) = (Liveness::new(far), Liveness::new(far));
        schedule(&short);
        schedule(&long);
        tokio::time::sleep(Duration::from_millis(20)).await;
        short.end();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(started.load(Ordering::SeqCst), 0, "not before the delay");
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(started.load(Ordering::SeqCst), 1, "the long one only");
        assert!(delayed.lock().running);
        long.end();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!delayed.lock().running, "the task ends with its last work");
    }

    /// Guards that all ended before their delay leave no task behind: it used to find
    /// nothing to start and then wait, with nothing to wake it, until the next grant.
    #[tokio::test(start_paused = true)]
    async fn guards_ended_before_the_delay_leave_no_task() {
        let delayed = Arc::new(Delayed::new(
            Handle::current(),
            Duration::from_millis(10),
            Duration::from_millis(10),
        ));
        let liveness = Liveness::new(Instant::now() + Duration::from_secs(60));
        delayed.schedule(liveness.clone(), || -> Work {
            Box::pin(async { unreachable!("the guard ended before its delay") })
        });
        // Due at the first look (the delay equals the tick), ended before it.
        liveness.end();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !delayed.lock().running,
            "the task ends once nothing is left"
        );
    }

    /// Grants that all end before their delay, one after another (a run of short
    /// critical sections), keep the one task: it ends only after a tick without grants,
    /// rather than ending at each look and being spawned again by the next grant.
    #[tokio::test(start_paused = true)]
    async fn the_task_lives_through_a_run_of_short_grants() {
        let delayed = Arc::new(Delayed::new(
            Handle::current(),
            Duration::from_millis(50),
            Duration::from_millis(10),
        ));
        let far = Instant::now() + Duration::from_secs(60);
        let short_grant = || {
            let liveness = Liveness::new(far);
            delayed.schedule(liveness.clone(), || -> Work {
                Box::pin(async { unreachable!("the guard ended before its delay") })
            });
            liveness.end();
        };
        short_grant();
        // The first look (10 ms) finds it ended: the task looks again a tick later.
        tokio::time::sleep(Duration::from_millis(15)).await;
        assert!(
            delayed.lock().running,
            "alive after a look that found grants"
        );
        short_grant();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(delayed.lock().running, "alive while grants come");
        // A tick with no grant (30 ms), and it ends.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!delayed.lock().running, "ended after a tick without grants");
    }
}
