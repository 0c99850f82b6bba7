//! Layers: locks that wrap another lock and implement the same trait, so they compose.
//!
//! Composition order (outermost first): metrics → waiter limit → retry → migration →
//! backend. Metrics
//! then sees what the application sees (including retried acquisitions as one), and
//! retry never re-sends half of a migration's two-leg acquisition.

pub mod limit;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod migration;
pub mod retry;

/// Spawns the task `make` builds on `kept` (the runtime a layer was made on), else, or
/// when that runtime has shut down (a task spawned there is dropped at once), on the
/// current one. `None` outside any runtime with none kept alive.
pub(crate) fn spawn_kept<F>(
    kept: Option<&tokio::runtime::Handle>,
    make: impl Fn() -> F,
) -> Option<tokio::task::JoinHandle<()>>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    if let Some(kept) = kept {
        let task = kept.spawn(make());
        // A runtime that shut down drops a new task at once. On a live one these tasks
        // wait for an end or a loss; one that finishes this fast (its guard already
        // ended) is spawned once more below, which does nothing twice.
        if !task.is_finished() {
            return Some(task);
        }
    }
    let current = tokio::runtime::Handle::try_current().ok()?;
    Some(current.spawn(make()))
}
