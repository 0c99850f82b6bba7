//! F10 and F11, faults of the waiters in a lock's queue, on etcd, ZooKeeper, Redis,
//! Redlock and the migration layer.
//!
//! - F10, a waiter partitioned while queued (its connections blackholed by a
//!   [`FaultProxy`] for 3 × the lease, then healed) while the holder keeps the lock:
//!   - etcd: its session lease can no longer be renewed, and the waiter returns
//!     `Err(Lost)` on its own timer, before the heal, no later than the lease + 250 ms
//!     after the partition; never `Ok`. Also with the lease revoked by an etcd client
//!     right before the holder releases: `Err(Lost)`, never `Ok` (etcd #11456).
//!   - ZooKeeper: its session expires on the server while it is cut off; the waiter
//!     returns `Err(Lost)` before the heal, when its client gives the session up (7/5 of
//!     the session timeout after it last heard from the server, checked between
//!     connection attempts of up to 2/5 of it), + 250 ms; never `Ok`.
//!   - Redis (single, Sentinel, Cluster) and Redlock have no queue and no waiter
//!     session: the partitioned waiter is never granted while the holder holds. Sentinel
//!     and Cluster servers announce their proxies (testkit's `start_behind_proxy` and
//!     `start_behind_proxies`); the holder's and the next waiter's connections are
//!     exempted from the fault before the waiter connects.
//!   - Migration (target-first, etcd first): as etcd.
//!
//!   Then the holder releases and the next waiter, queued after the heal, is granted
//!   within 1 s; no two holders overlap (C1) and tokens grow (C4); nothing of the
//!   partitioned waiter is left.
//! - F11, a middle waiter killed: the holder holds, V waits, N waits behind V; V's
//!   process (a child: this test binary re-run with `FENCELOCK_QUEUE_WAITER` set) is
//!   killed with SIGKILL. N is not granted while the holder holds (C1), V is never
//!   granted, and:
//!   - when the holder releases after V's lease or session has run out, N is granted
//!     within 1 s of the release;
//!   - when the holder releases at once, V's key (etcd) or node (ZooKeeper) still
//!     stands first in the queue, as it would for a live waiter that is about to be
//!     granted: N is granted once V's lease or session expires, within that bound of
//!     the kill (etcd: lease + 500 ms, its lessor's expiry round; ZooKeeper: session
//!     timeout + 2 ticks), plus 1 s.
//!   - Redis (single, Sentinel, Cluster) and Redlock (no queue): N is granted within
//!     1 s of the release.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error, MigrationPhase};
use fencelock_testkit::checker::{Checker, LOSS_BOUND};
use fencelock_testkit::{
    EtcdServer, Fault, FaultProxy, RedisCluster, RedisSentinelSet, RedisServer, ZkServer,
};
use tokio::time::Instant;

mod common;
use common::{Proxied, Servers};

/// The lease (etcd, Redis) and session timeout (ZooKeeper) of every client.
const LEASE: Duration = Duration::from_secs(2);
/// How long the waiter stays partitioned in F10: 3 × the lease.
const PARTITION: Duration = Duration::from_secs(6);
/// How soon the next waiter must be granted after the holder's release.
const HAND_OVER: Duration = Duration::from_secs(1);
/// ZooKeeper's `tickTime` in the testkit's servers, in milliseconds.
const ZK_TICK_MS: u64 = 500;
/// Set in the child process that plays the waiter to be killed: `URL|NAME`.
const WAITER_ENV: &str = "FENCELOCK_QUEUE_WAITER";

fn unique(name: &str) -> String {
    common::unique(&format!("q-{name}"))
}

/// How a backend keeps its waiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queue {
    /// etcd: one key per waiter, on the waiter's session lease; `inspect` counts them.
    Etcd,
    /// ZooKeeper: one ephemeral node per waiter, in the waiter's session; `inspect`
    /// counts them.
    ZooKeeper,
    /// Redis and Redlock: no queue; waiters retry on the unlock channel.
    None,
}

impl Queue {
    /// Waits until `lock` sees at least `waiters` waiters on `name` (for backends
    /// without a queue, a fixed pause long enough for a first try and a subscription).
    async fn wait_for_waiters(self, lock: &dyn DistributedLock, name: &str, waiters: usize) {
        if self == Queue::None {
            tokio::time::sleep(Duration::from_millis(500)).await;
            return;
        }
        let started = Instant::now();
        loop {
            match lock.inspect(name).await {
                Ok(info) if info.waiters >= Some(waiters) => return,
                _ => {}
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{waiters} waiter(s) never queued on {name}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Asserts that the `which` waiter's acquire ended with [`Error::Lost`], `after` the
/// `event` that took its key or session, within `bound` of it.
fn assert_told_lost<T: std::fmt::Debug>(
    which: &str,
    outcome: &Result<T, Error>,
    event: &str,
    after: Duration,
    bound: Duration,
) {
    assert!(
        matches!(outcome, Err(Error::Lost { .. })),
        "the {which} waiter: {outcome:?}"
    );
    assert!(
        after <= bound,
        "the {which} waiter was told {after:?} after the {event} (bound {bound:?})"
    );
}

/// Waits until `name` is free and (where the backend counts them) has no waiters, and
/// nothing of the scenario is left on the servers (C5).
async fn assert_clean(
    lock: &dyn DistributedLock,
    name: &str,
    within: Duration,
    servers: &Servers<'_>,
) {
    let deadline = Instant::now() + within;
    loop {
        let info = lock.inspect(name).await.expect("inspect");
        if !info.is_held() && matches!(info.waiters, None | Some(0)) {
            break;
        }
        assert!(Instant::now() < deadline, "left behind on {name}: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    servers.assert_nothing_left_within(name, within);
}

fn options() -> AcquireOptions {
    AcquireOptions::new().lease(LEASE)
}

/// What the partitioned waiter must end with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WaiterEnd {
    /// `Err(Lost)`, before the heal, at most this long after the partition.
    Lost(Duration),
    /// Anything but a grant while the holder holds.
    NotGrantedWhileHeld,
}

/// etcd: the waiter's session has a local deadline, at most the lease after the last
/// keepalive sent before the partition; 250 ms of slack, as for a guard (C6).
const ETCD_WAITER_LOST: Duration = Duration::from_millis(2000 + 250);
/// ZooKeeper: the waiter learns that its session is gone from its client, which
/// expires a session it cannot reconnect after 7/5 of the session timeout since it
/// last heard from the server (`zookeeper-client`). It checks that deadline between
/// connection attempts, and an attempt to a server that accepts the connection but never
/// answers (the blackholed proxy) lasts up to its connection timeout, 2/5 of the session
/// timeout: so up to 9/5 of it; 250 ms of slack. (One run in 10 measured 3.57 s, past
/// the 7/5 + 250 ms this bound first had.)
const ZK_WAITER_LOST: Duration = Duration::from_millis(2000 * 9 / 5 + 250);

/// F10: `holder` holds `name`; `waiter` (connected through `proxies`) queues and is
/// partitioned for [`PARTITION`]; after the heal `next` queues and the holder
/// releases.
#[allow(clippy::too_many_arguments)] // the scenario's parts, each named at the call
async fn partitioned_waiter(
    holder: &dyn DistributedLock,
    waiter: &dyn DistributedLock,
    next: &dyn DistributedLock,
    proxies: &[&FaultProxy],
    queue: Queue,
    name: &str,
    end: WaiterEnd,
    servers: &Servers<'_>,
) {
    let checker = Checker::new();
    let held = holder
        .acquire(name, options().no_wait())
        .await
        .expect("holder acquires");
    let held_token = held.token().get();
    checker.enter("holder", held_token);
    let released_at = OnceLock::<Instant>::new();

    let waiting = async {
        let result = waiter
            .acquire(
                name,
                options().wait_timeout(PARTITION + Duration::from_secs(10)),
            )
            .await;
        let at = Instant::now();
        if let Ok(guard) = &result {
            // Only a backend without a queue may grant it, and only after the release.
            checker.enter("waiter", guard.token().get());
            tokio::time::sleep(Duration::from_millis(50)).await;
            checker.exit("waiter", guard.token().get());
        }
        let outcome = match result {
            Ok(guard) => {
                let _ = guard.release().await;
                Ok(())
            }
            Err(e) => Err(e),
        };
        (outcome, at)
    };
    let script = async {
        queue.wait_for_waiters(holder, name, 1).await;
        for proxy in proxies {
            proxy.set(Fault::Blackhole);
        }
        let partitioned_at = Instant::now();
        tokio::time::sleep(PARTITION).await;
        for proxy in proxies {
            proxy.set(Fault::Pass);
        }
        let healed_at = Instant::now();
        assert!(!held.is_lost(), "the holder lost its lock");
        // The next waiter queues behind the holder, then the holder releases.
        let granting = async {
            let guard = next
                .acquire(name, options().wait_timeout(Duration::from_secs(10)))
                .await
                .expect("the next waiter is granted");
            let at = Instant::now();
            checker.enter("next", guard.token().get());
            (guard, at)
        };
        let releasing = async {
            queue.wait_for_waiters(holder, name, 1).await;
            checker.exit("holder", held_token);
            let _ = released_at.set(Instant::now());
            held.release().await.expect("the holder releases");
        };
        let ((next_guard, next_at), ()) = tokio::join!(granting, releasing);
        (partitioned_at, healed_at, next_guard, next_at)
    };
    let ((outcome, waiter_at), (partitioned_at, healed_at, next_guard, next_at)) =
        tokio::join!(waiting, script);
    let released_at = *released_at.get().unwrap();

    let waited = waiter_at.saturating_duration_since(partitioned_at);
    eprintln!(
        "{name}: the partitioned waiter ended {waited:?} after the partition with {outcome:?}; \
         the next waiter was granted {:?} after the release",
        next_at - released_at
    );
    match end {
        WaiterEnd::Lost(bound) => {
            assert_told_lost("partitioned", &outcome, "partition", waited, bound);
            assert!(
                waiter_at < healed_at,
                "the partitioned waiter was told only at the heal, {waited:?} after the \
                 partition (heal after {PARTITION:?})"
            );
        }
        WaiterEnd::NotGrantedWhileHeld => {
            assert!(
                outcome.is_err() || waiter_at >= released_at,
                "the partitioned waiter was granted while the holder held: {outcome:?}"
            );
        }
    }
    // The first grant after the release comes within the hand-over bound (on Redis the
    // partitioned waiter may win the race, if it is still waiting).
    let first_grant = match outcome {
        Ok(()) => next_at.min(waiter_at),
        Err(_) => next_at,
    };
    assert!(
        first_grant - released_at <= HAND_OVER,
        "the lock was handed over {:?} after the release",
        first_grant - released_at
    );
    assert!(next_guard.token().get() > held_token, "token did not grow");
    checker.exit("next", next_guard.token().get());
    next_guard
        .release()
        .await
        .expect("the next waiter releases");
    checker.assert_no_overlap();
    checker.assert_tokens_increase();
    assert_clean(next, name, Duration::from_secs(3), servers).await;
}

/// A line for the parent, straight to the stdout pipe (not through the harness's
/// output capture).
fn report(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The waiter of F11, in a child process: connects, says so, waits for the lock and
/// says if it ever gets it. A no-op in a normal test run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_waiter_role() {
    let Ok(setting) = std::env::var(WAITER_ENV) else {
        return;
    };
    let (url, name) = setting
        .split_once('|')
        .unwrap_or_else(|| panic!("bad {WAITER_ENV}: {setting}"));
    let locks = fencelock::connect(url).await.expect("connect");
    report("CONNECTED");
    let guard = locks
        .acquire(name, options().wait_forever())
        .await
        .expect("acquire");
    report(&format!("GRANTED {}", guard.token()));
    std::future::pending::<()>().await;
}

/// The child process; killed (even if already dead) when dropped.
struct WaiterProcess {
    child: Child,
    lines: Receiver<String>,
}

impl WaiterProcess {
    fn spawn(url: &str, name: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "queue_waiter_role",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WAITER_ENV, format!("{url}|{name}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the waiter process");
        let (tx, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        WaiterProcess { child, lines }
    }

    /// Waits for a line containing `word`; panics after 30 s.
    fn wait_for(&self, word: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(word) => return,
                Ok(_) => {}
                Err(e) => panic!("no {word} from the waiter process: {e}"),
            }
        }
    }

    /// Whether the waiter ever said it was granted.
    fn was_granted(&self) -> bool {
        self.lines.try_iter().any(|line| line.contains("GRANTED"))
    }

    /// SIGKILL, and reap.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WaiterProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// F11 on `name`: `holder` holds; a child process on `child_url` waits (V); `next`
/// waits behind it (N); V is killed, and `release_after_kill` later the holder
/// releases. N must be granted no later than `bound` after the release (when the
/// release came after V's lease ran out) or after the kill (when it came before).
#[allow(clippy::too_many_arguments)] // the scenario's parts, each named at the call
async fn dead_middle_waiter(
    holder: &dyn DistributedLock,
    next: &dyn DistributedLock,
    child_url: &str,
    queue: Queue,
    name: &str,
    release_after_kill: Duration,
    bound: HandOver,
    servers: &Servers<'_>,
) {
    let checker = Checker::new();
    let held = holder
        .acquire(name, options().no_wait())
        .await
        .expect("holder acquires");
    let held_token = held.token().get();
    checker.enter("holder", held_token);
    let mut middle = WaiterProcess::spawn(child_url, name);
    middle.wait_for("CONNECTED");
    queue.wait_for_waiters(holder, name, 1).await;

    let released_at = OnceLock::<Instant>::new();
    let killed_at = OnceLock::<Instant>::new();
    let granting = async {
        let guard = next
            .acquire(name, options().wait_timeout(Duration::from_secs(20)))
            .await
            .expect("the next waiter is granted");
        let at = Instant::now();
        assert!(
            released_at.get().is_some(),
            "the next waiter was granted while the holder held"
        );
        checker.enter("next", guard.token().get());
        (guard, at)
    };
    let script = async {
        queue.wait_for_waiters(holder, name, 2).await;
        middle.kill();
        let _ = killed_at.set(Instant::now());
        tokio::time::sleep(release_after_kill).await;
        assert!(!held.is_lost(), "the holder lost its lock");
        checker.exit("holder", held_token);
        let _ = released_at.set(Instant::now());
        held.release().await.expect("the holder releases");
    };
    let ((next_guard, next_at), ()) = tokio::join!(granting, script);
    let (released_at, killed_at) = (*released_at.get().unwrap(), *killed_at.get().unwrap());
    let after_release = next_at - released_at;
    let after_kill = next_at - killed_at;
    eprintln!(
        "{name}: holder released {release_after_kill:?} after the middle waiter was killed; \
         the next waiter was granted {after_release:?} after the release, {after_kill:?} \
         after the kill"
    );
    assert!(!middle.was_granted(), "the killed waiter was granted");
    match bound {
        HandOver::AfterRelease(bound) => assert!(
            after_release <= bound,
            "the next waiter was granted {after_release:?} after the release (bound {bound:?})"
        ),
        HandOver::AfterKill(bound) => assert!(
            after_kill <= bound,
            "the next waiter was granted {after_kill:?} after the kill (bound {bound:?}), \
             {after_release:?} after the release"
        ),
    }
    assert!(next_guard.token().get() > held_token, "token did not grow");
    checker.exit("next", next_guard.token().get());
    next_guard
        .release()
        .await
        .expect("the next waiter releases");
    checker.assert_no_overlap();
    checker.assert_tokens_increase();
    assert_clean(next, name, Duration::from_secs(3), servers).await;
}

/// The bound on F11's hand-over.
#[derive(Debug, Clone, Copy)]
enum HandOver {
    /// At most this long after the holder's release.
    AfterRelease(Duration),
    /// At most this long after the middle waiter was killed.
    AfterKill(Duration),
}

/// F11 in both orders on a queueing backend: the release after the killed waiter's
/// lease or session ran out (`expiry` after the kill, at the latest), and right after
/// the kill.
async fn dead_middle_waiter_both_orders(
    holder: &dyn DistributedLock,
    next: &dyn DistributedLock,
    child_url: &str,
    queue: Queue,
    expiry: Duration,
    servers: &Servers<'_>,
) {
    dead_middle_waiter(
        holder,
        next,
        child_url,
        queue,
        "late-release",
        expiry + Duration::from_millis(500),
        HandOver::AfterRelease(HAND_OVER),
        servers,
    )
    .await;
    dead_middle_waiter(
        holder,
        next,
        child_url,
        queue,
        "early-release",
        Duration::from_millis(100),
        HandOver::AfterKill(expiry + HAND_OVER),
        servers,
    )
    .await;
}

/// When an etcd lease of [`LEASE`] whose holder went silent is gone at the latest:
/// the TTL after its last keepalive, plus the lessor's expiry round (500 ms).
const ETCD_EXPIRY: Duration = Duration::from_millis(2500);
/// When a ZooKeeper session of [`LEASE`] whose client went silent is gone at the
/// latest: the session timeout, plus two ticks (expiry buckets and the server's
/// session tracker round).
const ZK_EXPIRY: Duration = Duration::from_millis(2000 + 2 * ZK_TICK_MS);

fn etcd_url(endpoint: &str, prefix: &str) -> String {
    format!("etcd://{endpoint}/{prefix}?lease=2s")
}

/// The shared etcd server, a proxy in front of it, and two clients of `prefix`: the
/// holder's, direct, and the waiter's, through the proxy.
async fn etcd_holder_and_proxied_waiter(
    prefix: &str,
) -> (
    &'static EtcdServer,
    FaultProxy,
    Arc<dyn DistributedLock>,
    Arc<dyn DistributedLock>,
) {
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let holder = fencelock::connect(&etcd_url(&server.endpoint(), prefix))
        .await
        .unwrap();
    let waiter = fencelock::connect(&etcd_url(&proxy.addr(), prefix))
        .await
        .unwrap();
    (server, proxy, holder, waiter)
}

fn zk_url(hosts: &str, chroot: &str) -> String {
    format!("zk://{hosts}/{chroot}?session_timeout=2s&min_lease=2s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_etcd_partitioned_waiter_is_lost_never_granted() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let prefix = unique("f10-etcd");
    let (server, proxy, holder, waiter) = etcd_holder_and_proxied_waiter(&prefix).await;
    let next = fencelock::connect(&etcd_url(&server.endpoint(), &prefix))
        .await
        .unwrap();
    let servers = Servers::Etcd(server, &prefix);
    partitioned_waiter(
        &*holder,
        &*waiter,
        &*next,
        &[&proxy],
        Queue::Etcd,
        "stock",
        WaiterEnd::Lost(ETCD_WAITER_LOST),
        &servers,
    )
    .await;
}

/// F10 cut between etcd applying the waiter's create and the waiter hearing of it: its
/// replies are slow, and the partition holds the create's answer on its way back. The
/// waiter's session is lost at its deadline, and so is its acquire, then; not at the
/// heal, when the held answer arrives (it used to await the create alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_etcd_waiter_cut_off_before_its_create_is_answered_is_lost() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let prefix = unique("f10-etcd-create");
    let name = "stock";
    let (server, proxy, holder, waiter) = etcd_holder_and_proxied_waiter(&prefix).await;
    let held = holder
        .acquire(name, options().no_wait())
        .await
        .expect("holder acquires");
    // Every answer to the waiter from now on comes half a second late, its create's too.
    proxy.set(Fault::DelayReplies(Duration::from_millis(500)));
    let waiting = async {
        let result = waiter
            .acquire(
                name,
                options().wait_timeout(PARTITION + Duration::from_secs(10)),
            )
            .await;
        (result.map(|_| ()), Instant::now())
    };
    let script = async {
        // The key is on the server: its create's answer is on its way, and held.
        Queue::Etcd.wait_for_waiters(&*holder, name, 1).await;
        proxy.set(Fault::Blackhole);
        let cut = Instant::now();
        tokio::time::sleep(PARTITION).await;
        proxy.set(Fault::Pass);
        cut
    };
    let ((outcome, ended), cut) = tokio::join!(waiting, script);
    let told = ended.saturating_duration_since(cut);
    eprintln!("{name}: the waiter ended {told:?} after the cut with {outcome:?}");
    assert_told_lost("cut-off", &outcome, "cut", told, ETCD_WAITER_LOST);
    held.release().await.expect("the holder releases");
    assert_clean(
        &*holder,
        name,
        ETCD_EXPIRY + Duration::from_secs(5),
        &Servers::Etcd(server, &prefix),
    )
    .await;
}

/// F10 with the waiter's session lease revoked by an etcd client, and the holder
/// releasing right after: the waiter's turn comes, but its key is gone, so it must not
/// take the lock (etcd #11456).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_etcd_revoked_waiter_is_lost_never_granted() {
    use fencelock_etcd::{EtcdConfig, EtcdLock};
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let server = EtcdServer::shared();
    let prefix = unique("f10-etcd-revoke");
    let config = || EtcdConfig::from_url(&etcd_url(&server.endpoint(), &prefix)).unwrap();
    let holder = EtcdLock::connect(config()).await.unwrap();
    let waiter = EtcdLock::connect(config()).await.unwrap();
    let next = EtcdLock::connect(config()).await.unwrap();
    // The waiter's session lease: the last part of its key, in hex.
    let probe = waiter.acquire("probe", options().no_wait()).await.unwrap();
    let owner = waiter.inspect("probe").await.unwrap().holder.unwrap().owner;
    let lease = i64::from_str_radix(&owner, 16).expect("a lease id in hex");
    probe.release().await.unwrap();

    let checker = Checker::new();
    let held = holder.acquire("stock", options().no_wait()).await.unwrap();
    checker.enter("holder", held.token().get());
    let waiting = async {
        let result = waiter
            .acquire("stock", options().wait_timeout(Duration::from_secs(10)))
            .await;
        (result, Instant::now())
    };
    let script = async {
        Queue::Etcd.wait_for_waiters(&holder, "stock", 1).await;
        holder
            .client()
            .lease_client()
            .revoke(lease)
            .await
            .expect("revoke the waiter's lease");
        checker.exit("holder", held.token().get());
        held.release().await.expect("the holder releases");
        Instant::now()
    };
    let ((result, ended_at), released_at) = tokio::join!(waiting, script);
    let after = ended_at.saturating_duration_since(released_at);
    eprintln!("the revoked waiter ended {after:?} after the release with {result:?}");
    // Told by its watch (the predecessor is gone, and so is its own key) or by its
    // next keepalive, whichever comes first.
    assert_told_lost("revoked", &result, "release", after, LEASE / 3 + LOSS_BOUND);
    let granted = next
        .acquire("stock", options().wait_timeout(HAND_OVER))
        .await
        .expect("the lock is free");
    checker.enter("next", granted.token().get());
    checker.exit("next", granted.token().get());
    granted.release().await.unwrap();
    checker.assert_no_overlap();
    checker.assert_tokens_increase();
    let servers = Servers::Etcd(server, &prefix);
    assert_clean(&next, "stock", Duration::from_secs(3), &servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_zookeeper_expired_waiter_is_lost_never_granted() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let chroot = unique("f10-zk");
    let direct = zk_url(&server.connect_string(), &chroot);
    let holder = fencelock::connect(&direct).await.unwrap();
    let waiter = fencelock::connect(&zk_url(&proxy.addr(), &chroot))
        .await
        .unwrap();
    let next = fencelock::connect(&direct).await.unwrap();
    let servers = Servers::Zk(server, &chroot);
    partitioned_waiter(
        &*holder,
        &*waiter,
        &*next,
        &[&proxy],
        Queue::ZooKeeper,
        "stock",
        WaiterEnd::Lost(ZK_WAITER_LOST),
        &servers,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_redis_partitioned_waiter_is_not_granted_while_held() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let server = RedisServer::shared();
    let proxy = FaultProxy::start(&server.addr());
    let prefix = unique("f10-redis");
    let direct = format!("{}?prefix={prefix}:", server.url());
    let holder = fencelock::connect(&direct).await.unwrap();
    let waiter = fencelock::connect(&format!("redis://{}?prefix={prefix}:", proxy.addr()))
        .await
        .unwrap();
    let next = fencelock::connect(&direct).await.unwrap();
    let servers = Servers::redis(server, &prefix);
    partitioned_waiter(
        &*holder,
        &*waiter,
        &*next,
        &[&proxy],
        Queue::None,
        "stock",
        WaiterEnd::NotGrantedWhileHeld,
        &servers,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_redlock_partitioned_waiter_is_not_granted_while_held() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| FaultProxy::start(&s.addr()))
        .collect();
    let prefix = unique("f10-redlock");
    let via = |addrs: Vec<String>| format!("redlock://{}?prefix={prefix}:", addrs.join(","));
    let direct = via(servers.iter().map(RedisServer::addr).collect());
    let holder = fencelock::connect(&direct).await.unwrap();
    let waiter = fencelock::connect(&via(proxies.iter().map(FaultProxy::addr).collect()))
        .await
        .unwrap();
    let next = fencelock::connect(&direct).await.unwrap();
    let proxies: Vec<&FaultProxy> = proxies.iter().collect();
    let servers = Servers::Redis(servers.iter().map(RedisServer::port).collect(), &prefix);
    partitioned_waiter(
        &*holder,
        &*waiter,
        &*next,
        &proxies,
        Queue::None,
        "stock",
        WaiterEnd::NotGrantedWhileHeld,
        &servers,
    )
    .await;
}

/// F10 on a deployment behind announced proxies: the holder's and the next waiter's
/// connections (and the servers' own links) are exempt, the waiter's are cut.
async fn partitioned_waiter_behind_proxies(deployment: Proxied, tag: &str) {
    let prefix = unique(tag);
    let holder = fencelock::connect(&deployment.url(&prefix)).await.unwrap();
    let next = fencelock::connect(&deployment.url(&prefix)).await.unwrap();
    deployment.exempt();
    let waiter = fencelock::connect(&deployment.cut_url(&prefix))
        .await
        .unwrap();
    partitioned_waiter(
        &*holder,
        &*waiter,
        &*next,
        &deployment.proxies(),
        Queue::None,
        "stock",
        WaiterEnd::NotGrantedWhileHeld,
        &deployment.servers(&prefix),
    )
    .await;
    deployment.assert_no_failover();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_redis_sentinel_partitioned_waiter_is_not_granted_while_held() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    partitioned_waiter_behind_proxies(Proxied::sentinel().await, "f10-sentinel").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_redis_cluster_partitioned_waiter_is_not_granted_while_held() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    partitioned_waiter_behind_proxies(Proxied::cluster().await, "f10-cluster").await;
}

/// The migration layer in its target-first phase, whose first leg (where waiters
/// queue) is etcd: the waiter's etcd session is lost while it is cut off, and so is its
/// acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f10_migration_partitioned_waiter_is_lost_never_granted() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let redis = RedisServer::shared();
    let etcd = EtcdServer::shared();
    let (redis_proxy, etcd_proxy) = (
        FaultProxy::start(&redis.addr()),
        FaultProxy::start(&etcd.endpoint()),
    );
    let prefix = unique("f10-migrate");
    let url = |redis: &str, etcd: &str| migration_url(&prefix, redis, etcd);
    let direct = url(&redis.addr(), &etcd.endpoint());
    let holder = fencelock::connect(&direct).await.unwrap();
    let waiter = fencelock::connect(&url(&redis_proxy.addr(), &etcd_proxy.addr()))
        .await
        .unwrap();
    let next = fencelock::connect(&direct).await.unwrap();
    let servers = Servers::Both(
        Box::new(Servers::redis(redis, &prefix)),
        Box::new(Servers::Etcd(etcd, &prefix)),
    );
    partitioned_waiter(
        &*holder,
        &*waiter,
        &*next,
        &[&redis_proxy, &etcd_proxy],
        Queue::Etcd,
        "stock",
        WaiterEnd::Lost(ETCD_WAITER_LOST),
        &servers,
    )
    .await;
}

fn migration_url(prefix: &str, redis: &str, etcd: &str) -> String {
    fencelock::migration_url(
        MigrationPhase::TargetFirst,
        &format!("redis://{redis}?layout=raw&prefix={prefix}:"),
        &etcd_url(etcd, prefix),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f11_etcd_killed_middle_waiter() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let server = EtcdServer::shared();
    let prefix = unique("f11-etcd");
    let url = etcd_url(&server.endpoint(), &prefix);
    let holder = fencelock::connect(&url).await.unwrap();
    let next = fencelock::connect(&url).await.unwrap();
    let servers = Servers::Etcd(server, &prefix);
    dead_middle_waiter_both_orders(&*holder, &*next, &url, Queue::Etcd, ETCD_EXPIRY, &servers)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f11_zookeeper_killed_middle_waiter() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let server = ZkServer::shared();
    let chroot = unique("f11-zk");
    let url = zk_url(&server.connect_string(), &chroot);
    let holder = fencelock::connect(&url).await.unwrap();
    let next = fencelock::connect(&url).await.unwrap();
    let servers = Servers::Zk(server, &chroot);
    dead_middle_waiter_both_orders(
        &*holder,
        &*next,
        &url,
        Queue::ZooKeeper,
        ZK_EXPIRY,
        &servers,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f11_redis_killed_middle_waiter() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let server = RedisServer::shared();
    let prefix = unique("f11-redis");
    let url = format!("{}?prefix={prefix}:", server.url());
    let holder = fencelock::connect(&url).await.unwrap();
    let next = fencelock::connect(&url).await.unwrap();
    let servers = Servers::redis(server, &prefix);
    dead_middle_waiter(
        &*holder,
        &*next,
        &url,
        Queue::None,
        "stock",
        Duration::from_millis(100),
        HandOver::AfterRelease(HAND_OVER),
        &servers,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f11_redlock_killed_middle_waiter() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let prefix = unique("f11-redlock");
    let url = format!(
        "redlock://{}?prefix={prefix}:",
        servers
            .iter()
            .map(RedisServer::addr)
            .collect::<Vec<_>>()
            .join(",")
    );
    let holder = fencelock::connect(&url).await.unwrap();
    let next = fencelock::connect(&url).await.unwrap();
    let servers = Servers::Redis(servers.iter().map(RedisServer::port).collect(), &prefix);
    dead_middle_waiter(
        &*holder,
        &*next,
        &url,
        Queue::None,
        "stock",
        Duration::from_millis(100),
        HandOver::AfterRelease(HAND_OVER),
        &servers,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f11_redis_sentinel_killed_middle_waiter() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let set = tokio::task::spawn_blocking(RedisSentinelSet::start)
        .await
        .unwrap();
    let prefix = unique("f11-sentinel");
    let url = format!("{}?prefix={prefix}:", set.url());
    let holder = fencelock::connect(&url).await.unwrap();
    let next = fencelock::connect(&url).await.unwrap();
    let servers = Servers::redis(set.master(), &prefix);
    dead_middle_waiter(
        &*holder,
        &*next,
        &url,
        Queue::None,
        "stock",
        Duration::from_millis(100),
        HandOver::AfterRelease(HAND_OVER),
        &servers,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f11_redis_cluster_killed_middle_waiter() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3))
        .await
        .unwrap();
    let prefix = unique("f11-cluster");
    let url = format!("{}?prefix={prefix}:", cluster.url());
    let holder = fencelock::connect(&url).await.unwrap();
    let next = fencelock::connect(&url).await.unwrap();
    let servers = Servers::Redis(
        cluster.nodes().iter().map(RedisServer::port).collect(),
        &prefix,
    );
    dead_middle_waiter(
        &*holder,
        &*next,
        &url,
        Queue::None,
        "stock",
        Duration::from_millis(100),
        HandOver::AfterRelease(HAND_OVER),
        &servers,
    )
    .await;
}

/// The migration layer in its target-first phase: waiters queue on the etcd leg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f11_migration_killed_middle_waiter() {
    if std::env::var(WAITER_ENV).is_ok() {
        return;
    }
    let redis = RedisServer::shared();
    let etcd = EtcdServer::shared();
    let prefix = unique("f11-migrate");
    let url = migration_url(&prefix, &redis.addr(), &etcd.endpoint());
    let holder = fencelock::connect(&url).await.unwrap();
    let next = fencelock::connect(&url).await.unwrap();
    let servers = Servers::Both(
        Box::new(Servers::redis(redis, &prefix)),
        Box::new(Servers::Etcd(etcd, &prefix)),
    );
    dead_middle_waiter_both_orders(&*holder, &*next, &url, Queue::Etcd, ETCD_EXPIRY, &servers)
        .await;
}
