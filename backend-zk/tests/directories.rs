//! A lock's directory goes with its last node: release removes the directory it leaves
//! empty (in the same multi-op as its node), so locking many distinct names does not grow
//! the server (ZooKeeper's container reaper removes at most 10,000 empty containers a
//! minute by default). An acquire that races the removal makes the directory again and
//! goes on; a waiter keeps the directory, and its place in line, through the holder's
//! release; under the root `/`, a directory the acquire did not make (it may be another
//! application's node) is never removed.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Permits};
use fencelock_testkit::ZkServer;
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};

const STEP: Duration = Duration::from_secs(20);

fn root() -> String {
    format!("/directories-{:016x}", fastrand::u64(..))
}

async fn client_of(server: &ZkServer, root: &str) -> ZkLock {
    let config = ZkConfig::new(server.connect_string())
        .with_chroot(root)
        .unwrap()
        .with_session_timeout(Duration::from_secs(10));
    ZkLock::connect(config).await.expect("connect")
}

/// The children of `path`, after a `sync`; none if it is gone.
async fn children(lock: &ZkLock, path: &str) -> Vec<String> {
    let client = lock.client().await.unwrap();
    client.sync("/").await.unwrap();
    let mut children = client.list_children(path).await.unwrap_or_default();
    children.sort();
    children
}

async fn exists(lock: &ZkLock, path: &str) -> bool {
    let client = lock.client().await.unwrap();
    client.sync("/").await.unwrap();
    client.check_stat(path).await.unwrap().is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_remove_the_directories_they_leave_empty() {
    let server = ZkServer::shared();
    let root = root();
    let locks = client_of(server, &root).await;
    for i in 0..20 {
        let name = format!("order-{i}");
        let guard = locks.acquire(&name, AcquireOptions::new()).await.unwrap();
        assert!(exists(&locks, &format!("{root}/{name}")).await);
        guard.release().await.unwrap();
    }
    for i in 0..5 {
        let guard = locks
            .acquire_write(&format!("rw-{i}"), AcquireOptions::new())
            .await
            .unwrap();
        guard.release().await.unwrap();
        let guard = locks
            .acquire_read(&format!("rw-{i}"), AcquireOptions::new())
            .await
            .unwrap();
        guard.release().await.unwrap();
        let term = locks
            .campaign(&format!("election-{i}"), "me", AcquireOptions::new())
            .await
            .unwrap();
        term.release().await.unwrap();
    }
    // The `%rw` parent holds every read-write lock of the client: one container, kept.
    assert_eq!(children(&locks, &root).await, ["%rw"]);
    assert_eq!(
        children(&locks, &format!("{root}/%rw")).await,
        Vec::<String>::new()
    );
    locks.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_keeps_the_directory_and_its_place_in_line() {
    let server = ZkServer::shared();
    let root = root();
    let (a, b, c) = (
        client_of(server, &root).await,
        client_of(server, &root).await,
        client_of(server, &root).await,
    );
    let held = a.acquire("job", AcquireOptions::new()).await.unwrap();
    let first = held.token();
    let b_waits = tokio::spawn(async move {
        let guard = b
            .acquire("job", AcquireOptions::new().wait_timeout(STEP))
            .await
            .unwrap();
        (b, guard)
    });
    // B is queued before C starts.
    tokio::time::timeout(STEP, async {
        while a.inspect("job").await.unwrap().waiters != Some(1) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("B queues");
    let c_waits = tokio::spawn(async move {
        let guard = c
            .acquire("job", AcquireOptions::new().wait_timeout(STEP))
            .await
            .unwrap();
        (c, guard)
    });
    tokio::time::timeout(STEP, async {
        while a.inspect("job").await.unwrap().waiters != Some(2) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("C queues");

    held.release().await.unwrap();
    let (b, b_guard) = tokio::time::timeout(STEP, b_waits)
        .await
        .expect("B is granted")
        .unwrap();
    assert!(b_guard.token() > first);
    assert!(!c_waits.is_finished(), "C came after B");
    assert_eq!(
        children(&a, &format!("{root}/job")).await.len(),
        2,
        "B's node and C's"
    );

    let second = b_guard.token();
    b_guard.release().await.unwrap();
    let (c, c_guard) = tokio::time::timeout(STEP, c_waits)
        .await
        .expect("C is granted")
        .unwrap();
    assert!(c_guard.token() > second);
    c_guard.release().await.unwrap();
    assert!(
        !exists(&a, &format!("{root}/job")).await,
        "the last release removes the directory"
    );
    for lock in [a, b, c] {
        lock.close().await.unwrap();
    }
}

/// Another node in a lock's directory at release (it came after the grant): the release
/// falls back to deleting its own node, and the other node and the directory stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_with_another_node_stays() {
    let server = ZkServer::shared();
    let root = root();
    let locks = client_of(server, &root).await;
    let client = locks.client().await.unwrap();
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    let guard = locks
        .acquire("shared", AcquireOptions::new())
        .await
        .unwrap();
    client
        .create(&format!("{root}/shared/app-node"), b"", &persistent)
        .await
        .unwrap();
    guard.release().await.unwrap();
    assert_eq!(
        children(&locks, &format!("{root}/shared")).await,
        ["app-node"]
    );
    locks.close().await.unwrap();
}

/// Under the root `/` a lock's directory may be another application's node (a client
/// cannot tell a container from a persistent node): only the directory the acquire made
/// itself is removed, never one that was there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_root_only_directories_made_by_the_acquire_are_removed() {
    let server = ZkServer::shared();
    let config =
        ZkConfig::new(server.connect_string()).with_session_timeout(Duration::from_secs(10));
    let locks = ZkLock::connect(config).await.unwrap();
    let client = locks.client().await.unwrap();
    let app = format!("directories-app-{:016x}", fastrand::u64(..));
    client
        .create(
            &format!("/{app}"),
            b"",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .unwrap();
    for _ in 0..3 {
        let guard = locks.acquire(&app, AcquireOptions::new()).await.unwrap();
        guard.release().await.unwrap();
    }
    assert!(
        exists(&locks, &format!("/{app}")).await,
        "an application's node stays"
    );
    assert_eq!(
        children(&locks, &format!("/{app}")).await,
        Vec::<String>::new()
    );
    client.delete(&format!("/{app}"), None).await.unwrap();

    let fresh = format!("directories-lock-{:016x}", fastrand::u64(..));
    for _ in 0..3 {
        let guard = locks.acquire(&fresh, AcquireOptions::new()).await.unwrap();
        guard.release().await.unwrap();
        assert!(
            !exists(&locks, &format!("/{fresh}")).await,
            "made by the acquire, removed"
        );
    }
    locks.close().await.unwrap();
}

/// Many clients take a few shared names (each directory is removed and made again
/// while others create in it), one hot name and fresh names, all at once: no error,
/// never two holders of a name, tokens only grow per name, and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_racing_the_removal_of_their_directory_go_on() {
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 60;
    let server = ZkServer::shared();
    let root = root();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(client_of(server, &root).await);
    }
    let held: Arc<HashMap<String, AtomicBool>> = Arc::new(
        ["hot", "p0", "p1", "p2"]
            .iter()
            .map(|name| ((*name).to_owned(), AtomicBool::new(false)))
            .collect(),
    );
    let tokens = Arc::new(std::sync::Mutex::new(HashMap::<String, u64>::new()));
    let mut tasks = Vec::new();
    for (c, lock) in clients.iter().enumerate() {
        // Two tasks per client: a task of a client also races its own client's.
        for t in 0..2 {
            let (lock, held, tokens) = (lock.clone(), held.clone(), tokens.clone());
            tasks.push(tokio::spawn(async move {
                for round in 0..ROUNDS {
                    let shared = format!("p{}", (round + c + t) % 3);
                    let fresh = format!("fresh-{c}-{t}-{round}");
                    let name = match round % 3 {
                        0 => "hot",
                        1 => shared.as_str(),
                        _ => fresh.as_str(),
                    };
                    let guard = lock
                        .acquire(name, AcquireOptions::new().wait_timeout(STEP))
                        .await
                        .unwrap_or_else(|error| panic!("{name}: {error:?}"));
                    if let Some(flag) = held.get(name) {
                        assert!(!flag.swap(true, Ordering::SeqCst), "two holders of {name}");
                    }
                    {
                        let mut tokens = tokens.lock().unwrap();
                        let last = tokens.insert(name.to_owned(), guard.token().get());
                        assert!(last < Some(guard.token().get()), "{name}: token went back");
                    }
                    tokio::task::yield_now().await;
                    if let Some(flag) = held.get(name) {
                        flag.store(false, Ordering::SeqCst);
                    }
                    guard
                        .release()
                        .await
                        .unwrap_or_else(|error| panic!("{name}: {error:?}"));
                }
            }));
        }
    }
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("the tasks finish")
            .unwrap();
    }
    assert_eq!(children(&clients[0], &root).await, Vec::<String>::new());
    for lock in clients {
        lock.close().await.unwrap();
    }
}

/// A semaphore's internal mutex directory goes with its last node too; its leases
/// directory (which carries the limit) is left to the server's reaper.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphores_mutex_directory_is_removed() {
    let server = ZkServer::shared();
    let root = root();
    let locks = client_of(server, &root).await;
    let permits = Permits::new(1, 2).unwrap();
    let guard = locks
        .acquire_permits("pool", permits, AcquireOptions::new())
        .await
        .unwrap();
    assert_eq!(
        children(&locks, &format!("{root}/%sem/pool")).await,
        ["leases"]
    );
    guard.release().await.unwrap();
    locks.close().await.unwrap();
}

/// An operator made the root read-only and the lock's directory writable: the acquire
/// may not make or remove directories there, so it creates its node in the directory
/// that is there (no error), and the release deletes its node alone (the directory
/// stays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_root_with_the_directory_made_by_an_operator() {
    let server = ZkServer::shared();
    let root = root();
    let admin = zk::Client::connect(&server.connect_string()).await.unwrap();
    admin
        .create(
            &root,
            b"",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .unwrap();
    admin
        .create(
            &format!("{root}/job"),
            b"",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .unwrap();
    admin
        .set_acl(&root, &zk::Acls::anyone_read(), None)
        .await
        .unwrap();
    let locks = client_of(server, &root).await;
    for _ in 0..3 {
        let guard = locks
            .acquire("job", AcquireOptions::new())
            .await
            .expect("the node goes into the operator's directory");
        guard.release().await.unwrap();
    }
    assert!(exists(&locks, &format!("{root}/job")).await);
    assert_eq!(
        children(&locks, &format!("{root}/job")).await,
        Vec::<String>::new()
    );
    locks.close().await.unwrap();
}
