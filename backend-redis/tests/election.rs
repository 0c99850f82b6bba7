//! Leader election on real Redis servers, for what is specific to Redis: a leader whose
//! lease runs out publishes nothing, yet observers are told; the leader's value lives in
//! the lock key (and goes with it on release, revocation and expiry, and is renewed with
//! it); a plain lock's layout is unchanged; on Cluster everything of a term is in the
//! lock key's slot (and a raw name that cannot have it so is refused); observers stop
//! when dropped and report a closed client; on Redlock, a term is reported only once a
//! majority holds it confirmed, with the guard's token.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock, Error, Leader, LeaderChanges};
use fencelock_redis::{RedisConfig, RedisLock};
use fencelock_testkit::{RedisCluster, RedisServer};
use redis::AsyncCommands;

async fn locks(url: &str) -> RedisLock {
    RedisLock::connect(RedisConfig::from_url(url).unwrap())
        .await
        .unwrap()
}

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{:016x}", fastrand_u64())
}

fn fastrand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}

/// The next item of `changes` within `within`.
async fn next(changes: &mut LeaderChanges, within: Duration) -> Option<Leader> {
    tokio::time::timeout(within, changes.next())
        .await
        .expect("a change within the time limit")
        .expect("the observation goes on")
        .expect("observing works")
}

/// A leader with a fixed lease that nobody releases: Redis expires the key and publishes
/// nothing, and the observer (on another client) still reports "nobody leads", at the
/// key's expiry (its `PTTL` deadline), not earlier and not much later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiring_leader_is_reported_to_observers() {
    let url = RedisServer::shared().url();
    let (a, b) = (locks(&url).await, locks(&url).await);
    let election = unique("expiring");
    let lease = Duration::from_millis(800);
    let mut changes = b.observe(&election).await.unwrap();
    assert_eq!(next(&mut changes, Duration::from_secs(5)).await, None);
    let granted = Instant::now();
    let term = a
        .campaign(
            &election,
            "10.0.0.7:80",
            AcquireOptions::new().fixed_lease(lease),
        )
        .await
        .unwrap();
    assert_eq!(
        next(&mut changes, Duration::from_secs(5)).await,
        Some(Leader::new("10.0.0.7:80", term.token()))
    );
    // The term is neither released nor renewed: its key expires.
    assert_eq!(next(&mut changes, lease * 3).await, None);
    let seen = granted.elapsed();
    assert!(
        seen >= lease - Duration::from_millis(50),
        "reported after {seen:?}, before the lease of {lease:?} ran out"
    );
    assert!(
        seen <= lease + Duration::from_millis(500),
        "reported only after {seen:?} (lease {lease:?})"
    );
    tokio::time::timeout(Duration::from_secs(1), term.lost())
        .await
        .expect("the leader itself knows");
    assert_eq!(b.leader(&election).await.unwrap(), None);
}

/// The leader's value is stored in the lock key, after the owner and the token, with the
/// key's expiry: there is no other key to keep consistent. It is renewed with the lock,
/// and gone with it after a release, a revocation or an expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_value_lives_and_dies_with_the_lock_key() {
    let server = RedisServer::shared();
    let mut conn = raw(server).await;
    let lock = locks(&server.url()).await;
    let election = unique("value");
    let key = format!("fencelock:{{{election}}}");

    // Renewed with the lock: a lease of 300 ms, held for three of them.
    let lease = Duration::from_millis(300);
    let term = lock
        .campaign(
            &election,
            "a\nvalue with a newline",
            AcquireOptions::new().lease(lease),
        )
        .await
        .unwrap();
    tokio::time::sleep(lease * 3).await;
    assert!(!term.is_lost());
    let stored: String = conn.get(&key).await.unwrap();
    let (owner, rest) = stored.split_once('\n').expect("owner line");
    assert_eq!(
        rest,
        format!("{}\na\nvalue with a newline", term.token().get())
    );
    let pttl: i64 = conn.pttl(&key).await.unwrap();
    assert!(pttl > 0 && pttl <= 300, "{pttl}");
    let keys: Vec<String> = conn
        .keys(format!("fencelock:{{{election}}}*"))
        .await
        .unwrap();
    let mut keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [key.as_str(), &format!("{key}:token")],
        "no key but lock and counter"
    );
    assert_eq!(
        lock.leader(&election).await.unwrap(),
        Some(Leader::new("a\nvalue with a newline", term.token()))
    );
    // `inspect` names the owner line, and the term's token.
    let holder = lock.inspect(&election).await.unwrap().holder.unwrap();
    assert_eq!(holder.owner, owner);
    assert_eq!(holder.token, term.token());

    // Released: the key, and so the value, is gone.
    term.release().await.unwrap();
    let exists: bool = conn.exists(&key).await.unwrap();
    assert!(!exists);
    assert_eq!(lock.leader(&election).await.unwrap(), None);

    // Revoked: gone too, and the revoked leader is told (at its next renewal).
    let term = lock
        .campaign(&election, "second", AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    let revoked = lock.revoke(&election).await.unwrap().expect("a holder");
    assert_eq!(revoked.token, term.token());
    let exists: bool = conn.exists(&key).await.unwrap();
    assert!(!exists);
    tokio::time::timeout(Duration::from_secs(2), term.lost())
        .await
        .expect("the revoked leader is told");

    // Expired: gone with the key's PX.
    let term = lock
        .campaign(&election, "third", AcquireOptions::new().fixed_lease(lease))
        .await
        .unwrap();
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let exists: bool = conn.exists(&key).await.unwrap();
    assert!(!exists);
    assert_eq!(lock.leader(&election).await.unwrap(), None);
    drop(term);
}

/// A plain lock keeps its layout (the key holds the owner alone), publishes nothing on
/// the election channel, and reads as a leader with an empty value (locking and
/// campaigning exclude each other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_lock_is_a_leader_without_value() {
    let server = RedisServer::shared();
    let mut conn = raw(server).await;
    let lock = locks(&server.url()).await;
    let name = unique("plain");
    let key = format!("fencelock:{{{name}}}");
    let guard = lock.acquire(&name, AcquireOptions::new()).await.unwrap();
    let stored: String = conn.get(&key).await.unwrap();
    assert!(!stored.contains('\n'), "{stored:?}");
    assert_eq!(
        lock.inspect(&name).await.unwrap().holder.unwrap().owner,
        stored
    );
    assert_eq!(
        lock.leader(&name).await.unwrap(),
        Some(Leader::new("", guard.token()))
    );
    assert!(matches!(
        lock.campaign(&name, "v", AcquireOptions::new().no_wait())
            .await,
        Err(Error::Contended { .. })
    ));
    guard.release().await.unwrap();
}

/// A dropped observation unsubscribes from the election channel; closing the client
/// ends every observation with `Error::Closed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_stop_when_dropped_and_when_closed() {
    let server = RedisServer::shared();
    let lock = locks(&server.url()).await;
    let election = unique("stop");
    let channel = format!("fencelock:{{{election}}}:election");
    let subscribers = |server: &RedisServer| {
        fencelock_testkit::leftovers::redis_subscribed_channels(server.port(), &channel).len()
    };
    let changes = lock.observe(&election).await.unwrap();
    assert_eq!(subscribers(server), 1);
    drop(changes);
    let until = Instant::now() + Duration::from_secs(5);
    while subscribers(server) != 0 {
        assert!(Instant::now() < until, "still subscribed after the drop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut changes = lock.observe(&election).await.unwrap();
    assert_eq!(next(&mut changes, Duration::from_secs(5)).await, None);
    lock.close().await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), changes.next())
        .await
        .expect("the observation ends");
    assert!(
        matches!(ended, Some(Err(Error::Closed { .. }))),
        "{ended:?}"
    );
    assert!(
        tokio::time::timeout(Duration::from_secs(5), changes.next())
            .await
            .expect("and stays ended")
            .is_none()
    );
    assert!(matches!(
        lock.observe(&election).await,
        Err(Error::Closed { .. })
    ));
}

fn cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| RedisCluster::start(3))
}

/// On a Cluster, a term (lock key with the value, counter) lives on the master of the
/// lock key's slot and nowhere else, and the election channel hashes to that slot too;
/// observers on another client follow elections whose names fall on different masters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_terms_stay_in_their_slot() {
    let cluster = cluster();
    let (a, b) = (locks(&cluster.url()).await, locks(&cluster.url()).await);
    let slot_of = |key: &str| -> u16 {
        cluster
            .cli(&cluster.nodes()[0], &["cluster", "keyslot", key])
            .expect("CLUSTER KEYSLOT")
            .trim()
            .parse()
            .expect("a slot")
    };
    let mut masters = std::collections::HashSet::new();
    for i in 0..6 {
        let election = unique(&format!("cluster-{i}"));
        let key = format!("fencelock:{{{election}}}");
        let slot = slot_of(&key);
        assert_eq!(slot_of(&format!("{key}:election")), slot);
        assert_eq!(slot_of(&format!("{key}:token")), slot);
        let master = cluster.master_of_slot(slot).expect("a master");
        masters.insert(master.port());

        let mut changes = b.observe(&election).await.unwrap();
        assert_eq!(next(&mut changes, Duration::from_secs(5)).await, None);
        let term = a
            .campaign(&election, &format!("node-{i}"), AcquireOptions::new())
            .await
            .unwrap();
        assert_eq!(
            next(&mut changes, Duration::from_secs(5)).await,
            Some(Leader::new(format!("node-{i}"), term.token()))
        );
        let stored = cluster
            .cli(master, &["get", &key])
            .expect("GET on the slot's master");
        assert!(
            stored.trim_end().ends_with(&format!("\nnode-{i}")),
            "{stored:?}"
        );
        for node in cluster.nodes() {
            let found = cluster
                .cli(node, &["keys", &format!("*{election}*")])
                .unwrap_or_default();
            if node.port() == master.port() {
                assert_eq!(found.lines().count(), 2, "lock and counter: {found:?}");
            } else {
                assert!(found.trim().is_empty(), "on another master: {found:?}");
            }
        }
        term.release().await.unwrap();
        assert_eq!(next(&mut changes, Duration::from_secs(5)).await, None);
    }
    assert!(masters.len() > 1, "the names fell on one master only");
}

/// The raw layout on a Cluster: a lock key with `}` and no hash tag (`PREFIX` + `a}b`)
/// cannot have its counter, marker and channels in its slot (their `{…a}b}` tag hashes on
/// the part before the `}`), so every operation on that name is a typed `InvalidName`
/// before any I/O, never a `CROSSSLOT` script error. Names whose keys share the slot
/// still work (one with a tag and a `}` after it among them), and so does the odd name's
/// semaphore, whose keys share a slot of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_names_whose_keys_cannot_share_a_slot_are_invalid_on_a_cluster() {
    let cluster = cluster();
    let prefix = unique("raw");
    let lock = locks(&format!("{}?layout=raw&prefix={prefix}:", cluster.url())).await;
    let odd = "a}b";
    let invalid = |what: &str, outcome: Result<(), Error>| {
        assert!(
            matches!(outcome, Err(Error::InvalidName { .. })),
            "{what}: {outcome:?}"
        );
    };
    let no_wait = AcquireOptions::new().no_wait();
    invalid("acquire", lock.acquire(odd, no_wait).await.map(drop));
    invalid("campaign", lock.campaign(odd, "v", no_wait).await.map(drop));
    invalid("leader", lock.leader(odd).await.map(drop));
    invalid("observe", lock.observe(odd).await.map(drop));
    invalid("inspect", lock.inspect(odd).await.map(drop));
    invalid("revoke", lock.revoke(odd).await.map(drop));
    for name in ["plain", "{tag}x}y"] {
        let guard = lock.acquire(name, no_wait).await.expect(name);
        assert!(lock.inspect(name).await.unwrap().holder.is_some(), "{name}");
        guard.release().await.unwrap();
    }
    let permits = fencelock_core::Permits::new(1, 2).unwrap();
    let permit = lock
        .acquire_permits(odd, permits, no_wait)
        .await
        .expect("the odd name's semaphore");
    permit.release().await.unwrap();
}

/// Three Redlock instances, started once for this file's Redlock tests.
fn redlock() -> &'static [RedisServer] {
    static SERVERS: OnceLock<Vec<RedisServer>> = OnceLock::new();
    SERVERS.get_or_init(|| (0..3).map(|_| RedisServer::start()).collect())
}

fn redlock_url() -> String {
    let hosts: Vec<String> = redlock().iter().map(RedisServer::addr).collect();
    format!("redlock://{}", hosts.join(","))
}

/// Every reported leader until (and with) the one whose value is `value`, skipping
/// "nobody leads".
async fn reported_until(changes: &mut LeaderChanges, value: &str) -> Vec<Leader> {
    let mut reported = Vec::new();
    loop {
        if let Some(leader) = next(changes, Duration::from_secs(10)).await {
            let done = leader.value == value;
            reported.push(leader);
            if done {
                return reported;
            }
        }
    }
}

/// Issue 35, item 2, made to happen at every term: the third Redlock instance is held by
/// someone else with its counter far ahead of the clocks, so the two granting instances
/// answer the candidate's proposal while the guard's token is one more than that
/// counter, written back after the grant. Before, an observer reading between the grant
/// and that write reported the term with the proposal (a token the leader never had),
/// then again with the guard's. Now every term is reported once, with the guard's token,
/// and `leader()` names that token too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_observers_report_the_guards_token_when_an_instance_is_ahead() {
    let servers = redlock();
    let url = redlock_url();
    let (candidate, observer) = (locks(&url).await, locks(&url).await);
    let election = unique("redlock-ahead");
    let key = format!("fencelock:{{{election}}}");
    let mut third = raw(&servers[2]).await;
    let () = third.set_ex(&key, "someone else's lock", 60).await.unwrap();
    let mut changes = observer.observe(&election).await.unwrap();
    assert_eq!(next(&mut changes, Duration::from_secs(5)).await, None);
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    for n in 0..30u64 {
        // The third instance's counter is ahead of every proposal, and of the last term.
        let ahead = now_us + 1_000_000_000 * (n + 1);
        let () = third
            .set_ex(format!("{key}:token"), ahead, 600)
            .await
            .unwrap();
        let value = format!("term-{n}");
        let term = candidate
            .campaign(&election, &value, AcquireOptions::new())
            .await
            .unwrap();
        assert_eq!(term.token().get(), ahead + 1, "the guard's token");
        let reported = reported_until(&mut changes, &value).await;
        assert_eq!(
            reported,
            [Leader::new(value.clone(), term.token())],
            "term {n}: reported otherwise than once with the guard's token"
        );
        assert_eq!(
            observer.leader(&election).await.unwrap(),
            Some(Leader::new(value, term.token()))
        );
        term.release().await.unwrap();
    }
}

/// A Redlock grant caught before it is confirmed: a majority of instances hold the
/// candidate's provisional term lines (each instance's own answer, `?` before the token),
/// so `leader()` names nobody and an observer reports nothing; once a majority holds the
/// confirmed line (the guard's token) and it is published, the observer reports it, with
/// that token, and `leader()` names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_reports_a_term_only_once_a_majority_holds_it_confirmed() {
    let servers = redlock();
    let observer = locks(&redlock_url()).await;
    let election = unique("redlock-provisional");
    let key = format!("fencelock:{{{election}}}");
    let channel = format!("{key}:election");
    let owner = "0123456789abcdef0123456789abcdef:1";
    let mut conns = Vec::new();
    for server in servers {
        conns.push(raw(server).await);
    }
    let mut changes = observer.observe(&election).await.unwrap();
    assert_eq!(next(&mut changes, Duration::from_secs(5)).await, None);
    for conn in &mut conns[..2] {
        let () = conn
            .set_ex(&key, format!("{owner}\n?673\np1"), 60)
            .await
            .unwrap();
        let () = conn.set_ex(format!("{key}:token"), 673, 600).await.unwrap();
    }
    let () = conns[2]
        .set_ex(&key, "the previous leader's key", 60)
        .await
        .unwrap();
    let () = conns[2]
        .set_ex(format!("{key}:token"), 948, 600)
        .await
        .unwrap();
    for conn in &mut conns {
        let _: i64 = conn.publish(&channel, "1").await.unwrap();
    }
    assert_eq!(observer.leader(&election).await.unwrap(), None);
    let holder = observer.inspect(&election).await.unwrap().holder;
    assert_eq!(holder.map(|h| h.owner), Some(owner.to_owned()), "held");
    // Confirmed on one instance only: still nobody.
    let () = conns[0]
        .set_ex(&key, format!("{owner}\n949\np1"), 60)
        .await
        .unwrap();
    let _: i64 = conns[0].publish(&channel, "1").await.unwrap();
    assert_eq!(observer.leader(&election).await.unwrap(), None);
    // On a majority.
    let () = conns[1]
        .set_ex(&key, format!("{owner}\n949\np1"), 60)
        .await
        .unwrap();
    let _: i64 = conns[1].publish(&channel, "1").await.unwrap();
    let expected = Leader::new("p1", fencelock_core::FencingToken::new(949));
    assert_eq!(
        next(&mut changes, Duration::from_secs(5)).await,
        Some(expected.clone()),
        "the first report is the confirmed term"
    );
    assert_eq!(observer.leader(&election).await.unwrap(), Some(expected));
    for conn in &mut conns {
        let _: i64 = conn.del(&key).await.unwrap();
        let _: i64 = conn.publish(&channel, "0").await.unwrap();
    }
    assert_eq!(next(&mut changes, Duration::from_secs(5)).await, None);
}
