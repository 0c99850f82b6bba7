//! Unit tests of the guard, against handles that stand for a backend's answers.

use super::*;

/// A grant whose server-side key is gone: extend answers `Lost`.
#[derive(Debug)]
struct Gone;

#[async_trait]
impl HeldLock for Gone {
    async fn release(&self) -> Result<(), Error> {
        Err(Error::lost("gone", "the key was deleted"))
    }

    fn release_in_background(&self) {}

    fn can_extend(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn extend(&self, _lease: Duration) -> Result<Instant, Error> {
        Err(Error::lost("gone", "the key was deleted when extending"))
    }
}

/// A backend that cannot be reached: release answers `Unavailable` after a while.
#[derive(Debug)]
struct Unreachable(Duration);

#[async_trait]
impl HeldLock for Unreachable {
    async fn release(&self) -> Result<(), Error> {
        tokio::time::sleep(self.0).await;
        Err(Error::unavailable(
            "test",
            std::io::Error::other("connection refused"),
        ))
    }

    fn release_in_background(&self) {}
}

/// A fixed lease on a server whose clock may run ahead of ours: `extend` moves the
/// server's expiry to `lease` after the send and answers, as backends do, the send
/// instant plus `lease` minus the drift margin.
#[derive(Debug)]
struct Margined {
    margin: Duration,
    server_expiry: std::sync::Mutex<Instant>,
}

impl Margined {
    /// A grant of `lease`, taken now: the handle, and the guard's first deadline.
    fn granted(lease: Duration, margin: Duration) -> (Arc<Self>, Instant) {
        let now = Instant::now();
        let held = Arc::new(Margined {
            margin,
            server_expiry: std::sync::Mutex::new(now + lease),
        });
        (held, now + lease - margin)
    }

    /// The conservative deadline of the lease the server holds now.
    fn conservative(&self) -> Instant {
        *self.server_expiry.lock().unwrap() - self.margin
    }
}

#[async_trait]
impl HeldLock for Margined {
    async fn release(&self) -> Result<(), Error> {
        Ok(())
    }

    fn release_in_background(&self) {}

    fn can_extend(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        let sent = Instant::now();
        *self.server_expiry.lock().unwrap() = sent + lease;
        // Long extensions answer slowly: their replies overtake nothing else.
        if lease >= Duration::from_secs(100) {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Ok(sent + lease - self.margin)
    }
}

/// Two extensions of one guard at once: the server applies them in the order sent,
/// the replies may come back in the other order. The guard must not keep the
/// deadline of the one the server applied first (300 s) while the server holds the
/// other's (60 s).
#[tokio::test(start_paused = true)]
async fn concurrent_extensions_never_leave_the_deadline_past_the_servers_lease() {
    let margin = Duration::from_millis(500);
    let (held, deadline) = Margined::granted(Duration::from_secs(10), margin);
    let guard = LockGuard::new(
        "both",
        FencingToken::new(4),
        "test",
        Liveness::new(deadline),
        held.clone(),
    );
    let (long, short) = tokio::join!(guard.extend(Duration::from_secs(300)), async {
        tokio::time::sleep(Duration::from_millis(10)).await;
        guard.extend(Duration::from_secs(60)).await
    });
    long.unwrap();
    short.unwrap();
    assert!(
        guard.valid_until() <= held.conservative(),
        "the guard claims {:?}, the server's lease is good until {:?}",
        guard.valid_until() - Instant::now(),
        held.conservative() - Instant::now()
    );
}

/// An extension whose new end falls between the old deadline and the old deadline
/// plus the drift margin replaces the server's lease with a (slightly) shorter one;
/// the guard's deadline must follow it down, never stay past the new lease's
/// conservative end. An extension that moves nothing leaves it as it was.
#[tokio::test(start_paused = true)]
async fn an_extension_never_leaves_the_deadline_past_the_new_lease() {
    let margin = Duration::from_millis(500);
    let (held, deadline) = Margined::granted(Duration::from_secs(10), margin);
    let guard = LockGuard::new(
        "margin",
        FencingToken::new(3),
        "test",
        Liveness::new(deadline),
        held.clone(),
    );
    let watched = guard.lost_token();
    // 9.8 s from now: past the 9.5 s deadline, short of the 10 s server expiry.
    guard.extend(Duration::from_millis(9_800)).await.unwrap();
    assert!(
        guard.valid_until() <= held.conservative(),
        "the guard claims {:?}, the server's new lease is good until {:?}",
        guard.valid_until() - Instant::now(),
        held.conservative() - Instant::now()
    );
    assert!(!guard.is_lost());
    // The watcher follows the earlier deadline: the loss is reported at it.
    tokio::time::timeout(Duration::from_millis(9_400), watched.cancelled())
        .await
        .expect("the loss is reported at the new lease's deadline");
    assert!(guard.is_lost());
    assert_eq!(guard.lost_cause(), Some(LossCause::LeaseExpired));
}

/// A guard that already reported loss (its deadline passed during a partition)
/// answers `Lost` to release even when the backend cannot be told: `Unavailable`
/// promises only that the lock frees itself, which a caller may read as "my work was
/// covered". A deadline that passes while the (slow) release is out is no loss: the
/// work ended when the release began.
#[tokio::test(start_paused = true)]
async fn release_of_a_lost_guard_is_lost_even_when_the_backend_is_unreachable() {
    let guard = |slow: Duration| {
        LockGuard::new(
            "down",
            FencingToken::new(1),
            "test",
            Liveness::new(Instant::now() + Duration::from_millis(20)),
            Arc::new(Unreachable(slow)),
        )
    };
    let lost = guard(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(lost.is_lost());
    let outcome = lost.release().await;
    assert!(matches!(outcome, Err(Error::Lost { .. })), "{outcome:?}");

    let live = guard(Duration::from_millis(30));
    assert!(!live.is_lost());
    let outcome = live.release().await;
    assert!(
        matches!(outcome, Err(Error::Unavailable { .. })),
        "{outcome:?}"
    );
}

/// An extension the server refuses because the grant is gone marks the guard lost at
/// once, whatever the backend did with its own state: `lost()` fires and `is_lost()`
/// holds, long before the lease it had ends.
#[tokio::test]
async fn an_extend_that_finds_the_grant_gone_reports_the_loss() {
    let liveness = Liveness::new(Instant::now() + Duration::from_secs(60));
    let guard = LockGuard::new(
        "gone",
        FencingToken::new(7),
        "test",
        liveness,
        Arc::new(Gone),
    );
    let outcome = guard.extend(Duration::from_secs(120)).await;
    assert!(matches!(outcome, Err(Error::Lost { .. })), "{outcome:?}");
    assert!(guard.is_lost());
    assert_eq!(guard.lost_cause(), Some(LossCause::KeyGone));
    assert!(guard.lost_reason().unwrap().contains("extending"));
    tokio::time::timeout(Duration::from_secs(1), guard.lost())
        .await
        .expect("lost() fires");
}
