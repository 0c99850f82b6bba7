//! Cancelled acquires and dropped guards.

use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use super::support::{unique_name, until_waiters};
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, Error};

/// 200 acquires dropped at random points (before the first poll, after one poll, after a
/// random short wait) while another task holds the lock: afterwards no waiter is left,
/// the lock is free the moment the holder releases, and nothing remains.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn cancelled_acquires_leave_nothing(lock: &dyn DistributedLock) {
    const CANCELLED: usize = 200;
    const BATCH: usize = 20;
    let name = unique_name("cancelled-acquires");
    let holder = lock.lock(&name).await.expect("acquire");
    for batch in 0..CANCELLED / BATCH {
        join_all((0..BATCH).map(|i| {
            let name = &name;
            async move {
                let acquire = lock.acquire(name, AcquireOptions::new());
                match (batch * BATCH + i) % 4 {
                    0 => drop(acquire),
                    // A zero timeout polls the acquire exactly once, then drops it.
                    1 => assert!(tokio::time::timeout(Duration::ZERO, acquire).await.is_err()),
                    2 => {
                        let wait = Duration::from_micros(fastrand::u64(0..5_000));
                        assert!(tokio::time::timeout(wait, acquire).await.is_err());
                    }
                    _ => {
                        let wait = Duration::from_millis(fastrand::u64(5..60));
                        assert!(tokio::time::timeout(wait, acquire).await.is_err());
                    }
                }
            }
        }))
        .await;
    }
    assert!(!holder.is_lost());
    // Cancelled waiters clean up promptly (in the background on remote backends).
    until_waiters(lock, &name, 0).await;
    holder.release().await.expect("release");
    let next = lock
        .try_lock(&name)
        .await
        .expect("try_lock")
        .expect("lock free right after the holder released");
    next.release().await.expect("release");
    let info = lock.inspect(&name).await.expect("inspect");
    assert!(!info.is_held(), "{info:?}");
    assert!(matches!(info.waiters, None | Some(0)), "{info:?}");
}

/// Dropping a guard frees the lock promptly for a waiter already queued.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn dropped_guard_frees_promptly(lock: &dyn DistributedLock) {
    let name = unique_name("dropped-guard");
    let guard = lock.lock(&name).await.expect("acquire");
    let waiter = lock.acquire(
        &name,
        AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
    );
    let drop_it = async {
        until_waiters(lock, &name, 1).await;
        let dropped_at = Instant::now();
        drop(guard);
        dropped_at
    };
    let (next, dropped_at) = tokio::join!(waiter, drop_it);
    let next = next.expect("waiter acquires after the drop");
    let after = dropped_at.elapsed();
    assert!(
        after < Duration::from_secs(2),
        "lock freed {after:?} after the guard was dropped"
    );
    next.release().await.expect("release");
}

/// A release whose future is dropped after its first poll (the request may be on its
/// way) may leave its work to the background, but a release retried after it is not
/// told the lock was lost: the grant was held until the release. The name is then free.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn a_release_retried_after_a_dropped_one_is_not_a_loss(lock: &dyn DistributedLock) {
    let name = unique_name("dropped-release");
    let guard = lock.lock(&name).await.expect("acquire");
    let handle = guard.held().clone();
    // Polled once, then dropped (unless it finished at once).
    let _ = tokio::time::timeout(Duration::ZERO, handle.release()).await;
    let retried = handle.release().await;
    // `Ok`, or `Unavailable` where the backend cannot tell its own applied release from
    // someone else's delete (the lock was freed either way): never a loss, nor another
    // error.
    assert!(
        matches!(retried, Ok(()) | Err(Error::Unavailable { .. })),
        "a release retried after a dropped one answered {retried:?} (Ok or Unavailable expected)"
    );
    drop(guard);
    lock.acquire(
        &name,
        AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
    )
    .await
    .expect("the name is free after the dropped and the retried release")
    .release()
    .await
    .expect("release");
}
