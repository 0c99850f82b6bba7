//! What operators and shutdown use: `list`, `revoke`, `close`.

use std::time::Duration;

use super::support::{SLACK, unique_name, until_waiters};
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, Error, LossCause};

/// A name with every character that a key encoding or a glob pattern treats specially.
fn odd(prefix: &str) -> String {
    format!("{prefix}/odd %25 %}}{{*?[\\]^.. ü")
}

/// How long a revoked or closed holder may take to learn of it: at once where the backend
/// notifies, otherwise by its next renewal, a third of `lease`, well before the lease.
fn notice_within(lock: &dyn DistributedLock, lease: Duration) -> Duration {
    match lock.capabilities().loss_detection {
        crate::LossDetection::Notified => Duration::from_secs(5),
        _ => lease + Duration::from_secs(2),
    }
}

/// `list` finds exactly the names under a prefix that are held or waited for, decoded,
/// sorted, each with its holder's token (and waiter count, where the backend counts
/// them), through either client; a longer prefix narrows it; once everything is released
/// the prefix lists nothing. A bad prefix is `InvalidName` before any I/O.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn list_finds_held_and_waited_names(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    // The slash keeps `list-1` from matching the names of a parallel `list-12`.
    let dir = unique_name("list");
    let prefix = format!("{dir}/");
    let (first, second, odd) = (format!("{prefix}a"), format!("{prefix}b"), odd(&dir));
    assert!(
        b.list(&prefix).await.expect("list").is_empty(),
        "nothing is listed before anything is taken"
    );
    let held_first = a.lock(&first).await.expect("acquire");
    let held_second = b.lock(&second).await.expect("acquire");
    let held_odd = a.lock(&odd).await.expect("acquire");
    let waiter = a.acquire(
        &second,
        AcquireOptions::new().wait_timeout(Duration::from_secs(30)),
    );
    let check = async {
        until_waiters(b, &second, 1).await;
        for client in [a, b] {
            let listed = client.list(&prefix).await.expect("list");
            let names: Vec<&str> = listed.iter().map(|l| l.name.as_str()).collect();
            let mut expected = vec![first.as_str(), second.as_str(), odd.as_str()];
            expected.sort_unstable();
            assert_eq!(names, expected, "list({prefix:?})");
            for (listed, guard) in listed.iter().zip(
                // Sorted as the names are: "a" < "b" < "odd...".
                [&held_first, &held_second, &held_odd],
            ) {
                let holder = listed.info.holder.as_ref().expect("listed locks are held");
                assert_eq!(holder.token, guard.token(), "{}", listed.name);
            }
            if client.capabilities().counts_waiters {
                assert_eq!(listed[1].info.waiters, Some(1), "{second}");
                assert_eq!(listed[0].info.waiters, Some(0), "{first}");
            }
        }
        let narrowed = b.list(&first).await.expect("list");
        assert_eq!(narrowed.len(), 1, "list({first:?}): {narrowed:?}");
        assert_eq!(narrowed[0].name, first);
        let odd_only = b.list(&odd).await.expect("list");
        assert_eq!(odd_only.len(), 1, "list({odd:?}): {odd_only:?}");
        assert!(
            b.list(&format!("{prefix}zz"))
                .await
                .expect("list")
                .is_empty(),
            "a prefix nothing starts with lists nothing"
        );
        assert!(matches!(
            b.list("bad\0prefix").await,
            Err(Error::InvalidName { .. })
        ));
        held_second.release().await.expect("release");
    };
    let (next, ()) = tokio::join!(waiter, check);
    next.expect("the waiter gets the lock")
        .release()
        .await
        .expect("release");
    held_first.release().await.expect("release");
    held_odd.release().await.expect("release");
    let left = b.list(&prefix).await.expect("list");
    assert!(left.is_empty(), "released locks are still listed: {left:?}");
}

/// `revoke` takes a lock from its live holder and says who that was: the holder learns
/// of the loss (at once where the backend notifies, otherwise by its next renewal), the
/// waiter on the other client is granted the lock with a larger token, a holder whose
/// lock was revoked with nobody waiting gets `Lost` from its release, and revoking a
/// free name returns `None`. A bad name is `InvalidName` before any I/O.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn revoke_takes_the_lock_from_its_holder(
    a: &dyn DistributedLock,
    b: &dyn DistributedLock,
) {
    let name = unique_name("revoke");
    let lease = a.capabilities().min_lease.max(Duration::from_secs(3));
    let holder = a
        .acquire(&name, AcquireOptions::new().lease(lease))
        .await
        .expect("acquire");
    let waiter = b.acquire(
        &name,
        AcquireOptions::new().wait_timeout(Duration::from_secs(30)),
    );
    let revoke = async {
        until_waiters(b, &name, 1).await;
        let revoked = b.revoke(&name).await.expect("revoke");
        let revoked = revoked.expect("revoke returns the holder it took the lock from");
        assert_eq!(revoked.token, holder.token());
    };
    let (next, ()) = tokio::join!(waiter, revoke);
    let next = next.expect("the waiter is granted the revoked lock");
    assert!(next.token() > holder.token());
    tokio::time::timeout(notice_within(a, lease) + SLACK, holder.lost())
        .await
        .expect("the revoked holder learns it lost the lock");
    assert!(
        matches!(
            holder.lost_cause(),
            Some(LossCause::KeyGone | LossCause::MigrationLeg)
        ),
        "{:?}: {:?}",
        holder.lost_cause(),
        holder.lost_reason()
    );
    assert!(
        !next.is_lost(),
        "revoking the old grant left the new one alone"
    );
    next.release().await.expect("release");
    // Revoked with nobody waiting (so nobody was granted since), the holder's release
    // still says the lock was taken from it: `Lost`, not `Ok`.
    let quiet = a
        .acquire(&name, AcquireOptions::new().lease(lease))
        .await
        .expect("acquire");
    assert!(b.revoke(&name).await.expect("revoke").is_some());
    let released = quiet.release().await;
    assert!(
        matches!(released, Err(Error::Lost { .. })),
        "the release of a revoked lock: {released:?}"
    );
    assert_eq!(a.revoke(&name).await.expect("revoke"), None);
    assert!(matches!(a.revoke("").await, Err(Error::InvalidName { .. })));
}

/// Acquires of free names in flight while `close` runs on another thread, truly at once:
/// each fails, or returns a guard `close` gave up (it reports
/// [`LossCause::ClientClosed`] within seconds, or [`LossCause::MigrationLeg`] through the
/// migration layer), never one that stays held. Either way
/// the name is free for `b` within seconds, long before the 60 s lease: nothing is left
/// behind. One round on a fresh client `a`; the suite runs several, each a new `a`.
///
/// The acquires and the close run on threads of their own (through the current
/// runtime's handle), so this needs a multi-thread runtime.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards, which the backend cleans up as its own
/// cancellation safety promises (the threads it started finish first).
pub async fn acquires_racing_close_are_given_up(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    let names: Vec<String> = (0..16).map(|_| unique_name("close-race")).collect();
    let options = AcquireOptions::new()
        .lease(Duration::from_secs(60))
        .wait_timeout(Duration::from_secs(5));
    let delay = Duration::from_micros(fastrand::u64(0..4000));
    let handle = tokio::runtime::Handle::current();
    let (results, closed) = tokio::task::block_in_place(|| {
        std::thread::scope(|threads| {
            let acquiring = threads.spawn(|| {
                handle.block_on(futures_util::future::join_all(
                    names.iter().map(|name| a.acquire(name, options)),
                ))
            });
            let closing = threads.spawn(|| {
                handle.block_on(async {
                    tokio::time::sleep(delay).await;
                    a.close().await
                })
            });
            let closed = closing.join().expect("close panicked");
            (acquiring.join().expect("an acquire panicked"), closed)
        })
    });
    closed.expect("close");
    let mut granted = 0;
    for (name, result) in names.iter().zip(results) {
        match result {
            Ok(guard) => {
                granted += 1;
                tokio::time::timeout(Duration::from_secs(5), guard.lost())
                    .await
                    .unwrap_or_else(|_| {
                        panic!(
                            "{name}: granted while close ran {delay:?} in, and still held \
                             5 s after close returned"
                        )
                    });
                // A migration guard reports its closed leg's loss, as in
                // `close_releases_and_refuses`.
                assert!(
                    matches!(
                        guard.lost_cause(),
                        Some(LossCause::ClientClosed | LossCause::MigrationLeg)
                    ),
                    "{name}: {:?}: {:?}",
                    guard.lost_cause(),
                    guard.lost_reason()
                );
            }
            Err(Error::Closed { .. }) => {}
            Err(error) => assert!(
                error.is_retryable(),
                "{name}: an acquire cut short by close fails with Closed or a retryable \
                 error, not {error:?}"
            ),
        }
    }
    for name in &names {
        let guard = b
            .acquire(
                name,
                AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
            )
            .await
            .unwrap_or_else(|e| {
                panic!("{name} is not free 10 s after close ({granted} granted): {e:?}")
            });
        guard.release().await.expect("release");
    }
}

/// `close` releases every lock held through the client (their guards report
/// `ClientClosed`; the other client takes the names at once, long before the leases
/// would end), fails its waiting acquire with `Closed`, leaves no waiter behind, and
/// makes every later call fail with `Closed`; closing again is fine.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn close_releases_and_refuses(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    let (renewing, fixed, theirs) = (
        unique_name("close-renewing"),
        unique_name("close-fixed"),
        unique_name("close-theirs"),
    );
    let lease = Duration::from_secs(60);
    let renewing_guard = a
        .acquire(&renewing, AcquireOptions::new().lease(lease))
        .await
        .expect("acquire");
    let fixed_guard = a
        .acquire(&fixed, AcquireOptions::new().fixed_lease(lease))
        .await
        .expect("acquire");
    let their_guard = b.lock(&theirs).await.expect("acquire");
    let waiter = a.acquire(
        &theirs,
        AcquireOptions::new().wait_timeout(Duration::from_secs(30)),
    );
    let close = async {
        until_waiters(b, &theirs, 1).await;
        a.close().await.expect("close");
    };
    let (waited, ()) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(waiter, close)
    })
    .await
    .expect("close ends a waiting acquire promptly");
    assert!(
        matches!(waited, Err(Error::Closed { .. })),
        "a waiting acquire fails with Closed: {waited:?}"
    );
    for guard in [&renewing_guard, &fixed_guard] {
        tokio::time::timeout(Duration::from_secs(5), guard.lost())
            .await
            .expect("a guard of a closed client reports loss");
        assert!(
            matches!(
                guard.lost_cause(),
                Some(LossCause::ClientClosed | LossCause::MigrationLeg)
            ),
            "{:?}: {:?}",
            guard.lost_cause(),
            guard.lost_reason()
        );
    }
    for name in [&renewing, &fixed] {
        let taken = b
            .acquire(
                name,
                AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
            )
            .await
            .expect("a closed client's lock is free at once, not when its lease ends");
        taken.release().await.expect("release");
    }
    if b.capabilities().counts_waiters {
        let info = b.inspect(&theirs).await.expect("inspect");
        assert_eq!(info.waiters, Some(0), "the closed client's waiter is gone");
    }
    their_guard.release().await.expect("release");
    let refused = a.try_lock(&unique_name("close-after")).await;
    assert!(
        matches!(refused, Err(Error::Closed { .. })),
        "acquire after close: {refused:?}"
    );
    assert!(matches!(
        a.inspect(&renewing).await,
        Err(Error::Closed { .. })
    ));
    assert!(matches!(a.list("").await, Err(Error::Closed { .. })));
    assert!(matches!(
        a.revoke(&renewing).await,
        Err(Error::Closed { .. })
    ));
    a.close().await.expect("closing again is fine");
}
