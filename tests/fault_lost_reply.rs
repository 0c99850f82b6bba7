//! F9, an acquire whose server applied it but whose answer never came back, and
//! acquires cancelled at the moment of their grant.
//!
//! (a) Lost reply. Client A reaches its servers through [`FaultProxy`]s. Under
//! [`Fault::DropReplies`] A's acquire reaches the server, which creates A's key, node or
//! Redis key (another client sees the name held), but the answer is thrown away; the
//! acquire future is dropped 1 s after it started, and not before the test has seen
//! both (a reply dropped and A's grant on the leg that lost it, within 10 s). Then the
//! proxies reset their connections and pass again. Within a bound (1 s for etcd and
//! ZooKeeper, one lease for Redis, from the heal) another client B sees the name free,
//! with no waiters where counted, and takes it at once with a token larger than the
//! orphan's and every earlier one. A's client works again afterwards (through the retry
//! layer: a connection reset while idle fails its next command once, retryably). Lease
//! 2 s everywhere.
//!
//! (b) Cancel at the moment of grant. Two clients make 150 acquires each on one name,
//! every one under a `tokio::time::timeout` of a random 0-5 ms, holding each grant for a
//! random 0-2 ms, so that timeouts keep firing while the other client's release hands
//! the lock over. Afterwards nothing is left (free, 0 waiters where counted, within
//! 1 s), `try_lock` by either client wins at once, and the history passes C1-C4.
//!
//! `f9_etcd_cancelled_create_leaves_no_orphan` is (b) on fresh names, where an orphan
//! would not be cleaned up by the client's next acquire.
//!
//! Redis Sentinel and Cluster clients learn the servers' addresses from the deployment,
//! so there the servers announce their proxies (testkit's `start_behind_proxy` and
//! `start_behind_proxies`), both clients connect through them, and B's connections are
//! exempted from the fault before A connects.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::sync::Arc;
use std::time::Duration;

use fencelock::layer::migration::era_token;
use fencelock::{
    AcquireOptions, DistributedLock, DistributedLockExt, FencingToken, MigrationPhase, Retry,
    RetryPolicy,
};
use fencelock_testkit::checker::Checker;
use fencelock_testkit::leftovers;
use fencelock_testkit::{EtcdServer, Fault, FaultProxy, RedisServer, ZkServer};
use tokio::time::Instant;

mod common;
use common::{Proxied, Rng, Servers};

const LEASE: Duration = Duration::from_secs(2);
/// How long A's acquire is given under the fault before it is dropped (longer when the
/// server's applying it shows later).
const DROP_AFTER: Duration = Duration::from_secs(1);
/// The bound on the server applying A's acquire under the fault and a reply being
/// dropped: generous, for a machine whose cores are busy.
const APPLIED_BOUND: Duration = Duration::from_secs(10);
/// The bound on clean-up for etcd and ZooKeeper.
const CP_BOUND: Duration = Duration::from_secs(1);
/// The bound on clean-up for Redis: one lease.
const REDIS_BOUND: Duration = LEASE;
/// How soon nothing of a scenario may be left on the servers (C5): a Redis waiter
/// marker lives two seconds at least.
const LEFT_BOUND: Duration = Duration::from_secs(3);

type Lock = Arc<dyn DistributedLock>;

fn unique(name: &str) -> String {
    common::unique(&format!("f9-{name}"))
}

fn options() -> AcquireOptions {
    AcquireOptions::new().lease(LEASE)
}

/// Waits until `lock` sees `name` free with no waiters (where counted); fails if that
/// takes longer than `within`.
async fn free_within(label: &str, lock: &dyn DistributedLock, name: &str, within: Duration) {
    let start = Instant::now();
    loop {
        let info = lock.inspect(name).await.expect("inspect");
        if !info.is_held() && matches!(info.waiters, None | Some(0)) {
            return;
        }
        assert!(
            start.elapsed() < within,
            "{label}: still not free {within:?} later: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Where the server applying A's acquire shows: a client that inspects, directly, the
/// leg whose reply is lost first (B itself on a plain backend), and how its tokens
/// compare with B's grants.
struct Witness<'a> {
    lock: &'a dyn DistributedLock,
    /// `Some(epoch)`: the witness's token `t` is `era_token(epoch, t)` among B's grants
    /// (0 and B itself on a plain backend; the first leg of a migration). `None`: the
    /// second leg of a migration, whose tokens are in no order with B's grants (they
    /// are the first leg's).
    era: Option<u8>,
}

impl<'a> Witness<'a> {
    /// On a plain backend: B itself.
    fn plain(b: &'a dyn DistributedLock) -> Self {
        Witness {
            lock: b,
            era: Some(0),
        }
    }

    /// The token of `name`'s holder, as the witness sees it.
    async fn holder(&self, label: &str, name: &str) -> Option<u64> {
        let info = self.lock.inspect(name).await;
        let info = info.unwrap_or_else(|e| panic!("{label}: the witness's inspect: {e:?}"));
        info.holder.map(|h| h.token.get())
    }

    /// A witness token as one of B's grants, where the two are in one order.
    fn among_grants(&self, token: u64) -> Option<u64> {
        let era = self.era?;
        Some(
            era_token(era, FencingToken::new(token))
                .expect("era token")
                .get(),
        )
    }
}

/// The sum of the replies `proxies` dropped.
fn dropped(proxies: &[&FaultProxy]) -> u64 {
    proxies.iter().map(|p| p.dropped_replies()).sum()
}

/// Waits for the event "the server applied A's acquire and a reply was lost": a reply
/// dropped by `proxies` since `dropped_before`, and the witness seeing the name held
/// with a token above A's earlier one there (`earlier`). Returns the orphan's token as
/// the witness sees it. Fails after [`APPLIED_BOUND`].
async fn applied_and_lost(
    label: &str,
    witness: &Witness<'_>,
    proxies: &[&FaultProxy],
    dropped_before: u64,
    name: &str,
    earlier: u64,
) -> u64 {
    let start = Instant::now();
    loop {
        let lost = dropped(proxies) > dropped_before;
        let holder = witness.holder(label, name).await;
        match holder {
            Some(orphan) if lost && orphan > earlier => return orphan,
            _ => {}
        }
        assert!(
            start.elapsed() < APPLIED_BOUND,
            "{label}: {APPLIED_BOUND:?} into the fault, the server did not apply A's \
             acquire with its reply lost (a reply dropped: {lost}; the holder the witness \
             sees: {holder:?}, A's earlier token there {earlier})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// F9 (a): `a` goes through `drop_replies` (and possibly more proxies that pass), `b`
/// directly; `witness` sees the leg whose reply is lost first.
#[allow(clippy::too_many_arguments)]
async fn lost_acquire_reply(
    label: &str,
    a: &Lock,
    b: &dyn DistributedLock,
    witness: &Witness<'_>,
    drop_replies: &[&FaultProxy],
    all_proxies: &[&FaultProxy],
    name: &str,
    bound: Duration,
) {
    let checker = Checker::new();
    // An ordinary grant first, so tokens are compared across the fault.
    let first = a
        .acquire(name, options().no_wait())
        .await
        .expect("A acquires before the fault");
    let first_token = first.token().get();
    // A's token on the witness's leg.
    let first_seen = witness
        .holder(label, name)
        .await
        .unwrap_or_else(|| panic!("{label}: the witness does not see A's first grant"));
    if let Some(among_grants) = witness.among_grants(first_seen) {
        assert_eq!(
            among_grants, first_token,
            "{label}: the witness is another leg"
        );
    }
    checker.enter("a", first_token);
    assert!(checker.write("a", first_token));
    checker.exit("a", first_token);
    first.release().await.expect("A releases before the fault");

    let dropped_before = dropped(drop_replies);
    for proxy in drop_replies {
        proxy.set(Fault::DropReplies);
    }
    let started = Instant::now();
    // Meanwhile the server applies it, and its reply is lost: then B sees the name held
    // too (while A's attempt still holds what it has), and the attempt is dropped (at
    // the end of this block), not before DROP_AFTER.
    let (attempt, (orphan_seen, seen)) = {
        let mut attempt =
            std::pin::pin!(a.acquire(name, options().wait_timeout(Duration::from_secs(10))));
        let mut watch = std::pin::pin!(async {
            let orphan = applied_and_lost(
                label,
                witness,
                drop_replies,
                dropped_before,
                name,
                first_seen,
            )
            .await;
            let seen = b.inspect(name).await.expect("B inspects during the fault");
            tokio::time::sleep_until(started + DROP_AFTER).await;
            (orphan, seen)
        });
        tokio::select! {
            watched = &mut watch => (None, watched),
            finished = &mut attempt => (Some(finished), watch.await),
        }
    };
    let healed_at = Instant::now();
    for proxy in all_proxies {
        proxy.reset_connections();
        proxy.set(Fault::Pass);
    }
    match &attempt {
        // Dropped while waiting for the answer.
        None => {}
        // Redlock gives every instance at most half a lease to answer: the attempt may
        // fail on its own first, retryably.
        Some(Err(e)) if e.is_retryable() => {}
        Some(result) => panic!("{label}: A's acquire finished without its reply: {result:?}"),
    }
    assert!(
        dropped(drop_replies) > dropped_before,
        "{label}: no reply was dropped (the fault did not hit)"
    );
    assert!(
        seen.is_held(),
        "{label}: the server applied A's acquire, but B saw the name free: {seen:?}"
    );
    // The orphan among B's grants, where the witness's tokens are (its token there is
    // above the earlier grant's: `applied_and_lost` waited for that).
    let orphan = witness.among_grants(orphan_seen);
    if let Some(orphan) = orphan {
        assert!(
            orphan > first_token,
            "{label}: the orphan's token {orphan} is not above the earlier {first_token}"
        );
    }

    free_within(label, b, name, bound).await;
    let freed_after = healed_at.elapsed();
    let next = match b.acquire(name, options().no_wait()).await {
        Ok(next) => next,
        Err(e) => panic!("{label}: B could not take the free name at once: {e:?}"),
    };
    let granted_after = healed_at.elapsed();
    eprintln!("{label}: free {freed_after:?} and granted {granted_after:?} after the heal");
    assert!(
        granted_after <= bound,
        "{label}: B was granted {granted_after:?} after the heal"
    );
    let next_token = next.token().get();
    checker.enter("b", next_token);
    assert!(checker.write("b", next_token));
    if let Some(orphan) = orphan {
        assert!(
            next_token > orphan,
            "{label}: B's token {next_token} is not above the orphan's {orphan}"
        );
    }
    // And on the leg of the lost reply, in its own tokens.
    let next_seen = witness.holder(label, name).await;
    assert!(
        next_seen.is_some_and(|t| t > orphan_seen),
        "{label}: B's token where the reply was lost ({next_seen:?}) is not above the \
         orphan's {orphan_seen}"
    );
    checker.exit("b", next_token);
    next.release().await.expect("B releases");

    // A's client works again. Through the retry layer: a connection the proxy reset
    // while it was idle (a Redis leg that was not in use) fails its next command once,
    // retryably, before it reconnects.
    let retrying = Retry::new(a.clone(), RetryPolicy::default());
    let again = match retrying.acquire(name, options().wait_timeout(bound)).await {
        Ok(again) => again,
        Err(e) => panic!("{label}: A cannot lock again after the heal: {e:?}"),
    };
    let again_token = again.token().get();
    checker.enter("a", again_token);
    assert!(checker.write("a", again_token));
    checker.exit("a", again_token);
    again.release().await.expect("A releases after the heal");

    checker.assert_no_overlap();
    checker.assert_no_stale_write_accepted();
    checker.assert_no_lost_update(3);
    checker.assert_tokens_increase();
    free_within(label, b, name, bound).await;
}

/// One client's 150 acquires of F9 (b), each given a random time of up to `longest`:
/// returns (granted, cancelled).
async fn barrage(
    label: &str,
    checker: &Checker,
    client: &str,
    lock: &dyn DistributedLock,
    name: &str,
    longest: Duration,
) -> (u64, u64) {
    let mut rng = Rng::new();
    let (mut granted, mut cancelled) = (0u64, 0u64);
    let longest = u64::try_from(longest.as_micros()).unwrap_or(u64::MAX);
    for _ in 0..150 {
        let limit = Duration::from_micros(rng.below(longest.saturating_add(1)));
        let hold = Duration::from_micros(rng.below(2_001));
        let acquire = lock.acquire(name, options().wait_timeout(Duration::from_secs(10)));
        match tokio::time::timeout(limit, acquire).await {
            Ok(Ok(guard)) => {
                let token = guard.token().get();
                checker.enter(client, token);
                assert!(checker.write(client, token), "{label}: write rejected");
                tokio::time::sleep(hold).await;
                checker.exit(client, token);
                if let Err(e) = guard.release().await {
                    panic!("{label}: {client}'s release of token {token}: {e:?}");
                }
                granted += 1;
            }
            Ok(Err(e)) => panic!("{label}: {client}'s acquire failed: {e:?}"),
            Err(_) => cancelled += 1,
        }
    }
    (granted, cancelled)
}

/// F9 (b): `clients` race 150 acquires each on `name`, with random timeouts of up to 5
/// ms, or three times the median of 5 uncontended acquires where that is longer (at
/// most 50 ms): so that some are granted and some cancelled, at every point of the
/// acquire, however fast the machine and the backend (a two-leg migration over etcd
/// takes longer than 5 ms on a busy 2-core machine, and then nothing was ever granted).
/// The median, not the slowest, so that one slow moment does not make nearly every
/// timeout long enough to be granted.
async fn cancel_at_grant(label: &str, clients: [&dyn DistributedLock; 2], name: &str) {
    let mut uncontended = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let guard = clients[0]
            .acquire(name, options().wait_timeout(Duration::from_secs(10)))
            .await
            .unwrap_or_else(|e| panic!("{label}: an uncontended acquire failed: {e:?}"));
        uncontended.push(started.elapsed());
        guard.release().await.expect("release");
    }
    uncontended.sort();
    let longest = (uncontended[2] * 3).clamp(Duration::from_millis(5), Duration::from_millis(50));
    let checker = Checker::new();
    let start = Instant::now();
    let ((g1, c1), (g2, c2)) = tokio::join!(
        barrage(label, &checker, "c1", clients[0], name, longest),
        barrage(label, &checker, "c2", clients[1], name, longest),
    );
    let took = start.elapsed();
    let done = Instant::now();
    for client in clients {
        free_within(label, client, name, Duration::from_secs(1)).await;
    }
    let freed_after = done.elapsed();
    eprintln!(
        "{label}: {} granted, {} cancelled (timeouts up to {longest:?}) in {took:?}; free \
         {freed_after:?} later",
        g1 + g2,
        c1 + c2
    );
    assert!(g1 + g2 > 0, "{label}: no acquire was granted");
    assert!(c1 + c2 > 0, "{label}: no acquire was cancelled");
    // Usable at once, by either client: `try_lock` (no wait, the default lease) wins.
    for (who, client) in ["c1", "c2"].into_iter().zip(clients) {
        let started = Instant::now();
        let guard = match client.try_lock(name).await {
            Ok(Some(guard)) => guard,
            Ok(None) => panic!("{label}: {who}'s try_lock found the lock held afterwards"),
            Err(e) => panic!("{label}: {who}'s try_lock failed afterwards: {e:?}"),
        };
        let token = guard.token().get();
        checker.enter(who, token);
        assert!(checker.write(who, token));
        checker.exit(who, token);
        guard.release().await.expect("release");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{label}: a free try took {:?}",
            started.elapsed()
        );
    }
    checker.assert_no_overlap();
    checker.assert_no_stale_write_accepted();
    checker.assert_no_lost_update(g1 + g2 + 2);
    checker.assert_tokens_increase();
    free_within(label, clients[0], name, Duration::from_secs(1)).await;
}

async fn connect(url: &str) -> Lock {
    fencelock::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_etcd() {
    // A server of its own: its leases are checked too.
    let server = EtcdServer::start();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = unique("etcd");
    let a = connect(&format!("etcd://{}/{prefix}?lease=2s", proxy.addr())).await;
    let b = connect(&format!("etcd://{}/{prefix}?lease=2s", server.endpoint())).await;
    lost_acquire_reply(
        "etcd",
        &a,
        &*b,
        &Witness::plain(&*b),
        &[&proxy],
        &[&proxy],
        "lost",
        CP_BOUND,
    )
    .await;
    cancel_at_grant("etcd", [&*a, &*b], "race").await;
    Servers::Etcd(&server, &prefix).assert_nothing_left_within("etcd F9", LEFT_BOUND);
    // The clients' session leases end with the clients (revoked, or at the latest when
    // their 2 s TTL runs out). The server is this test's own, so every lease is theirs.
    drop((a, b));
    tokio::task::block_in_place(|| {
        leftovers::assert_none_within("etcd F9 leases", LEASE + Duration::from_secs(1), || {
            leftovers::etcd_leases(&server.endpoint())
        })
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_zookeeper() {
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let chroot = unique("zk");
    let url = |hosts: &str| format!("zk://{hosts}/{chroot}?session_timeout=2s&min_lease=2s");
    let a = connect(&url(&proxy.addr())).await;
    let b = connect(&url(&server.connect_string())).await;
    lost_acquire_reply(
        "zookeeper",
        &a,
        &*b,
        &Witness::plain(&*b),
        &[&proxy],
        &[&proxy],
        "lost",
        CP_BOUND,
    )
    .await;
    cancel_at_grant("zookeeper", [&*a, &*b], "race").await;
    Servers::Zk(server, &chroot).assert_nothing_left_within("ZooKeeper F9", LEFT_BOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_redis() {
    let server = RedisServer::shared();
    let proxy = FaultProxy::start(&server.addr());
    let prefix = unique("redis");
    let a = connect(&format!("redis://{}?prefix={prefix}:", proxy.addr())).await;
    let b = connect(&format!("{}?prefix={prefix}:", server.url())).await;
    lost_acquire_reply(
        "redis",
        &a,
        &*b,
        &Witness::plain(&*b),
        &[&proxy],
        &[&proxy],
        "lost",
        REDIS_BOUND,
    )
    .await;
    cancel_at_grant("redis", [&*a, &*b], "race").await;
    Servers::redis(server, &prefix).assert_nothing_left_within("Redis F9", LEFT_BOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_redlock() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| FaultProxy::start(&s.addr()))
        .collect();
    let prefix = unique("redlock");
    let via = |addrs: Vec<String>| format!("redlock://{}?prefix={prefix}:", addrs.join(","));
    let a = connect(&via(proxies.iter().map(FaultProxy::addr).collect())).await;
    let b = connect(&via(servers.iter().map(RedisServer::addr).collect())).await;
    let proxies: Vec<&FaultProxy> = proxies.iter().collect();
    lost_acquire_reply(
        "redlock",
        &a,
        &*b,
        &Witness::plain(&*b),
        &proxies,
        &proxies,
        "lost",
        REDIS_BOUND,
    )
    .await;
    cancel_at_grant("redlock", [&*a, &*b], "race").await;
    Servers::Redis(servers.iter().map(RedisServer::port).collect(), &prefix)
        .assert_nothing_left_within("Redlock F9", LEFT_BOUND);
}

/// F9 on a deployment behind announced proxies: B's connections (and the servers' own
/// links) are exempt from the fault, A's are not.
async fn lost_reply_behind_proxies(deployment: Proxied, label: &str) {
    let prefix = unique(label);
    let b = connect(&deployment.url(&prefix)).await;
    deployment.exempt();
    let a = connect(&deployment.cut_url(&prefix)).await;
    let proxies = deployment.proxies();
    lost_acquire_reply(
        label,
        &a,
        &*b,
        &Witness::plain(&*b),
        &proxies,
        &proxies,
        "lost",
        REDIS_BOUND,
    )
    .await;
    cancel_at_grant(label, [&*a, &*b], "race").await;
    deployment
        .servers(&prefix)
        .assert_nothing_left_within(label, LEFT_BOUND);
    deployment.assert_no_failover();
}

/// Sentinel: the Sentinels name the master's proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_redis_sentinel() {
    lost_reply_behind_proxies(Proxied::sentinel().await, "sentinel").await;
}

/// Cluster: every node announces its proxy; A reaches every node (and subscribes)
/// through the proxies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_redis_cluster() {
    lost_reply_behind_proxies(Proxied::cluster().await, "cluster").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_memory() {
    let namespace = unique("mem");
    let url = format!("mem://{namespace}");
    let (a, b) = (connect(&url).await, connect(&url).await);
    cancel_at_grant("mem", [&*a, &*b], "race").await;
}

/// The migration layer in its mixed phases (legacy Redis, raw layout; target etcd).
/// (a) twice per phase: every leg's replies lost (the first leg's acquire hangs), and
/// only the second leg's (the first leg granted, then dropped with the attempt). The
/// server's applying A's acquire shows on the leg whose reply is lost first, so B's
/// client of that leg is the witness: the name held through B's migration client is not
/// enough, since the first leg alone holds it before the second leg's create arrives.
/// An orphan on the second leg has no token in the order of B's grants (they are the
/// first leg's); its token is compared with B's on that leg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_migration() {
    let redis = RedisServer::shared();
    let etcd = EtcdServer::shared();
    for phase in [MigrationPhase::LegacyFirst, MigrationPhase::TargetFirst] {
        for only_second in [false, true] {
            let redis_proxy = FaultProxy::start(&redis.addr());
            let etcd_proxy = FaultProxy::start(&etcd.endpoint());
            let prefix = unique("migrate");
            let url = |redis: &str, etcd: &str| {
                fencelock::migration_url(
                    phase,
                    &format!("redis://{redis}?layout=raw&prefix={prefix}:"),
                    &format!("etcd://{etcd}/{prefix}?lease=2s"),
                )
            };
            let a = connect(&url(&redis_proxy.addr(), &etcd_proxy.addr())).await;
            let b = connect(&url(&redis.addr(), &etcd.endpoint())).await;
            // B's legs, directly: the witness is the leg whose reply is lost first.
            let legacy_leg = connect(&format!(
                "redis://{}?layout=raw&prefix={prefix}:",
                redis.addr()
            ))
            .await;
            let target_leg =
                connect(&format!("etcd://{}/{prefix}?lease=2s", etcd.endpoint())).await;
            let (second, first_leg, second_leg) = match phase {
                MigrationPhase::LegacyFirst => (&etcd_proxy, (&legacy_leg, 0), &target_leg),
                _ => (&redis_proxy, (&target_leg, 1), &legacy_leg),
            };
            let witness = if only_second {
                Witness {
                    lock: &**second_leg,
                    era: None,
                }
            } else {
                Witness {
                    lock: &**first_leg.0,
                    era: Some(first_leg.1),
                }
            };
            let all = [&redis_proxy, &etcd_proxy];
            let dropping: Vec<&FaultProxy> = if only_second {
                vec![second]
            } else {
                all.to_vec()
            };
            let label = format!(
                "migration {phase} ({} replies lost)",
                if only_second { "second leg's" } else { "all" }
            );
            let bound = REDIS_BOUND;
            lost_acquire_reply(&label, &a, &*b, &witness, &dropping, &all, "lost", bound).await;
            if only_second {
                cancel_at_grant(&label, [&*a, &*b], "race").await;
            }
            Servers::Both(
                Box::new(Servers::redis(redis, &prefix)),
                Box::new(Servers::Etcd(etcd, &prefix)),
            )
            .assert_nothing_left_within(&label, LEFT_BOUND);
        }
    }
}

/// Acquires cancelled while their create is in flight, on fresh names (so that no later
/// acquire of the same client cleans up after them), 40 ms apart: none may leave its
/// key behind.
///
/// This failed on etcd before creates ran in their own task: the clean-up of a dropped
/// acquire whose create was sent but not answered deleted the key by name at once, on
/// another gRPC stream, while etcd could still apply the create afterwards (the two
/// requests are proposed by different server goroutines, in either order). The key then
/// stayed on the client's live session lease, kept alive, and blocked the name for every
/// other client until this client acquired that name again or its session ended: 2-3 %
/// of the cancelled tries left one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f9_etcd_cancelled_create_leaves_no_orphan() {
    const TRIES: usize = 200;
    let server = EtcdServer::shared();
    let url = format!("etcd://{}/{}?lease=2s", server.endpoint(), unique("fresh"));
    let (a, b) = (connect(&url).await, connect(&url).await);
    let mut rng = Rng::new();
    let mut cancelled = 0;
    for i in 0..TRIES {
        tokio::time::sleep(Duration::from_millis(40)).await;
        let limit = Duration::from_micros(rng.below(4_000));
        let name = format!("fresh-{i}");
        match tokio::time::timeout(limit, a.acquire(&name, options().no_wait())).await {
            Ok(Ok(guard)) => guard.release().await.expect("release"),
            Ok(Err(e)) => panic!("try {i} failed: {e:?}"),
            Err(_) => cancelled += 1,
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut left = Vec::new();
    for i in 0..TRIES {
        let name = format!("fresh-{i}");
        let info = b.inspect(&name).await.expect("inspect");
        if info.is_held() {
            left.push((name, info));
        }
    }
    assert!(
        left.is_empty(),
        "{} of {cancelled} cancelled tries left their key behind: {left:?}",
        left.len()
    );
}
