//! Sessions, one per lease duration: bounded in number (each is a connection, and
//! ZooKeeper limits connections per client address, `maxClientCnxns`, 60 by default), and
//! leases checked against `min_lease`, at acquire and at extend. They live on the client's
//! runtime, whichever call opened them, and a dropped `close` still closes them all.

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Error, LossCause};
use fencelock_testkit::{Fault, FaultProxy, ZkServer};
use fencelock_zk::{ZkConfig, ZkLock};

async fn client() -> ZkLock {
    client_of(ZkServer::shared()).await
}

async fn client_of(server: &ZkServer) -> ZkLock {
    let url = format!(
        "zk://{}/sessions-{:x}?min_lease=1s",
        server.connect_string(),
        std::process::id()
    );
    ZkLock::connect(ZkConfig::from_url(&url).unwrap())
        .await
        .unwrap()
}

fn lease(i: u64) -> AcquireOptions {
    AcquireOptions::new()
        .lease(Duration::from_millis(2000 + 10 * i))
        .no_wait()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_lease_durations_over_time_reuse_a_bounded_set_of_sessions() {
    let server = ZkServer::start();
    let locks = client_of(&server).await;
    // More distinct durations than the default connection limit, one after the other.
    for i in 0..70 {
        let guard = locks
            .acquire(&format!("n{i}"), lease(i))
            .await
            .unwrap_or_else(|e| panic!("lease {i}: {e:?}"));
        guard.release().await.unwrap();
    }
    // Closed sessions take a moment to show on the server.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let connections = server
        .four_letter_word("cons")
        .unwrap()
        .lines()
        .filter(|l| l.contains("sid="))
        .count();
    assert!(
        connections <= fencelock_zk_max_sessions() + 1,
        "{connections} connections open on the server"
    );
}

/// The bound documented by the backend (8 sessions per client).
fn fencelock_zk_max_sessions() -> usize {
    8
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_durations_held_at_once_is_a_typed_error() {
    let locks = client().await;
    let mut held = Vec::new();
    let mut refused = None;
    for i in 0..12 {
        match locks.acquire(&format!("held{i}"), lease(100 + i)).await {
            Ok(guard) => held.push(guard),
            Err(error) => {
                refused = Some(error);
                break;
            }
        }
    }
    let error = refused.expect("12 distinct durations held at once were all accepted");
    assert!(matches!(error, Error::InvalidConfig(_)), "{error:?}");
    assert!(held.len() >= 4, "only {} held", held.len());
    for guard in held {
        guard.release().await.unwrap();
    }
    // Room again once the locks are released.
    let guard = locks.acquire("again", lease(200)).await.unwrap();
    guard.release().await.unwrap();
}

/// With `min_lease` above 30 s (the default lease of other backends), an acquire without
/// a lease takes the client's session timeout, its configured default, which meets that
/// minimum: it is granted, not refused with `InvalidConfig`. A shorter lease asked for
/// is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_min_lease_above_thirty_seconds_allows_acquires_without_a_lease() {
    let url = format!(
        "zk://{}/sessions-min-{:x}?session_timeout=35s&min_lease=35s",
        ZkServer::shared().connect_string(),
        std::process::id()
    );
    let locks = ZkLock::connect(ZkConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    let guard = locks
        .acquire("default-lease", AcquireOptions::new().no_wait())
        .await
        .expect("an acquire with the configured default lease");
    guard.release().await.unwrap();
    let short = locks
        .acquire(
            "default-lease",
            AcquireOptions::new().lease(Duration::from_secs(20)),
        )
        .await;
    assert!(matches!(short, Err(Error::InvalidConfig(_))), "{short:?}");
}

/// `extend` refuses a lease shorter than `min_lease`, as `acquire` does, before sending
/// anything: the guard keeps its deadline. A lease of at least `min_lease` extends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_refuses_a_lease_shorter_than_min_lease() {
    let url = format!(
        "zk://{}/sessions-extend-{:x}?min_lease=2s",
        ZkServer::shared().connect_string(),
        std::process::id()
    );
    let locks = ZkLock::connect(ZkConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    let guard = locks
        .acquire(
            "extend",
            AcquireOptions::new()
                .fixed_lease(Duration::from_secs(2))
                .no_wait(),
        )
        .await
        .unwrap();
    // Less than 1.9 s of the lease is left now: a 1.9 s extension would move the
    // deadline, so the guard hands it to the backend.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = guard.valid_until();
    let short = guard.extend(Duration::from_millis(1900)).await;
    assert!(matches!(short, Err(Error::InvalidConfig(_))), "{short:?}");
    assert_eq!(guard.valid_until(), before);
    assert!(!guard.is_lost());
    guard.extend(Duration::from_secs(2)).await.unwrap();
    assert!(guard.valid_until() > before);
    guard.release().await.unwrap();
}

/// A session runs on the client's runtime, not on that of the acquire that opened it:
/// when that runtime ended (a `block_on`, another test's), the session's connection and
/// its renewals ended with it, and every later lock of that lease duration was refused
/// or lost.
#[test]
fn a_session_outlives_the_runtime_of_the_acquire_that_opened_it() {
    let runtime = |threads| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .unwrap()
    };
    let main = runtime(2);
    let locks = main.block_on(client());
    // Not the configured session timeout: this acquire opens a session of its own.
    let options = AcquireOptions::new()
        .no_wait()
        .lease(Duration::from_secs(3));
    let short = runtime(1);
    let first = short
        .block_on(locks.acquire("outlives-first", options))
        .unwrap();
    short.block_on(first.release()).unwrap();
    drop(short);
    main.block_on(async {
        let guard = tokio::time::timeout(
            Duration::from_secs(10),
            locks.acquire("outlives-second", options),
        )
        .await
        .expect("the acquire answers")
        .expect("granted in the session the ended runtime opened");
        // Past the session timeout: renewed all along.
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert!(!guard.is_lost(), "{:?}", guard.lost_reason());
        guard.release().await.unwrap();
    });
}

/// A `close` dropped before it is done still gives up the locks of every session (here
/// two, of two lease durations): their guards report the loss at once and their nodes
/// are deleted in the background, which a second `close` waits for; the names are free
/// for others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_close_still_gives_up_the_locks_of_every_session() {
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let url = |hosts: &str| {
        format!(
            "zk://{hosts}/sessions-close-{:x}?min_lease=1s&session_timeout=4s",
            std::process::id()
        )
    };
    let locks = ZkLock::connect(ZkConfig::from_url(&url(&proxy.addr())).unwrap())
        .await
        .unwrap();
    let other = ZkLock::connect(ZkConfig::from_url(&url(&server.connect_string())).unwrap())
        .await
        .unwrap();
    let options = AcquireOptions::new().no_wait();
    let guards = [
        locks.acquire("close-a", options).await.unwrap(),
        locks
            .acquire("close-b", options.lease(Duration::from_secs(3)))
            .await
            .unwrap(),
    ];
    proxy.set(Fault::DelayReplies(Duration::from_millis(500)));
    let dropped = tokio::time::timeout(Duration::from_millis(200), locks.close()).await;
    assert!(
        dropped.is_err(),
        "the close did not wait for a reply: {dropped:?}"
    );
    for guard in &guards {
        assert_eq!(
            guard.lost_cause(),
            Some(LossCause::ClientClosed),
            "{}: {:?}",
            guard.name(),
            guard.lost_reason()
        );
    }
    proxy.set(Fault::Pass);
    locks.close().await.expect("the second close");
    for guard in &guards {
        let next = other
            .acquire(
                guard.name(),
                AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
            )
            .await
            .unwrap_or_else(|e| panic!("{} is not free: {e}", guard.name()));
        next.release().await.unwrap();
    }
}
