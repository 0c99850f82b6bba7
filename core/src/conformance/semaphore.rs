//! Semaphores: never more than the limit held, permits back on lease expiry and
//! cancellation, one limit per semaphore. Backends without semaphores must refuse them
//! with a typed error, which these cases check instead.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures_util::future::join_all;

use super::support::{SLACK, short_lease, unique_name};
use crate::{AcquireOptions, DistributedLock, Error, Permits};

/// Whether `lock` has semaphores; if not, checks that it says so with
/// [`Error::Unsupported`].
async fn has_semaphores(lock: &dyn DistributedLock) -> bool {
    if lock.capabilities().semaphore {
        return true;
    }
    let refused = lock
        .acquire_permits(
            &unique_name("no-semaphore"),
            Permits::one_of(3).expect("valid"),
            AcquireOptions::new(),
        )
        .await;
    assert!(
        matches!(refused, Err(Error::Unsupported { .. })),
        "{refused:?}"
    );
    false
}

/// Permits are shared up to the limit (one and two of 3 on two clients are granted at
/// once, a third request is refused); then eight tasks on two clients take permits of
/// one semaphore of 3, fifty times each (one permit, or two every fifth time): the
/// permits held at once never exceed 3, every grant has a token of its own, and the
/// tokens of one task increase.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending requests, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn never_more_permits_than_the_limit(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    if !has_semaphores(a).await {
        return;
    }
    let name = unique_name("semaphore-limit");
    let one = a
        .acquire_permits(
            &name,
            Permits::one_of(3).expect("valid"),
            AcquireOptions::new(),
        )
        .await
        .expect("permits");
    let two = b
        .acquire_permits(
            &name,
            Permits::new(2, 3).expect("valid"),
            AcquireOptions::new().no_wait(),
        )
        .await
        .expect("two more of 3 are free at once");
    let refused = a
        .acquire_permits(
            &name,
            Permits::one_of(3).expect("valid"),
            AcquireOptions::new().no_wait(),
        )
        .await;
    assert!(
        matches!(refused, Err(Error::Contended { .. })),
        "{refused:?}"
    );
    assert!(two.token() > one.token());
    one.release().await.expect("release");
    two.release().await.expect("release");

    let held = AtomicU32::new(0);
    let tokens = Mutex::new(Vec::new());
    let workers = (0..8).map(|i| {
        let client = if i % 2 == 0 { a } else { b };
        let (name, held, tokens) = (&name, &held, &tokens);
        async move {
            let mut last = None;
            for round in 0..50 {
                let count = if round % 5 == 4 { 2 } else { 1 };
                let permits = Permits::new(count, 3).expect("valid");
                let guard = client
                    .acquire_permits(
                        name,
                        permits,
                        AcquireOptions::new().wait_timeout(Duration::from_secs(60)),
                    )
                    .await
                    .expect("permits");
                let now = held.fetch_add(count, Ordering::SeqCst) + count;
                assert!(now <= 3, "{now} permits held of 3");
                assert!(last < Some(guard.token()), "a task's tokens increase");
                last = Some(guard.token());
                tokens.lock().unwrap().push(guard.token());
                tokio::task::yield_now().await;
                held.fetch_sub(count, Ordering::SeqCst);
                guard.release().await.expect("release");
            }
        }
    });
    join_all(workers).await;
    let mut tokens = tokens.into_inner().unwrap();
    let grants = tokens.len();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), grants, "every grant has a token of its own");
    assert_eq!(grants, 400);
}

/// Permits whose fixed lease runs out (a crashed or paused holder) come back: a waiter
/// on the other client is granted them once the lease ended, with a larger token, and
/// the holder learns it lost them.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending requests, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn permits_come_back_when_a_lease_ends(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    if !has_semaphores(a).await {
        return;
    }
    let name = unique_name("semaphore-expiry");
    let lease = short_lease(a);
    let all = Permits::new(2, 2).expect("valid");
    let holder = a
        .acquire_permits(&name, all, AcquireOptions::new().fixed_lease(lease))
        .await
        .expect("permits");
    let start = tokio::time::Instant::now();
    let next = b
        .acquire_permits(
            &name,
            Permits::one_of(2).expect("valid"),
            AcquireOptions::new().wait_timeout(lease * 4 + Duration::from_secs(10)),
        )
        .await
        .expect("granted once the holder's lease ended");
    assert!(
        start.elapsed() + SLACK >= lease,
        "granted before the lease ended"
    );
    assert!(next.token() > holder.token());
    tokio::time::timeout(SLACK * 4, holder.lost())
        .await
        .expect("the expired holder is told");
    next.release().await.expect("release");
}

/// A fixed lease on permits starts when they are granted, not while waiting, and the
/// wait never lets the limit be passed: on a semaphore of 1 held by one request, a
/// request with a fixed lease waits longer than its lease, a renewing request joins
/// after that, and when the holder lets go the two are granted one after the other,
/// never both at once (the first waiter's wait must not have used up anything that
/// keeps the second out), and the fixed-lease grant then holds for its lease.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending requests, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn contended_fixed_lease_permits_start_at_grant(
    a: &dyn DistributedLock,
    b: &dyn DistributedLock,
) {
    if !has_semaphores(a).await {
        return;
    }
    let name = unique_name("semaphore-fixed-wait");
    let lease = short_lease(a).max(short_lease(b));
    let wait = lease * 6 + Duration::from_secs(10);
    let holder = a
        .acquire_permits(
            &name,
            Permits::one_of(1).expect("valid"),
            AcquireOptions::new(),
        )
        .await
        .expect("permits");
    let holding = AtomicU32::new(0);
    let most = AtomicU32::new(0);
    let counts = (&holding, &most);
    let fixed = hold_one(
        b,
        &name,
        AcquireOptions::new().fixed_lease(lease).wait_timeout(wait),
        counts,
    );
    let renewing = async {
        // Joins once the fixed-lease request has waited longer than its lease.
        tokio::time::sleep(lease + lease / 2).await;
        hold_one(a, &name, AcquireOptions::new().wait_timeout(wait), counts).await;
    };
    let release = async {
        tokio::time::sleep(lease * 2 + lease / 2).await;
        holder.release().await.expect("release");
    };
    tokio::join!(fixed, renewing, release);
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "a semaphore of 1 was held by two requests at once"
    );
}

/// Takes one permit of `name` (a semaphore of 1), counts the requests holding at once
/// in `holding` and the most ever in `most`, holds a moment, and releases. A fixed lease
/// must start at the grant.
async fn hold_one(
    client: &dyn DistributedLock,
    name: &str,
    options: AcquireOptions,
    (holding, most): (&AtomicU32, &AtomicU32),
) {
    let what = if options.lease_kind().is_renewing() {
        "renewing"
    } else {
        "fixed-lease"
    };
    let guard = client
        .acquire_permits(name, Permits::one_of(1).expect("valid"), options)
        .await
        .unwrap_or_else(|e| panic!("the {what} request: {e}"));
    let granted_at = tokio::time::Instant::now();
    let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
    most.fetch_max(now, Ordering::SeqCst);
    if let crate::Lease::Fixed(lease) = options.lease_kind() {
        assert!(
            guard.valid_until() + SLACK >= granted_at + lease,
            "the fixed lease was partly spent waiting: valid {:?} after its grant",
            guard.valid_until().saturating_duration_since(granted_at)
        );
    }
    tokio::time::sleep(SLACK).await;
    assert!(!guard.is_lost(), "the {what} grant was lost at once");
    holding.fetch_sub(1, Ordering::SeqCst);
    guard.release().await.expect("release");
}

/// Bad requests are refused before any I/O (`Permits` checks them); a request with
/// another limit than the semaphore's is `InvalidConfig`; a request that cannot wait is
/// `Contended` when not enough permits are free; a cancelled request leaves nothing
/// behind; once everything is released the limit may change; a request for 10,000
/// permits is answered at once (granted, or `InvalidConfig`), never left hanging.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending requests, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn semaphore_requests_are_checked_and_cancellable(
    a: &dyn DistributedLock,
    b: &dyn DistributedLock,
) {
    if !has_semaphores(a).await {
        return;
    }
    assert!(Permits::new(0, 3).is_err());
    assert!(Permits::new(4, 3).is_err());
    assert!(Permits::one_of(0).is_err());
    let name = unique_name("semaphore-checked");
    let two_of_three = Permits::new(2, 3).expect("valid");
    let held = a
        .acquire_permits(&name, two_of_three, AcquireOptions::new())
        .await
        .expect("permits");
    let other_limit = b
        .acquire_permits(
            &name,
            Permits::one_of(4).expect("valid"),
            AcquireOptions::new(),
        )
        .await;
    assert!(
        matches!(other_limit, Err(Error::InvalidConfig(_))),
        "{other_limit:?}"
    );
    let busy = b
        .acquire_permits(&name, two_of_three, AcquireOptions::new().no_wait())
        .await;
    assert!(matches!(busy, Err(Error::Contended { .. })), "{busy:?}");
    assert!(matches!(
        b.acquire_permits("", two_of_three, AcquireOptions::new())
            .await,
        Err(Error::InvalidName { .. })
    ));
    // A request dropped while it waits leaves no permit and no queue entry.
    let waiting = b.acquire_permits(&name, two_of_three, AcquireOptions::new());
    let granted = tokio::time::timeout(Duration::from_millis(200), waiting).await;
    assert!(
        granted.is_err(),
        "two permits were granted while only one was free: {granted:?}"
    );
    let one = b
        .acquire_permits(
            &name,
            Permits::one_of(3).expect("valid"),
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("the free permit, not blocked by the dropped request");
    one.release().await.expect("release");
    held.release().await.expect("release");
    let all_of_five = b
        .acquire_permits(
            &name,
            Permits::new(5, 5).expect("valid"),
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("an idle semaphore takes a new limit");
    all_of_five.release().await.expect("release");
    // A free semaphore is granted with a zero wait.
    let free = b
        .acquire_permits(
            &unique_name("semaphore-free"),
            Permits::one_of(2).expect("valid"),
            AcquireOptions::new().wait_timeout(Duration::ZERO),
        )
        .await;
    free.unwrap_or_else(|e| panic!("free permits with a zero wait: {e:?}"))
        .release()
        .await
        .expect("release");
    // A request for very many permits is granted, or refused with `InvalidConfig` where
    // the backend cannot take that many in one request: answered at once, never a hang.
    let many = Permits::new(10_000, 10_000).expect("valid");
    let asked = tokio::time::timeout(
        Duration::from_secs(20),
        a.acquire_permits(
            &unique_name("semaphore-many"),
            many,
            AcquireOptions::new().no_wait(),
        ),
    )
    .await
    .expect("a request for 10,000 permits hung");
    match asked {
        Ok(guard) => guard.release().await.expect("release"),
        Err(Error::InvalidConfig(_)) => {}
        Err(other) => panic!("a request for 10,000 permits: {other}"),
    }
}

/// A name's tokens keep growing after it was idle: a grant of a lock, a semaphore's
/// permit, a read and a write lock, and an election's term, each released by one client
/// so that nobody holds or waits, and then granted again to the other, gets a larger
/// token than the first grant. (A backend that forgets an idle name's state must not
/// forget its token counter: a resource fenced by the first grant's token would accept
/// the stale holder otherwise.)
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards, which the backend cleans up as its own
/// cancellation safety promises.
pub async fn tokens_grow_after_a_name_was_idle(a: &dyn DistributedLock, b: &dyn DistributedLock) {
    let caps = a.capabilities();
    let mut kinds = vec![Kind::Lock];
    if caps.semaphore {
        kinds.push(Kind::Permit);
    }
    if caps.rw_lock {
        kinds.extend([Kind::Read, Kind::Write]);
    }
    if caps.election {
        let election = unique_name("idle-term");
        let first = a
            .campaign(&election, "a", AcquireOptions::new().no_wait())
            .await
            .expect("first term");
        let token = first.token();
        first.release().await.expect("resign");
        let second = b
            .campaign(&election, "b", AcquireOptions::new().no_wait())
            .await
            .expect("second term");
        assert!(
            second.token() > token,
            "a term after an idle election has token {} <= the earlier {token}",
            second.token()
        );
        second.release().await.expect("resign");
    }
    for kind in kinds {
        let name = unique_name("idle-tokens");
        let first = kind
            .grant(a, &name)
            .await
            .unwrap_or_else(|e| panic!("first {kind:?}: {e}"));
        let token = first.token();
        first.release().await.expect("release");
        let second = kind
            .grant(b, &name)
            .await
            .unwrap_or_else(|e| panic!("second {kind:?}: {e}"));
        assert!(
            second.token() > token,
            "a {kind:?} granted after the name was idle has token {} <= the earlier {token}",
            second.token()
        );
        second.release().await.expect("release");
    }
}

/// What [`tokens_grow_after_a_name_was_idle`] grants.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Lock,
    Permit,
    Read,
    Write,
}

impl Kind {
    async fn grant(
        self,
        lock: &dyn DistributedLock,
        name: &str,
    ) -> Result<crate::LockGuard, Error> {
        let options = AcquireOptions::new().no_wait();
        match self {
            Kind::Lock => lock.acquire(name, options).await,
            Kind::Permit => {
                lock.acquire_permits(name, Permits::one_of(3)?, options)
                    .await
            }
            Kind::Read => lock.acquire_read(name, options).await,
            Kind::Write => lock.acquire_write(name, options).await,
        }
    }
}
