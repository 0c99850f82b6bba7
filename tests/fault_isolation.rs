//! F19 and F20, a cluster member isolated from its peers while its clients stay
//! connected to it: each member of a 3-member etcd cluster or a 3-server ZooKeeper
//! ensemble runs in its own network namespace ([`NetLab`]), the clients run in the test
//! process, and `iptables` DROP rules in the member's namespace cut it from the others.
//!
//! - F19 (etcd): the leader is cut from its followers while the holder's client is
//!   connected to the leader alone.
//! - F20 (ZooKeeper): the follower the holder's client is connected to is cut from the
//!   quorum.
//!
//! Each test runs two phases on one cluster:
//!
//! 1. One holder on the member to be cut, one client on the majority side queued behind
//!    it. After the cut the holder reports loss on its own timer before the heal, no
//!    later than its `valid_until` + 250 ms (C6); the majority-side client acquires
//!    within the stated bound, never while the holder's guard still claimed validity
//!    (C1), with a larger token (C4); the cut holder's late fenced write is rejected
//!    (C2) and its release after the heal is `Err(Lost)`; the majority-side grant comes
//!    after the holder's `valid_until` (C1 by the clock). On ZooKeeper the guard must
//!    also signal that it is at risk (`is_at_risk()`) before it is lost. (On etcd the
//!    majority-side waiter may lose its own session at the cut and acquire again: its
//!    keepalives are forwarded by its member to the cut leader and hang there until
//!    etcd's request timeout, longer than the 2 s lease.)
//! 2. Four clients (two on the member to be cut, two on the majority side) contend for
//!    one name with a fenced read-modify-write counter. Once a cut-side client holds the
//!    lock (it keeps it, writing every 50 ms), its member is cut for 6 s and healed:
//!    no overlap (C1), no stale write accepted (C2), no lost update (C3), tokens
//!    increase in grant order (C4), every loss reported in time (C6), the cut-side
//!    holder's write after its loss (made once a holder with a larger token has used
//!    the counter, not after a fixed time) is refused, and the majority side grants
//!    during the cut and after the heal. On failure every grant is printed with its
//!    times.
//!
//! F20 runs again, phase 1 only, at ZooKeeper's minimum session timeout (two ticks),
//! where the client's deadline has the least room against the leader's ping period.
//!
//! The namespaces need root, `ip` and `iptables` (`./scripts/test` installs and checks
//! them). Where namespaces cannot be made, these tests fail; they never skip.
#![cfg(all(feature = "etcd", feature = "zookeeper"))]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error};
use fencelock_testkit::checker::{Checker, LOSS_BOUND};
use fencelock_testkit::leftovers;
use fencelock_testkit::{EtcdCluster, NetLab, ZkEnsemble};
use tokio::time::Instant;

mod common;
use common::Servers;

/// The lease (etcd) and session timeout (ZooKeeper) of every client.
const LEASE: Duration = Duration::from_secs(2);
/// How long the member stays cut in phase 2: 3 × the lease, longer than it takes the
/// majority side to take over (see the bounds in the tests).
const CONTENTION_PARTITION: Duration = Duration::from_secs(6);
/// How long the cut-side holder of phase 2, once lost, waits for a holder with a larger
/// token to use the counter before its own late write: longer than the cut and the
/// grants after the heal (the workers are stopped later than that).
const ZOMBIE_WAIT: Duration = Duration::from_secs(16);
/// etcd's election timeout in the testkit's clusters (`--election-timeout 500`).
const ETCD_ELECTION: Duration = Duration::from_millis(500);
/// ZooKeeper's `tickTime` in the testkit's ensembles.
const ZK_TICK: Duration = Duration::from_millis(500);
/// The testkit servers' `minSessionTimeout`: two ticks, ZooKeeper's default minimum.
const ZK_MIN_SESSION: Duration = Duration::from_secs(1);

fn unique(name: &str) -> String {
    common::unique(&format!("iso-{name}"))
}

/// A small random pause (0..20 ms) inside the critical section.
fn jitter() -> Duration {
    Duration::from_millis(common::nanos() % 20)
}

/// A counter that checks fencing tokens on reads and writes, as the fence store of the
/// fault-test plan: a read or write with a token below the largest one seen is refused,
/// so a read-modify-write under a valid token is never interleaved with another
/// holder's. C3: the value is the number of accepted writes.
#[derive(Default)]
struct FencedCounter {
    state: Mutex<CounterState>,
}

#[derive(Default, Debug)]
struct CounterState {
    max_seen: u64,
    value: u64,
    accepted_writes: u64,
    refused: u64,
}

impl FencedCounter {
    fn read(&self, token: u64) -> Option<u64> {
        let mut s = self.state.lock().unwrap();
        if token < s.max_seen {
            s.refused += 1;
            return None;
        }
        s.max_seen = token;
        Some(s.value)
    }

    fn write(&self, token: u64, value: u64) -> bool {
        let mut s = self.state.lock().unwrap();
        if token < s.max_seen {
            s.refused += 1;
            return false;
        }
        s.max_seen = token;
        s.value = value;
        s.accepted_writes += 1;
        true
    }

    /// Whether a holder with a token larger than `token` has read or written the
    /// counter (from then on a read or write with `token` is refused).
    fn has_newer_than(&self, token: u64) -> bool {
        self.state.lock().unwrap().max_seen > token
    }

    /// Waits until a holder with a token larger than `token` has read or written the
    /// counter, polling every 10 ms for at most `within`. Returns whether it did.
    async fn wait_for_newer_than(&self, token: u64, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while !self.has_newer_than(token) {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    fn assert_no_lost_update(&self) {
        let s = self.state.lock().unwrap();
        assert_eq!(
            s.value, s.accepted_writes,
            "C3: the counter is {} after {} accepted increments ({s:?})",
            s.value, s.accepted_writes
        );
    }
}

/// What phase 1 measured (printed, and read by the callers' assertions).
#[derive(Debug)]
#[allow(dead_code)] // Some fields are only printed.
struct Phase1 {
    /// From the cut to the holder's loss report.
    lost_after: Duration,
    /// How late the loss report came after the guard's `valid_until` (zero if before).
    lost_late_by: Duration,
    /// From the cut to the majority-side grant.
    granted_after: Duration,
    /// From the cut to the first time the guard said it was at risk, if it ever did
    /// before it was lost.
    at_risk_after: Option<Duration>,
    /// Retryable errors the majority-side client got while waiting.
    majority_retries: u64,
    old_token: u64,
    new_token: u64,
}

/// Phase 1: `holder` talks only to member `cut` of `net`; `other` talks only to the
/// majority; both lock with `lease`. The member is cut from its peers for 3 × `lease`,
/// then healed.
async fn isolated_holder(
    holder: &dyn DistributedLock,
    other: &dyn DistributedLock,
    net: &NetLab,
    cut: usize,
    name: &str,
    lease: Duration,
) -> Phase1 {
    let partition = lease * 3;
    let checker = Checker::new();
    let options = AcquireOptions::new().lease(lease).no_wait();
    let guard = holder
        .acquire(name, options)
        .await
        .expect("holder acquires");
    let old_token = guard.token().get();
    checker.enter("holder", old_token);
    assert!(checker.write("holder", old_token));
    // Let a renewal or two happen first.
    tokio::time::sleep(lease / 2).await;
    assert!(!guard.is_lost(), "lost before the cut");
    assert!(!guard.is_at_risk(), "at risk before the cut");

    // The majority-side client queues behind the holder before the cut (F3's "B waits
    // in lock(L)"); the cut comes once its turn is recorded in the backend.
    let cut_at = std::sync::OnceLock::<Instant>::new();
    let retries = AtomicU64::new(0);
    let next = async {
        let deadline = Instant::now() + partition + Duration::from_secs(10);
        let next = loop {
            let options = AcquireOptions::new()
                .lease(lease)
                .wait_timeout(deadline.saturating_duration_since(Instant::now()));
            match other.acquire(name, options).await {
                Ok(next) => break next,
                // etcd: a request caught in the election ("request timed out"). (Before
                // keepalives were resent on a new stream after one unanswered renew
                // interval, the waiter's own session was lost here in every run: its
                // keepalive, forwarded to the cut leader, hung until etcd's 6 s request
                // timeout.) An application acquires again; so does this client, and the
                // bound below still holds.
                Err(e)
                    if (e.is_retryable() || matches!(e, Error::Lost { .. }))
                        && Instant::now() < deadline =>
                {
                    retries.fetch_add(1, Ordering::SeqCst);
                    eprintln!("majority-side acquire: {e}; retrying");
                }
                Err(e) => panic!("a majority-side client acquires during the cut: {e:?}"),
            }
        };
        let granted_at = Instant::now();
        checker.enter("other", next.token().get());
        assert!(checker.write("other", next.token().get()));
        (next, granted_at)
    };
    let loss = async {
        let queued = Instant::now();
        while !matches!(other.inspect(name).await, Ok(info) if info.waiters >= Some(1)) {
            assert!(
                queued.elapsed() < Duration::from_secs(5),
                "the majority-side client did not queue"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        net.isolate(cut);
        let cut_at = *cut_at.get_or_init(Instant::now);
        // Poll the at-risk flag until the guard is lost (it reads false once lost).
        let mut at_risk_after = None;
        loop {
            if at_risk_after.is_none() && guard.is_at_risk() {
                at_risk_after = Some(cut_at.elapsed());
            }
            tokio::select! {
                _ = guard.lost() => break,
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
        let lost_at = Instant::now();
        let valid_until = guard.valid_until();
        checker.lost("holder", old_token, valid_until.into_std());
        (
            lost_at,
            lost_at.saturating_duration_since(valid_until),
            at_risk_after,
        )
    };
    let ((lost_at, lost_late_by, at_risk_after), (next, granted_at)) = tokio::join!(loss, next);
    let new_token = next.token().get();
    let cut_at = *cut_at.get().expect("the cut was made");

    let lost_after = lost_at - cut_at;
    assert!(
        lost_after < partition,
        "loss reported {lost_after:?} into the cut, not before the heal"
    );
    // C1 by the clock, not only by the order the two were recorded in: the majority
    // side's grant came after the cut holder's deadline (the server expired the
    // holder's lease or session only after the holder stopped claiming it).
    assert!(
        granted_at >= guard.valid_until(),
        "the majority side was granted {:?} before the cut holder's deadline",
        guard.valid_until() - granted_at
    );
    assert!(new_token > old_token, "token {new_token} after {old_token}");
    // The zombie's late write, with its old token.
    assert!(
        !checker.write("holder", old_token),
        "the cut holder's late write was accepted"
    );
    assert!(
        !guard.is_at_risk(),
        "a lost guard is not 'at risk' but lost"
    );

    tokio::time::sleep_until(cut_at + partition).await;
    net.heal();
    let released = guard.release().await;
    assert!(
        matches!(released, Err(Error::Lost { .. })),
        "the cut holder's release after the heal: {released:?}"
    );
    checker.exit("other", new_token);
    next.release().await.expect("the new holder releases");

    checker.assert_no_overlap();
    checker.assert_no_stale_write_accepted();
    checker.assert_no_lost_update(2);
    checker.assert_tokens_increase();
    checker.assert_loss_reported_in_time();
    Phase1 {
        lost_after,
        lost_late_by,
        granted_after: granted_at - cut_at,
        at_risk_after,
        majority_retries: retries.load(Ordering::SeqCst),
        old_token,
        new_token,
    }
}

/// What phase 2 measured.
#[derive(Debug, Default)]
struct Phase2 {
    grants: u64,
    /// Grants to the majority-side clients while the member was cut.
    grants_during_cut: u64,
    losses: u64,
    /// Writes the cut-side holder tried after its loss: refused, accepted (before any
    /// newer holder had written, which is safe).
    zombie_writes_refused: u64,
    zombie_writes_accepted: u64,
    /// Times the cut-side holder, after its loss, saw no holder with a larger token use
    /// the counter within [`ZOMBIE_WAIT`] (so it did not write).
    zombie_saw_no_successor: u64,
    errors: Vec<String>,
    /// The longest `acquire` call (its wait is bounded at 3 s).
    longest_acquire: Duration,
    /// Every grant, for the failure message.
    #[allow(dead_code)] // Printed on failure.
    log: Vec<Grant>,
}

/// One grant of phase 2, with times relative to the start of the run.
#[derive(Debug, Clone)]
#[allow(dead_code)] // Printed on failure.
struct Grant {
    who: String,
    token: u64,
    asked: Duration,
    granted: Duration,
    /// The guard's `valid_until` right after the grant.
    valid_until: Duration,
    ended: Duration,
    lost: Option<String>,
}

/// Phase 2: four clients contend for `name` with a fenced read-modify-write counter,
/// `clients[..2]` on member `cut`, `clients[2..]` on the majority. Once a cut-side
/// client holds the lock (and keeps it, writing every 50 ms), member `cut` is cut from
/// its peers for [`CONTENTION_PARTITION`], then healed; the run goes on for a while.
async fn contention_across_a_cut(
    clients: &[Arc<dyn DistributedLock>],
    net: &NetLab,
    cut: usize,
    name: &str,
) -> Phase2 {
    let checker = Arc::new(Checker::new());
    let counter = Arc::new(FencedCounter::default());
    let stop = Arc::new(AtomicBool::new(false));
    let cut_now = Arc::new(AtomicBool::new(false));
    // Set by the test: the next cut-side client to be granted keeps the lock.
    let keep_wanted = Arc::new(AtomicBool::new(false));
    let keeping = Arc::new(tokio::sync::Notify::new());
    let phase = Arc::new(Mutex::new(Phase2::default()));
    let start = Instant::now();
    let marks = Arc::new(Mutex::new(Vec::<(&str, Duration)>::new()));
    let mut workers = Vec::new();
    for (i, lock) in clients.iter().enumerate() {
        let cut_side = i < 2;
        let label = format!("{}{i}", if cut_side { "cut-side-" } else { "majority-" });
        let (lock, checker, counter, stop, cut_now, keep_wanted, keeping, phase) = (
            lock.clone(),
            checker.clone(),
            counter.clone(),
            stop.clone(),
            cut_now.clone(),
            keep_wanted.clone(),
            keeping.clone(),
            phase.clone(),
        );
        let name = name.to_owned();
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let asked = Instant::now();
                let options = AcquireOptions::new()
                    .lease(LEASE)
                    .wait_timeout(Duration::from_secs(3));
                let acquired = lock.acquire(&name, options).await;
                {
                    let mut phase = phase.lock().unwrap();
                    phase.longest_acquire = phase.longest_acquire.max(asked.elapsed());
                }
                let guard = match acquired {
                    Ok(guard) => guard,
                    Err(e) => {
                        phase.lock().unwrap().errors.push(format!("{label}: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let token = guard.token().get();
                checker.enter(&label, token);
                let granted = start.elapsed();
                let valid_until = guard.valid_until().saturating_duration_since(start);
                {
                    let mut phase = phase.lock().unwrap();
                    phase.grants += 1;
                    if cut_now.load(Ordering::SeqCst) && !cut_side {
                        phase.grants_during_cut += 1;
                    }
                }
                let keep = cut_side && keep_wanted.swap(false, Ordering::SeqCst);
                if keep {
                    keeping.notify_one();
                }
                let increment = || async {
                    let Some(value) = counter.read(token) else {
                        return false;
                    };
                    tokio::time::sleep(jitter()).await;
                    counter.write(token, value + 1)
                };
                let work = async {
                    increment().await;
                    if keep {
                        // Until the loss, which ends the `select!` below.
                        loop {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            increment().await;
                        }
                    }
                };
                let lost = tokio::select! {
                    biased;
                    _ = guard.lost() => true,
                    _ = work => guard.is_lost(),
                };
                if lost {
                    checker.lost(&label, token, guard.valid_until().into_std());
                    phase.lock().unwrap().losses += 1;
                } else {
                    checker.exit(&label, token);
                }
                phase.lock().unwrap().log.push(Grant {
                    who: label.clone(),
                    token,
                    asked: asked.saturating_duration_since(start),
                    granted,
                    valid_until,
                    ended: start.elapsed(),
                    lost: lost.then(|| guard.lost_reason().unwrap_or_default().to_owned()),
                });
                if keep {
                    // The zombie: one more read-modify-write after the loss, once a
                    // holder with a larger token has used the counter. Not after a fixed
                    // time: under load the majority side was once granted 2.9 s after
                    // asking (etcd extends leases across a leader change), and a write
                    // before any newer token exists is rightly accepted.
                    if counter.wait_for_newer_than(token, ZOMBIE_WAIT).await {
                        let accepted = increment().await;
                        let mut phase = phase.lock().unwrap();
                        if accepted {
                            phase.zombie_writes_accepted += 1;
                        } else {
                            phase.zombie_writes_refused += 1;
                        }
                    } else {
                        phase.lock().unwrap().zombie_saw_no_successor += 1;
                    }
                }
                let _ = guard.release().await;
            }
        }));
    }
    let grants = || phase.lock().unwrap().grants;
    let wait_for_grants = |n: u64, within: Duration| async move {
        let deadline = Instant::now() + within;
        while grants() < n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    wait_for_grants(20, Duration::from_secs(5)).await;
    keep_wanted.store(true, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(10), keeping.notified())
        .await
        .expect("a cut-side client took the lock");
    net.isolate(cut);
    marks.lock().unwrap().push(("cut", start.elapsed()));
    cut_now.store(true, Ordering::SeqCst);
    tokio::time::sleep(CONTENTION_PARTITION).await;
    cut_now.store(false, Ordering::SeqCst);
    net.heal();
    marks.lock().unwrap().push(("heal", start.elapsed()));
    let healed_at_grants = grants();
    tokio::time::sleep(Duration::from_secs(2)).await;
    wait_for_grants(healed_at_grants + 5, Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        tokio::time::timeout(Duration::from_secs(15), worker)
            .await
            .expect("a worker stops within 15 s")
            .expect("worker");
    }

    let checks = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        checker.assert_no_overlap();
        checker.assert_no_stale_write_accepted();
        checker.assert_tokens_increase();
        checker.assert_loss_reported_in_time();
        counter.assert_no_lost_update();
    }));
    let phase = std::mem::take(&mut *phase.lock().unwrap());
    if let Err(failure) = checks {
        let mut log = phase.log.clone();
        log.sort_by_key(|g| g.granted);
        eprintln!("phase 2 failed; marks {:?}; grants:", marks.lock().unwrap());
        for grant in log {
            eprintln!("  {grant:?}");
        }
        eprintln!("errors: {:?}", phase.errors);
        std::panic::resume_unwind(failure);
    }
    assert!(
        phase.losses >= 1,
        "the cut-side holder did not report its loss: {phase:?}"
    );
    assert_eq!(
        phase.zombie_saw_no_successor, 0,
        "no holder with a larger token used the counter within {ZOMBIE_WAIT:?} of the \
         cut-side holder's loss: {phase:?}"
    );
    assert_eq!(
        phase.zombie_writes_refused, 1,
        "the cut-side holder's write after its loss: {phase:?}"
    );
    assert!(
        phase.grants_during_cut > 0,
        "the majority side granted nothing during the cut: {phase:?}"
    );
    assert!(
        phase.grants > healed_at_grants,
        "no grant after the heal: {phase:?}"
    );
    phase
}

/// F19: the etcd leader is cut from its followers; the holder's client talks to the
/// leader alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f19_etcd_leader_isolated_from_its_followers() {
    let started = Instant::now();
    let cluster = EtcdCluster::start_isolated(3);
    let net = cluster.net().expect("namespaces");
    let leader = cluster.wait_for_leader(Duration::from_secs(10));
    let followers: Vec<String> = (0..3)
        .filter(|&i| i != leader)
        .map(|i| cluster.member(i).endpoint())
        .collect();
    let prefix = unique("etcd");
    let url = |endpoints: &str| format!("etcd://{endpoints}/{prefix}?lease=2s");
    let holder = fencelock::connect(&url(&cluster.member(leader).endpoint()))
        .await
        .unwrap();
    let other = fencelock::connect(&url(&followers.join(",")))
        .await
        .unwrap();

    let phase1 = isolated_holder(&*holder, &*other, net, leader, "stock", LEASE).await;
    eprintln!("F19 etcd phase 1: {phase1:?}");
    let first_prefix = prefix.clone();
    // The lease outlives the old leader: the new leader, elected within 2 election
    // timeouts of the cut, renews every lease on promotion to its TTL plus an election
    // timeout, and its lessor revokes expired leases in rounds of 500 ms. So the
    // majority side gets the lock at most lease + 3 election timeouts + 500 ms after
    // the cut; 1 s more of slack.
    let bound = LEASE + ETCD_ELECTION * 3 + Duration::from_millis(500) + Duration::from_secs(1);
    assert!(
        phase1.granted_after <= bound,
        "the majority side acquired {:?} after the cut (bound {bound:?}): {phase1:?}",
        phase1.granted_after
    );
    drop((holder, other));

    cluster.wait_healthy();
    let leader = cluster.wait_for_leader(Duration::from_secs(10));
    let majority: Vec<String> = (0..3)
        .filter(|&i| i != leader)
        .map(|i| cluster.member(i).endpoint())
        .collect();
    let prefix = unique("etcd-contention");
    let url = |endpoints: &str| format!("etcd://{endpoints}/{prefix}?lease=2s");
    let mut clients = Vec::new();
    for i in 0..4 {
        let endpoints = if i < 2 {
            cluster.member(leader).endpoint()
        } else {
            majority.join(",")
        };
        clients.push(fencelock::connect(&url(&endpoints)).await.unwrap());
    }
    let phase2 = contention_across_a_cut(&clients, net, leader, "counter").await;
    eprintln!(
        "F19 etcd: phase 2: {} grants ({} on the majority during the cut), {} losses, \
         zombie writes refused {} accepted {}, longest acquire {:?}, errors {:?}; {:?} in all",
        phase2.grants,
        phase2.grants_during_cut,
        phase2.losses,
        phase2.zombie_writes_refused,
        phase2.zombie_writes_accepted,
        phase2.longest_acquire,
        phase2.errors,
        started.elapsed()
    );
    // Nothing of either phase is left (C5), and with the clients gone, no lease: the
    // cluster is this test's own.
    drop(clients);
    let leader = cluster.wait_for_leader(Duration::from_secs(10));
    let member = cluster.member(leader);
    let bound = LEASE + Duration::from_secs(2);
    Servers::Etcd(member, &first_prefix).assert_nothing_left_within("F19 phase 1", bound);
    Servers::Etcd(member, &prefix).assert_nothing_left_within("F19 phase 2", bound);
    tokio::task::block_in_place(|| {
        leftovers::assert_none_within("F19 leases", bound, || {
            leftovers::etcd_leases(&member.endpoint())
        })
    });
}

/// F20: the ZooKeeper follower the holder's client is connected to is cut from the
/// quorum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f20_zookeeper_follower_cut_from_the_quorum() {
    let started = Instant::now();
    let ensemble = ZkEnsemble::start_isolated(3);
    let net = ensemble.net().expect("namespaces");
    let leader = ensemble.wait_for_leader(Duration::from_secs(20));
    let follower = (0..3).find(|&i| i != leader).unwrap();
    let majority: Vec<String> = (0..3)
        .filter(|&i| i != follower)
        .map(|i| ensemble.member(i).connect_string())
        .collect();
    let chroot = unique("zk");
    let url = |hosts: &str| format!("zk://{hosts}/{chroot}?session_timeout=2s&min_lease=2s");
    let holder = fencelock::connect(&url(&ensemble.member(follower).connect_string()))
        .await
        .unwrap();
    let other = fencelock::connect(&url(&majority.join(","))).await.unwrap();

    let phase1 = isolated_holder(&*holder, &*other, net, follower, "stock", LEASE).await;
    eprintln!("F20 ZooKeeper phase 1: {phase1:?}");
    let first_chroot = chroot.clone();
    // The leader expires the holder's session once it has not heard of it for the
    // session timeout (sessions expire in tickTime buckets, and the follower forwards
    // its clients' pings once a tick): session + 2 ticks + 1 s of slack.
    let bound = LEASE + ZK_TICK * 2 + Duration::from_secs(1);
    assert!(
        phase1.granted_after <= bound,
        "the majority side acquired {:?} after the cut (bound {bound:?}): {phase1:?}",
        phase1.granted_after
    );
    assert!(
        phase1.at_risk_after.is_some(),
        "the guard never said it was at risk between the cut and its loss \
         ({:?} after the cut, {:?} after valid_until): {phase1:?}",
        phase1.lost_after,
        phase1.lost_late_by
    );
    assert!(phase1.lost_late_by <= LOSS_BOUND);
    drop((holder, other));

    // The cut follower rejoins.
    let rejoined = Instant::now();
    while !ensemble
        .member(follower)
        .mode()
        .is_some_and(|m| m == "follower" || m == "leader")
    {
        assert!(
            rejoined.elapsed() < Duration::from_secs(20),
            "server {follower} did not rejoin the ensemble after the heal"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let leader = ensemble.wait_for_leader(Duration::from_secs(20));
    let follower = (0..3).find(|&i| i != leader).unwrap();
    let majority: Vec<String> = (0..3)
        .filter(|&i| i != follower)
        .map(|i| ensemble.member(i).connect_string())
        .collect();
    let chroot = unique("zk-contention");
    let url = |hosts: &str| format!("zk://{hosts}/{chroot}?session_timeout=2s&min_lease=2s");
    let mut clients = Vec::new();
    for i in 0..4 {
        let hosts = if i < 2 {
            ensemble.member(follower).connect_string()
        } else {
            majority.join(",")
        };
        clients.push(fencelock::connect(&url(&hosts)).await.unwrap());
    }
    let phase2 = contention_across_a_cut(&clients, net, follower, "counter").await;
    eprintln!(
        "F20 ZooKeeper: phase 2: {} grants ({} on the majority during the cut), {} losses, \
         zombie writes refused {} accepted {}, longest acquire {:?}, errors {:?}; {:?} in all",
        phase2.grants,
        phase2.grants_during_cut,
        phase2.losses,
        phase2.zombie_writes_refused,
        phase2.zombie_writes_accepted,
        phase2.longest_acquire,
        phase2.errors,
        started.elapsed()
    );
    // Nothing of either phase is left (C5): the leader lists every ephemeral node.
    drop(clients);
    let leader = ensemble.member(ensemble.wait_for_leader(Duration::from_secs(20)));
    let bound = LEASE + ZK_TICK * 2 + Duration::from_secs(1);
    Servers::Zk(leader, &first_chroot).assert_nothing_left_within("F20 phase 1", bound);
    Servers::Zk(leader, &chroot).assert_nothing_left_within("F20 phase 2", bound);
}

/// F20 at ZooKeeper's minimum session timeout (two ticks: 1 s with the testkit's
/// `tickTime` of 500 ms), where the client's session deadline has the least room
/// against the leader's ping period (half a tick), which decides how late the leader
/// hears of the session's last touches at the cut follower. Phase 1 of F20 with 1 s
/// sessions and leases: the holder reports loss on its own timer before the leader
/// expires its session and the majority-side client is granted (C1 by the record and by
/// the clock: the grant comes after the holder's `valid_until`), in time (C6), after
/// saying it was at risk; the late write is refused (C2), the token larger (C4), nothing
/// left (C5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f20_zookeeper_follower_cut_at_the_minimum_session_timeout() {
    let started = Instant::now();
    let ensemble = ZkEnsemble::start_isolated(3);
    let net = ensemble.net().expect("namespaces");
    let leader = ensemble.wait_for_leader(Duration::from_secs(20));
    let follower = (0..3).find(|&i| i != leader).unwrap();
    let majority: Vec<String> = (0..3)
        .filter(|&i| i != follower)
        .map(|i| ensemble.member(i).connect_string())
        .collect();
    let chroot = unique("zk-min-session");
    let url = |hosts: &str| format!("zk://{hosts}/{chroot}?session_timeout=1s&min_lease=1s");
    let holder = fencelock::connect(&url(&ensemble.member(follower).connect_string()))
        .await
        .unwrap();
    let other = fencelock::connect(&url(&majority.join(","))).await.unwrap();

    let phase1 = isolated_holder(&*holder, &*other, net, follower, "stock", ZK_MIN_SESSION).await;
    eprintln!(
        "F20 ZooKeeper at the minimum session timeout: {phase1:?}; {:?} in all",
        started.elapsed()
    );
    // As in F20: session + 2 ticks + 1 s of slack.
    let bound = ZK_MIN_SESSION + ZK_TICK * 2 + Duration::from_secs(1);
    assert!(
        phase1.granted_after <= bound,
        "the majority side acquired {:?} after the cut (bound {bound:?}): {phase1:?}",
        phase1.granted_after
    );
    assert!(
        phase1.at_risk_after.is_some(),
        "the guard never said it was at risk between the cut and its loss \
         ({:?} after the cut, {:?} after valid_until): {phase1:?}",
        phase1.lost_after,
        phase1.lost_late_by
    );
    assert!(phase1.lost_late_by <= LOSS_BOUND);
    drop((holder, other));
    let leader = ensemble.member(ensemble.wait_for_leader(Duration::from_secs(20)));
    let bound = ZK_MIN_SESSION + ZK_TICK * 2 + Duration::from_secs(1);
    Servers::Zk(leader, &chroot).assert_nothing_left_within("F20 at the minimum session", bound);
}
