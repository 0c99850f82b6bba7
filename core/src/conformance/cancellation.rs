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

/// Acquires of a *free* name dropped at random points, where the grant may be on its way
/// or already made on the server, then extensions of a fixed lease dropped the same way:
/// a dropped acquire that was granted gives the name back promptly (in the background on
/// remote backends, well before its 60 s lease would end), and a guard whose extensions
/// were dropped is neither lost nor unable to release. Nothing is left afterwards: the
/// name is free, has no waiter and is not listed.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn cancelled_grants_and_extensions_leave_nothing(lock: &dyn DistributedLock) {
    const DROPPED: usize = 60;
    let name = unique_name("cancelled-grants");
    let lease = Duration::from_secs(60);
    let mut granted = 0;
    for i in 0..DROPPED {
        // Before the first poll, after one poll, and at random points up to a few round
        // trips in (most requests are answered within them).
        let wait = match i % 4 {
            0 => None,
            1 => Some(Duration::ZERO),
            2 => Some(Duration::from_micros(fastrand::u64(0..1_000))),
            _ => Some(Duration::from_micros(fastrand::u64(1_000..8_000))),
        };
        let acquire = lock.acquire(&name, AcquireOptions::new().fixed_lease(lease));
        let Some(wait) = wait else {
            drop(acquire);
            continue;
        };
        if let Ok(outcome) = tokio::time::timeout(wait, acquire).await {
            let guard = outcome.expect("acquire of a free name");
            granted += 1;
            guard.release().await.expect("release of a granted acquire");
        }
    }
    // Granted and dropped acquires give the name back in the background: it is free
    // within seconds, not at the end of a 60 s lease.
    let deadline = Instant::now() + Duration::from_secs(10);
    let guard = loop {
        if let Some(guard) = lock
            .acquire(&name, AcquireOptions::new().fixed_lease(lease).no_wait())
            .await
            .map(Some)
            .or_else(|error| match error {
                Error::Contended { .. } => Ok(None),
                other => Err(other),
            })
            .expect("acquire after the dropped ones")
        {
            break guard;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: still held 10 s after {DROPPED} dropped acquires ({granted} completed); \
             a dropped grant was left to its 60 s lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Extensions dropped at the same points: each either extended the lease or left it
    // as it was, and the guard still holds and releases the lock.
    let mut extensible = true;
    for i in 0..DROPPED / 2 {
        // Each asks more than any before it, so none is already covered and skipped.
        let to = lease + Duration::from_secs(10 * (i as u64 + 1));
        let extend = guard.extend(to);
        let outcome = match i % 3 {
            0 => tokio::time::timeout(Duration::ZERO, extend).await,
            1 => {
                let wait = Duration::from_micros(fastrand::u64(0..1_000));
                tokio::time::timeout(wait, extend).await
            }
            _ => {
                let wait = Duration::from_micros(fastrand::u64(1_000..8_000));
                tokio::time::timeout(wait, extend).await
            }
        };
        match outcome {
            Ok(Err(Error::Unsupported { .. })) => {
                extensible = false;
                break;
            }
            // A retryable failure under load leaves the lease as it was.
            Ok(Err(error)) if error.is_retryable() => {}
            Ok(result) => result.expect("extend"),
            Err(_) => {}
        }
    }
    if extensible {
        // One more, awaited, after the dropped ones' work (extensions of one guard take
        // turns): the lock is still this guard's on the server.
        guard
            .extend(lease + Duration::from_secs(10 * (DROPPED as u64 + 1)))
            .await
            .expect("an extension after the dropped ones");
    }
    assert!(
        !guard.is_lost(),
        "{name}: lost after dropped extensions: {:?}",
        guard.lost_reason()
    );
    guard
        .release()
        .await
        .expect("release after dropped extensions");
    let info = lock.inspect(&name).await.expect("inspect");
    assert!(
        !info.is_held(),
        "{name}: held after the last release: {info:?}"
    );
    assert!(matches!(info.waiters, None | Some(0)), "{info:?}");
    let listed = lock.list(&name).await.expect("list");
    assert!(
        listed.is_empty(),
        "{name}: listed after the last release: {listed:?}"
    );
}
