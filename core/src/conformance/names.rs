//! Names and input validation.

use std::time::Duration;

use futures_util::future::join_all;

use super::support::unique_name;
use crate::{AcquireOptions, DistributedLock, DistributedLockExt, Error, MAX_LEASE, MAX_NAME_LEN};

/// Odd but valid names (unicode, `/`, `..`, `{}`, spaces, a prefix of another name,
/// 1 KiB, the maximum length) all work and are independent: all are held at once.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn odd_names_are_independent(lock: &dyn DistributedLock) {
    let base = unique_name("odd-names");
    let mut names: Vec<String> = [
        "",
        "/",
        "/a",
        "/a/b",
        "/a/b/",
        "/..",
        "/../..",
        "/.",
        "/{tag}",
        "/{tag}x",
        "/with space",
        "/锁/订单-8842",
        "/émoji-🔒",
        "/%2F",
        "/a%2Fb",
        "/*",
        "/?x=1#y",
        "/\\",
        "/ ",
    ]
    .iter()
    .map(|suffix| format!("{base}{suffix}"))
    .collect();
    names.push(format!("{base}/{}", "k".repeat(1024)));
    names.push(format!(
        "{base}/{}",
        "m".repeat(MAX_NAME_LEN - base.len() - 1)
    ));
    names.push(format!("{{{base}}}"));
    let guards = join_all(names.iter().map(|name| lock.try_lock(name))).await;
    let mut held = Vec::new();
    for (name, guard) in names.iter().zip(guards) {
        let guard = guard
            .unwrap_or_else(|e| panic!("{:.80}: {e:?}", name))
            .unwrap_or_else(|| panic!("{:.80}: held by another name", name));
        assert_eq!(guard.name(), name);
        held.push(guard);
    }
    for guard in held {
        let name = guard.name().to_owned();
        guard
            .release()
            .await
            .unwrap_or_else(|e| panic!("{name:.80}: {e:?}"));
    }
}

/// Invalid names and options fail with typed errors, before any I/O.
///
/// # Errors
///
/// None: a violation of the contract panics with a message saying what went wrong.
///
/// # Cancel safety
///
/// Dropping it drops the case's guards and pending acquires, which the backend cleans up
/// as its own cancellation safety promises.
pub async fn invalid_input_is_rejected(lock: &dyn DistributedLock) {
    let too_long = "x".repeat(MAX_NAME_LEN + 1);
    for name in ["", "nul\0byte", "new\nline", "\u{7f}", &too_long] {
        let err = lock.try_lock(name).await.unwrap_err();
        assert!(
            matches!(err, Error::InvalidName { .. }),
            "{name:.20?}: {err:?}"
        );
        let err = lock.inspect(name).await.unwrap_err();
        assert!(
            matches!(err, Error::InvalidName { .. }),
            "{name:.20?}: {err:?}"
        );
    }
    let name = unique_name("invalid-options");
    let err = lock
        .acquire(&name, AcquireOptions::new().lease(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    let min = lock.capabilities().min_lease;
    if min > Duration::from_millis(1) {
        let err = lock
            .acquire(&name, AcquireOptions::new().fixed_lease(min / 2))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    }
    // Extreme durations: a typed error before any I/O, never a panic.
    for options in [
        AcquireOptions::new().lease(Duration::MAX),
        AcquireOptions::new().fixed_lease(Duration::MAX),
        AcquireOptions::new().lease(Duration::from_nanos(2)),
        AcquireOptions::new().fixed_lease(Duration::from_nanos(2)),
        AcquireOptions::new().lease(MAX_LEASE + Duration::from_secs(1)),
        AcquireOptions::new()
            .fixed_lease(Duration::MAX)
            .wait_timeout(Duration::MAX),
    ] {
        let err = lock.acquire(&name, options).await.unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig(_)),
            "{options:?}: {err:?}"
        );
    }
    // Nothing was left behind by the failed calls.
    let guard = lock.try_lock(&name).await.expect("try_lock").expect("free");
    guard.release().await.expect("release");
    // A wait too long to represent waits forever: granted when free, still waiting (not
    // panicking, not timing out) when held.
    let forever = AcquireOptions::new().wait_timeout(Duration::MAX);
    let guard = lock.acquire(&name, forever).await.expect("acquire, free");
    let waiting = tokio::time::timeout(Duration::from_millis(300), lock.acquire(&name, forever));
    assert!(waiting.await.is_err(), "a wait of Duration::MAX ended");
    guard.release().await.expect("release");
    let guard = lock.try_lock(&name).await.expect("try_lock").expect("free");
    guard.release().await.expect("release");
}
