//! In-memory backend behaviour that needs its internals or a paused clock.

use std::time::Duration;

use tokio::time::Instant;

use super::MemoryLock;
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, Error, LockGuard};

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
    assert!(locks.revoke("a").await.unwrap().is_some());
    tokio::time::timeout(Duration::from_millis(1), holder.lost())
        .await
        .unwrap();
    assert_eq!(holder.lost_reason(), Some("the lock was revoked"));
    assert!(waiter.await.unwrap() > holder.token());
    assert!(locks.revoke("a").await.unwrap().is_none());
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

/// Spawns `acquire(name, options)` on the current runtime and returns once the new
/// waiter is in the queue (the queue grew by one), so waiters queue in a known order.
async fn queued(
    locks: &MemoryLock,
    name: &'static str,
    options: AcquireOptions,
) -> tokio::task::JoinHandle<Result<LockGuard, Error>> {
    let before = locks.inspect(name).await.unwrap().waiters.unwrap();
    let task = tokio::spawn({
        let locks = locks.clone();
        async move { locks.acquire(name, options).await }
    });
    for _ in 0..1000 {
        tokio::task::yield_now().await;
        if locks.inspect(name).await.unwrap().waiters.unwrap() > before {
            return task;
        }
    }
    panic!("the waiter for {name:?} never queued");
}

/// Awaits a queued acquire for at most `limit`, failing the test with `what` if it is
/// still waiting then.
async fn granted_within(
    limit: Duration,
    task: tokio::task::JoinHandle<Result<LockGuard, Error>>,
    what: &str,
) -> LockGuard {
    match tokio::time::timeout(limit, task).await {
        Ok(joined) => joined.unwrap().unwrap(),
        Err(_) => panic!("{what} was not granted within {limit:?}"),
    }
}

/// The instant a fixed-lease guard was granted: its deadline minus its lease.
fn granted_at(guard: &LockGuard, fixed_lease: Duration) -> Instant {
    guard.valid_until() - fixed_lease
}

/// A holds; B (fixed lease) and C queue; A releases and B is granted from the queue; B's
/// guard is leaked. When B's lease runs out, C must be granted (it is at the front now),
/// not left waiting for a wake-up that never comes. Shared by the paused-clock and the
/// real-time test; `slack` bounds how late after B's expiry C may be granted.
async fn leaked_fixed_holder_from_the_queue(lease: Duration, slack: Duration) {
    let locks = MemoryLock::new();
    let c_lease = Duration::from_secs(30);
    let a = locks.lock("a").await.unwrap();
    let b_task = queued(&locks, "a", AcquireOptions::new().fixed_lease(lease)).await;
    let c_task = queued(&locks, "a", AcquireOptions::new().fixed_lease(c_lease)).await;
    assert_eq!(locks.inspect("a").await.unwrap().waiters, Some(2));
    let a_token = a.token();
    a.release().await.unwrap();

    // B is granted; its guard is leaked: never renewed (fixed lease), never released.
    // `ManuallyDrop` leaks exactly like `std::mem::forget` but lets us still watch it.
    let b = std::mem::ManuallyDrop::new(granted_within(slack, b_task, "B").await);
    assert!(b.token() > a_token);
    let info = locks.inspect("a").await.unwrap();
    assert_eq!(info.holder.map(|h| h.token), Some(b.token()));
    assert_eq!(info.waiters, Some(1));

    // After B's lease, C is granted: not before (mutual exclusion), and not much later.
    let c = granted_within(lease + slack, c_task, "C, after B's lease expired").await;
    assert!(granted_at(&c, c_lease) >= b.valid_until());
    assert!(granted_at(&c, c_lease) <= b.valid_until() + slack);
    assert!(c.token() > b.token());
    assert!(b.is_lost());
    assert!(!c.is_lost());
    let info = locks.inspect("a").await.unwrap();
    assert_eq!(info.holder.map(|h| h.token), Some(c.token()));
    assert_eq!(info.waiters, Some(0));
    assert!(locks.try_lock("a").await.unwrap().is_none());

    // The leaked grant can no longer release anything, and does not disturb C.
    assert!(matches!(b.held().release().await, Err(Error::Lost { .. })));
    assert!(!c.is_lost());
    let c_token = c.token();
    c.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
    let d = locks
        .try_lock("a")
        .await
        .unwrap()
        .expect("free after C released");
    assert!(d.token() > c_token);
    d.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(start_paused = true)]
async fn expiry_of_a_leaked_fixed_lease_granted_from_the_queue_serves_the_next_waiter() {
    leaked_fixed_holder_from_the_queue(Duration::from_secs(1), Duration::from_millis(10)).await;
}

#[tokio::test]
async fn expiry_of_a_leaked_fixed_lease_serves_the_next_waiter_in_real_time() {
    leaked_fixed_holder_from_the_queue(Duration::from_millis(200), Duration::from_millis(500))
        .await;
}

#[tokio::test(start_paused = true)]
async fn a_chain_of_leaked_fixed_leases_hands_over_at_each_expiry() {
    // A is granted directly (nobody waiting); B, C and D queue behind it afterwards.
    // Every guard is leaked; each expiry must serve the next in line.
    let locks = MemoryLock::new();
    let lease = Duration::from_secs(1);
    let fixed = || AcquireOptions::new().fixed_lease(lease);
    let start = Instant::now();
    let a = std::mem::ManuallyDrop::new(locks.acquire("a", fixed()).await.unwrap());
    let mut tasks = Vec::new();
    for _ in 0..3 {
        tasks.push(queued(&locks, "a", fixed()).await);
    }
    let mut previous = a;
    for (i, task) in (1u32..).zip(tasks) {
        let next = std::mem::ManuallyDrop::new(
            granted_within(lease + Duration::from_millis(10), task, "the next waiter").await,
        );
        assert_eq!(granted_at(&next, lease), start + lease * i);
        assert!(previous.is_lost());
        assert!(next.token() > previous.token());
        previous = next;
    }
    assert_eq!(locks.inspect("a").await.unwrap().waiters, Some(0));
    tokio::time::sleep(lease).await;
    assert!(previous.is_lost());
    assert!(!locks.inspect("a").await.unwrap().is_held());
    assert_eq!(locks.active_names(), 0);
    let last = locks
        .try_lock("a")
        .await
        .unwrap()
        .expect("free after expiry");
    assert!(last.token() > previous.token());
    last.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_front_waiter_cancelled_under_a_leaked_holder_passes_its_turn_on() {
    let locks = MemoryLock::new();
    let lease = Duration::from_secs(1);
    let a = std::mem::ManuallyDrop::new(
        locks
            .acquire("a", AcquireOptions::new().fixed_lease(lease))
            .await
            .unwrap(),
    );
    let front = queued(&locks, "a", AcquireOptions::new()).await;
    let second = queued(&locks, "a", AcquireOptions::new()).await;
    front.abort();
    assert!(front.await.unwrap_err().is_cancelled());
    assert_eq!(locks.inspect("a").await.unwrap().waiters, Some(1));
    let second = granted_within(lease + Duration::from_millis(10), second, "the second").await;
    assert_eq!(
        granted_at(&second, Duration::from_secs(30)),
        a.valid_until()
    );
    assert!(a.is_lost());
    assert!(second.token() > a.token());
    second.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_front_waiter_timing_out_under_a_leaked_holder_passes_its_turn_on() {
    let locks = MemoryLock::new();
    let lease = Duration::from_secs(2);
    let a = std::mem::ManuallyDrop::new(
        locks
            .acquire("a", AcquireOptions::new().fixed_lease(lease))
            .await
            .unwrap(),
    );
    let front = queued(
        &locks,
        "a",
        AcquireOptions::new().wait_timeout(Duration::from_millis(500)),
    )
    .await;
    let second = queued(&locks, "a", AcquireOptions::new()).await;
    assert!(matches!(front.await.unwrap(), Err(Error::Timeout { .. })));
    assert_eq!(locks.inspect("a").await.unwrap().waiters, Some(1));
    let second = granted_within(lease, second, "the second").await;
    assert_eq!(
        granted_at(&second, Duration::from_secs(30)),
        a.valid_until()
    );
    assert!(a.is_lost());
    second.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(start_paused = true)]
async fn after_a_revoke_the_expiry_of_the_next_leaked_holder_serves_the_one_after() {
    let locks = MemoryLock::new();
    let lease = Duration::from_secs(1);
    let a = locks.lock("a").await.unwrap();
    let b = queued(&locks, "a", AcquireOptions::new().fixed_lease(lease)).await;
    let c = queued(&locks, "a", AcquireOptions::new()).await;
    assert!(locks.revoke("a").await.unwrap().is_some());
    assert!(a.is_lost());
    let b = std::mem::ManuallyDrop::new(granted_within(lease, b, "B, after the revoke").await);
    let c = granted_within(lease + Duration::from_millis(10), c, "C, after B expired").await;
    assert_eq!(granted_at(&c, Duration::from_secs(30)), b.valid_until());
    assert!(b.is_lost());
    assert!(c.token() > b.token());
    c.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(start_paused = true)]
async fn revoking_an_expired_lock_reports_it_was_not_held() {
    let locks = MemoryLock::new();
    let lease = Duration::from_secs(1);
    let a = std::mem::ManuallyDrop::new(
        locks
            .acquire("a", AcquireOptions::new().fixed_lease(lease))
            .await
            .unwrap(),
    );
    tokio::time::sleep(lease * 2).await;
    assert!(locks.revoke("a").await.unwrap().is_none());
    assert_ne!(a.lost_reason(), Some("the lock was revoked"));
    assert_eq!(locks.active_names(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_leaked_renewing_guard_holds_until_its_renewal_stops_then_the_queue_moves() {
    // A leaked renewing guard still lives: its renewal task keeps the lock, as an etcd
    // session keepalive would. When renewal stops (here the process stalls past the
    // lease), the lease expires and every waiter behind it is served in turn.
    let locks = MemoryLock::new();
    let lease = Duration::from_secs(3);
    let b_lease = Duration::from_secs(1);
    let a = std::mem::ManuallyDrop::new(
        locks
            .acquire("a", AcquireOptions::new().lease(lease))
            .await
            .unwrap(),
    );
    let b = queued(&locks, "a", AcquireOptions::new().fixed_lease(b_lease)).await;
    let c = queued(&locks, "a", AcquireOptions::new()).await;
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(!a.is_lost());
    assert_eq!(locks.inspect("a").await.unwrap().waiters, Some(2));

    tokio::time::advance(lease * 3).await;
    let b = std::mem::ManuallyDrop::new(granted_within(lease, b, "B, after A expired").await);
    assert!(a.is_lost());
    assert!(b.token() > a.token());
    let c = granted_within(b_lease + Duration::from_millis(10), c, "C, after B expired").await;
    assert_eq!(granted_at(&c, Duration::from_secs(30)), b.valid_until());
    assert!(b.is_lost());
    assert!(c.token() > b.token());
    c.release().await.unwrap();
    assert_eq!(locks.active_names(), 0);
}

#[test]
fn a_leaked_renewing_guard_whose_runtime_ended_expires_and_serves_the_queue() {
    // B's guard is leaked on a runtime that then shuts down, which ends its renewal task:
    // the lease must expire and C (waiting on another runtime) must be served.
    let lease = Duration::from_millis(200);
    let slack = Duration::from_millis(500);
    let locks = MemoryLock::new();
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    main.block_on(async {
        let a = locks.lock("a").await.unwrap();
        let other = std::thread::spawn({
            let locks = locks.clone();
            move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .unwrap();
                let guard = runtime
                    .block_on(locks.acquire("a", AcquireOptions::new().lease(lease)))
                    .unwrap();
                std::mem::ManuallyDrop::new(guard)
            }
        });
        while locks.inspect("a").await.unwrap().waiters != Some(1) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let c = queued(&locks, "a", AcquireOptions::new().fixed_lease(lease * 100)).await;
        a.release().await.unwrap();
        let b = tokio::task::spawn_blocking(move || other.join().unwrap())
            .await
            .unwrap();
        let c = granted_within(lease + slack, c, "C, after B's renewal ended").await;
        assert!(granted_at(&c, lease * 100) >= b.valid_until());
        assert!(b.is_lost());
        assert!(c.token() > b.token());
        c.release().await.unwrap();
        assert_eq!(locks.active_names(), 0);
    });
}

/// A `lost_token()` taken inside a temporary runtime (a `block_on` that then ends) fires
/// at a fixed lease's deadline while the runtime the lock was taken on runs: its
/// deadline watcher, dropped with the temporary runtime, must go on on the lock's, or
/// nothing marks the loss (a fixed `mem://` lease without contention has no other
/// watcher) and the token already handed out never fires.
#[test]
fn a_lost_token_taken_on_a_runtime_that_ended_fires_at_the_deadline() {
    let lease = Duration::from_millis(300);
    let locks = MemoryLock::new();
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let guard = main
        .block_on(locks.acquire("a", AcquireOptions::new().fixed_lease(lease)))
        .unwrap();
    let temporary = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let token = temporary.block_on(async { guard.lost_token() });
    drop(temporary);
    main.block_on(async {
        tokio::time::timeout(lease + Duration::from_secs(2), token.cancelled())
            .await
            .expect("the token fires at the deadline");
    });
    assert!(guard.is_lost());
}

/// A `lost_token()` taken inside a `current_thread` runtime the caller keeps but only
/// enters now and then (a sync wrapper's `block_on`) fires at the deadline while the
/// lock's own runtime runs: a watcher parked on the idle runtime would never be polled.
#[test]
fn a_lost_token_taken_on_an_idle_runtime_fires_at_the_deadline() {
    let lease = Duration::from_millis(300);
    let locks = MemoryLock::new();
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let guard = main
        .block_on(locks.acquire("a", AcquireOptions::new().fixed_lease(lease)))
        .unwrap();
    let kept = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let token = kept.block_on(async { guard.lost_token() });
    // The kept runtime is idle from here on; the lock's own keeps running.
    std::thread::sleep(lease + Duration::from_millis(700));
    assert!(
        token.is_cancelled(),
        "the token did not fire at the deadline"
    );
    drop(kept);
}

/// The other way round: the lock acquired inside a `current_thread` runtime the caller
/// keeps but leaves idle, the token taken on a running one. The record's runtime is the
/// idle one, so a watcher there alone would never fire.
#[test]
fn a_lost_token_of_a_lock_acquired_on_an_idle_runtime_fires_at_the_deadline() {
    let lease = Duration::from_millis(300);
    let locks = MemoryLock::new();
    let kept = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let guard = kept
        .block_on(locks.acquire("a", AcquireOptions::new().fixed_lease(lease)))
        .unwrap();
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let token = main.block_on(async { guard.lost_token() });
    std::thread::sleep(lease + Duration::from_millis(700));
    assert!(
        token.is_cancelled(),
        "the token did not fire at the deadline"
    );
    drop(main);
    drop(kept);
}

#[tokio::test(start_paused = true)]
async fn closing_one_client_leaves_the_others_of_its_set_alone() {
    let namespace = "closing-one-client";
    let (a, b) = (MemoryLock::named(namespace), MemoryLock::named(namespace));
    let clone_of_a = a.clone();
    let theirs = b.lock("theirs").await.unwrap();
    let ours = a.lock("ours").await.unwrap();
    a.close().await.unwrap();
    assert!(ours.is_lost());
    assert!(matches!(
        clone_of_a.try_lock("x").await,
        Err(Error::Closed { backend: "mem" })
    ));
    assert!(!theirs.is_lost());
    assert!(b.try_lock("ours").await.unwrap().is_some());
    let c = MemoryLock::named(namespace);
    assert!(c.try_lock("theirs").await.unwrap().is_none());
    theirs.release().await.unwrap();
    assert!(matches!(ours.release().await, Err(Error::Lost { .. })));
    assert_eq!(c.active_names(), 0);
}

/// The tasks alive on the current runtime.
fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Locking one name in a loop with a renewing lease keeps one renewal task: the
/// scheduler of the runtime is kept while its task runs, not forgotten (and a new task
/// started) at each acquire once the last lock was released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_taken_in_a_loop_starts_one_renewal_task() {
    let alive = alive_tasks;
    let before = alive();
    let locks = MemoryLock::new();
    for _ in 0..100 {
        let guard = locks
            .acquire(
                "looped",
                AcquireOptions::new().lease(Duration::from_secs(3)),
            )
            .await
            .unwrap();
        guard.release().await.unwrap();
    }
    assert!(
        alive() <= before + 1,
        "{} tasks alive after 100 acquires, {before} before",
        alive()
    );
}

/// Every renewing lock of a client is renewed by one task (per runtime), not one task
/// each: 1,000 locks held over many renewals cost one task, none is lost, and the task
/// ends once nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_task_renews_every_held_lock_of_a_client() {
    let alive = alive_tasks;
    let before = alive();
    let locks = MemoryLock::new();
    let lease = Duration::from_millis(300);
    let mut guards = Vec::new();
    for i in 0..1_000 {
        let name = format!("renewed-{i}");
        guards.push(
            locks
                .acquire(&name, AcquireOptions::new().lease(lease))
                .await
                .unwrap(),
        );
    }
    assert_eq!(alive(), before + 1, "one renewal task for 1,000 locks");
    tokio::time::sleep(lease * 5).await;
    assert!(
        guards.iter().all(|g| !g.is_lost()),
        "renewed through 5 lease periods"
    );
    for guard in guards {
        guard.release().await.unwrap();
    }
    assert_eq!(locks.active_names(), 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive() > before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        alive(),
        before,
        "the renewal task ends when nothing is held"
    );
}

/// A semaphore's limit is kept only while anyone holds or waits: once the last holder's
/// fixed lease ran out (its guard still alive), a request with another limit is granted
/// at once, not refused with `InvalidConfig`.
#[tokio::test(start_paused = true)]
async fn an_expired_semaphore_takes_a_new_limit() {
    let locks = MemoryLock::new();
    let old = locks
        .acquire_permits(
            "s",
            crate::Permits::one_of(3).unwrap(),
            AcquireOptions::new().fixed_lease(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(old.is_lost());
    let new = locks
        .acquire_permits(
            "s",
            crate::Permits::one_of(5).unwrap(),
            AcquireOptions::new().no_wait(),
        )
        .await;
    assert!(new.is_ok(), "{new:?}");
}

/// A renewing lease too short to be renewed in time (renewed every third of it, on
/// millisecond timers) is refused; a fixed lease of 1 ms is fine, and the shortest
/// renewing lease taken is held across many renewals.
#[tokio::test(start_paused = true)]
async fn renewing_leases_too_short_to_renew_are_refused() {
    let locks = MemoryLock::new();
    let short = locks
        .acquire("r", AcquireOptions::new().lease(Duration::from_millis(1)))
        .await;
    assert!(matches!(short, Err(Error::InvalidConfig(_))), "{short:?}");
    let fixed = locks
        .acquire(
            "f",
            AcquireOptions::new().fixed_lease(Duration::from_millis(1)),
        )
        .await
        .unwrap();
    drop(fixed);
    let shortest = locks
        .acquire("s", AcquireOptions::new().lease(Duration::from_millis(10)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!shortest.is_lost(), "{:?}", shortest.lost_reason());
    shortest.release().await.unwrap();
}

/// An observer learns that the leader's lease ran out even when nobody else campaigns
/// or looks at the election (nothing else touches the name), as etcd would push the
/// deletion: the term, then nobody.
#[tokio::test(start_paused = true)]
async fn observers_learn_of_a_term_that_ran_out_untouched() {
    let locks = MemoryLock::new();
    let term = locks
        .campaign(
            "e",
            "v",
            AcquireOptions::new().fixed_lease(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    let mut changes = locks.observe("e").await.unwrap();
    let first = changes.next().await.unwrap().unwrap();
    assert_eq!(first.map(|l| l.token), Some(term.token()));
    let next = tokio::time::timeout(Duration::from_secs(3), changes.next())
        .await
        .expect("the end of the term was pushed");
    assert!(matches!(next, Some(Ok(None))), "{next:?}");
    assert!(term.is_lost());
}

/// An observation whose client goes away (every handle and guard dropped, never closed)
/// ends with an error item, as every stream of `observe` does, not silently.
#[tokio::test]
async fn an_observation_ends_with_an_error_when_its_client_is_gone() {
    let locks = MemoryLock::new();
    let mut changes = locks.observe("e").await.unwrap();
    assert!(matches!(changes.next().await, Some(Ok(None))));
    drop(locks);
    let last = tokio::time::timeout(Duration::from_secs(5), changes.next())
        .await
        .expect("the stream ends");
    assert!(matches!(last, Some(Err(Error::Closed { .. }))), "{last:?}");
    assert!(changes.next().await.is_none());
}

/// A name only observed is not active (nobody holds or waits), and a dropped observation
/// leaves no state for its name.
#[tokio::test]
async fn observed_names_are_not_active_and_dropped_observations_leave_nothing() {
    let locks = MemoryLock::new();
    let changes = locks.observe("e").await.unwrap();
    assert_eq!(locks.active_names(), 0);
    drop(changes);
    let gone = async {
        while locks.shared.table().entries() != 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), gone)
        .await
        .expect("the observed name's entry is forgotten once the observation is dropped");
}

/// `close` tells an observer of this client's own term that it ended before the stream
/// ends with `Closed`, also when the relay runs on another worker while `close` is still
/// going through many names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_own_terms_end_is_told_before_closed() {
    for _ in 0..10 {
        let locks = MemoryLock::new();
        let mut held = Vec::new();
        for i in 0..20_000 {
            let name = format!("n{i}");
            let options = AcquireOptions::new().fixed_lease(Duration::from_secs(60));
            held.push(locks.acquire(&name, options).await.unwrap());
        }
        let _term = locks
            .campaign("e", "v", AcquireOptions::new())
            .await
            .unwrap();
        let mut changes = locks.observe("e").await.unwrap();
        assert!(matches!(changes.next().await, Some(Ok(Some(_)))));
        locks.close().await.unwrap();
        let next = changes.next().await;
        assert!(matches!(next, Some(Ok(None))), "the term's end: {next:?}");
        let last = changes.next().await;
        assert!(matches!(last, Some(Err(Error::Closed { .. }))), "{last:?}");
    }
}

/// The changes queued when the client's last handle goes (its own term's end among them)
/// come before the closing `Closed`.
#[tokio::test]
async fn changes_queued_when_the_client_goes_come_before_closed() {
    let locks = MemoryLock::new();
    let mut changes = locks.observe("e").await.unwrap();
    assert!(matches!(changes.next().await, Some(Ok(None))));
    let options = AcquireOptions::new().fixed_lease(Duration::from_secs(60));
    let term = locks.campaign("e", "v", options).await.unwrap();
    drop(term);
    drop(locks);
    let mut seen = Vec::new();
    while let Some(change) = tokio::time::timeout(Duration::from_secs(5), changes.next())
        .await
        .expect("the stream ends")
    {
        seen.push(change);
    }
    assert!(
        matches!(
            seen.as_slice(),
            [Ok(Some(_)), Ok(None), Err(Error::Closed { .. })]
        ),
        "{seen:?}"
    );
}

/// Outside a Tokio runtime (another executor), a renewing acquire is refused with a
/// typed error before anything is granted, rather than granted and then panicking with
/// the name left held until its lease ran out; so is observing. A fixed lease needs no
/// runtime.
#[test]
fn outside_a_runtime_a_renewing_acquire_is_refused_and_leaves_nothing() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    fn poll_once<F: Future>(future: F) -> Poll<F::Output> {
        let mut future = std::pin::pin!(future);
        future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
    }
    let locks = MemoryLock::new();
    let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        poll_once(locks.try_lock("outside"))
    }));
    assert!(
        matches!(tried, Ok(Poll::Ready(Err(Error::InvalidConfig(_))))),
        "{tried:?}"
    );
    let observed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        poll_once(locks.observe("outside")).map(|r| r.map(drop))
    }));
    assert!(
        matches!(observed, Ok(Poll::Ready(Err(Error::InvalidConfig(_))))),
        "{observed:?}"
    );
    let fixed = AcquireOptions::new()
        .fixed_lease(Duration::from_secs(30))
        .no_wait();
    match poll_once(locks.acquire("outside", fixed)) {
        Poll::Ready(Ok(guard)) => drop(guard),
        other => panic!("{other:?}"),
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let guard = locks.try_lock("outside").await.unwrap();
        assert!(guard.is_some(), "the name was left held");
    });
}

/// An observation whose relay ran on a runtime that then shut down ends with an error
/// item (not silently, as if nobody would ever lead again), and leaves no state for its
/// name.
#[test]
fn an_observation_whose_runtime_ended_says_so_and_leaves_nothing() {
    let locks = MemoryLock::new();
    let temporary = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let mut changes = temporary.block_on(locks.observe("e")).unwrap();
    drop(temporary);
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    main.block_on(async {
        let first = changes.next().await;
        assert!(matches!(first, Some(Ok(None))), "{first:?}");
        let end = tokio::time::timeout(Duration::from_secs(5), changes.next())
            .await
            .expect("the stream ends");
        assert!(
            matches!(end, Some(Err(Error::Unavailable { .. }))),
            "the stream ended with {end:?}, not an error"
        );
        assert_eq!(
            locks.shared.table().entries(),
            0,
            "the name's entry is left"
        );
    });
}
