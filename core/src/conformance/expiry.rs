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
