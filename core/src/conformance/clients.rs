//! Cases with two independent clients of the same deployment (two connections, two
//! sessions), as two service instances would have.

use std::time::Duration;

use super::support::{fenced_counter, unique_name};
use crate::{AcquireOptions, DistributedLock, DistributedLockExt};

/// Four tasks on each of two clients, 25 rounds each, read-sleep-write on a fenced
/// register: no overlap, no rejected write, 200 strictly increasing tokens.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn mutual_exclusion_across_clients(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    fenced_counter(&[a, b], &unique_name("exclusion-across-clients"), 8, 25).await;
}

/// A lock held through one client is held for the other: `try_lock` is `Ok(None)`,
/// `inspect` shows the holder's token, and a waiter on the other client gets the lock
/// with a larger token once it is released.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn exclusion_is_visible_across_clients(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    let name = unique_name("visible-across-clients");
    let holder = a.lock(&name).await.expect("acquire");
    assert!(b.try_lock(&name).await.expect("try_lock").is_none());
    let info = b.inspect(&name).await.expect("inspect");
    assert_eq!(info.holder.map(|h| h.token), Some(holder.token()));
    let waiter = b.acquire(
        &name,
        AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
    );
    let release = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let token = holder.token();
        holder.release().await.expect("release");
        token
    };
    let (next, released) = tokio::join!(waiter, release);
    let next = next.expect("the other client's waiter gets the lock");
    assert!(next.token() > released);
    next.release().await.expect("release");
}

/// The `try_lock` race (F2): three tries on each of two clients at once, five rounds on
/// one name. Each round exactly one wins, with a token larger than the last round's; the
/// others get `Ok(None)` within a second; once the winner has released, the name is
/// free for both clients and nobody waits: the losers left nothing behind.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending tries, which the backend cleans up as
/// its own cancellation safety promises.
pub async fn try_lock_races_across_clients(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    let name = unique_name("try-lock-race");
    let mut last = None;
    for round in 0..5 {
        let tries = [a, a, a, b, b, b].map(|lock| {
            let name = name.as_str();
            async move {
                let started = tokio::time::Instant::now();
                let outcome = lock.try_lock(name).await.expect("try_lock");
                (outcome, started.elapsed())
            }
        });
        let outcomes = futures_util::future::join_all(tries).await;
        let mut winners = Vec::new();
        for (outcome, took) in outcomes {
            match outcome {
                Some(guard) => winners.push(guard),
                None => assert!(
                    took < Duration::from_secs(1),
                    "round {round}: a losing try took {took:?}"
                ),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners of one race");
        let winner = winners.pop().expect("one winner");
        if let Some(last) = last {
            assert!(winner.token() > last, "round {round}: token after {last}");
        }
        last = Some(winner.token());
        winner.release().await.expect("release");
        for lock in [a, b] {
            let info = lock.inspect(&name).await.expect("inspect");
            assert!(
                info.holder.is_none(),
                "round {round}: held after the release: {info:?}"
            );
            assert!(
                matches!(info.waiters, None | Some(0)),
                "round {round}: a losing try left a waiter: {info:?}"
            );
        }
    }
}
