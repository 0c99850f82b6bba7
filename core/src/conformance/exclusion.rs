//! Exclusion, contention, FIFO, release.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use super::support::{SLACK, fenced_counter, unique_name, until_waiters};
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, Error, FencingToken};

/// 8 tasks × 50 acquisitions doing read-sleep-write on a fenced register: the final count
/// is 400, no write is rejected, no two holders overlap, and the 400 tokens are unique and
/// strictly increasing in the order the writes happened.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn mutual_exclusion(lock: &dyn DistributedLock) {
    fenced_counter(&[lock], &unique_name("mutual-exclusion"), 8, 50).await;
}

/// `try_lock` on a held lock is `Ok(None)`; `acquire` with no wait is `Contended`; both
/// succeed once it is released.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn try_lock_under_contention(lock: &dyn DistributedLock) {
    let name = unique_name("try-lock");
    let first = lock
        .try_lock(&name)
        .await
        .expect("try_lock")
        .expect("free lock");
    assert!(lock.try_lock(&name).await.expect("try_lock").is_none());
    let err = lock
        .acquire(&name, AcquireOptions::new().no_wait())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Contended { .. }), "{err:?}");
    let first_token = first.token();
    first.release().await.expect("release");
    let second = lock
        .try_lock(&name)
        .await
        .expect("try_lock")
        .expect("released lock is free");
    assert!(second.token() > first_token);
    second.release().await.expect("release");
}

/// A free lock is granted with a zero or tiny wait timeout (the wait bounds the time
/// spent behind a holder, not the round trips). Waiting with a timeout on a held lock
/// fails with `Timeout` after the timeout, not much later, has left the queue by the
/// time it returns, and leaves the holder undisturbed.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn wait_timeout_is_honoured(lock: &dyn DistributedLock) {
    // The wait is time spent while someone else holds the lock: a free lock is granted
    // with a zero or tiny wait, however long the round trips to the backend take.
    for wait in [Duration::ZERO, Duration::from_millis(1)] {
        let free = unique_name("wait-timeout-free");
        let granted = lock
            .acquire(&free, AcquireOptions::new().wait_timeout(wait))
            .await;
        match granted {
            Ok(guard) => guard.release().await.expect("release"),
            Err(err) => panic!("a free lock with a wait of {wait:?}: {err:?}"),
        }
    }
    let name = unique_name("wait-timeout");
    let holder = lock.lock(&name).await.expect("acquire");
    let wait = Duration::from_millis(400);
    let start = Instant::now();
    let err = lock
        .acquire(&name, AcquireOptions::new().wait_timeout(wait))
        .await
        .unwrap_err();
    let waited = start.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        waited >= wait,
        "gave up after {waited:?}, before the {wait:?} timeout"
    );
    assert!(
        waited <= wait + SLACK * 3,
        "gave up after {waited:?} for a {wait:?} timeout"
    );
    assert!(!holder.is_lost());
    // The waiter cleaned up before returning, not in the background: a process may exit
    // right after a timeout.
    if lock.capabilities().counts_waiters {
        let info = lock.inspect(&name).await.expect("inspect");
        assert_eq!(
            info.waiters,
            Some(0),
            "a timed-out waiter is still queued: {info:?}"
        );
    }
    assert!(lock.try_lock(&name).await.expect("try_lock").is_none());
    holder.release().await.expect("release");
}

/// Five waiters that queued one after another behind a holder are each served once, one
/// at a time, with tokens rising in the order of the grants; where the backend claims
/// FIFO, in the order they queued.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn fifo_order(lock: &dyn DistributedLock) {
    const WAITERS: usize = 5;
    let fifo = lock.capabilities().fifo;
    let name = unique_name("fifo");
    let holder = lock.lock(&name).await.expect("acquire");
    let order = Mutex::new(Vec::new());
    let queued = AtomicUsize::new(0);
    let inside = AtomicUsize::new(0);
    let waiter = |i: usize| {
        let (name, order, queued, inside) = (&name, &order, &queued, &inside);
        async move {
            // Join the queue only after waiter i-1 has joined it.
            while queued.load(Ordering::SeqCst) < i {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let acquire = lock.acquire(
                name,
                AcquireOptions::new().wait_timeout(Duration::from_secs(30)),
            );
            let queued_now = async {
                until_waiters(lock, name, i + 1).await;
                queued.fetch_add(1, Ordering::SeqCst);
            };
            let (guard, ()) = tokio::join!(acquire, queued_now);
            let guard = guard.expect("waiter acquires");
            assert_eq!(
                inside.fetch_add(1, Ordering::SeqCst),
                0,
                "waiter {i} was granted while another waiter held the lock"
            );
            order.lock().unwrap().push((i, guard.token()));
            inside.fetch_sub(1, Ordering::SeqCst);
            guard.release().await.expect("release");
        }
    };
    let release_holder = async {
        while queued.load(Ordering::SeqCst) < WAITERS {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        holder.release().await.expect("release");
    };
    tokio::join!(join_all((0..WAITERS).map(waiter)), release_holder);
    let order = order.into_inner().unwrap();
    let mut served: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
    assert!(
        order.windows(2).all(|w| w[0].1 < w[1].1),
        "tokens do not rise in the order of the grants: {order:?}"
    );
    if fifo {
        assert_eq!(served, (0..WAITERS).collect::<Vec<_>>(), "FIFO claimed");
    }
    served.sort_unstable();
    assert_eq!(
        served,
        (0..WAITERS).collect::<Vec<_>>(),
        "every waiter is served exactly once"
    );
}

/// Releasing is safe to repeat: a second release of the same grant is `Ok` and a late one
/// never frees a newer holder's lock.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn release_is_idempotent(lock: &dyn DistributedLock) {
    let name = unique_name("idempotent-release");
    let first = lock.lock(&name).await.expect("acquire");
    let handle = first.held().clone();
    handle.release().await.expect("first release");
    handle
        .release()
        .await
        .expect("repeated release of a released grant");
    let second = lock
        .acquire(
            &name,
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("lock is free after release");
    // The first guard's own release and drop come late: they must not touch `second`.
    match first.release().await {
        Ok(()) | Err(Error::Lost { .. }) => {}
        Err(e) => panic!("late release failed: {e:?}"),
    }
    handle.release().await.expect("late repeated release");
    assert!(!second.is_lost());
    assert!(
        lock.try_lock(&name).await.expect("try_lock").is_none(),
        "late release freed a newer holder"
    );
    second
        .release()
        .await
        .expect("newer holder releases normally");
}

/// `with_lock` runs the closure with the guard's token, returns its value, and releases.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn with_lock_runs_and_releases(lock: &dyn DistributedLock) {
    let name = unique_name("with-lock");
    let seen = Mutex::new(None::<FencingToken>);
    let (seen_ref, name_ref) = (&seen, &name);
    let value = lock
        .with_lock(&name, |token| async move {
            *seen_ref.lock().unwrap() = Some(token);
            assert!(
                lock.try_lock(name_ref).await.expect("try_lock").is_none(),
                "held inside with_lock"
            );
            7
        })
        .await
        .expect("with_lock");
    assert_eq!(value, 7);
    assert!(seen.into_inner().unwrap().is_some());
    let after = lock
        .try_lock(&name)
        .await
        .expect("try_lock")
        .expect("released after with_lock");
    after.release().await.expect("release");
}

/// Locks are not reentrant: while a guard holds a name, a second acquire of it through
/// the same client (the same task, even) is refused or waits like anyone else's, and gets
/// the lock only once the first guard is released. `try_with_lock` skips held names;
/// `lock_within` gives `None` when its wait runs out.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn locks_are_not_reentrant(lock: &dyn DistributedLock) {
    let name = unique_name("not-reentrant");
    let held = lock.lock(&name).await.expect("acquire");
    assert!(
        lock.try_lock(&name).await.expect("try_lock").is_none(),
        "a second acquire by the holder's own client is refused"
    );
    let wait = Duration::from_millis(300);
    let waited = lock.lock_within(&name, wait).await.expect("lock_within");
    assert!(
        waited.is_none(),
        "the holder's own client waits like anyone else"
    );
    let ran = lock
        .try_with_lock(&name, |_| async { "ran" })
        .await
        .expect("try_with_lock");
    assert_eq!(ran, None, "try_with_lock skips a held name");
    held.release().await.expect("release");
    let ran = lock
        .try_with_lock(&name, |token| async move { token })
        .await
        .expect("try_with_lock")
        .expect("a free name runs");
    let again = lock
        .lock_within(&name, Duration::from_secs(5))
        .await
        .expect("lock_within")
        .expect("free again after try_with_lock");
    assert!(again.token() > ran);
    again.release().await.expect("release");
}
