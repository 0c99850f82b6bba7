//! Tasks a held guard relies on (a deadline watcher, a migration guard's follower, the
//! metrics layer's watch), kept running while any runtime they may run on lives.
//!
//! A Tokio runtime that shuts down drops its tasks unfinished, and drops a task spawned
//! on it afterwards at once. A guard outlives the runtime it was made on whenever that
//! runtime was a temporary one (a `Runtime::new().block_on(...)` on a helper thread):
//! its tasks must then go on elsewhere, or a loss is never reported.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::runtime::Handle;

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs the task `make` builds on the first of `runtimes` that is running. When that
/// runtime shuts down before the task completed (which drops it), `make` builds it again
/// on the next one, and so on. `gave_up` is called once no runtime is left: at once when
/// none of them is running. A runtime given twice is tried once.
///
/// `make` may be called again after a task of it started and was dropped: a task that
/// takes state over must leave it where the next one finds it.
///
/// Returns whether a task was running (or had completed) when this returned.
pub(crate) fn spawn_kept<F>(
    runtimes: impl IntoIterator<Item = Handle>,
    make: impl Fn() -> F + Send + Sync + 'static,
    gave_up: impl FnOnce() + Send + 'static,
) -> bool
where
    F: Future<Output = ()> + Send + 'static,
{
    let mut unique: Vec<Handle> = Vec::new();
    for runtime in runtimes {
        if unique.iter().all(|r| r.id() != runtime.id()) {
            unique.push(runtime);
        }
    }
    let chain = Arc::new(Chain {
        runtimes: unique,
        make: Box::new(move || Box::pin(make())),
        gave_up: Mutex::new(Some(Box::new(gave_up))),
    });
    chain.start(0);
    !chain.given_up()
}

/// The runtimes a task may run on, in order, and how to build it.
struct Chain {
    runtimes: Vec<Handle>,
    make: Box<dyn Fn() -> Task + Send + Sync>,
    /// Taken when no runtime is left.
    gave_up: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Chain {
    /// Spawns the task on runtime `at`. A runtime that shut down drops it at once, and
    /// its [`Running`] goes on to the next: so does one that shuts down later.
    fn start(self: &Arc<Self>, at: usize) {
        let Some(runtime) = self.runtimes.get(at) else {
            let gave_up = self
                .gave_up
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(gave_up) = gave_up {
                gave_up();
            }
            return;
        };
        let running = Running {
            chain: self.clone(),
            at,
            done: false,
        };
        runtime.spawn(Kept {
            task: (self.make)(),
            running,
        });
    }

    fn given_up(&self) -> bool {
        self.gave_up
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }
}

/// A task and its [`Running`], dropped in that order: the task built next finds what
/// this one leaves behind when it is dropped (see [`spawn_kept`]).
struct Kept {
    task: Task,
    running: Running,
}

impl Future for Kept {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let polled = self.task.as_mut().poll(cx);
        if polled.is_ready() {
            self.running.done = true;
        }
        polled
    }
}

/// Held by a running task: dropped before the task completed (its runtime shut down,
/// or it panicked), it starts the task on the next runtime.
struct Running {
    chain: Arc<Chain>,
    at: usize,
    done: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            self.chain.start(self.at + 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    /// A task dropped with its runtime is built again on the next one; a runtime that
    /// shut down before is skipped; `gave_up` runs once the last one is gone.
    #[test]
    fn a_task_goes_on_on_the_next_runtime_until_none_is_left() {
        let (dead, first, second) = (runtime(), runtime(), runtime());
        let dead_handle = dead.handle().clone();
        drop(dead);
        let built = Arc::new(AtomicUsize::new(0));
        let gave_up = Arc::new(AtomicUsize::new(0));
        let running = spawn_kept(
            [
                dead_handle,
                first.handle().clone(),
                first.handle().clone(),
                second.handle().clone(),
            ],
            {
                let built = built.clone();
                move || {
                    built.fetch_add(1, Ordering::SeqCst);
                    std::future::pending()
                }
            },
            {
                let gave_up = gave_up.clone();
                move || {
                    gave_up.fetch_add(1, Ordering::SeqCst);
                }
            },
        );
        assert!(running);
        assert_eq!(built.load(Ordering::SeqCst), 2, "dead, then first");
        drop(first);
        assert_eq!(built.load(Ordering::SeqCst), 3, "then second, once");
        assert_eq!(gave_up.load(Ordering::SeqCst), 0);
        drop(second);
        assert_eq!(gave_up.load(Ordering::SeqCst), 1);
    }

    /// A task that completed is not built again when its runtime ends, and nothing
    /// gives up.
    #[test]
    fn a_completed_task_is_not_built_again() {
        let (first, second) = (runtime(), runtime());
        let built = Arc::new(AtomicUsize::new(0));
        let gave_up = Arc::new(AtomicUsize::new(0));
        assert!(spawn_kept(
            [first.handle().clone(), second.handle().clone()],
            {
                let built = built.clone();
                move || {
                    built.fetch_add(1, Ordering::SeqCst);
                    async {}
                }
            },
            {
                let gave_up = gave_up.clone();
                move || {
                    gave_up.fetch_add(1, Ordering::SeqCst);
                }
            },
        ));
        first.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
        drop(first);
        drop(second);
        assert_eq!(built.load(Ordering::SeqCst), 1);
        assert_eq!(gave_up.load(Ordering::SeqCst), 0);
    }

    /// With no runtime running, nothing runs and `gave_up` is called at once.
    #[test]
    fn without_a_running_runtime_it_gives_up_at_once() {
        let gave_up = Arc::new(AtomicUsize::new(0));
        let counted = gave_up.clone();
        assert!(!spawn_kept(
            std::iter::empty(),
            || async {},
            move || {
                counted.fetch_add(1, Ordering::SeqCst);
            },
        ));
        assert_eq!(gave_up.load(Ordering::SeqCst), 1);
    }
}
