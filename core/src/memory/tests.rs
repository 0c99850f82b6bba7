//! In-memory backend behaviour that needs its internals or a paused clock.

use std::time::Duration;

use tokio::time::Instant;

use super::MemoryLock;
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, Error};

#[tokio::test(start_paused = true)]
async fn renewing_lease_is_held_for_many_lease_durations() {
    let locks = MemoryLock::new();
    let guard = locks
        .acquire("a", AcquireOptions::new().lease(Duration::from_secs(3)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert!(!guard.is_lost());
    assert!(guard.valid_until() > Instant::now());
    assert!(guard.valid_until() <= Instant::now() + Duration::from_secs(3));
    assert!(locks.try_lock("a").await.unwrap().is_none());
    guard.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(start_paused = true)]
async fn fixed_lease_hands_over_exactly_at_expiry() {
    let locks = MemoryLock::new();
    let start = Instant::now();
    let old = locks
        .acquire(
            "a",
            AcquireOptions::new().fixed_lease(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    assert_eq!(old.valid_until(), start + Duration::from_secs(5));
    let new = locks.lock("a").await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    assert!(old.is_lost());
    assert!(new.token() > old.token());
    assert!(matches!(old.release().await, Err(Error::Lost { .. })));
    assert!(locks.try_lock("a").await.unwrap().is_none());
    drop(new);
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(flavor = "current_thread")]
async fn a_stalled_process_loses_its_renewing_lease() {
    // The runtime is blocked, as by a long GC pause: renewal cannot run, the lease runs
    // out, and the next contender takes over while the stalled guard learns it is lost.
    let locks = MemoryLock::new();
    let lease = Duration::from_millis(150);
    let stalled = locks
        .acquire("a", AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    std::thread::sleep(lease * 2);
    assert!(stalled.is_lost());
    let next = locks
        .try_lock("a")
        .await
        .unwrap()
        .expect("expired lease is free");
    assert!(next.token() > stalled.token());
    assert!(matches!(stalled.release().await, Err(Error::Lost { .. })));
    assert!(!next.is_lost());
    next.release().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn revoke_reports_loss_at_once_and_serves_the_next_waiter() {
    let locks = MemoryLock::new();
    let holder = locks.lock("a").await.unwrap();
    let waiter = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock("a").await.unwrap().token() }
    });
    tokio::task::yield_now().await;
    assert!(locks.revoke("a"));
    tokio::time::timeout(Duration::from_millis(1), holder.lost())
        .await
        .unwrap();
    assert_eq!(holder.lost_reason(), Some("the lock was revoked"));
    assert!(waiter.await.unwrap() > holder.token());
    assert!(!locks.revoke("a"));
}

#[tokio::test(start_paused = true)]
async fn cancelled_and_timed_out_waiters_leave_no_state() {
    let locks = MemoryLock::new();
    let holder = locks.lock("a").await.unwrap();
    for i in 0..50u64 {
        let opts = AcquireOptions::new().wait_timeout(Duration::from_millis(i));
        assert!(locks.acquire("a", opts).await.is_err());
        let pending = locks.lock("a");
        drop(pending);
    }
    assert_eq!(locks.inspect("a").await.unwrap().waiters, Some(0));
    holder.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_front_waiter_passes_its_turn_on() {
    let locks = MemoryLock::new();
    let holder = locks.lock("a").await.unwrap();
    let front = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock("a").await }
    });
    tokio::task::yield_now().await;
    let second = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock("a").await.unwrap().token() }
    });
    tokio::task::yield_now().await;
    assert_eq!(locks.inspect("a").await.unwrap().waiters, Some(2));
    holder.release().await.unwrap();
    front.abort();
    assert!(second.await.unwrap() > crate::FencingToken::new(0));
}

#[tokio::test]
async fn named_instances_are_shared_and_new_ones_are_not() {
    let a = MemoryLock::named("memory-tests-shared");
    let b = MemoryLock::named("memory-tests-shared");
    let guard = a.lock("x").await.unwrap();
    assert!(b.try_lock("x").await.unwrap().is_none());
    assert!(MemoryLock::new().try_lock("x").await.unwrap().is_some());
    guard.release().await.unwrap();
}

#[tokio::test]
async fn inspect_reports_holder_and_waiters() {
    let locks = MemoryLock::new();
    assert!(!locks.inspect("a").await.unwrap().is_held());
    let guard = locks.lock("a").await.unwrap();
    let info = locks.inspect("a").await.unwrap();
    let holder = info.holder.unwrap();
    assert_eq!(holder.token, guard.token());
    assert!(holder.remaining_lease.unwrap() <= Duration::from_secs(30));
    assert_eq!(info.waiters, Some(0));
}
