//! F5 and F6, a stalled server: the servers behind a running holder stop answering
//! (SIGSTOP, and for Redis also `CLIENT PAUSE ... ALL` and `DEBUG SLEEP`) while their
//! clocks keep running, then go on. Every stalled server is a dedicated one. Leases are
//! 2 s (etcd `?lease=2s`, ZooKeeper `?session_timeout=2s&min_lease=2s`, Redis from the
//! options).
//!
//! F5, a stall of 0.4 × lease (800 ms): no false alarm. The guard is not lost during or
//! after it (checked a lease and a half after the resume, so the first renewals after
//! the resume must have succeeded), the backend still names its token as the holder's,
//! another client is refused, a write with the token is accepted, and `release()` is
//! `Ok`.
//!
//! F6, a stall of 3 × lease (6 s): the holder reports loss during the stall, on its own
//! timer: before the resume, at most lease + 250 ms after the stall began and no later
//! than its `valid_until` + 250 ms (C6). After the resume another client, connected
//! before the stall, acquires within 1 s (ZooKeeper: session timeout + 1.5 s, see
//! `f5_f6_zookeeper`) with a larger token; the stalled holder's late write is rejected
//! (C2), its `release()` is `Err(Lost)`, and nothing is left behind.
//!
//! Deployments: etcd and ZooKeeper (one server each); a single Redis server stalled each
//! of the three ways; Redlock with all 3 instances stalled and with 2 of 3; Redis Cluster
//! (the master of the lock's slot); Redis Sentinel (the master; the long stall causes a
//! failover); the migration layer in `legacy-first` and `target-first` (Redis and etcd
//! legs, both servers stalled).
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error, MigrationPhase};
use fencelock_testkit::checker::{Checker, LOSS_BOUND};
use fencelock_testkit::{
    EtcdServer, RedisCluster, RedisSentinelSet, RedisServer, Server, ZkServer,
};
use tokio::time::Instant;

mod common;
use common::Servers;

const LEASE: Duration = Duration::from_secs(2);
/// F5: 0.4 × lease.
const SHORT_STALL: Duration = Duration::from_millis(800);
/// F6: 3 × lease.
const LONG_STALL: Duration = Duration::from_secs(6);
/// F6: how soon after the resume the next holder must be granted (but on ZooKeeper).
const AFTER_RESUME: Duration = Duration::from_secs(1);
/// How soon nothing of a scenario may be left on the servers (C5): a Redis waiter
/// marker lives two seconds at least.
const LEFT_BOUND: Duration = Duration::from_secs(3);

fn unique(name: &str) -> String {
    common::unique(&format!("stall-{name}"))
}

fn options() -> AcquireOptions {
    AcquireOptions::new().lease(LEASE)
}

/// How a deployment is stalled.
enum Stall<'a> {
    /// SIGSTOP every process, SIGCONT them all afterwards.
    Stop(Vec<&'a Server>),
    /// `CLIENT PAUSE <ms> ALL` on the Redis server at this URL.
    ClientPause(String),
    /// `DEBUG SLEEP <s>` on the Redis server at this URL (started with
    /// `--enable-debug-command local`).
    DebugSleep(String),
}

impl Stall<'_> {
    /// Stalls for `length` and returns once the servers run again.
    async fn run(&self, length: Duration) {
        match self {
            Stall::Stop(servers) => {
                for server in servers {
                    server.pause();
                }
                tokio::time::sleep(length).await;
                for server in servers {
                    server.resume();
                }
            }
            Stall::ClientPause(url) => {
                let mut conn = raw_redis(url).await;
                let _: String = redis::cmd("CLIENT")
                    .arg("PAUSE")
                    .arg(length.as_millis() as u64)
                    .arg("ALL")
                    .query_async(&mut conn)
                    .await
                    .expect("CLIENT PAUSE");
                tokio::time::sleep(length).await;
            }
            Stall::DebugSleep(url) => {
                let mut conn = raw_redis(url).await;
                let _: String = redis::cmd("DEBUG")
                    .arg("SLEEP")
                    .arg(length.as_secs_f64())
                    .query_async(&mut conn)
                    .await
                    .expect("DEBUG SLEEP");
            }
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Stall::Stop(_) => "SIGSTOP",
            Stall::ClientPause(_) => "CLIENT PAUSE",
            Stall::DebugSleep(_) => "DEBUG SLEEP",
        }
    }
}

/// A plain connection without a response timeout (`DEBUG SLEEP` answers after the sleep).
async fn raw_redis(url: &str) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    redis::Client::open(url)
        .expect("redis URL")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("raw redis connection")
}

/// F5 on `holder`, with `other` a second client of the same deployment.
async fn short_stall(
    label: &str,
    holder: &dyn DistributedLock,
    other: &dyn DistributedLock,
    stall: &Stall<'_>,
    name: &str,
    servers: &Servers<'_>,
) {
    let checker = Checker::new();
    let guard = holder
        .acquire(name, options().no_wait())
        .await
        .expect("holder acquires");
    let token = guard.token().get();
    checker.enter("holder", token);
    assert!(checker.write("holder", token));
    // A renewal or two first.
    tokio::time::sleep(LEASE / 2).await;
    assert!(!guard.is_lost(), "{label}: lost before the stall");

    let stalled_at = Instant::now();
    stall.run(SHORT_STALL).await;
    let resumed_at = Instant::now();
    // Long enough for the first renewals after the resume to have to succeed: without
    // them, the deadline would have passed.
    tokio::time::sleep(LEASE + LEASE / 2).await;
    eprintln!(
        "{label} F5 {}: stalled {:?}, valid_until {:?} after the resume",
        stall.describe(),
        resumed_at - stalled_at,
        guard.valid_until().saturating_duration_since(resumed_at)
    );
    assert!(
        !guard.is_lost(),
        "{label} F5 {}: a stall of {:?} made the guard lost: {:?}",
        stall.describe(),
        resumed_at - stalled_at,
        guard.lost_reason()
    );
    let info = other.inspect(name).await.expect("inspect");
    let holder_token = info.holder.as_ref().map(|h| h.token.get());
    assert_eq!(
        holder_token,
        Some(token),
        "{label}: after the stall the backend names another holder: {info:?}"
    );
    match other.acquire(name, options().no_wait()).await {
        Err(Error::Contended { .. }) => {}
        Ok(g) => panic!(
            "{label}: another client was granted the lock (token {}) after the stall",
            g.token()
        ),
        Err(e) => panic!("{label}: another client's try failed: {e:?}"),
    }
    assert!(
        checker.write("holder", token),
        "{label}: a write with the holder's token was rejected after the stall"
    );
    checker.exit("holder", token);
    guard
        .release()
        .await
        .unwrap_or_else(|e| panic!("{label}: release after the stall: {e:?}"));

    checker.assert_no_overlap();
    checker.assert_no_stale_write_accepted();
    checker.assert_no_lost_update(2);
    checker.assert_tokens_increase();
    checker.assert_loss_reported_in_time();
    servers.assert_nothing_left_within(label, LEFT_BOUND);
}

/// F6 on `holder`; `other`, connected before the stall, acquires after the resume
/// within `next_within`.
async fn long_stall(
    label: &str,
    holder: &dyn DistributedLock,
    other: &dyn DistributedLock,
    stall: &Stall<'_>,
    name: &str,
    next_within: Duration,
    servers: &Servers<'_>,
) {
    let checker = Checker::new();
    let guard = holder
        .acquire(name, options().no_wait())
        .await
        .expect("holder acquires");
    let token = guard.token().get();
    checker.enter("holder", token);
    assert!(checker.write("holder", token));
    tokio::time::sleep(LEASE / 2).await;
    assert!(!guard.is_lost(), "{label}: lost before the stall");

    let stalled_at = Instant::now();
    let loss = async {
        guard.lost().await;
        let lost_at = Instant::now();
        // The deadline the guard held when it reported loss (final from then on).
        let valid_until = guard.valid_until();
        checker.lost("holder", token, valid_until.into_std());
        (lost_at, valid_until)
    };
    let stalling = async {
        stall.run(LONG_STALL).await;
        Instant::now()
    };
    let ((lost_at, valid_until), resumed_at) = tokio::join!(loss, stalling);
    eprintln!(
        "{label} F6 {}: lost {:?} into the stall (valid_until {:?} into it): {:?}",
        stall.describe(),
        lost_at - stalled_at,
        valid_until.saturating_duration_since(stalled_at),
        guard.lost_reason()
    );
    assert!(
        lost_at <= stalled_at + LEASE + LOSS_BOUND && lost_at < resumed_at,
        "{label}: loss reported {:?} into a stall of {:?}: not within a lease + {LOSS_BOUND:?}, \
         before the resume",
        lost_at - stalled_at,
        resumed_at - stalled_at
    );

    let next = match other
        .acquire(name, options().wait_timeout(next_within))
        .await
    {
        Ok(next) => next,
        Err(e) => panic!(
            "{label}: another client did not acquire within {next_within:?} of the resume: {e:?}"
        ),
    };
    let granted_after = resumed_at.elapsed();
    eprintln!(
        "{label} F6 {}: the next holder was granted {granted_after:?} after the resume",
        stall.describe()
    );
    assert!(
        granted_after <= next_within,
        "{label}: the next holder was granted {granted_after:?} after the resume"
    );
    let next_token = next.token().get();
    checker.enter("other", next_token);
    assert!(checker.write("other", next_token));
    assert!(
        next_token > token,
        "{label}: the next token {next_token} is not larger than the stalled holder's {token}"
    );
    assert!(
        !checker.write("holder", token),
        "{label}: the stalled holder's late write was accepted"
    );
    let released = guard.release().await;
    assert!(
        matches!(released, Err(Error::Lost { .. })),
        "{label}: the stalled holder's release after the resume: {released:?}"
    );
    checker.exit("other", next_token);
    next.release().await.expect("the next holder releases");

    checker.assert_no_overlap();
    checker.assert_no_stale_write_accepted();
    checker.assert_no_lost_update(2);
    checker.assert_tokens_increase();
    checker.assert_loss_reported_in_time();

    // Nothing of either holder remains.
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let info = other.inspect(name).await.expect("inspect");
        if !info.is_held() && matches!(info.waiters, None | Some(0)) {
            break;
        }
        assert!(Instant::now() < deadline, "{label}: left behind: {info:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    servers.assert_nothing_left_within(label, LEFT_BOUND);
}

/// F5, then F6 on another name, with two clients connected before either.
async fn both(
    label: &str,
    url: String,
    stall: Stall<'_>,
    next_within: Duration,
    servers: Servers<'_>,
) {
    let holder = fencelock::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{label}: connect: {e:?}"));
    let other = fencelock::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("{label}: connect: {e:?}"));
    short_stall(label, &*holder, &*other, &stall, "short", &servers).await;
    long_stall(
        label,
        &*holder,
        &*other,
        &stall,
        "long",
        next_within,
        &servers,
    )
    .await;
}

/// etcd: after the resume the leader revokes the expired leases at once (its lease TTLs
/// ran on during the stall, on the monotonic clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_f6_etcd() {
    let server = EtcdServer::start();
    let prefix = unique("etcd");
    let url = format!("etcd://{}/{prefix}?lease=2s", server.endpoint());
    let servers = Servers::Etcd(&server, &prefix);
    both(
        "etcd",
        url,
        Stall::Stop(vec![&server]),
        AFTER_RESUME,
        servers,
    )
    .await;
}

/// ZooKeeper: at the resume the server expires the sessions whose timeout ran out
/// during the stall, and the holder's node goes with its session. That races with the
/// reconnect request the holder's client sent during the stall, still in the socket: when
/// the server reads that first, it revives the session (about 1 run in 10 here), whose
/// client has given up on it already (`zookeeper-client` expires a session locally after
/// 7/5 of its timeout without an answer), so the node lives until the revived session
/// expires, a session timeout (rounded up to a tick of 500 ms) after the resume. Hence
/// the bound: session timeout + 1.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_f6_zookeeper() {
    let server = ZkServer::start();
    let chroot = unique("zk");
    let url = format!(
        "zk://{}/{chroot}?session_timeout=2s&min_lease=2s",
        server.connect_string(),
    );
    let bound = LEASE + Duration::from_millis(1500);
    let servers = Servers::Zk(&server, &chroot);
    both("zookeeper", url, Stall::Stop(vec![&server]), bound, servers).await;
}

/// A single Redis server, stalled three ways (a server each, at once). Redis keeps the
/// absolute expiry time of every key, so the holder's key is expired at the resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_f6_redis() {
    let stop = RedisServer::start();
    let pause = RedisServer::start();
    let sleep = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let prefix = unique("redis");
    let url = |server: &RedisServer| format!("{}?prefix={prefix}:", server.url());
    tokio::join!(
        both(
            "redis SIGSTOP",
            url(&stop),
            Stall::Stop(vec![&stop]),
            AFTER_RESUME,
            Servers::redis(&stop, &prefix),
        ),
        both(
            "redis CLIENT PAUSE",
            url(&pause),
            Stall::ClientPause(pause.url()),
            AFTER_RESUME,
            Servers::redis(&pause, &prefix),
        ),
        both(
            "redis DEBUG SLEEP",
            url(&sleep),
            Stall::DebugSleep(sleep.url()),
            AFTER_RESUME,
            Servers::redis(&sleep, &prefix),
        ),
    );
}

/// Redlock over 3 instances: all of them stalled, and (on another 3) a majority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_f6_redlock() {
    let all: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let majority: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let prefix = unique("redlock");
    let url = |servers: &[RedisServer]| {
        let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
        format!("redlock://{}?prefix={prefix}:", hosts.join(","))
    };
    let ports = |servers: &[RedisServer]| servers.iter().map(RedisServer::port).collect();
    tokio::join!(
        both(
            "redlock (3 of 3 stalled)",
            url(&all),
            Stall::Stop(all.iter().map(|s| &**s).collect()),
            AFTER_RESUME,
            Servers::Redis(ports(&all), &prefix),
        ),
        both(
            "redlock (2 of 3 stalled)",
            url(&majority),
            Stall::Stop(majority[..2].iter().map(|s| &**s).collect()),
            AFTER_RESUME,
            Servers::Redis(ports(&majority), &prefix),
        ),
    );
}

/// The node of `cluster` that serves `key`'s slot (the others answer MOVED).
async fn cluster_owner<'a>(cluster: &'a RedisCluster, key: &str) -> &'a RedisServer {
    for node in cluster.nodes() {
        let mut conn = raw_redis(&node.url()).await;
        let found: redis::RedisResult<Option<String>> =
            redis::cmd("GET").arg(key).query_async(&mut conn).await;
        if found.is_ok() {
            return node;
        }
    }
    panic!("no cluster node serves {key}");
}

/// Redis Cluster (3 masters, no replicas): the master serving the lock's slot is
/// stalled. With no replica there is no failover: the slot is unavailable during the
/// stall (for 6 s the other masters mark it failed) and served again after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_f6_redis_cluster() {
    let cluster = RedisCluster::start(3);
    let prefix = unique("cluster");
    let url = format!("{}?prefix={prefix}:", cluster.url());
    let holder = fencelock::connect(&url).await.unwrap();
    let other = fencelock::connect(&url).await.unwrap();
    let short = cluster_owner(&cluster, &format!("{prefix}:{{short}}")).await;
    let stall = Stall::Stop(vec![short]);
    let servers = Servers::Redis(
        cluster.nodes().iter().map(RedisServer::port).collect(),
        &prefix,
    );
    short_stall("cluster", &*holder, &*other, &stall, "short", &servers).await;
    let long = cluster_owner(&cluster, &format!("{prefix}:{{long}}")).await;
    let stall = Stall::Stop(vec![long]);
    let (label, next) = ("cluster", AFTER_RESUME);
    long_stall(label, &*holder, &*other, &stall, "long", next, &servers).await;
}

/// Redis Sentinel (master, replica, 3 Sentinels with down-after 1 s): the master is
/// stalled. 800 ms is below down-after: no failover. 6 s is not: the Sentinels promote the
/// replica during the stall. The holder still reports loss on its own timer (its renewals
/// are stuck on the stalled master for the whole command timeout), and the next holder,
/// a client connected before the stall, is granted at the resume.
///
/// Where: on the promoted replica. The old master, after the resume, goes on acting as a
/// master for about 10 s until the Sentinels demote it, but both clients dropped their
/// connections to it on the Sentinels' `+switch-master` (see
/// `backend-redis/tests/failover.rs::a_returning_old_master_grants_nothing_after_the_failover`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_f6_redis_sentinel() {
    let set = RedisSentinelSet::start();
    let prefix = unique("sentinel");
    let url = format!("{}?prefix={prefix}:", set.url());
    // Both servers: the replica is master after the long stall.
    let servers = Servers::Redis(vec![set.master().port(), set.replica().port()], &prefix);
    both(
        "sentinel",
        url,
        Stall::Stop(vec![set.master()]),
        AFTER_RESUME,
        servers,
    )
    .await;
}

/// The migration layer in its mixed phases (legacy Redis, raw layout; target etcd), each
/// phase on servers of its own: both legs' servers are stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f5_f6_migration() {
    let legacy_first = (RedisServer::start(), EtcdServer::start());
    let target_first = (RedisServer::start(), EtcdServer::start());
    let prefix = unique("migrate");
    let url = |phase, (redis, etcd): &(RedisServer, EtcdServer)| {
        fencelock::migration_url(
            phase,
            &format!("{}?layout=raw&prefix={prefix}:", redis.url()),
            &format!("etcd://{}/{prefix}?lease=2s", etcd.endpoint()),
        )
    };
    tokio::join!(
        both(
            "migration legacy-first",
            url(MigrationPhase::LegacyFirst, &legacy_first),
            Stall::Stop(vec![&legacy_first.0, &legacy_first.1]),
            AFTER_RESUME,
            Servers::Both(
                Box::new(Servers::redis(&legacy_first.0, &prefix)),
                Box::new(Servers::Etcd(&legacy_first.1, &prefix)),
            ),
        ),
        both(
            "migration target-first",
            url(MigrationPhase::TargetFirst, &target_first),
            Stall::Stop(vec![&target_first.0, &target_first.1]),
            AFTER_RESUME,
            Servers::Both(
                Box::new(Servers::redis(&target_first.0, &prefix)),
                Box::new(Servers::Etcd(&target_first.1, &prefix)),
            ),
        ),
    );
}
