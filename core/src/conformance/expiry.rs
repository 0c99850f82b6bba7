//! Leases: expiry, loss reporting, renewal.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::support::{SLACK, short_lease, unique_name};
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, Error, LossCause};

/// A fixed lease that expires lets the next holder in with a larger token, never before
/// the old guard's `valid_until()`; the old guard reports loss no later than that deadline
/// (through `lost()`, `is_lost()` and its cancellation token); its late `release()` is
/// `Err(Lost)` and does not disturb the new holder.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn fixed_lease_expires_and_reports_loss(lock: &dyn DistributedLock) {
    let name = unique_name("fixed-lease");
    let lease = short_lease(lock);
    let old = lock
        .acquire(&name, AcquireOptions::new().fixed_lease(lease).no_wait())
        .await
        .expect("acquire");
    let valid_until = old.valid_until();
    assert!(
        valid_until <= Instant::now() + lease,
        "valid_until lies beyond the lease"
    );
    let cancel = old.lost_token();

    let next = async {
        let guard = lock
            .acquire(
                &name,
                AcquireOptions::new().wait_timeout(lease * 4 + Duration::from_secs(10)),
            )
            .await
            .expect("next holder acquires after expiry");
        (guard, Instant::now())
    };
    let loss = async {
        old.lost().await;
        Instant::now()
    };
    let ((new, granted_at), lost_at) = tokio::join!(next, loss);

    assert!(
        granted_at >= valid_until,
        "a second holder was granted before the first one's valid_until"
    );
    assert!(
        lost_at <= valid_until + SLACK,
        "loss reported {:?} after valid_until",
        lost_at - valid_until
    );
    assert!(new.token() > old.token());
    assert!(old.is_lost());
    // Every backend types its loss: an expired fixed lease is the client's own deadline,
    // or the key (node, session) found gone on the server, or (migration layer) a leg's.
    assert!(
        matches!(
            old.lost_cause(),
            Some(
                LossCause::LeaseExpired
                    | LossCause::KeyGone
                    | LossCause::SessionEnded
                    | LossCause::MigrationLeg
            )
        ),
        "loss cause {:?} ({:?})",
        old.lost_cause(),
        old.lost_reason()
    );
    tokio::time::timeout(SLACK, cancel.cancelled())
        .await
        .expect("lost_token fires with the loss");

    let err = old.release().await.unwrap_err();
    assert!(matches!(err, Error::Lost { .. }), "{err:?}");
    assert!(!new.is_lost());
    assert!(
        lock.try_lock(&name).await.expect("try_lock").is_none(),
        "a late release freed the new holder"
    );
    new.release().await.expect("new holder releases");
}

/// A renewing lease is held well past its duration, and its deadline moves forward.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn renewing_lease_outlives_its_duration(lock: &dyn DistributedLock) {
    let name = unique_name("renewing-lease");
    let lease = short_lease(lock);
    let guard = lock
        .acquire(&name, AcquireOptions::new().lease(lease))
        .await
        .expect("acquire");
    let first_deadline = guard.valid_until();
    tokio::time::sleep(lease * 2 + lease / 2).await;
    assert!(
        !guard.is_lost(),
        "renewing lease lost: {:?}",
        guard.lost_reason()
    );
    assert!(guard.valid_until() > first_deadline, "deadline never moved");
    assert!(lock.try_lock(&name).await.expect("try_lock").is_none());
    guard.release().await.expect("release");
}

/// A guard outlives the client it was acquired through: with that client dropped
/// (without `close`), the renewing lease is still renewed past several of its
/// durations, the lock stays held for `other` (another client of the deployment), and
/// the guard releases normally.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guard, which the backend cleans up as its own
/// cancellation safety promises.
pub async fn a_guard_outlives_its_dropped_client<L>(lock: L, other: &dyn DistributedLock)
where
    L: std::ops::Deref + Send,
    L::Target: DistributedLock,
{
    let name = unique_name("outlives-client");
    let lease = short_lease(other);
    let guard = lock
        .acquire(&name, AcquireOptions::new().lease(lease))
        .await
        .expect("acquire");
    let first_deadline = guard.valid_until();
    drop(lock);
    tokio::time::sleep(lease * 3).await;
    assert!(
        !guard.is_lost(),
        "a guard of a dropped client was lost: {:?}",
        guard.lost_reason()
    );
    assert!(guard.valid_until() > first_deadline, "deadline never moved");
    assert!(other.try_lock(&name).await.expect("try_lock").is_none());
    guard.release().await.expect("release");
    let next = other.try_lock(&name).await.expect("try_lock");
    next.expect("free once released")
        .release()
        .await
        .expect("release");
}

/// `with_lock` stops the work and returns `Lost` when the lock is lost mid-way.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn with_lock_cancels_work_on_loss(lock: &dyn DistributedLock) {
    let name = unique_name("with-lock-loss");
    let lease = short_lease(lock);
    let finished = AtomicBool::new(false);
    let start = Instant::now();
    let result = lock
        .with_lock_opts(
            &name,
            AcquireOptions::new().fixed_lease(lease),
            |_token| async {
                tokio::time::sleep(lease * 20).await;
                finished.store(true, Ordering::SeqCst);
            },
        )
        .await;
    assert!(matches!(result, Err(Error::Lost { .. })), "{result:?}");
    assert!(!finished.load(Ordering::SeqCst), "work ran past the loss");
    assert!(
        start.elapsed() <= lease + SLACK * 3,
        "loss noticed after {:?}",
        start.elapsed()
    );
    let after = lock
        .acquire(
            &name,
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("lock free after lost with_lock");
    after.release().await.expect("release");
}

/// [`LockGuard::extend`](crate::LockGuard::extend) moves the end of a fixed lease: the
/// guard outlives its first deadline, no other client gets the lock before the extended
/// `valid_until`, the token stays, and when the extended lease ends the guard reports
/// loss and the next holder gets a larger token. A shorter extension never moves the
/// deadline back; a renewing lease, a zero or absurd duration and a lost guard are
/// refused with typed errors, without panicking.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn fixed_leases_can_be_extended(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    let name = unique_name("extend");
    let lease = short_lease(a);

    // A renewing lease is not extended, whatever the duration.
    let renewing = a
        .acquire(&name, AcquireOptions::new().no_wait())
        .await
        .expect("acquire with a renewing lease");
    for duration in [lease * 4, Duration::ZERO, Duration::MAX] {
        assert!(
            matches!(
                renewing.extend(duration).await,
                Err(Error::InvalidConfig(_))
            ),
            "extending a renewing lease by {duration:?} must be InvalidConfig"
        );
    }
    renewing.release().await.expect("release");

    let guard = a
        .acquire(&name, AcquireOptions::new().fixed_lease(lease).no_wait())
        .await
        .expect("acquire with a fixed lease");
    let first_deadline = guard.valid_until();
    for duration in [Duration::ZERO, Duration::MAX, crate::MAX_LEASE * 2] {
        assert!(
            matches!(guard.extend(duration).await, Err(Error::InvalidConfig(_))),
            "extending by {duration:?} must be InvalidConfig"
        );
    }
    assert_eq!(
        guard.valid_until(),
        first_deadline,
        "a refused extension moved the deadline"
    );

    let extended_to = lease * 4;
    let sent = Instant::now();
    guard.extend(extended_to).await.expect("extend");
    let extended = guard.valid_until();
    assert!(extended > first_deadline, "extend did not move valid_until");
    assert!(
        extended <= Instant::now() + extended_to && extended >= sent,
        "valid_until lies beyond the extension"
    );
    // Shorter than what is left: nothing moves back.
    guard.extend(lease).await.expect("a shorter extension");
    assert!(
        guard.valid_until() >= extended,
        "a shorter extension moved valid_until back"
    );
    // Shorter than the backend's minimum: refused as the acquire would refuse it, also
    // where it would move nothing.
    let below = a.capabilities().min_lease / 2;
    assert!(
        matches!(guard.extend(below).await, Err(Error::InvalidConfig(_))),
        "extending by {below:?}, under the backend's minimum lease, must be InvalidConfig"
    );

    // Past the first deadline the guard still holds, and the other client is refused.
    tokio::time::sleep_until(first_deadline + SLACK).await;
    assert!(
        !guard.is_lost(),
        "the extended guard was lost at its first deadline: {:?}",
        guard.lost_reason()
    );
    assert!(
        matches!(
            b.acquire(&name, AcquireOptions::new().no_wait()).await,
            Err(Error::Contended { .. })
        ),
        "another client got the lock after the first deadline of an extended lease"
    );

    // When the extension ends, the guard is lost and the next holder comes in after it.
    let valid_until = guard.valid_until();
    let next = async {
        let next = b
            .acquire(
                &name,
                AcquireOptions::new().wait_timeout(extended_to * 2 + Duration::from_secs(10)),
            )
            .await
            .expect("the next holder acquires after the extension ends");
        (next, Instant::now())
    };
    let loss = async {
        guard.lost().await;
        Instant::now()
    };
    let ((next, granted_at), lost_at) = tokio::join!(next, loss);
    assert!(
        granted_at >= valid_until,
        "a second holder was granted before the extended valid_until"
    );
    assert!(
        lost_at <= valid_until + SLACK,
        "loss reported {:?} after the extended valid_until",
        lost_at - valid_until
    );
    assert!(next.token() > guard.token(), "tokens must increase");
    assert!(
        matches!(guard.extend(extended_to).await, Err(Error::Lost { .. })),
        "a lost guard must not be extended"
    );
    assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
    next.release().await.expect("release");
}
