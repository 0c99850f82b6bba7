//! Hand-offs under faults of the caller's own making: a release or a give-up cancelled
//! half-way, a holder whose guard was leaked, a fixed lease that had to wait.

use std::future::{Future, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::support::{SLACK, short_lease, unique_name, until_waiters};
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, LockGuard};

/// Polls `future` exactly once, deterministically (a biased `select!` against a ready
/// future), while every other worker thread of the runtime is kept busy, so nothing the
/// poll handed to another task (a request queued for a connection's writer task, say)
/// runs before the future is dropped. Returns the output if that poll completed it.
async fn poll_once_then_drop<F: Future + ?Sized>(mut future: Pin<Box<F>>) -> Option<F::Output> {
    let others = tokio::runtime::Handle::current()
        .metrics()
        .num_workers()
        .saturating_sub(1);
    let started = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(AtomicBool::new(false));
    let blockers: Vec<_> = (0..others)
        .map(|_| {
            let (started, release) = (started.clone(), release.clone());
            tokio::spawn(async move {
                started.fetch_add(1, Ordering::SeqCst);
                // Blocks this worker thread (on purpose) until the poll is over.
                let until = std::time::Instant::now() + Duration::from_secs(1);
                while !release.load(Ordering::SeqCst) && std::time::Instant::now() < until {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    while started.load(Ordering::SeqCst) < others {
        tokio::task::yield_now().await;
    }
    let output = tokio::select! {
        biased;
        output = future.as_mut() => Some(output),
        () = ready(()) => None,
    };
    drop(future);
    release.store(true, Ordering::SeqCst);
    for blocker in blockers {
        let _ = blocker.await;
    }
    output
}

/// Acquires `name` with a 10 s wait, checking it is granted within `bound`.
async fn acquire_within(lock: &dyn DistributedLock, name: &str, bound: Duration) -> LockGuard {
    let start = Instant::now();
    let guard = lock
        .acquire(
            name,
            AcquireOptions::new().wait_timeout(bound + Duration::from_secs(10)),
        )
        .await
        .unwrap_or_else(|e| panic!("{name}: {e:?}"));
    let took = start.elapsed();
    assert!(
        took <= bound,
        "{name}: granted after {took:?}, bound {bound:?}"
    );
    guard
}

/// A `release()` polled once and then dropped still frees the name: the release goes on
/// in the background, so another client (`other`) and the owner get the lock again
/// promptly, and nothing is left.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn cancelled_release_frees_the_name(
    lock: &dyn DistributedLock,
    other: &dyn DistributedLock,
) {
    let name = unique_name("cancelled-release");
    let first = lock.lock(&name).await.expect("acquire");
    let token = first.token();
    if let Some(result) = poll_once_then_drop(Box::pin(first.release())).await {
        result.expect("release");
    }
    let next = acquire_within(other, &name, Duration::from_secs(3)).await;
    assert!(
        next.token() > token,
        "the next holder's token is not larger"
    );
    next.release().await.expect("release");
    let again = acquire_within(lock, &name, Duration::from_secs(3)).await;
    again.release().await.expect("release");
    let info = lock.inspect(&name).await.expect("inspect");
    assert!(!info.is_held(), "{info:?}");
}

/// A waiter whose wait timed out and whose future is dropped during its give-up (polled
/// once after the timeout, then dropped) leaves nothing in the queue: the release of the
/// holder (another client, `other`) hands the lock on at once.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn cancelled_give_up_leaves_no_waiter(
    lock: &dyn DistributedLock,
    other: &dyn DistributedLock,
) {
    let name = unique_name("cancelled-give-up");
    // The holder is another client, so the waiter queues in the backend, not behind a
    // holder of its own client.
    let holder = other.lock(&name).await.expect("acquire");
    let wait = Duration::from_millis(300);
    let mut waiter = Some(Box::pin(
        lock.acquire(&name, AcquireOptions::new().wait_timeout(wait)),
    ));
    // Drive the waiter until it is queued (or its wait runs out first).
    let queued = tokio::select! {
        result = waiter.as_mut().expect("present").as_mut() => {
            let err = result.expect_err("granted while the holder holds");
            assert!(matches!(err, crate::Error::Timeout { .. }), "{err:?}");
            false
        }
        () = until_waiters(lock, &name, 1) => true,
    };
    if queued {
        // Past the timeout without polling; then one poll starts the give-up.
        tokio::time::sleep(wait + Duration::from_millis(100)).await;
        let waiter = waiter.take().expect("present");
        if let Some(result) = poll_once_then_drop(waiter).await {
            let err = result.expect_err("granted while the holder holds");
            assert!(matches!(err, crate::Error::Timeout { .. }), "{err:?}");
        }
    }
    drop(waiter);
    assert!(!holder.is_lost());
    let token = holder.token();
    holder.release().await.expect("release");
    let next = acquire_within(other, &name, Duration::from_secs(3)).await;
    assert!(next.token() > token);
    next.release().await.expect("release");
    until_waiters(lock, &name, 0).await;
    let info = lock.inspect(&name).await.expect("inspect");
    assert!(!info.is_held(), "{info:?}");
}

/// A holder granted through a hand-off whose guard is leaked (neither renewed nor
/// released: a fixed lease and `mem::forget`) expires, and the next waiter is granted
/// within one lease and a small bound, with a larger token.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn expiry_after_handoff_passes_the_turn_on(lock: &dyn DistributedLock) {
    let name = unique_name("expiry-after-handoff");
    let lease = short_lease(lock);
    let first = lock.lock(&name).await.expect("acquire");
    // With FIFO the third queues behind the second; without, it starts once the second
    // holds, so the hand-off cannot go to it instead.
    let fifo = lock.capabilities().fifo;
    let second_granted = tokio::sync::Notify::new();
    let second = lock.acquire(
        &name,
        AcquireOptions::new()
            .fixed_lease(lease)
            .wait_timeout(Duration::from_secs(30)),
    );
    let third = async {
        if fifo {
            until_waiters(lock, &name, 1).await;
        } else {
            second_granted.notified().await;
        }
        lock.acquire(
            &name,
            AcquireOptions::new().wait_timeout(lease * 3 + Duration::from_secs(30)),
        )
        .await
        .map(|guard| (guard, Instant::now()))
    };
    let hand_off = async {
        until_waiters(lock, &name, if fifo { 2 } else { 1 }).await;
        first.release().await.expect("release");
    };
    let leak = async {
        let second = second.await.expect("the second waiter is granted");
        let granted = (second.token(), Instant::now());
        second_granted.notify_one();
        // Leaked: never renewed (fixed lease), never released.
        std::mem::forget(second);
        granted
    };
    let (((second_token, second_at), third), ()) =
        tokio::join!(async { tokio::join!(leak, third) }, hand_off);
    let (third, third_at) = third.expect("the third waiter is granted after the expiry");
    let after = third_at.saturating_duration_since(second_at);
    assert!(
        after <= lease + Duration::from_secs(2),
        "the turn passed {after:?} after the hand-off of a {lease:?} lease"
    );
    assert!(third.token() > second_token);
    third.release().await.expect("release");
    let info = lock.inspect(&name).await.expect("inspect");
    assert!(!info.is_held(), "{info:?}");
    assert!(matches!(info.waiters, None | Some(0)), "{info:?}");
}

/// A fixed lease starts when the lock is granted, not while waiting: an acquire with a
/// fixed lease that waits longer than the lease succeeds and then holds for the lease,
/// with a deadline no later than the lease after the grant.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn contended_fixed_lease_starts_at_grant(lock: &dyn DistributedLock) {
    let name = unique_name("contended-fixed-lease");
    let lease = short_lease(lock);
    let holder = lock.lock(&name).await.expect("acquire");
    let started = Instant::now();
    let waiter = lock.acquire(
        &name,
        AcquireOptions::new()
            .fixed_lease(lease)
            .wait_timeout(lease * 4 + Duration::from_secs(10)),
    );
    let release = async {
        until_waiters(lock, &name, 1).await;
        // Release only after more than the lease has passed.
        tokio::time::sleep_until(started + lease + lease / 2).await;
        holder.release().await.expect("release");
        Instant::now()
    };
    let (guard, released_at) = tokio::join!(waiter, release);
    let guard = guard.expect("a fixed-lease acquire that waited longer than its lease");
    let granted_at = Instant::now();
    assert!(!guard.is_lost(), "lost at grant");
    assert!(
        guard.valid_until() <= granted_at + lease,
        "valid_until lies beyond the lease"
    );
    assert!(
        guard.valid_until() >= released_at + lease / 2,
        "valid_until {:?} after the release leaves less than half the lease",
        guard.valid_until().saturating_duration_since(released_at)
    );
    // Still held at half the lease: nobody else gets it.
    tokio::time::sleep_until(released_at + lease / 2).await;
    assert!(!guard.is_lost(), "lost before half the lease");
    assert!(lock.try_lock(&name).await.expect("try_lock").is_none());
    // The fixed lease ends: loss is reported, and the name is free.
    tokio::time::timeout(lease + SLACK, guard.lost())
        .await
        .expect("a fixed lease reports loss after its duration");
    drop(guard);
    let next = acquire_within(lock, &name, lease + Duration::from_secs(2)).await;
    next.release().await.expect("release");
}
