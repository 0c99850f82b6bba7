//! Leader election on real Redis servers, for what is specific to Redis: a leader whose
//! lease runs out publishes nothing, yet observers are told; the leader's value lives in
//! the lock key (and goes with it on release, revocation and expiry, and is renewed with
//! it); a plain lock's layout is unchanged; on Cluster everything of a term is in the
//! lock key's slot (and a raw name that cannot have it so is refused); observers stop
//! when dropped and report a closed client.

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
