//! The migration layer over two in-memory lock services.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use tokio::time::Instant;

use super::*;
use crate::{
    DistributedLockExt, FencedRegister, FencingToken, HeldLock, LeaderChange, Lease, Liveness,
    MemoryLock,
};

/// A memory lock that keeps the liveness of every guard it hands out, so a test can make
/// one leg lose its lock.
///
/// With a `default_lease`, it applies its own configured lease to options that set none,
/// as `etcd://...?lease=2s` and `zk://...?session_timeout=4s` do.
#[derive(Debug, Default)]
struct SpyLock {
    inner: MemoryLock,
    handed_out: Mutex<Vec<Liveness>>,
    default_lease: Option<Lease>,
}

impl SpyLock {
    /// A spy whose configuration sets `lease` as the default lease.
    fn with_default_lease(lease: Lease) -> Arc<Self> {
        Arc::new(SpyLock {
            default_lease: Some(lease),
            ..SpyLock::default()
        })
    }

    /// The liveness of the `i`th guard handed out.
    fn leg(&self, i: usize) -> Liveness {
        self.handed_out.lock().unwrap()[i].clone()
    }
}

#[async_trait]
impl DistributedLock for SpyLock {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let options = match self.default_lease {
            Some(lease) if !options.has_lease() => options.with_lease(lease),
            _ => options,
        };
        let guard = self.inner.acquire(name, options).await?;
        self.handed_out
            .lock()
            .unwrap()
            .push(guard.liveness().clone());
        Ok(guard)
    }
    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        self.inner.inspect(name).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        self.inner.list(prefix).await
    }
    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        self.inner.revoke(name).await
    }
    async fn close(&self) -> Result<(), Error> {
        self.inner.close().await
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn backend(&self) -> &'static str {
        "spy"
    }
}

fn mem() -> Arc<dyn DistributedLock> {
    Arc::new(MemoryLock::new())
}

fn migration(
    phase: MigrationPhase,
    legacy: &Arc<dyn DistributedLock>,
    target: &Arc<dyn DistributedLock>,
) -> MigrationLock {
    MigrationLock::new(phase, Some(legacy.clone()), Some(target.clone()))
        .unwrap()
        .with_second_leg_wait(Duration::from_millis(100))
        .unwrap()
}

#[tokio::test]
async fn tokens_keep_growing_across_every_phase_change() {
    let (legacy, target) = (mem(), mem());
    // The legacy service has been busy: its counter is far ahead of the target's.
    for _ in 0..50 {
        legacy.lock("stock").await.unwrap().release().await.unwrap();
    }
    let register = FencedRegister::new(0u32);
    let direct = legacy.lock("stock").await.unwrap();
    register.write(direct.token(), 1).unwrap();
    let mut zombies = vec![direct.token()];
    direct.release().await.unwrap();
    for phase in MigrationPhase::ALL {
        let locks = migration(phase, &legacy, &target);
        let guard = locks.lock("stock").await.unwrap();
        let token = guard.token();
        register
            .write(token, 2)
            .unwrap_or_else(|e| panic!("{phase}: the first holder was refused: {e}"));
        for zombie in &zombies {
            assert!(
                register.write(*zombie, 3).is_err(),
                "{phase}: a zombie token {zombie} was accepted after {token}"
            );
        }
        assert_eq!(token.get() >> ERA_SHIFT, u64::from(phase.target_tokens()));
        zombies.push(token);
        guard.release().await.unwrap();
    }
    assert_eq!(register.read(), 2);
}

#[tokio::test]
async fn both_legs_exclude_single_leg_users() {
    for phase in [MigrationPhase::LegacyFirst, MigrationPhase::TargetFirst] {
        let (legacy, target) = (mem(), mem());
        let guard = migration(phase, &legacy, &target).lock("x").await.unwrap();
        assert!(legacy.try_lock("x").await.unwrap().is_none(), "{phase}");
        assert!(target.try_lock("x").await.unwrap().is_none(), "{phase}");
        guard.release().await.unwrap();
        assert!(legacy.try_lock("x").await.unwrap().is_some(), "{phase}");
        assert!(target.try_lock("x").await.unwrap().is_some(), "{phase}");
    }
}

#[tokio::test]
async fn a_second_leg_that_cannot_be_had_gives_the_first_back() {
    for phase in [MigrationPhase::LegacyFirst, MigrationPhase::TargetFirst] {
        let (legacy, target) = (mem(), mem());
        let (first, second) = match phase {
            MigrationPhase::LegacyFirst => (&legacy, &target),
            _ => (&target, &legacy),
        };
        let blocker = second.lock("x").await.unwrap();
        let locks = migration(phase, &legacy, &target);
        let err = locks.acquire("x", AcquireOptions::new().no_wait()).await;
        assert!(
            matches!(err, Err(Error::Contended { .. })),
            "{phase}: {err:?}"
        );
        assert!(first.try_lock("x").await.unwrap().is_some(), "{phase}");
        let wait = Duration::from_millis(300);
        let err = locks
            .acquire("x", AcquireOptions::new().wait_timeout(wait))
            .await;
        assert!(matches!(err, Err(Error::Timeout { waited, .. }) if waited == wait));
        assert!(first.try_lock("x").await.unwrap().is_some(), "{phase}");
        // A waiter gets both once the second leg is free.
        let waiter = locks.acquire(
            "x",
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        );
        let free = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            blocker.release().await.unwrap();
        };
        let (guard, ()) = tokio::join!(waiter, free);
        guard.unwrap().release().await.unwrap();
    }
}

#[tokio::test]
async fn a_cancelled_acquire_leaves_no_leg_behind() {
    let (legacy, target) = (mem(), mem());
    let blocker = target.lock("x").await.unwrap();
    let locks = migration(MigrationPhase::LegacyFirst, &legacy, &target);
    let attempt = tokio::time::timeout(Duration::from_millis(60), locks.lock("x")).await;
    assert!(attempt.is_err());
    assert!(legacy.try_lock("x").await.unwrap().is_some());
    blocker.release().await.unwrap();
}

/// A lock held on one leg only (an acquire between its legs, the second leg of a
/// cancelled acquire whose reply was lost, a leg whose partner expired) is reported held,
/// and with no token above the next grant's: `inspect`, `list` and `revoke` report
/// tokens a resource can be fenced with, and `revoke` promises the next holder a larger
/// one. In `legacy-first` the target leg's era is above every token the lock hands out,
/// so that leg's token was reported as 2^56 + its own: above every later grant, and a
/// token no guard of the phase ever had (F9 on etcd saw 72057594037928052 before a grant
/// of 1796607849902705).
#[tokio::test]
async fn a_lock_held_on_one_leg_reports_no_token_above_the_next_grant() {
    for phase in [MigrationPhase::LegacyFirst, MigrationPhase::TargetFirst] {
        for held_leg in ["legacy", "target"] {
            let (legacy, target) = (mem(), mem());
            // Leg counters apart, as real backends' are (Redis microseconds, etcd
            // revisions).
            for _ in 0..5 {
                legacy.lock("x").await.unwrap().release().await.unwrap();
            }
            let locks = migration(phase, &legacy, &target);
            let leg = if held_leg == "legacy" {
                &legacy
            } else {
                &target
            };
            let label = format!("{phase}, held on the {held_leg} leg only");
            for how in ["inspect", "list", "revoke"] {
                let half = leg.lock("x").await.unwrap();
                let reported = match how {
                    "inspect" => locks.inspect("x").await.unwrap().holder,
                    "list" => {
                        let listed = locks.list("").await.unwrap();
                        assert_eq!(listed.len(), 1, "{label}: {listed:?}");
                        listed[0].info.holder.clone()
                    }
                    _ => locks.revoke("x").await.unwrap(),
                };
                let reported = reported
                    .unwrap_or_else(|| panic!("{label}: {how} did not report the holder"))
                    .token;
                let _ = half.release().await;
                let next = locks.lock("x").await.unwrap();
                assert!(
                    next.token() > reported,
                    "{label}: {how} reported token {reported}, above the next grant's {}",
                    next.token()
                );
                next.release().await.unwrap();
            }
        }
    }
}

#[tokio::test]
async fn losing_either_leg_loses_the_guard() {
    for (phase, lose) in [
        (MigrationPhase::LegacyFirst, "legacy"),
        (MigrationPhase::LegacyFirst, "target"),
        (MigrationPhase::TargetFirst, "legacy"),
        (MigrationPhase::TargetFirst, "target"),
    ] {
        let (legacy, target) = (Arc::new(SpyLock::default()), Arc::new(SpyLock::default()));
        let (l, t): (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) =
            (legacy.clone(), target.clone());
        let guard = migration(phase, &l, &t).lock("x").await.unwrap();
        assert!(!guard.is_lost());
        let victim = if lose == "legacy" { &legacy } else { &target };
        victim.handed_out.lock().unwrap()[0].mark_lost(crate::LossCause::KeyGone, "key deleted");
        tokio::time::timeout(Duration::from_secs(1), guard.lost())
            .await
            .expect("loss of a leg reaches the guard");
        let reason = guard.lost_reason().unwrap();
        assert_eq!(reason, format!("the {lose} leg was lost: key deleted"));
        assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
        assert!(l.try_lock("x").await.unwrap().is_some(), "{phase}/{lose}");
        assert!(t.try_lock("x").await.unwrap().is_some(), "{phase}/{lose}");
    }
}

/// Legs whose own configuration sets short leases (2 s and 4 s renewing, like
/// `etcd://...?lease=2s` and `zk://...?session_timeout=4s`), acquired with the caller's
/// default options (a 30 s lease the legs do not use): the guard holds for many leg
/// leases while the legs renew, and its deadline follows theirs.
#[tokio::test(start_paused = true)]
async fn short_leg_leases_do_not_make_the_guard_report_loss() {
    for phase in [MigrationPhase::LegacyFirst, MigrationPhase::TargetFirst] {
        let legacy = SpyLock::with_default_lease(Lease::Renewing(Duration::from_secs(2)));
        let target = SpyLock::with_default_lease(Lease::Renewing(Duration::from_secs(4)));
        let (l, t): (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) =
            (legacy.clone(), target.clone());
        let guard = migration(phase, &l, &t).lock("x").await.unwrap();
        let lost = guard.lost_token();
        for step in 0..16 {
            let held = tokio::time::timeout(Duration::from_millis(500), guard.lost()).await;
            let at = format!("{phase}, after {} ms", (step + 1) * 500);
            assert!(held.is_err(), "{at}: lost: {:?}", guard.lost_reason());
            assert!(!guard.is_lost(), "{at}");
            assert!(!lost.is_cancelled(), "{at}");
            // The guard's deadline follows the legs': never later than the earlier one,
            // and moved forward as they renew (more than a third of the shortest lease
            // ahead).
            let legs = legacy.leg(0).valid_until().min(target.leg(0).valid_until());
            assert!(guard.valid_until() <= legs, "{at}");
            assert!(
                guard.valid_until() > Instant::now() + Duration::from_secs(2) / 3,
                "{at}: {:?} left",
                guard.valid_until() - Instant::now()
            );
        }
        assert!(l.try_lock("x").await.unwrap().is_none(), "{phase}");
        assert!(t.try_lock("x").await.unwrap().is_none(), "{phase}");
        guard.release().await.unwrap();
        assert!(l.try_lock("x").await.unwrap().is_some(), "{phase}");
        assert!(t.try_lock("x").await.unwrap().is_some(), "{phase}");
    }
}

/// Loss comes from the legs and only from them: a leg whose configuration sets a fixed
/// 2 s lease (never renewed) loses the guard exactly at that leg's deadline, whatever
/// the caller's options say; a leg taken away after several leases loses it at once.
#[tokio::test(start_paused = true)]
async fn the_guard_is_lost_with_a_leg_and_not_before() {
    for phase in [MigrationPhase::LegacyFirst, MigrationPhase::TargetFirst] {
        let legacy = SpyLock::with_default_lease(Lease::Fixed(Duration::from_secs(2)));
        let target = SpyLock::with_default_lease(Lease::Renewing(Duration::from_secs(4)));
        let (l, t): (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) =
            (legacy.clone(), target.clone());
        let start = Instant::now();
        let guard = migration(phase, &l, &t).lock("x").await.unwrap();
        let deadline = legacy.leg(0).valid_until();
        assert_eq!(deadline, start + Duration::from_secs(2), "{phase}");
        assert_eq!(guard.valid_until(), deadline, "{phase}");
        guard.lost().await;
        assert_eq!(
            Instant::now(),
            deadline,
            "{phase}: lost at the leg's deadline"
        );
        assert!(legacy.leg(0).is_lost(), "{phase}");
        assert!(guard.lost_reason().unwrap().contains("deadline"), "{phase}");
        assert!(matches!(guard.release().await, Err(Error::Lost { .. })));

        let legacy = Arc::new(MemoryLock::new());
        let target = SpyLock::with_default_lease(Lease::Renewing(Duration::from_secs(2)));
        let (l, t): (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) =
            (legacy.clone(), target.clone());
        let guard = migration(phase, &l, &t).lock("y").await.unwrap();
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert!(!guard.is_lost(), "{phase}: {:?}", guard.lost_reason());
        assert!(legacy.revoke("y").await.unwrap().is_some());
        tokio::time::timeout(Duration::from_millis(1), guard.lost())
            .await
            .expect("the loss of a leg reaches the guard at once");
        assert!(
            guard
                .lost_reason()
                .unwrap()
                .starts_with("the legacy leg was lost"),
            "{phase}: {:?}",
            guard.lost_reason()
        );
    }
}

/// During a rolling change from legacy-first to target-first, instances take the legs in
/// opposite orders: they still exclude each other, and the bounded second-leg wait keeps
/// them from waiting on each other forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_orders_exclude_each_other_without_deadlock() {
    let (legacy, target) = (mem(), mem());
    let inside = AtomicUsize::new(0);
    let locks = [
        migration(MigrationPhase::LegacyFirst, &legacy, &target),
        migration(MigrationPhase::TargetFirst, &legacy, &target),
    ];
    let worker = |i: usize| {
        let (locks, inside) = (&locks, &inside);
        async move {
            for _ in 0..25 {
                let guard = locks[i % 2].lock("rolling").await.unwrap();
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await.unwrap();
            }
        }
    };
    let all = async { tokio::join!(worker(0), worker(1), worker(2), worker(3)) };
    tokio::time::timeout(Duration::from_secs(30), all)
        .await
        .expect("no deadlock");
}

#[test]
fn configuration_is_checked() {
    let (legacy, target) = (mem(), mem());
    for phase in MigrationPhase::ALL {
        assert_eq!(phase.as_str().parse::<MigrationPhase>().unwrap(), phase);
        let needs_both = MigrationLock::new(phase, Some(legacy.clone()), Some(target.clone()));
        assert!(needs_both.is_ok());
        assert_eq!(
            MigrationLock::new(phase, None, Some(target.clone())).is_ok(),
            !phase.uses_legacy()
        );
        assert_eq!(
            MigrationLock::new(phase, Some(legacy.clone()), None).is_ok(),
            !phase.uses_target()
        );
    }
    assert_eq!(
        "Target_First".parse::<MigrationPhase>().unwrap(),
        MigrationPhase::TargetFirst
    );
    assert!("sideways".parse::<MigrationPhase>().is_err());
    let locks = migration(MigrationPhase::TargetFirst, &legacy, &target);
    assert!(locks.clone().with_epochs(1, 1).is_err());
    assert!(locks.clone().with_epochs(0, MAX_EPOCH + 1).is_err());
    assert_eq!(locks.clone().with_epochs(1, 2).unwrap().token_epoch(), 2);
    let legacy_first = migration(MigrationPhase::LegacyFirst, &legacy, &target);
    assert_eq!(legacy_first.with_epochs(1, 2).unwrap().token_epoch(), 1);
    assert!(locks.with_second_leg_wait(Duration::ZERO).is_err());
}

#[test]
fn two_legs_are_as_strong_as_the_weaker_one_and_not_fifo() {
    let (legacy, target) = (mem(), mem());
    let caps = migration(MigrationPhase::LegacyFirst, &legacy, &target).capabilities();
    assert!(caps.linearizable);
    assert!(!caps.fifo);
    assert_eq!(
        migration(MigrationPhase::Target, &legacy, &target).capabilities(),
        target.capabilities()
    );
}

#[cfg(feature = "conformance")]
mod conformance {
    use super::*;

    /// Each call is a new client of the same two in-memory deployments (process-wide
    /// named instances), as the two-client cases require; case names never collide.
    fn over_memory(phase: MigrationPhase) -> Arc<dyn DistributedLock> {
        let legacy: Arc<dyn DistributedLock> =
            Arc::new(MemoryLock::named("migration-conformance-legacy"));
        let target: Arc<dyn DistributedLock> =
            Arc::new(MemoryLock::named("migration-conformance-target"));
        Arc::new(migration(phase, &legacy, &target))
    }

    mod legacy {
        crate::conformance_suite!(super::over_memory(super::MigrationPhase::Legacy));
    }
    mod legacy_first {
        crate::conformance_suite!(super::over_memory(super::MigrationPhase::LegacyFirst));
    }
    mod target_first {
        crate::conformance_suite!(super::over_memory(super::MigrationPhase::TargetFirst));
    }
    mod target {
        crate::conformance_suite!(super::over_memory(super::MigrationPhase::Target));
    }
}

/// A lock whose `observe` replays a fixed list of changes (a memory lock otherwise).
#[derive(Debug, Default)]
struct ReplayObserve {
    inner: MemoryLock,
    changes: Mutex<Vec<LeaderChange>>,
}

#[async_trait]
impl DistributedLock for ReplayObserve {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.inner.acquire(name, options).await
    }
    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        self.inner.inspect(name).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        self.inner.list(prefix).await
    }
    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        self.inner.revoke(name).await
    }
    async fn close(&self) -> Result<(), Error> {
        self.inner.close().await
    }
    async fn observe(&self, _election: &str) -> Result<LeaderChanges, Error> {
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        for change in self.changes.lock().unwrap().drain(..) {
            sender.send(change).unwrap();
        }
        // Kept open, like a live observation.
        std::mem::forget(sender);
        Ok(LeaderChanges::new(
            receiver,
            tokio_util::sync::CancellationToken::new(),
        ))
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn backend(&self) -> &'static str {
        "replay"
    }
}

/// The stream ends after an error, as `LeaderChanges` promises, also after the layer's
/// own error (a backend token too large to carry an epoch) while the inner stream goes
/// on.
#[tokio::test]
async fn an_observation_ends_after_a_token_it_cannot_map() {
    let legacy: Arc<dyn DistributedLock> = Arc::new(ReplayObserve {
        changes: Mutex::new(vec![
            Ok(Some(Leader::new("huge", FencingToken::new(1 << 60)))),
            Ok(None),
            Ok(Some(Leader::new("next", FencingToken::new(7)))),
        ]),
        ..ReplayObserve::default()
    });
    let lock = MigrationLock::new(MigrationPhase::Legacy, Some(legacy), None).unwrap();
    let mut changes = lock.observe("e").await.unwrap();
    let first = changes.next().await.expect("the first change");
    assert!(first.is_err(), "{first:?}");
    let after = tokio::time::timeout(Duration::from_secs(1), changes.next())
        .await
        .expect("the stream ends");
    assert!(after.is_none(), "an item after the error: {after:?}");
}

/// A first leg lost while the second is waited for (revoked, here) is not a grant: the
/// acquire does not hand out a guard that looks live while another client holds that
/// leg; it starts again, and gets the lock once it is free on both.
#[tokio::test]
async fn a_first_leg_lost_while_waiting_for_the_second_is_not_granted() {
    let (legacy, target) = (mem(), mem());
    let blocker = target.lock("x").await.unwrap();
    let locks = migration(MigrationPhase::LegacyFirst, &legacy, &target)
        .with_second_leg_wait(Duration::from_secs(5))
        .unwrap();
    let acquire = locks.acquire(
        "x",
        AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
    );
    let meddle = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The migrating client holds the legacy leg and waits for the target one.
        assert!(legacy.revoke("x").await.unwrap().is_some());
        let direct = legacy
            .try_lock("x")
            .await
            .unwrap()
            .expect("the legacy leg is free");
        blocker.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Both looked valid at once before the fix; now the acquire waits for it.
        let direct_token = direct.token();
        direct.release().await.unwrap();
        direct_token
    };
    let (guard, direct_token) = tokio::join!(acquire, meddle);
    let guard = guard.expect("granted once both legs are free");
    assert!(!guard.is_lost());
    assert!(
        guard.token() > era_token(0, direct_token).unwrap(),
        "granted before the direct legacy holder released"
    );
    guard.release().await.unwrap();
}

/// A fixed lease starts when the lock is granted: the first leg's lease ran while the
/// second leg was waited for, so it is started again; the guard gets a whole lease.
#[tokio::test(start_paused = true)]
async fn a_fixed_lease_is_whole_after_waiting_for_the_second_leg() {
    let (legacy, target) = (mem(), mem());
    let blocker = target.lock("x").await.unwrap();
    let locks = migration(MigrationPhase::LegacyFirst, &legacy, &target)
        .with_second_leg_wait(MigrationLock::DEFAULT_SECOND_LEG_WAIT)
        .unwrap();
    let free = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        blocker.release().await.unwrap();
    };
    let lease = Duration::from_secs(1);
    let (guard, ()) = tokio::join!(
        locks.acquire("x", AcquireOptions::new().fixed_lease(lease)),
        free
    );
    let guard = guard.expect("granted");
    assert!(!guard.is_lost(), "lost at birth");
    assert!(
        guard.valid_until() >= Instant::now() + lease - Duration::from_millis(100),
        "the guard's lease is {:?}, not a whole one",
        guard
            .valid_until()
            .saturating_duration_since(Instant::now())
    );
    tokio::time::sleep(lease / 2).await;
    assert!(!guard.is_lost());
    assert!(
        legacy.try_lock("x").await.unwrap().is_none(),
        "the legacy leg expired early"
    );
    guard.release().await.unwrap();
}

/// A second-leg wait too long to represent would wait for ever, and two clients in
/// opposite phases would then wait on each other for ever: refused.
#[test]
fn an_endless_second_leg_wait_is_refused() {
    let (legacy, target) = (mem(), mem());
    let locks = migration(MigrationPhase::LegacyFirst, &legacy, &target);
    assert!(locks.clone().with_second_leg_wait(Duration::MAX).is_err());
    assert!(locks.clone().with_second_leg_wait(crate::FOREVER).is_err());
    assert!(
        locks
            .with_second_leg_wait(Duration::from_secs(3600))
            .is_ok()
    );
}

/// A migration lock made on a runtime that has ended since (built in a temporary
/// `block_on`) still follows its legs: the follower falls back to the acquire's runtime
/// instead of being dropped by the dead one, so the guard is not reported lost while
/// both legs renew.
#[test]
fn a_lock_made_on_a_runtime_that_ended_still_follows_its_legs() {
    let locks = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            MigrationLock::new(
                MigrationPhase::LegacyFirst,
                Some(Arc::new(MemoryLock::new())),
                Some(Arc::new(MemoryLock::new())),
            )
            .unwrap()
        });
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    main.block_on(async {
        let lease = Duration::from_millis(300);
        let guard = locks
            .acquire("made-elsewhere", AcquireOptions::new().lease(lease))
            .await
            .unwrap();
        tokio::time::sleep(lease * 4).await;
        assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
        guard.release().await.unwrap();
    });
}

/// A guard held when the runtime its lock was made on ends still reports a lost leg:
/// the follower, dropped with that runtime, must go on on another (the acquire's), or
/// the loss of a leg is never reported to the holder.
#[test]
fn a_guard_held_when_its_locks_runtime_ends_still_reports_a_lost_leg() {
    let made_on = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let legacy = Arc::new(MemoryLock::new());
    let locks = made_on.block_on(async {
        MigrationLock::new(
            MigrationPhase::LegacyFirst,
            Some(legacy.clone() as Arc<dyn DistributedLock>),
            Some(Arc::new(MemoryLock::new())),
        )
        .unwrap()
    });
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let options = AcquireOptions::new().fixed_lease(Duration::from_secs(60));
    let guard = main.block_on(locks.acquire("leg-lost", options)).unwrap();
    drop(made_on);
    main.block_on(async {
        assert!(legacy.revoke("leg-lost").await.unwrap().is_some());
        tokio::time::timeout(Duration::from_secs(2), guard.lost())
            .await
            .expect("the lost leg is reported");
        assert_eq!(guard.lost_cause(), Some(crate::LossCause::MigrationLeg));
    });
}

/// An observation started on a lock made on a runtime that has ended since maps its
/// changes on the caller's runtime: a mapping task spawned on the dead runtime is
/// dropped at once, and the stream used to end with no item and no error.
#[test]
fn an_observation_on_a_lock_made_on_a_runtime_that_ended_still_delivers() {
    let locks = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let legacy: Arc<dyn DistributedLock> = Arc::new(ReplayObserve {
                changes: Mutex::new(vec![Ok(Some(Leader::new("a", FencingToken::new(7))))]),
                ..ReplayObserve::default()
            });
            MigrationLock::new(MigrationPhase::Legacy, Some(legacy), None).unwrap()
        });
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    main.block_on(async {
        let mut changes = locks.observe("e").await.unwrap();
        let first = tokio::time::timeout(Duration::from_secs(2), changes.next())
            .await
            .expect("the first change arrives");
        let leader = first
            .expect("the stream has a first item")
            .unwrap()
            .expect("a leader");
        assert_eq!(leader.token, era_token(0, FencingToken::new(7)).unwrap());
    });
}

/// An observation whose lock's runtime ends while it runs goes on delivering: the
/// mapping task, dropped with that runtime, must go on on another (the caller's) with
/// the leg's stream it had, or the caller's stream just ends, with no error.
#[test]
fn an_observation_goes_on_after_its_locks_runtime_ended() {
    let made_on = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let legacy = Arc::new(MemoryLock::new());
    let locks = made_on.block_on(async {
        MigrationLock::new(
            MigrationPhase::Legacy,
            Some(legacy.clone() as Arc<dyn DistributedLock>),
            None,
        )
        .unwrap()
    });
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut changes = main.block_on(async {
        let mut changes = locks.observe("e").await.unwrap();
        let first = tokio::time::timeout(Duration::from_secs(2), changes.next())
            .await
            .expect("the first change arrives");
        assert!(matches!(first, Some(Ok(None))), "{first:?}");
        changes
    });
    drop(made_on);
    main.block_on(async {
        let term = legacy
            .campaign("e", "v", AcquireOptions::new())
            .await
            .unwrap();
        let next = tokio::time::timeout(Duration::from_secs(2), changes.next())
            .await
            .expect("the next change arrives");
        let leader = next
            .expect("the stream goes on")
            .unwrap()
            .expect("a leader");
        assert_eq!(leader.token, era_token(0, term.token()).unwrap());
        term.release().await.unwrap();
    });
}

/// An observation whose every runtime ended (the lock's, then the one it moved to) ends
/// with an error item, not silently, as if nobody would ever lead again.
#[test]
fn an_observation_whose_runtimes_all_ended_says_so() {
    let made_on = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let legacy = Arc::new(MemoryLock::new());
    let locks = made_on.block_on(async {
        MigrationLock::new(
            MigrationPhase::Legacy,
            Some(legacy.clone() as Arc<dyn DistributedLock>),
            None,
        )
        .unwrap()
    });
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut changes = main.block_on(async { locks.observe("e").await.unwrap() });
    drop(made_on);
    drop(main);
    let last = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    last.block_on(async {
        let mut last_item = None;
        while let Ok(Some(item)) =
            tokio::time::timeout(Duration::from_secs(2), changes.next()).await
        {
            last_item = Some(item);
        }
        assert!(
            matches!(last_item, Some(Err(Error::Unavailable { .. }))),
            "the stream ended after {last_item:?}, not an error"
        );
    });
}

/// A leg's fixed lease, as its server sees it: `extend` takes `took` to answer, may be
/// told to fail once, and answers the send instant plus the lease minus `margin`.
#[derive(Debug)]
struct FixedLeg {
    margin: Duration,
    took: Duration,
    server_expiry: Mutex<Instant>,
    fail_next: std::sync::atomic::AtomicBool,
}

impl FixedLeg {
    /// The conservative end of the lease the server holds now.
    fn conservative(&self) -> Instant {
        *self.server_expiry.lock().unwrap() - self.margin
    }
}

#[async_trait]
impl HeldLock for FixedLeg {
    async fn release(&self) -> Result<(), Error> {
        Ok(())
    }
    fn release_in_background(&self) {}
    fn can_extend(&self) -> Result<(), Error> {
        Ok(())
    }
    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        if self.fail_next.swap(false, Ordering::SeqCst) {
            return Err(Error::unavailable(
                "fixed-leg",
                std::io::Error::other("connection refused"),
            ));
        }
        let sent = Instant::now();
        *self.server_expiry.lock().unwrap() = sent + lease;
        tokio::time::sleep(self.took).await;
        Ok(sent + lease - self.margin)
    }
}

/// A lock service whose grants are [`FixedLeg`]s (no exclusion: one client).
#[derive(Debug, Default)]
struct FixedLegs {
    took: Duration,
    handed_out: Mutex<Vec<(Arc<FixedLeg>, Liveness)>>,
}

impl FixedLegs {
    fn leg(&self, i: usize) -> (Arc<FixedLeg>, Liveness) {
        self.handed_out.lock().unwrap()[i].clone()
    }
}

#[async_trait]
impl DistributedLock for FixedLegs {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let Lease::Fixed(lease) = options.lease_kind() else {
            return Err(Error::InvalidConfig("fixed leases only".into()));
        };
        let margin = Duration::from_millis(600);
        let now = Instant::now();
        let held = Arc::new(FixedLeg {
            margin,
            took: self.took,
            server_expiry: Mutex::new(now + lease),
            fail_next: false.into(),
        });
        let liveness = Liveness::new(now + lease - margin);
        let mut handed_out = self.handed_out.lock().unwrap();
        handed_out.push((held.clone(), liveness.clone()));
        let token = FencingToken::new(handed_out.len() as u64);
        Ok(LockGuard::new(name, token, "fixed-leg", liveness, held))
    }
    async fn inspect(&self, _name: &str) -> Result<LockInfo, Error> {
        Err(Error::InvalidConfig("not in this test".into()))
    }
    async fn list(&self, _prefix: &str) -> Result<Vec<ListedLock>, Error> {
        Ok(Vec::new())
    }
    async fn revoke(&self, _name: &str) -> Result<Option<HolderInfo>, Error> {
        Ok(None)
    }
    async fn close(&self) -> Result<(), Error> {
        Ok(())
    }
    fn capabilities(&self) -> Capabilities {
        MemoryLock::new().capabilities()
    }
    fn backend(&self) -> &'static str {
        "fixed-leg"
    }
}

/// Extending a two-leg guard keeps the legs' own "never shorter" rule: after an
/// extension that moved the first leg far out and failed on the second, a shorter one
/// must not replace the first leg's long server lease by a short one while that leg
/// (and so the guard) keeps the long deadline. Every leg's deadline, and the guard's,
/// stay within what its server's current lease guarantees.
#[tokio::test(start_paused = true)]
async fn extending_after_a_failed_extension_never_outlives_a_legs_server_lease() {
    // The first leg (etcd, say) answers in 2 s, more than the 600 ms drift margin.
    let legacy = Arc::new(FixedLegs {
        took: Duration::from_secs(2),
        ..FixedLegs::default()
    });
    let target = Arc::new(FixedLegs::default());
    let (l, t): (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) =
        (legacy.clone(), target.clone());
    let guard = migration(MigrationPhase::LegacyFirst, &l, &t)
        .acquire(
            "x",
            AcquireOptions::new().fixed_lease(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    let check = |when: &str| {
        for (role, legs) in [("legacy", &legacy), ("target", &target)] {
            let (server, leg) = legs.leg(0);
            assert!(
                leg.valid_until() <= server.conservative(),
                "{when}: the {role} leg claims {:?}, its server lease is good until {:?}",
                leg.valid_until() - Instant::now(),
                server.conservative() - Instant::now()
            );
            assert!(
                guard.valid_until() <= server.conservative(),
                "{when}: the guard claims {:?}, the {role} leg's server lease is good \
                 until {:?}",
                guard.valid_until() - Instant::now(),
                server.conservative() - Instant::now()
            );
        }
    };
    target.leg(0).0.fail_next.store(true, Ordering::SeqCst);
    let failed = guard.extend(Duration::from_secs(300)).await;
    assert!(
        matches!(failed, Err(Error::Unavailable { .. })),
        "{failed:?}"
    );
    check("after the failed extension");
    guard.extend(Duration::from_secs(60)).await.unwrap();
    check("after the shorter extension");
    assert!(!guard.is_lost());
    guard.extend(Duration::from_secs(400)).await.unwrap();
    check("after a longer one");
    guard.release().await.unwrap();
}

/// A leg moved back by its backend while a later leg is still being extended (an etcd
/// extension task of an earlier, dropped call confirming a shorter lease): the guard's
/// deadline after `extend` returns is no later than that leg's. The extension's answer,
/// read before the leg moved back, must not raise the guard above it.
#[tokio::test(start_paused = true)]
async fn a_leg_moved_back_during_an_extension_keeps_the_guard_below_it() {
    let legacy = Arc::new(FixedLegs::default());
    let target = Arc::new(FixedLegs {
        took: Duration::from_secs(2),
        ..FixedLegs::default()
    });
    let (l, t): (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) =
        (legacy.clone(), target.clone());
    let guard = migration(MigrationPhase::LegacyFirst, &l, &t)
        .acquire(
            "x",
            AcquireOptions::new().fixed_lease(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    let (_, legacy_leg) = legacy.leg(0);
    let moving_back = async {
        // The legacy leg is extended at once; the target leg takes 2 s.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(legacy_leg.confirm_extension(Instant::now() + Duration::from_secs(10)));
    };
    let (extended, ()) = tokio::join!(guard.extend(Duration::from_secs(60)), moving_back);
    extended.unwrap();
    assert!(
        guard.valid_until() <= legacy_leg.valid_until(),
        "the guard claims {:?}, its legacy leg only {:?}",
        guard.valid_until() - Instant::now(),
        legacy_leg.valid_until() - Instant::now()
    );
    guard.release().await.unwrap();
}

/// An extension that moved the first leg's deadline back (its new lease ended within the
/// drift margin of the old deadline) and then failed on the second leg must still bring
/// the guard's deadline down to the first leg's: nothing else lowers it before that leg
/// is lost.
#[tokio::test(start_paused = true)]
async fn a_failed_extension_that_moved_a_leg_back_moves_the_guard_back() {
    let legacy = Arc::new(FixedLegs::default());
    let target = Arc::new(FixedLegs::default());
    let (l, t): (Arc<dyn DistributedLock>, Arc<dyn DistributedLock>) =
        (legacy.clone(), target.clone());
    let guard = migration(MigrationPhase::LegacyFirst, &l, &t)
        .acquire(
            "x",
            AcquireOptions::new().fixed_lease(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    target.leg(0).0.fail_next.store(true, Ordering::SeqCst);
    // 29.8 s: past the legs' 29.4 s deadlines, within the margin of their 30 s leases.
    let failed = guard.extend(Duration::from_millis(29_800)).await;
    assert!(
        matches!(failed, Err(Error::Unavailable { .. })),
        "{failed:?}"
    );
    let (server, leg) = legacy.leg(0);
    assert!(leg.valid_until() <= server.conservative());
    assert!(
        guard.valid_until() <= server.conservative(),
        "the guard claims {:?}, the legacy leg's server lease is good until {:?}",
        guard.valid_until() - Instant::now(),
        server.conservative() - Instant::now()
    );
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
}
