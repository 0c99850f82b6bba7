//! Deadlines under slow replies: every guard's `valid_until` is anchored at the moment
//! the request that started its lease was *sent*, so a slow reply never makes a guard
//! believe it is valid after the server could have given the lock to someone else. The
//! holder's client goes through a [`FaultProxy`] that delays every chunk by 150 ms each
//! way; the lease is a fixed 2 s; a second client, connected directly, must not be
//! granted before the first guard's `valid_until`, and the first guard reports loss no
//! later than that deadline + 250 ms.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock};
use fencelock_testkit::checker::Checker;
use fencelock_testkit::{EtcdServer, Fault, FaultProxy, RedisServer, ZkServer};
use tokio::time::Instant;

mod common;
use common::Servers;

const LEASE: Duration = Duration::from_secs(2);
const DELAY: Duration = Duration::from_millis(150);

fn unique(name: &str) -> String {
    common::unique(&format!("delay-{name}"))
}

/// How soon nothing of a scenario may be left on the servers (C5).
const LEFT_BOUND: Duration = Duration::from_secs(3);

async fn anchored_at_send(
    holder: &dyn DistributedLock,
    other: &dyn DistributedLock,
    proxies: &[&FaultProxy],
    servers: &Servers<'_>,
) {
    let checker = Checker::new();
    for proxy in proxies {
        proxy.set(Fault::Delay {
            min: DELAY,
            max: DELAY,
        });
    }
    let sent = Instant::now();
    let guard = holder
        .acquire("x", AcquireOptions::new().fixed_lease(LEASE).no_wait())
        .await
        .expect("acquire through the slow proxy");
    let answered = sent.elapsed();
    assert!(
        answered >= DELAY * 2,
        "the proxy did not delay ({answered:?})"
    );
    let valid_until = guard.valid_until();
    // Anchored at a reply, it would lie at least 2 x DELAY past the send + lease.
    assert!(
        valid_until < sent + LEASE + DELAY,
        "valid_until lies {:?} past the send + lease: anchored at a reply",
        valid_until - (sent + LEASE)
    );
    assert!(!guard.is_lost(), "a guard was handed out already lost");
    checker.enter("slow", guard.token().get());
    let loss = async {
        guard.lost().await;
        checker.lost("slow", guard.token().get(), guard.valid_until().into_std());
    };
    let next = async {
        let next = other
            .acquire("x", AcquireOptions::new().wait_timeout(LEASE * 5))
            .await
            .expect("the second client acquires after the fixed lease");
        let granted_at = Instant::now();
        assert!(
            granted_at >= valid_until,
            "a second holder was granted {:?} before the first guard's valid_until",
            valid_until - granted_at
        );
        next
    };
    let ((), next) = tokio::join!(loss, next);
    checker.enter("direct", next.token().get());
    checker.exit("direct", next.token().get());
    next.release().await.expect("release");
    checker.assert_no_overlap();
    checker.assert_tokens_increase();
    checker.assert_loss_reported_in_time();
    for proxy in proxies {
        proxy.set(Fault::Pass);
    }
    servers.assert_nothing_left_within("slow replies", LEFT_BOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_deadlines_are_anchored_at_send() {
    let server = EtcdServer::shared();
    let proxy = FaultProxy::start(&server.endpoint());
    let prefix = unique("etcd");
    let holder = fencelock::connect(&format!("etcd://{}/{prefix}", proxy.addr()))
        .await
        .unwrap();
    let other = fencelock::connect(&format!("etcd://{}/{prefix}", server.endpoint()))
        .await
        .unwrap();
    anchored_at_send(
        &*holder,
        &*other,
        &[&proxy],
        &Servers::Etcd(server, &prefix),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_deadlines_are_anchored_at_send() {
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let chroot = unique("zk");
    let url = |hosts: &str| format!("zk://{hosts}/{chroot}?min_lease=2s");
    let holder = fencelock::connect(&url(&proxy.addr())).await.unwrap();
    let other = fencelock::connect(&url(&server.connect_string()))
        .await
        .unwrap();
    // The chroot is made first, as on any deployment in use, so the acquire under test
    // takes the lock's own round trips (directory and node in one multi-op, then the
    // listing) through the slow proxy, not the chroot's creation as well: with it, five
    // delayed round trips could outlast the 2 s fixed lease on a busy machine, and the
    // acquire rightly failed with "the lease ran out before the grant was confirmed".
    other
        .acquire("warm-up", AcquireOptions::new().no_wait())
        .await
        .expect("the chroot is made")
        .release()
        .await
        .expect("release");
    anchored_at_send(&*holder, &*other, &[&proxy], &Servers::Zk(server, &chroot)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_deadlines_are_anchored_at_send() {
    let server = RedisServer::shared();
    let proxy = FaultProxy::start(&server.addr());
    let prefix = unique("redis");
    let holder = fencelock::connect(&format!("redis://{}?prefix={prefix}:", proxy.addr()))
        .await
        .unwrap();
    let other = fencelock::connect(&format!("{}?prefix={prefix}:", server.url()))
        .await
        .unwrap();
    anchored_at_send(
        &*holder,
        &*other,
        &[&proxy],
        &Servers::redis(server, &prefix),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_deadlines_are_anchored_at_send() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| FaultProxy::start(&s.addr()))
        .collect();
    let prefix = unique("redlock");
    let via =
        |addrs: Vec<String>| format!("redlock://{}?timeout=3s&prefix={prefix}:", addrs.join(","));
    let holder = fencelock::connect(&via(proxies.iter().map(FaultProxy::addr).collect()))
        .await
        .unwrap();
    let other = fencelock::connect(&via(servers.iter().map(RedisServer::addr).collect()))
        .await
        .unwrap();
    let proxies: Vec<&FaultProxy> = proxies.iter().collect();
    let servers = Servers::Redis(servers.iter().map(RedisServer::port).collect(), &prefix);
    anchored_at_send(&*holder, &*other, &proxies, &servers).await;
}

/// A wait timeout bounds the whole acquire, also against a server that stopped
/// answering (blackholed): `Err(Timeout)` (or a retryable error) within the timeout and
/// a small bound, on every backend, and nothing is left once it answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_timeout_bounds_an_acquire_against_a_hung_server() {
    let etcd = EtcdServer::shared();
    let zk = ZkServer::shared();
    let redis = RedisServer::shared();
    let cases = [
        ("etcd", etcd.endpoint(), "etcd://{}/{p}"),
        ("zk", zk.connect_string(), "zk://{}/{p}?min_lease=2s"),
        ("redis", redis.addr(), "redis://{}?prefix={p}:"),
    ];
    for (backend, upstream, template) in cases {
        let proxy = FaultProxy::start(&upstream);
        let prefix = unique(backend);
        let url = |host: &str| template.replace("{}", host).replace("{p}", &prefix);
        let locks = fencelock::connect(&url(&proxy.addr())).await.unwrap();
        proxy.set(Fault::Blackhole);
        let limit = Duration::from_secs(1);
        let started = Instant::now();
        let outcome = locks
            .acquire("x", AcquireOptions::new().wait_timeout(limit))
            .await;
        let took = started.elapsed();
        assert!(
            matches!(&outcome, Err(fencelock::Error::Timeout { .. }))
                || matches!(&outcome, Err(e) if e.is_retryable()),
            "{backend}: {:?}",
            outcome.map(|g| g.token())
        );
        assert!(
            took <= limit + Duration::from_millis(300),
            "{backend}: a 1 s wait took {took:?} against a hung server"
        );
        proxy.set(Fault::Pass);
        let direct = fencelock::connect(&url(&upstream)).await.unwrap();
        let guard = direct
            .acquire(
                "x",
                AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
            )
            .await
            .unwrap_or_else(|e| panic!("{backend}: the name stays blocked: {e:?}"));
        guard.release().await.unwrap();
        let servers = match backend {
            "etcd" => Servers::Etcd(etcd, &prefix),
            "zk" => Servers::Zk(zk, &prefix),
            _ => Servers::redis(redis, &prefix),
        };
        servers.assert_nothing_left_within(backend, LEFT_BOUND);
    }
}
