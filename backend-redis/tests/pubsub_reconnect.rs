//! Unlock notifications across a broken pub/sub connection, on real servers: a waiter
//! that subscribes while the connection is being re-established must not cost the other
//! waiters their wake-ups, a waiter that gives up in that window must not be subscribed
//! again, and a SUBSCRIBE that fails on a dead connection must be retried on a new one.
//!
//! On a Cluster, a waiter subscribes on the master that serves its lock's slot, so the
//! unlock message reaches it without a hop over the cluster bus.
//!
//! Every test starts its own server: `CLIENT KILL TYPE pubsub` would cut the pub/sub
//! connections of every other test on a shared one.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, LockGuard};
use fencelock_redis::{RedisConfig, RedisLock};
use fencelock_testkit::{RedisCluster, RedisServer};
use redis::AsyncCommands;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The holders' (renewing) lease: a waiter that misses its wake-up sleeps most of it.
const LEASE: Duration = Duration::from_secs(10);

/// How long a hand-off may take when the unlock message arrives.
const HANDOFF: Duration = Duration::from_secs(1);

/// How long a (re)subscription may take to show up on the server.
const SETTLE: Duration = Duration::from_secs(3);

/// How long after losing its pub/sub connection the client reconnects, at the least (the
/// subscriber's first backoff step, before its jitter of up to a quarter more). A waiter
/// that starts within it of the kill subscribes while there is no connection.
const RECONNECT_DELAY: Duration = Duration::from_millis(100);

/// The locks whose waiter is meant to start inside the reconnect window: one per kill,
/// as many kills as a busy machine gets to start one in time.
const IN_WINDOW: [&str; 5] = ["c", "c2", "c3", "c4", "c5"];

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn locks(url: &str) -> RedisLock {
    RedisLock::connect(RedisConfig::from_url(url).unwrap())
        .await
        .unwrap()
}

/// The unlock channel of lock `name` under `prefix=prc:`.
fn channel(name: &str) -> String {
    format!("prc:{{{name}}}:unlock")
}

/// How many connections are subscribed to the unlock channel of `name`.
async fn subscribers(conn: &mut redis::aio::MultiplexedConnection, name: &str) -> i64 {
    let (_, count): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel(name))
        .query_async(conn)
        .await
        .unwrap();
    count
}

/// The subscriber counts of `names`, in order.
async fn all_subscribers(conn: &mut redis::aio::MultiplexedConnection, names: &[&str]) -> Vec<i64> {
    let mut counts = Vec::new();
    for name in names {
        counts.push(subscribers(conn, name).await);
    }
    counts
}

/// Waits until the subscriber counts of `names` are `want`; returns the last counts seen.
async fn await_subscribers(
    conn: &mut redis::aio::MultiplexedConnection,
    names: &[&str],
    want: &[i64],
) -> Vec<i64> {
    let deadline = Instant::now() + SETTLE;
    loop {
        let counts = all_subscribers(conn, names).await;
        if counts == want || Instant::now() >= deadline {
            return counts;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the server has exactly one pub/sub client, not one of `old`, and the
/// subscriber counts of `names` are `want`; returns the last counts seen.
async fn await_new_connection(
    conn: &mut redis::aio::MultiplexedConnection,
    old: &[u16],
    names: &[&str],
    want: &[i64],
) -> Vec<i64> {
    let deadline = Instant::now() + SETTLE;
    loop {
        let ports = pubsub_client_ports(conn).await;
        let counts = all_subscribers(conn, names).await;
        let renewed = ports.len() == 1 && !old.contains(&ports[0]);
        if (renewed && counts == want) || Instant::now() >= deadline {
            assert!(renewed, "no new pub/sub connection: {old:?} then {ports:?}");
            return counts;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `CLIENT KILL TYPE pubsub`: cuts every pub/sub connection; returns how many.
async fn kill_pubsub(conn: &mut redis::aio::MultiplexedConnection) -> i64 {
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(conn)
        .await
        .unwrap()
}

async fn hold(locks: &RedisLock, name: &str) -> LockGuard {
    locks
        .acquire(name, AcquireOptions::new().lease(LEASE))
        .await
        .unwrap()
}

/// A waiter for `name` (it would get the lock when the holder's lease ran out at the
/// latest, long after [`HANDOFF`]).
fn wait_for(locks: &RedisLock, name: &'static str) -> JoinHandle<LockGuard> {
    let locks = locks.clone();
    tokio::spawn(async move {
        locks
            .acquire(
                name,
                AcquireOptions::new()
                    .lease(LEASE)
                    .wait_timeout(Duration::from_secs(60)),
            )
            .await
            .unwrap()
    })
}

/// Releases `holder` and expects `waiter` to have the lock within [`HANDOFF`], with a
/// larger token; returns the waiter's guard.
async fn hand_off(
    name: &str,
    holder: LockGuard,
    waiter: JoinHandle<LockGuard>,
    before: &[i64],
) -> LockGuard {
    let token = holder.token();
    let released = Instant::now();
    holder.release().await.unwrap();
    let Ok(guard) = tokio::time::timeout(HANDOFF, waiter).await else {
        panic!(
            "`{name}` was not handed over within {HANDOFF:?} of its release \
             (subscribers per channel before the releases: {before:?})"
        );
    };
    let guard = guard.unwrap();
    assert!(
        guard.token() > token,
        "{name}: token {} after {}",
        guard.token(),
        token
    );
    assert!(released.elapsed() < HANDOFF);
    guard
}

/// The reported defect. A client waits on `a` and `b`; its pub/sub connection is killed;
/// before the reconnect (100 ms later) the same client starts waiting on `c`. All three
/// channels must be subscribed again, and each release hands its lock over at once, not
/// when the holder's 10 s lease would have run out.
///
/// The waiter on `c` must start inside that 100 ms; a busy machine may take longer to
/// start it. Then the window was missed and nothing shown: that waiter gives up, the
/// reconnection is awaited, and the connection is killed again with a fresh lock in the
/// role of `c` (a few times at most). Only a kill whose waiter started in time is
/// carried on to the hand-offs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_during_reconnect_keeps_every_waiter() {
    let server = RedisServer::start();
    let url = format!("{}?prefix=prc:", server.url());
    let mut admin = raw(&server).await;
    let holder = locks(&url).await;
    let other = locks(&url).await;
    let (a, b) = (hold(&holder, "a").await, hold(&holder, "b").await);

    let wait_a = wait_for(&other, "a");
    let wait_b = wait_for(&other, "b");
    let seen = await_subscribers(&mut admin, &["a", "b"], &[1, 1]).await;
    assert_eq!(seen, [1, 1], "the waiters on a and b never subscribed");

    let mut missed = Vec::new();
    let (c_name, c, wait_c) = 'window: {
        for name in IN_WINDOW {
            let c = hold(&holder, name).await;
            let old = pubsub_client_ports(&mut admin).await;
            let killed_at = Instant::now();
            assert_eq!(kill_pubsub(&mut admin).await, 1);
            let wait_c = wait_for(&other, name);
            // c's first refused try marks the lock; the waiter subscribes right after it.
            let marker = format!("prc:{{{name}}}:waiters");
            while !admin.exists::<_, bool>(&marker).await.unwrap() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let started = killed_at.elapsed();
            if started < RECONNECT_DELAY {
                break 'window (name, c, wait_c);
            }
            // Too late: c subscribed after the reconnection, if at all. Give up on it and
            // start over on the reconnected client.
            missed.push(started);
            wait_c.abort();
            assert!(wait_c.await.is_err_and(|e| e.is_cancelled()));
            let seen = await_new_connection(&mut admin, &old, &["a", "b", name], &[1, 1, 0]).await;
            assert_eq!(
                seen,
                [1, 1, 0],
                "after a kill outside the window (a, b, {name})"
            );
            c.release().await.unwrap();
        }
        panic!(
            "no waiter started within {RECONNECT_DELAY:?} of the kill, in {} tries: {missed:?}",
            IN_WINDOW.len()
        );
    };
    let seen = await_subscribers(&mut admin, &[c_name], &[1]).await;
    assert_eq!(seen, [1], "the waiter on {c_name} never subscribed");
    // Well past the reconnect delay.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = all_subscribers(&mut admin, &["a", "b", c_name]).await;

    let a = hand_off("a", a, wait_a, &before).await;
    let b = hand_off("b", b, wait_b, &before).await;
    let c = hand_off(c_name, c, wait_c, &before).await;
    for guard in [a, b, c] {
        guard.release().await.unwrap();
    }
}

/// Whatever happens in the reconnect window is reflected afterwards: a waiter that gives
/// up in the window (its acquire is dropped) is not subscribed again, one that starts in
/// it is, and those that kept waiting are. Two rounds, so that a reconnection made by the
/// first round's fix is itself cut and restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_restores_exactly_the_live_channels() {
    let server = RedisServer::start();
    let url = format!("{}?prefix=prc:", server.url());
    let mut admin = raw(&server).await;
    let holder = locks(&url).await;
    let other = locks(&url).await;
    let (a, b, c, d) = (
        hold(&holder, "a").await,
        hold(&holder, "b").await,
        hold(&holder, "c").await,
        hold(&holder, "d").await,
    );

    let wait_a = wait_for(&other, "a");
    let wait_b = wait_for(&other, "b");
    let wait_d = wait_for(&other, "d");
    let names = ["a", "b", "c", "d"];
    let seen = await_subscribers(&mut admin, &names, &[1, 1, 0, 1]).await;
    assert_eq!(seen, [1, 1, 0, 1], "the first waiters never subscribed");

    // Round 1: d gives up and c starts waiting while the connection is down.
    let first = pubsub_client_ports(&mut admin).await;
    assert_eq!(kill_pubsub(&mut admin).await, 1);
    wait_d.abort();
    let wait_c = wait_for(&other, "c");
    let seen = await_new_connection(&mut admin, &first, &names, &[1, 1, 1, 0]).await;
    assert_eq!(seen, [1, 1, 1, 0], "after the first reconnect (a, b, c, d)");

    // Round 2: the restored connection is cut again, with nothing else happening.
    let second = pubsub_client_ports(&mut admin).await;
    assert_eq!(kill_pubsub(&mut admin).await, 1);
    let seen = await_new_connection(&mut admin, &second, &names, &[1, 1, 1, 0]).await;
    assert_eq!(
        seen,
        [1, 1, 1, 0],
        "after the second reconnect (a, b, c, d)"
    );

    let a = hand_off("a", a, wait_a, &seen).await;
    let b = hand_off("b", b, wait_b, &seen).await;
    let c = hand_off("c", c, wait_c, &seen).await;
    for guard in [a, b, c, d] {
        guard.release().await.unwrap();
    }
}

/// Per proxied connection: the local port of its upstream side (as the server's
/// `CLIENT LIST` shows it) and whether it swallows traffic.
type Links = Arc<Mutex<Vec<(u16, Arc<AtomicBool>)>>>;

/// A TCP proxy in front of a server whose connections can be made to swallow all
/// traffic (both ways) without closing, as a dead network path does.
struct Proxy {
    port: u16,
    links: Links,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let links = Links::default();
        let registry = links.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let frozen = Arc::new(AtomicBool::new(false));
                let upstream = server.local_addr().unwrap().port();
                registry.lock().unwrap().push((upstream, frozen.clone()));
                pump(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    frozen.clone(),
                );
                pump(server, client, frozen);
            }
        });
        Proxy { port, links }
    }

    /// Makes the connection whose upstream local port is `upstream` swallow traffic.
    fn freeze(&self, upstream: u16) {
        let links = self.links.lock().unwrap();
        let (_, frozen) = links
            .iter()
            .find(|(port, _)| *port == upstream)
            .expect("no proxied connection with that port");
        frozen.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until either closes, dropping the bytes while `frozen`.
fn pump(mut from: TcpStream, mut to: TcpStream, frozen: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let mut buf = [0; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if !frozen.load(Ordering::SeqCst) && to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

/// The ports (as seen by the server) of its pub/sub clients.
async fn pubsub_client_ports(conn: &mut redis::aio::MultiplexedConnection) -> Vec<u16> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(conn)
        .await
        .unwrap();
    list.lines()
        .filter_map(|line| {
            let addr = line.split(' ').find_map(|f| f.strip_prefix("addr="))?;
            addr.rsplit(':').next()?.parse().ok()
        })
        .collect()
}

/// A SUBSCRIBE that fails (here: times out on a connection that went silent without
/// closing) is retried on a new connection, together with every other live channel;
/// the waiters on the channels subscribed before the failure keep getting their
/// wake-ups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_subscribe_is_retried_with_every_channel() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port());
    let mut admin = raw(&server).await;
    let holder = locks(&format!("{}?prefix=prc:", server.url())).await;
    // Behind the proxy, with a short command timeout so the silent SUBSCRIBE fails soon.
    let other = locks(&format!(
        "redis://127.0.0.1:{}?prefix=prc:&timeout=300ms",
        proxy.port
    ))
    .await;
    let (a, b, c) = (
        hold(&holder, "a").await,
        hold(&holder, "b").await,
        hold(&holder, "c").await,
    );

    let wait_a = wait_for(&other, "a");
    let wait_b = wait_for(&other, "b");
    let names = ["a", "b", "c"];
    let seen = await_subscribers(&mut admin, &names, &[1, 1, 0]).await;
    assert_eq!(seen, [1, 1, 0], "the waiters on a and b never subscribed");

    // The pub/sub connection goes silent: c's SUBSCRIBE gets no answer.
    let ports = pubsub_client_ports(&mut admin).await;
    assert_eq!(ports.len(), 1, "{ports:?}");
    proxy.freeze(ports[0]);
    let wait_c = wait_for(&other, "c");
    // The silent connection counts on the server until it is closed: wait for a new
    // one that carries all three channels.
    let seen = await_new_connection(&mut admin, &ports, &names, &[1, 1, 1]).await;
    assert_eq!(seen, [1, 1, 1], "after the failed SUBSCRIBE (a, b, c)");

    let a = hand_off("a", a, wait_a, &seen).await;
    let b = hand_off("b", b, wait_b, &seen).await;
    let c = hand_off("c", c, wait_c, &seen).await;
    for guard in [a, b, c] {
        guard.release().await.unwrap();
    }
}

/// Classic `PUBLISH` on a Cluster reaches every node, but a subscriber on another node
/// than the publisher's gets the message one hop over the cluster bus later: long
/// enough for the releasing client to take the lock again first (hand-overs among four
/// clients fell from about 5,000/s to 300-700/s on names of the other masters). So the
/// waiter must subscribe on the master of its lock's slot, for every master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_waiter_subscribes_on_the_master_of_its_slot() {
    let cluster = RedisCluster::start(3);
    let holder = locks(&cluster.url()).await;
    let waiter = locks(&cluster.url()).await;
    let mut masters_seen = Vec::new();
    for i in 0.. {
        let name = format!("slot-{i}");
        let channel = format!("fencelock:{{{name}}}:unlock");
        let slot: u16 = cluster
            .cli(&cluster.nodes()[0], &["cluster", "keyslot", &channel])
            .and_then(|s| s.trim().parse().ok())
            .expect("CLUSTER KEYSLOT");
        let master = cluster
            .master_of_slot(slot)
            .expect("a master serves the slot");
        if masters_seen.contains(&master.port()) {
            continue;
        }
        masters_seen.push(master.port());
        let guard = holder
            .acquire(&name, AcquireOptions::new().lease(LEASE))
            .await
            .unwrap();
        let waiting = tokio::spawn({
            let waiter = waiter.clone();
            async move { waiter.acquire(&name, AcquireOptions::new()).await }
        });
        // PUBSUB NUMSUB counts the subscribers connected to the node asked.
        let subscribed = Instant::now() + SETTLE;
        loop {
            let numsub = cluster
                .cli(master, &["pubsub", "numsub", &channel])
                .unwrap_or_default();
            if numsub.lines().nth(1).map(str::trim) == Some("1") {
                break;
            }
            assert!(
                Instant::now() < subscribed,
                "the waiter did not subscribe on the master of slot {slot} (port {}): {numsub:?}",
                master.port()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        guard.release().await.unwrap();
        let granted = tokio::time::timeout(HANDOFF, waiting)
            .await
            .expect("woken by the unlock message")
            .unwrap()
            .unwrap();
        granted.release().await.unwrap();
        if masters_seen.len() == cluster.nodes().len() {
            break;
        }
    }
}
