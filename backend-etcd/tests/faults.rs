//! Fault tests on real etcd servers: a holder process frozen past its lease (SIGSTOP), an
//! etcd restart, and a 3-member cluster losing its leader during contention.
//!
//! The frozen holder is this test binary re-run as a child process: the `holder_child`
//! test does nothing unless `FENCELOCK_ETCD_HOLDER` is set.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Txn, TxnOp};
use fencelock_core::{
    AcquireOptions, DistributedLock, DistributedLockExt, FencedRegister, FencingToken,
};
use fencelock_etcd::{EtcdConfig, EtcdLock, owner_compare};
use fencelock_testkit::{EtcdCluster, EtcdServer};

const HOLDER: &str = "FENCELOCK_ETCD_HOLDER";
const LEASE: Duration = Duration::from_secs(2);

fn config(endpoints: Vec<String>, prefix: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints,
        prefix: prefix.to_owned(),
        lease: LEASE,
        ..EtcdConfig::default()
    }
}

/// The holder child, resumed and killed when dropped: a test that fails while the child
/// is SIGSTOPped must not leave it stopped for ever.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // Not once it has been waited for: its pid may belong to another process by now.
        if let Ok(None) = self.0.try_wait() {
            let _ = Command::new("kill")
                .args(["-CONT", &self.0.id().to_string()])
                .status();
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Child side of `frozen_holder_is_fenced_and_told`: takes the lock, prints its token,
/// prints `lost` the moment its guard reports loss, and on each `write` line from the
/// parent tries a write fenced by `owner_compare`, printing whether etcd applied it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_child() {
    let Ok(endpoint) = std::env::var(HOLDER) else {
        return;
    };
    let locks = EtcdLock::connect(config(vec![endpoint], "faults-frozen"))
        .await
        .unwrap();
    let guard = locks.lock("stock").await.unwrap();
    println!("token {}", guard.token());
    let watcher = async {
        guard.lost().await;
        println!("lost");
    };
    let writer = async {
        let (lines, mut rx) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        while let Some(line) = rx.recv().await {
            if line == "write" {
                let txn = Txn::new()
                    .when([owner_compare(&guard).unwrap()])
                    .and_then([TxnOp::put("faults-frozen-stock", "zombie", None)]);
                let applied = locks
                    .client()
                    .kv_client()
                    .txn(txn)
                    .await
                    .unwrap()
                    .succeeded();
                println!("write {}", if applied { "applied" } else { "rejected" });
            }
        }
    };
    tokio::join!(watcher, writer);
}

/// The holder is SIGSTOPped for 3× its lease. The next holder gets the lock with a larger
/// token, the zombie's fenced write is rejected by etcd, and its guard reports loss within
/// 1 s of SIGCONT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_holder_is_fenced_and_told() {
    let server = EtcdServer::shared();
    let mut child = ChildGuard(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "holder_child", "--nocapture", "--test-threads=1"])
            .env(HOLDER, server.endpoint())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let (lines_tx, lines) = std::sync::mpsc::channel::<(Instant, String)>();
    let stdout = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest may print "running 1 test" and "test holder_child ... " around ours.
            let line = line.trim_start_matches("test holder_child ... ").to_owned();
            let _ = lines_tx.send((Instant::now(), line));
        }
    });
    let next_line = |prefix: &str| loop {
        let (at, line) = lines
            .recv_timeout(Duration::from_secs(20))
            .expect("child output");
        if let Some(rest) = line.strip_prefix(prefix) {
            return (at, rest.trim().to_owned());
        }
    };
    let (_, zombie_token) = next_line("token ");
    let zombie_token = FencingToken::new(zombie_token.parse().unwrap());

    let pid = child.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let paused_at = Instant::now();
    let locks = EtcdLock::connect(config(vec![server.endpoint()], "faults-frozen"))
        .await
        .unwrap();
    let next = locks
        .acquire("stock", AcquireOptions::new().wait_timeout(LEASE * 5))
        .await
        .expect("the next holder gets the lock once the frozen holder's lease expires");
    assert!(next.token() > zombie_token);
    let remaining = (LEASE * 3).saturating_sub(paused_at.elapsed());
    tokio::time::sleep(remaining).await;

    assert!(
        Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let resumed_at = Instant::now();
    let (lost_at, _) = next_line("lost");
    assert!(
        lost_at.duration_since(resumed_at) < Duration::from_secs(1),
        "loss reported {:?} after SIGCONT",
        lost_at.duration_since(resumed_at)
    );
    writeln!(child.0.stdin.as_mut().unwrap(), "write").unwrap();
    let (_, outcome) = next_line("write ");
    assert_eq!(outcome, "rejected", "the zombie's write must be fenced off");
    next.release().await.unwrap();
    child.0.kill().unwrap();
    child.0.wait().unwrap();
}

/// Tokens are etcd revisions, which survive a restart: every token after it is larger
/// than every token before it, and a lock held across the restart is either kept or
/// reported lost, never silently shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_across_an_etcd_restart() {
    let server = EtcdServer::start();
    let locks = EtcdLock::connect(config(vec![server.endpoint()], "faults-restart"))
        .await
        .unwrap();
    let mut before = FencingToken::new(0);
    for _ in 0..20 {
        let guard = locks.lock("restart").await.unwrap();
        before = before.max(guard.token());
        guard.release().await.unwrap();
    }
    let held = locks.lock("held-across").await.unwrap();
    server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart();
    let after = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match locks
                .acquire(
                    "restart",
                    AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
                )
                .await
            {
                Ok(guard) => return guard,
                Err(e) => {
                    assert!(e.is_retryable(), "{e:?}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    })
    .await
    .expect("locks work again after the restart");
    assert!(
        after.token() > before,
        "{:?} after the restart, {before:?} before",
        after.token()
    );
    after.release().await.unwrap();
    // The guard held across the restart either survived with its session or reports loss;
    // while it claims the lock, another client cannot have it.
    let other = EtcdLock::connect(config(vec![server.endpoint()], "faults-restart"))
        .await
        .unwrap();
    if held.is_lost() {
        assert!(held.release().await.is_err());
    } else {
        let info = locks.inspect("held-across").await.unwrap();
        assert_eq!(info.holder.map(|h| h.token), Some(held.token()));
        assert!(
            other.try_lock("held-across").await.unwrap().is_none(),
            "shared: another client got a lock its holder still claims"
        );
        assert!(!held.is_lost(), "{:?}", held.lost_reason());
        held.release().await.unwrap();
    }

    // Across an outage of three leases the holder learns of the loss on its own timer,
    // and after the restart another client takes the lock over with a larger token.
    let long = locks.lock("held-long").await.unwrap();
    server.kill();
    tokio::time::timeout(LEASE * 2, long.lost())
        .await
        .expect("no loss reported while the server was down for longer than the lease");
    tokio::time::sleep(LEASE * 3).await;
    server.restart();
    let next = other
        .acquire("held-long", AcquireOptions::new().wait_timeout(LEASE * 5))
        .await
        .expect("another client takes over after the outage");
    assert!(
        next.token() > long.token(),
        "{:?} after {:?}",
        next.token(),
        long.token()
    );
    assert!(matches!(
        long.release().await,
        Err(fencelock_core::Error::Lost { .. })
    ));
    next.release().await.unwrap();
}

/// Three members, four clients contending on one name with a fenced register; the leader
/// is killed mid-way. No two holders overlap, no write is rejected, and grants continue
/// after the election.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_kill_during_contention_keeps_exclusion() {
    let cluster = EtcdCluster::start(3);
    let leader = cluster.wait_for_leader(Duration::from_secs(10));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let mut config = config(cluster.endpoints(), "faults-cluster");
        config.lease = Duration::from_secs(5);
        clients.push(EtcdLock::connect(config).await.unwrap());
    }
    let register = FencedRegister::new(0u64);
    let inside = AtomicUsize::new(0);
    let grants = AtomicU64::new(0);
    let grants_after_kill = AtomicU64::new(0);
    let killed = std::sync::atomic::AtomicBool::new(false);
    let errors = Mutex::new(Vec::new());
    let deadline = Instant::now() + Duration::from_secs(12);
    let work = clients.iter().map(|lock| async {
        while Instant::now() < deadline {
            let guard = match lock
                .acquire(
                    "contended",
                    AcquireOptions::new().wait_timeout(Duration::from_secs(3)),
                )
                .await
            {
                Ok(guard) => guard,
                Err(e) => {
                    errors.lock().unwrap().push(e.to_string());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            assert_eq!(
                inside.fetch_add(1, Ordering::SeqCst),
                0,
                "two holders at once"
            );
            let value = register.read();
            tokio::time::sleep(Duration::from_millis(2)).await;
            if !guard.is_lost() {
                register
                    .write(guard.token(), value + 1)
                    .expect("a valid holder was fenced off");
            }
            inside.fetch_sub(1, Ordering::SeqCst);
            grants.fetch_add(1, Ordering::SeqCst);
            if killed.load(Ordering::SeqCst) {
                grants_after_kill.fetch_add(1, Ordering::SeqCst);
            }
            let _ = guard.release().await;
        }
    });
    let chaos = async {
        while grants.load(Ordering::SeqCst) < 30 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        cluster.kill_member(leader);
        killed.store(true, Ordering::SeqCst);
    };
    tokio::join!(futures_util::future::join_all(work), chaos);
    assert_eq!(register.rejections(), 0);
    assert!(
        grants_after_kill.load(Ordering::SeqCst) > 10,
        "progress stalled after the leader died; errors: {:?}",
        errors.lock().unwrap()
    );
    let new_leader = cluster.wait_for_leader(Duration::from_secs(10));
    assert_ne!(new_leader, leader);
}

/// A combined release of the group commit whose answer is lost after etcd applied it
/// (the connection breaks while the reply is on its way) must not report `Lost`: the
/// keys are gone because our own delete went through. Each release answers with an
/// `Unavailable` error (the outcome is unknown to the client) instead, and nothing is
/// left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_to_a_combined_release_is_not_reported_as_loss() {
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("combined-release-{:x}", std::process::id());
    let locks = EtcdLock::connect(EtcdConfig {
        endpoints: vec![proxy.addr()],
        prefix: prefix.clone(),
        ..EtcdConfig::default()
    })
    .await
    .unwrap();
    let names = ["a", "b", "c", "d", "e"];
    let mut guards = Vec::new();
    for name in names {
        guards.push(locks.lock(name).await.unwrap());
    }
    let delay = Duration::from_millis(300);
    proxy.set(Fault::Delay {
        min: delay,
        max: delay,
    });
    let mut guards = guards.into_iter();
    // The first release goes out alone and occupies the lane for a round trip; the
    // others queue and go out together as soon as it is answered.
    let first = tokio::spawn(guards.next().unwrap().release());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let rest: Vec<_> = guards.map(|g| tokio::spawn(g.release())).collect();
    first.await.unwrap().unwrap();
    // The combined request went out as the first was answered. Once etcd has applied
    // it (the keys are gone), its answer is in the proxy for a delay: cut it there.
    let direct = EtcdLock::connect(EtcdConfig {
        endpoints: vec![server.endpoint()],
        prefix: prefix.clone(),
        ..EtcdConfig::default()
    })
    .await
    .unwrap();
    let under = format!("{prefix}/");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = direct
            .client()
            .kv_client()
            .get(
                under.as_str(),
                Some(
                    etcd_client::GetOptions::new()
                        .with_prefix()
                        .with_count_only(),
                ),
            )
            .await
            .unwrap()
            .count();
        if left == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the combined release never arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.set(Fault::Pass);
    proxy.reset_connections();
    for release in rest {
        let outcome = release.await.unwrap();
        assert!(
            !matches!(outcome, Err(fencelock_core::Error::Lost { .. })),
            "a released lock was reported lost: {outcome:?}"
        );
    }
    // Nothing is left.
    for name in names {
        let guard = direct.try_lock(name).await.unwrap().expect("free");
        guard.release().await.unwrap();
    }
}

/// A release retried after one that could not be confirmed (the server unreachable) is
/// not reported as a loss: the first left its delete to the background, which finishes
/// once etcd is reachable again, and the name is then free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_release_after_an_unconfirmed_one_is_not_a_loss() {
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("retried-release-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        cleanup_timeout: Duration::from_millis(300),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config(proxy.addr())).await.unwrap();
    let guard = locks.lock("x").await.unwrap();
    proxy.set(Fault::Blackhole);
    let first = guard.held().release().await;
    assert!(
        matches!(first, Err(fencelock_core::Error::Unavailable { .. })),
        "{first:?}"
    );
    let retried = guard.held().release().await;
    assert!(
        !matches!(retried, Err(fencelock_core::Error::Lost { .. })),
        "a retried release was reported as a loss: {retried:?}"
    );
    proxy.set(Fault::Pass);
    drop(guard);
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let next = direct
        .acquire(
            "x",
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("the background delete frees the name");
    next.release().await.unwrap();
}

/// A grant confirmed only after its lease ran out (replies slower than the lease) is not
/// handed out as an already-expired guard: the acquire fails with a retryable error and
/// its key is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_confirmed_after_its_lease_ran_out_is_an_error() {
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("late-grant-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config(proxy.addr())).await.unwrap();
    let delay = Duration::from_millis(400);
    proxy.set(Fault::Delay {
        min: delay,
        max: delay,
    });
    let outcome = locks
        .acquire(
            "x",
            AcquireOptions::new()
                .fixed_lease(Duration::from_secs(2))
                .no_wait(),
        )
        .await;
    assert!(
        matches!(&outcome, Err(e) if e.is_retryable()),
        "{:?}",
        outcome.map(|g| (g.is_lost(), g.token()))
    );
    proxy.set(Fault::Pass);
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let next = direct
        .acquire(
            "x",
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("nothing of the late grant blocks the name");
    next.release().await.unwrap();
}

/// Keepalive answers slower than a third of the lease (a slow network: etcd renews the
/// lease on each request as it arrives) keep the lock. Each request's answer used to be
/// awaited for a third of the lease only, its stream dropped with the answer still on
/// the way, and the guard lost at its deadline though etcd held the key all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_answers_slower_than_a_third_of_the_lease_keep_the_lock() {
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("slow-keepalive-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        lease: Duration::from_secs(3),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config(proxy.addr())).await.unwrap();
    let guard = locks.lock("x").await.unwrap();
    proxy.set(Fault::DelayReplies(Duration::from_millis(1200)));
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        !guard.is_lost(),
        "lost though etcd renewed the lease: {:?}",
        guard.lost_reason()
    );
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let info = direct.inspect("x").await.unwrap();
    assert!(info.holder.is_some(), "{info:?}");
    proxy.set(Fault::Pass);
    guard.release().await.unwrap();
}

/// A 2 s session granted over a ~550 ms round trip keeps its lock: the keepalive
/// stream's opening renews the lease (it sends a keepalive and waits for the answer), so
/// it is credited from the instant it was begun, and the first renewal follows a third
/// of the lease after that instant. The opening used to be ignored and the first
/// renewal sent a third of the lease after the stream opened, ~1.8 s after the grant
/// was sent: its answer came after the deadline (grant + 1.93 s) and the guard was lost
/// at once, although etcd held the lease until ~2.5 s and later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_granted_over_a_slow_link_keeps_its_lock() {
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("slow-grant-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        lease: Duration::from_secs(2),
        ..EtcdConfig::default()
    };
    // Every answer, the session grant's (in connect) and the stream opening's included,
    // arrives 550 ms late.
    proxy.set(Fault::DelayReplies(Duration::from_millis(550)));
    let locks = EtcdLock::connect(config(proxy.addr())).await.unwrap();
    let guard = locks.lock("x").await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !guard.is_lost(),
        "lost though etcd renewed the lease: {:?}",
        guard.lost_reason()
    );
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let info = direct.inspect("x").await.unwrap();
    assert_eq!(info.holder.map(|h| h.token), Some(guard.token()));
    proxy.set(Fault::Pass);
    guard.release().await.unwrap();
}

/// A cancelled acquire whose create is still on its way (held in a partition, queued
/// behind another create in the batcher's lane) leaves no key: the clean-up deletes by
/// name when the create does not answer in time, and then the incarnation the create
/// made if etcd applied it after that deletion. That key used to stay on the session
/// lease, first under the name: a holder nobody holds, for as long as the client lived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_applied_after_its_cancelled_acquire_was_cleaned_up_leaves_no_key() {
    use etcd_client::GetOptions;
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("late-create-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        lease: Duration::from_secs(10),
        cleanup_timeout: Duration::from_secs(1),
        ..EtcdConfig::default()
    };
    let locks = std::sync::Arc::new(EtcdLock::connect(config(proxy.addr())).await.unwrap());
    // The session exists before the partition: the creates below are what is held up.
    locks
        .lock("warm-up")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    proxy.set(Fault::Blackhole);
    let other = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock("other").await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let cancelled = tokio::spawn({
        let locks = locks.clone();
        async move { locks.lock("x").await.map(drop) }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    cancelled.abort();
    // The clean-up waits its second for the create, then deletes by name (held up too).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    proxy.set(Fault::Pass);
    let other = other.await.unwrap().unwrap();
    other.release().await.unwrap();

    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let next = direct
        .acquire(
            "x",
            AcquireOptions::new().wait_timeout(Duration::from_secs(4)),
        )
        .await
        .expect("no key of the cancelled acquire holds the name");
    next.release().await.unwrap();
    let left = direct
        .client()
        .kv_client()
        .get(
            format!("{prefix}/"),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await
        .unwrap();
    assert!(left.kvs().is_empty(), "{:?}", left.kvs());
}

/// An extension whose lease grant is applied but answered too late leaves no lease
/// behind: the new lease's ID is chosen before the request and revoked when the grant
/// times out. It used to live out its TTL (here 97 s; up to a year) unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_granted_too_late_leaves_no_lease() {
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("late-extend-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        cleanup_timeout: Duration::from_secs(1),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config(proxy.addr())).await.unwrap();
    let guard = locks
        .acquire(
            "x",
            AcquireOptions::new()
                .fixed_lease(Duration::from_secs(5))
                .no_wait(),
        )
        .await
        .unwrap();
    proxy.set(Fault::DelayReplies(Duration::from_millis(1_500)));
    let extended = guard.extend(Duration::from_secs(97)).await;
    assert!(extended.is_err(), "{extended:?}");
    proxy.set(Fault::Pass);
    // What etcd holds: no lease granted for 97 s (the revoke goes on in the background).
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let mut client = direct.client().clone();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut left = Vec::new();
        for lease in client.leases().await.unwrap().leases() {
            let ttl = client.lease_time_to_live(lease.id(), None).await.unwrap();
            if ttl.granted_ttl() == 97 {
                left.push(lease.id());
            }
        }
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the extension's lease was left: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = guard.release().await;
}

/// A fixed-lease guard behind a proxy whose replies are held `delay`, and a direct
/// client on the same prefix.
async fn slow_fixed_guard(
    prefix: &str,
    delay: Duration,
) -> (
    fencelock_testkit::FaultProxy,
    EtcdLock,
    fencelock_core::LockGuard,
) {
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let locks = EtcdLock::connect(EtcdConfig {
        endpoints: vec![proxy.addr()],
        prefix: prefix.to_owned(),
        ..EtcdConfig::default()
    })
    .await
    .unwrap();
    let guard = locks
        .acquire(
            "x",
            AcquireOptions::new()
                .fixed_lease(Duration::from_secs(5))
                .no_wait(),
        )
        .await
        .unwrap();
    proxy.set(Fault::DelayReplies(delay));
    let direct = EtcdLock::connect(EtcdConfig {
        endpoints: vec![server.endpoint()],
        prefix: prefix.to_owned(),
        ..EtcdConfig::default()
    })
    .await
    .unwrap();
    (proxy, direct, guard)
}

/// Whether `guard`'s key is still in etcd, read through `direct`.
async fn still_held(direct: &EtcdLock, guard: &fencelock_core::LockGuard) -> bool {
    let info = direct.inspect("x").await.unwrap();
    info.holder.map(|h| h.token) == Some(guard.token())
}

/// An extend retried after a dropped one (a caller's timeout) is not a loss: the
/// dropped one goes on in its own task and moves the key onto its lease. The retry used
/// to read the same "current" lease, move the key from it, find it moved already, and
/// report the lock lost, whose clean-up then deleted the validly held key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extend_retried_after_a_dropped_one_is_not_a_loss() {
    use fencelock_testkit::Fault;
    let prefix = format!("retried-extend-{:x}", std::process::id());
    let (proxy, direct, guard) = slow_fixed_guard(&prefix, Duration::from_millis(300)).await;
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        guard.extend(Duration::from_secs(30)),
    )
    .await;
    assert!(
        dropped.is_err(),
        "the first extend was meant to be cut short"
    );
    let retried = guard.extend(Duration::from_secs(40)).await;
    proxy.set(Fault::Pass);
    assert!(retried.is_ok(), "{retried:?}");
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    assert!(
        still_held(&direct, &guard).await,
        "the held key was deleted"
    );
    guard.release().await.unwrap();
}

/// Two extends of one guard at once are never a loss: they take turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_extends_at_once_are_not_a_loss() {
    use fencelock_testkit::Fault;
    let prefix = format!("concurrent-extend-{:x}", std::process::id());
    let (proxy, direct, guard) = slow_fixed_guard(&prefix, Duration::from_millis(200)).await;
    let (first, second) = tokio::join!(
        guard.extend(Duration::from_secs(30)),
        guard.extend(Duration::from_secs(40))
    );
    proxy.set(Fault::Pass);
    for outcome in [&first, &second] {
        assert!(
            !matches!(outcome, Err(fencelock_core::Error::Lost { .. })),
            "an extend reported a held lock lost: {first:?} {second:?}"
        );
    }
    assert!(first.is_ok() && second.is_ok(), "{first:?} {second:?}");
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    assert!(
        still_held(&direct, &guard).await,
        "the held key was deleted"
    );
    guard.release().await.unwrap();
}

/// etcd's conservative end of a lease of `ttl` from a request sent at `sent`: minus the
/// drift margin (1 % of the lease plus 50 ms).
fn conservative_end(sent: tokio::time::Instant, ttl: Duration) -> tokio::time::Instant {
    sent + ttl - (ttl / 100 + Duration::from_millis(50))
}

/// A guard on a 100 s fixed lease through a proxy (passing everything), a direct
/// client on the same prefix, and the lease the guard's key is on. Requests time out
/// after 1 s.
async fn long_fixed_guard(
    prefix: &str,
) -> (
    fencelock_testkit::FaultProxy,
    EtcdLock,
    fencelock_core::LockGuard,
    i64,
) {
    let server = EtcdServer::shared();
    let proxy = fencelock_testkit::FaultProxy::start(&server.endpoint());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.to_owned(),
        cleanup_timeout: Duration::from_secs(1),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config(proxy.addr())).await.unwrap();
    let options = AcquireOptions::new()
        .fixed_lease(Duration::from_secs(100))
        .no_wait();
    let guard = locks.acquire("x", options).await.unwrap();
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let lease = lease_of(&direct, &guard).await.expect("the guard's key");
    (proxy, direct, guard, lease)
}

/// The lease `guard`'s key is on in etcd, read through `direct` (`None`: gone).
async fn lease_of(direct: &EtcdLock, guard: &fencelock_core::LockGuard) -> Option<i64> {
    let key = guard.backend_key().unwrap();
    let read = direct.client().kv_client().get(key, None).await.unwrap();
    read.kvs()
        .first()
        .filter(|kv| kv.create_revision() as u64 == guard.token().get())
        .map(|kv| kv.lease())
}

/// Waits (3 s at most) until `guard`'s key is on another lease than `old`; returns an
/// instant after etcd applied the move, so after the request that granted the new lease
/// was sent.
async fn moved_from(
    direct: &EtcdLock,
    guard: &fencelock_core::LockGuard,
    old: i64,
) -> tokio::time::Instant {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        let lease = lease_of(direct, guard).await;
        if lease.is_some_and(|lease| lease != old) {
            return tokio::time::Instant::now();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the key was never moved: {lease:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An extend dropped after it sent its requests (a caller's timeout) goes on in its own
/// task and moves the key onto its lease; the guard's deadline then follows that lease,
/// also when it ends earlier than the old one (a 99 s lease right after a 100 s one:
/// the conservative ends are about a second apart). The deadline used to stay where it
/// was, up to one drift margin past the conservative end of the lease the key is on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_extend_that_moved_the_key_sets_the_deadline() {
    use fencelock_testkit::Fault;
    let prefix = format!("dropped-shorter-{:x}", std::process::id());
    let (proxy, direct, guard, old) = long_fixed_guard(&prefix).await;
    let lease = Duration::from_secs(99);
    proxy.set(Fault::DelayReplies(Duration::from_millis(100)));
    let asked = tokio::time::Instant::now();
    let dropped = tokio::time::timeout(Duration::from_millis(20), guard.extend(lease)).await;
    assert!(dropped.is_err(), "the extend was meant to be cut short");
    let moved = moved_from(&direct, &guard, old).await;
    // The old lease is revoked once the move is answered (and the extension done).
    let mut client = direct.client().clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while client.lease_time_to_live(old, None).await.unwrap().ttl() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the old lease was never revoked"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.set(Fault::Pass);
    let end = conservative_end(moved, lease);
    let valid_until = guard.valid_until();
    assert!(
        valid_until <= end,
        "the guard's deadline is {:?} past the conservative end of the lease its key is on",
        valid_until - end
    );
    assert!(valid_until >= conservative_end(asked, lease));
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    guard.release().await.unwrap();
}

/// A release while a dropped extend's task still waits for its move's answer: the task
/// then finds the clean-up taken (or the key deleted) and must not call that a loss:
/// the holder released, nothing was lost, and its `lost_token` must not fire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_during_a_dropped_extends_move_is_no_loss() {
    use fencelock_testkit::Fault;
    let prefix = format!("release-during-move-{:x}", std::process::id());
    let (proxy, direct, guard, old) = long_fixed_guard(&prefix).await;
    proxy.set(Fault::DelayReplies(Duration::from_millis(200)));
    let dropped = tokio::time::timeout(
        Duration::from_millis(20),
        guard.extend(Duration::from_secs(99)),
    )
    .await;
    assert!(dropped.is_err(), "the extend was meant to be cut short");
    let lost = guard.lost_token();
    // The move is applied; its answer is 200 ms away. Release now.
    moved_from(&direct, &guard, old).await;
    guard.release().await.unwrap();
    proxy.set(Fault::Pass);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        !lost.is_cancelled(),
        "a release was reported as a loss to the holder"
    );
}

/// An extend whose move is applied but never answered (the link goes dark with the
/// answer on its way), nor can a read say where the key is: the key may be on the new,
/// shorter lease, and the guard's deadline comes down to its conservative end. It used
/// to stay where it was, up to one drift margin past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfirmed_move_onto_a_shorter_lease_lowers_the_deadline() {
    use fencelock_testkit::Fault;
    let prefix = format!("unconfirmed-shorter-{:x}", std::process::id());
    let (proxy, direct, guard, old) = long_fixed_guard(&prefix).await;
    let lease = Duration::from_secs(99);
    // The grant is answered 300 ms late; the move's answer, due 300 ms after etcd
    // applied it, is held by the partition set as soon as the move is seen.
    proxy.set(Fault::DelayReplies(Duration::from_millis(300)));
    let asked = tokio::time::Instant::now();
    let (extended, moved) = tokio::join!(guard.extend(lease), async {
        let moved = moved_from(&direct, &guard, old).await;
        proxy.set(Fault::Blackhole);
        moved
    });
    proxy.set(Fault::Pass);
    assert!(
        extended
            .as_ref()
            .is_err_and(|e| !matches!(e, fencelock_core::Error::Lost { .. })),
        "{extended:?}"
    );
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    let end = conservative_end(moved, lease);
    let valid_until = guard.valid_until();
    assert!(
        valid_until <= end,
        "the guard's deadline is {:?} past the conservative end of the lease its key may be on",
        valid_until - end
    );
    assert!(valid_until >= conservative_end(asked, lease));
    guard.release().await.unwrap();
}

/// An extend dropped after it sent its grant, whose task then finds the key moved onto
/// a lease none of ours (an operator's put) and so gives the lock up as lost: the guard
/// reports the loss, as it does when the call is awaited. Only the call marked it, so a
/// dropped one left the guard valid until its old deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_extend_that_finds_the_key_on_a_foreign_lease_reports_the_loss() {
    use etcd_client::PutOptions;
    use fencelock_testkit::Fault;
    let prefix = format!("dropped-foreign-{:x}", std::process::id());
    let (proxy, direct, guard, _) = long_fixed_guard(&prefix).await;
    proxy.set(Fault::DelayReplies(Duration::from_millis(200)));
    let dropped = tokio::time::timeout(
        Duration::from_millis(20),
        guard.extend(Duration::from_secs(99)),
    )
    .await;
    assert!(dropped.is_err(), "the extend was meant to be cut short");
    // Before the move is sent (after the grant's answer, held 200 ms).
    let mut client = direct.client().clone();
    let foreign = client.lease_grant(60, None).await.unwrap().id();
    let options = PutOptions::new().with_lease(foreign).with_ignore_value();
    let key = guard.backend_key().unwrap().to_owned();
    client.put(key, "", Some(options)).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while !guard.is_lost() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.set(Fault::Pass);
    let lost = guard.is_lost();
    let _ = client.lease_revoke(foreign).await;
    assert!(
        lost,
        "the guard was not told its extension found the lock lost"
    );
}

/// The IDs of the leases etcd holds that were granted for `ttl`.
async fn leases_granted_for(client: &etcd_client::Client, ttl: i64) -> Vec<i64> {
    let mut client = client.clone();
    let mut found = Vec::new();
    for lease in client.leases().await.unwrap().leases() {
        let live = client.lease_time_to_live(lease.id(), None).await.unwrap();
        if live.granted_ttl() == ttl {
            found.push(lease.id());
        }
    }
    found
}

/// A fixed-lease try polled inside the client's runtime and dropped outside any runtime
/// while its lease grant is on its way leaves no lease: its revoke runs on the client's
/// runtime. It used to look for the current runtime, find none and skip the revoke,
/// leaving a keyless lease to live out its TTL (here 10 min; up to a year).
#[test]
fn an_acquire_dropped_outside_a_runtime_leaves_no_lease() {
    use fencelock_testkit::{Fault, FaultProxy};
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("dropped-outside-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        ..EtcdConfig::default()
    };
    let (locks, direct) = runtime.block_on(async {
        (
            EtcdLock::connect(config(proxy.addr())).await.unwrap(),
            EtcdLock::connect(config(server.endpoint())).await.unwrap(),
        )
    });
    // A TTL nothing else here uses.
    let ttl = 613;
    let before = runtime.block_on(leases_granted_for(direct.client(), ttl));
    let options = AcquireOptions::new()
        .fixed_lease(Duration::from_secs(ttl as u64))
        .no_wait();
    let mut acquire = Box::pin(locks.acquire("x", options));
    proxy.set(Fault::DelayReplies(Duration::from_millis(300)));
    runtime.block_on(async {
        let polled = tokio::time::timeout(Duration::from_millis(50), &mut acquire).await;
        assert!(polled.is_err(), "the grant was meant to be on its way");
    });
    // Outside any runtime.
    drop(acquire);
    proxy.set(Fault::Pass);
    runtime.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        loop {
            let mut left = leases_granted_for(direct.client(), ttl).await;
            left.retain(|lease| !before.contains(lease));
            if left.is_empty() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the dropped acquire's lease was left: {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// A `close` dropped while its first revoke is on its way still ends every session: all
/// were marked lost before it, and their revokes (and the fixed leases') go on in the
/// background, so every name is free soon after. The sessions after the first used to
/// stay alive and renewed, their guards valid, while a retried `close` said `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_close_still_ends_every_session() {
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("dropped-close-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        lease: Duration::from_secs(2),
        ..EtcdConfig::default()
    };
    let locks = EtcdLock::connect(config(proxy.addr())).await.unwrap();
    let names = ["two", "three", "fixed"];
    let guards = [
        locks.lock(names[0]).await.unwrap(),
        locks
            .acquire(
                names[1],
                AcquireOptions::new().lease(Duration::from_secs(3)),
            )
            .await
            .unwrap(),
        locks
            .acquire(
                names[2],
                AcquireOptions::new()
                    .fixed_lease(Duration::from_secs(60))
                    .no_wait(),
            )
            .await
            .unwrap(),
    ];
    proxy.set(Fault::DelayReplies(Duration::from_millis(500)));
    let dropped = tokio::time::timeout(Duration::from_millis(200), locks.close()).await;
    assert!(dropped.is_err(), "the close was meant to be cut short");
    proxy.set(Fault::Pass);
    let _ = locks.close().await;
    for (name, guard) in names.iter().zip(&guards) {
        assert!(guard.is_lost(), "{name}: still valid after close");
    }
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    for name in names {
        let next = direct
            .acquire(
                name,
                AcquireOptions::new().wait_timeout(Duration::from_secs(2)),
            )
            .await
            .unwrap_or_else(|e| panic!("{name}: still held after close: {e}"));
        next.release().await.unwrap();
    }
}

/// A combined create of the group commit whose answer is lost after etcd applied it is
/// answered to each caller as an error whose outcome is unknown (retryable), not sent
/// again: a create sent again could be answered, and its key released, before etcd
/// applies a combined create held up in it, which would then make keys nobody holds.
/// (Sent again here, each found its own key and reported the free name as taken.) The
/// clean-ups delete the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_answer_to_a_combined_create_is_an_unknown_outcome() {
    use etcd_client::GetOptions;
    use fencelock_testkit::{Fault, FaultProxy};
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("combined-create-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        ..EtcdConfig::default()
    };
    let locks = std::sync::Arc::new(EtcdLock::connect(config(proxy.addr())).await.unwrap());
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let delay = Duration::from_millis(300);
    proxy.set(Fault::Delay {
        min: delay,
        max: delay,
    });
    // The first create goes out alone and occupies the lane for a round trip; the
    // others queue and go out together as soon as it is answered.
    let try_lock = |name: &'static str| {
        let locks = locks.clone();
        tokio::spawn(async move { locks.try_lock(name).await })
    };
    let first = try_lock("a");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let names = ["b", "c", "d", "e"];
    let rest: Vec<_> = names.iter().map(|&name| try_lock(name)).collect();
    // Once etcd has applied the combined create (all five keys exist), its answer is
    // in the proxy for a delay: cut it there.
    let under = format!("{prefix}/");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let made = direct
            .client()
            .kv_client()
            .get(
                under.as_str(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            )
            .await
            .unwrap()
            .count();
        if made == 5 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the combined create never arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.set(Fault::Pass);
    proxy.reset_connections();
    let first = first.await.unwrap().unwrap();
    assert!(first.is_some(), "the lone create was granted");
    for (name, outcome) in names.iter().zip(rest) {
        let outcome = outcome.await.unwrap().map(|g| g.is_some());
        assert!(
            matches!(&outcome, Err(e) if e.is_retryable()),
            "{name}: {outcome:?}"
        );
    }
    // Nothing of the combined create is left.
    for name in names {
        let next = direct
            .acquire(
                name,
                AcquireOptions::new().wait_timeout(Duration::from_secs(2)),
            )
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        next.release().await.unwrap();
    }
}

/// A move of the key onto an extension's lease whose outcome is unknown (its connection
/// broke with the request on its way) while a read still finds the key on the old lease
/// keeps that lease: etcd may still apply the move. The move is held in a partition,
/// its connection reset (it never arrives here), and its late application is played by
/// a direct client. The extension's lease used to be revoked at once, so a move applied
/// late left the key on a revoked lease: deleted, and the held lock lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_whose_outcome_is_unknown_keeps_its_lease() {
    use etcd_client::{Compare, CompareOp, PutOptions};
    use fencelock_testkit::{Fault, FaultProxy};
    /// The client's own runtime, one worker: held up (blocked) while the grant's answer
    /// waits in its socket, so that the move it sends then meets the partition.
    struct Paused(Option<tokio::runtime::Runtime>);
    impl Drop for Paused {
        fn drop(&mut self) {
            if let Some(runtime) = self.0.take() {
                runtime.shutdown_background();
            }
        }
    }
    let paused = Paused(Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    ));
    let runtime = paused.0.as_ref().unwrap().handle().clone();
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = format!("unknown-move-{:x}", std::process::id());
    let config = |endpoint: String| EtcdConfig {
        endpoints: vec![endpoint],
        prefix: prefix.clone(),
        cleanup_timeout: Duration::from_secs(1),
        ..EtcdConfig::default()
    };
    let direct = EtcdLock::connect(config(server.endpoint())).await.unwrap();
    let connecting = config(proxy.addr());
    let (locks, guard) = runtime
        .spawn(async move {
            let locks = EtcdLock::connect(connecting).await.unwrap();
            let options = AcquireOptions::new()
                .fixed_lease(Duration::from_secs(5))
                .no_wait();
            let guard = locks.acquire("x", options).await.unwrap();
            (locks, std::sync::Arc::new(guard))
        })
        .await
        .unwrap();
    let valid_until = guard.valid_until();
    // The guard's key watch starts (50 ms on) before the faults: nothing else is sent.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A TTL nothing else here uses.
    let ttl = 71;
    // The grant goes through at once and is answered 300 ms later, while the client is
    // held up; the partition is set before the client reads the answer and sends the
    // move.
    proxy.set(Fault::DelayReplies(Duration::from_millis(300)));
    let extend = {
        let guard = guard.clone();
        runtime.spawn(async move { guard.extend(Duration::from_secs(ttl as u64)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    runtime.spawn(async { std::thread::sleep(Duration::from_millis(400)) });
    tokio::time::sleep(Duration::from_millis(250)).await;
    proxy.set(Fault::Blackhole);
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(!extend.is_finished(), "the move was meant to be held");
    proxy.reset_connections();
    proxy.set(Fault::Pass);
    let extended = extend.await.unwrap();
    // The grant was answered; the move was not.
    assert!(
        extended
            .as_ref()
            .is_err_and(|e| !e.to_string().contains("granting")),
        "{extended:?}"
    );
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    assert_eq!(
        guard.valid_until(),
        valid_until,
        "an unconfirmed move set a deadline"
    );
    // etcd applies the move late: the key onto the extension's lease.
    let new = leases_granted_for(direct.client(), ttl).await;
    assert_eq!(
        new.len(),
        1,
        "the extension's lease was revoked: {extended:?}"
    );
    let key = guard.backend_key().unwrap().to_owned();
    let revision = guard.token().get() as i64;
    let late = Txn::new()
        .when([Compare::create_revision(
            key.as_str(),
            CompareOp::Equal,
            revision,
        )])
        .and_then([TxnOp::put(
            key.as_str(),
            "",
            Some(PutOptions::new().with_lease(new[0]).with_ignore_value()),
        )]);
    let applied = direct.client().kv_client().txn(late).await;
    assert!(
        applied.as_ref().is_ok_and(|a| a.succeeded()),
        "the late move failed: {applied:?}"
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
    assert!(
        still_held(&direct, &guard).await,
        "the held key was deleted"
    );
    let guard = std::sync::Arc::try_unwrap(guard).ok().unwrap();
    guard.release().await.unwrap();
    drop(locks);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        let left = leases_granted_for(direct.client(), ttl).await;
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the extension's lease was left: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
