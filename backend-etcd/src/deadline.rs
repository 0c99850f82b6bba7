//! The deadlines of an acquire's steps.

use fencelock_core::Error;
use tokio::time::Instant;

/// The deadline of the steps before any waiting (connecting a session, creating the key,
/// the first read of the queue): the caller's, or [`ROUND_TRIP_GRACE`] from now if that
/// is later, so that a free lock is granted with a zero wait and a hung etcd still ends
/// the acquire (as [`fencelock_core::WaitDeadline::bound`]).
///
/// [`ROUND_TRIP_GRACE`]: fencelock_core::ROUND_TRIP_GRACE
pub(crate) fn step_deadline(deadline: Option<Instant>) -> Option<Instant> {
    deadline.map(|d| d.max(Instant::now() + fencelock_core::ROUND_TRIP_GRACE))
}

/// Runs `step`, giving up at `deadline` with the error `timed_out` makes.
pub(crate) async fn within<T>(
    deadline: Option<Instant>,
    step: impl std::future::Future<Output = T>,
    timed_out: impl FnOnce() -> Error,
) -> Result<T, Error> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, step)
            .await
            .map_err(|_| timed_out()),
        None => Ok(step.await),
    }
}
