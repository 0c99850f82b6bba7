//! The watch on held locks' nodes: one watcher per session reports a node deleted by
//! anyone else as a loss, before and after the watch is armed, for locks and for every
//! node of a semaphore's grant, and costs no task per held lock.

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, LockGuard, LossCause, Permits};
use fencelock_testkit::ZkServer;
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};
use tokio::time::Instant;

fn root(test: &str) -> String {
    format!("/watcher-{test}-{:x}", std::process::id())
}

async fn client(root: &str) -> ZkLock {
    let url = format!("zk://{}{root}", ZkServer::shared().connect_string());
    ZkLock::connect(ZkConfig::from_url(&url).unwrap())
        .await
        .unwrap()
}

/// Another client, with no chroot: the one that deletes nodes it does not own.
async fn raw() -> zk::Client {
    zk::Client::connect(&ZkServer::shared().connect_string())
        .await
        .unwrap()
}

fn no_wait() -> AcquireOptions {
    AcquireOptions::new().no_wait()
}

/// The node's path as the raw client sees it: the guard's key, which includes the root.
fn full_path(root: &str, guard: &LockGuard) -> String {
    let key = guard.backend_key().unwrap();
    assert!(key.starts_with(root), "{key} is under {root}");
    key.to_owned()
}

/// The tasks alive on the test's runtime.
fn alive() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Waits up to `within` for the tasks alive to fall to `target`.
async fn settle(target: usize, within: Duration) {
    let deadline = Instant::now() + within;
    while alive() > target && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits up to 5 s for every node under `dir` to be deleted; fails naming those left.
async fn all_deleted(raw: &zk::Client, dir: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = raw.list_children(dir).await.unwrap();
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "nodes left: {left:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits up to 5 s for the guard to report its loss; returns how long that took.
async fn loss_of(guard: &LockGuard) -> Duration {
    let start = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .expect("the loss is reported within 5 s");
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_deleted_by_someone_else_is_a_loss_before_and_after_the_watch_is_armed() {
    let root = root("deleted");
    let locks = client(&root).await;
    let raw = raw().await;
    // Held for a while: the session's watcher has armed its watch.
    let armed = locks.acquire("armed", no_wait()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Fresh: deleted before the watch is armed, which then finds no node.
    let fresh = locks.acquire("fresh", no_wait()).await.unwrap();
    raw.delete(&full_path(&root, &fresh), None).await.unwrap();
    raw.delete(&full_path(&root, &armed), None).await.unwrap();
    for guard in [&armed, &fresh] {
        let took = loss_of(guard).await;
        assert!(took < Duration::from_secs(2), "reported after {took:?}");
        assert_eq!(guard.lost_cause(), Some(LossCause::KeyGone));
    }
    // Each name is free for the next holder.
    for name in ["armed", "fresh"] {
        let next = locks.acquire(name, no_wait()).await.unwrap();
        assert!(!next.is_lost());
        next.release().await.unwrap();
    }
    assert!(
        armed.release().await.is_err(),
        "a lost lock's release says so"
    );
    assert!(
        fresh.release().await.is_err(),
        "a lost lock's release says so"
    );
    locks.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_grant_losing_one_node_is_lost_and_frees_its_other_permits() {
    let root = root("semaphore");
    let locks = client(&root).await;
    let raw = raw().await;
    let permits = Permits::new(2, 3).unwrap();
    let grant = locks
        .acquire_permits("pool", permits, no_wait())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let main = full_path(&root, &grant);
    let leases = main.rsplit_once('/').unwrap().0.to_owned();
    let before = raw.list_children(&leases).await.unwrap();
    assert_eq!(before.len(), 2, "one lease node per permit: {before:?}");
    raw.delete(&main, None).await.unwrap();
    loss_of(&grant).await;
    assert_eq!(grant.lost_cause(), Some(LossCause::KeyGone));
    // The grant's other node is deleted too: all 3 permits are free again.
    all_deleted(&raw, &leases).await;
    let all = locks
        .acquire_permits("pool", Permits::new(3, 3).unwrap(), no_wait())
        .await
        .unwrap();
    all.release().await.unwrap();
    drop(grant);
    locks.close().await.unwrap();
}

/// Held locks are watched by their session's one watcher task, not a task each: 500
/// held locks cost at most that one task (the old design spawned 500), the watches are
/// armed (a deletion is seen), and the task ends when nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_locks_are_watched_by_one_task_per_session() {
    let root = root("tasks");
    let locks = client(&root).await;
    let raw = raw().await;
    // The session and its monitor exist once a first lock was taken.
    locks
        .acquire("warm-up", no_wait())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let before = alive();
    let mut guards = Vec::new();
    for i in 0..500 {
        guards.push(
            locks
                .acquire(&format!("held-{i}"), no_wait())
                .await
                .unwrap(),
        );
    }
    // Past the watch delay: every watch is armed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    settle(before + 1, Duration::from_secs(5)).await;
    assert!(
        alive() <= before + 1,
        "{} tasks for 500 held locks (before: {before})",
        alive()
    );
    raw.delete(&full_path(&root, &guards[250]), None)
        .await
        .unwrap();
    loss_of(&guards[250]).await;
    assert_eq!(guards[250].lost_cause(), Some(LossCause::KeyGone));
    for (i, guard) in guards.into_iter().enumerate() {
        if i == 250 {
            continue;
        }
        assert!(!guard.is_lost(), "lock {i} was not touched");
        guard.release().await.unwrap();
    }
    settle(before, Duration::from_secs(5)).await;
    assert!(
        alive() <= before,
        "the watcher task ends when nothing is held: {} tasks, {before} before",
        alive()
    );
    locks.close().await.unwrap();
}

/// Locks all released before their watch is armed leave no watcher task behind: the
/// task used to find nothing to arm and then sleep, with nothing to wake it, until the
/// session's next grant (and for ever once the session was gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_released_before_their_watch_is_armed_leave_no_task() {
    let root = root("short");
    let locks = client(&root).await;
    // Held past the watch delay, then released: the session exists and its watcher
    // task has ended after its one watch.
    let warm = locks.acquire("warm-up", no_wait()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    warm.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = alive();
    for i in 0..10 {
        locks
            .acquire(&format!("short-{i}"), no_wait())
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    settle(before, Duration::from_secs(2)).await;
    assert!(
        alive() <= before,
        "{} tasks after 10 short locks, {before} before",
        alive()
    );
    locks.close().await.unwrap();
}

/// A semaphore grant found lost by `extend` (its main node deleted by someone else)
/// frees its other permits at once, as a loss seen by the watch does; they used to stay
/// until the grant's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_grant_found_lost_by_extend_frees_its_other_permits() {
    let root = root("extend");
    let locks = client(&root).await;
    let raw = raw().await;
    let grant = locks
        .acquire_permits(
            "pool",
            Permits::new(2, 3).unwrap(),
            no_wait().fixed_lease(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let main = full_path(&root, &grant);
    let leases = main.rsplit_once('/').unwrap().0.to_owned();
    raw.delete(&main, None).await.unwrap();
    assert!(grant.extend(Duration::from_secs(60)).await.is_err());
    assert_eq!(grant.lost_cause(), Some(LossCause::KeyGone));
    all_deleted(&raw, &leases).await;
    drop(grant);
    locks.close().await.unwrap();
}

/// A semaphore request waiting for a permit whose internal mutex node is deleted by
/// someone else answers a retryable error as soon as the watch reports it, although no
/// permit changes hands; it used to wait for ever outside the mutex's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_request_whose_mutex_node_is_deleted_while_waiting_says_so() {
    let root = root("sem-mutex");
    let locks = client(&root).await;
    let raw = raw().await;
    let one = Permits::new(1, 1).unwrap();
    let held = locks.acquire_permits("pool", one, no_wait()).await.unwrap();
    let waiting = tokio::spawn({
        let locks = locks.clone();
        async move {
            locks
                .acquire_permits("pool", one, AcquireOptions::new().wait_forever())
                .await
        }
    });
    let mutex_dir = format!("{root}/%sem/pool/locks");
    let mutex = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let [node] = raw
                .list_children(&mutex_dir)
                .await
                .unwrap_or_default()
                .as_slice()
            {
                return format!("{mutex_dir}/{node}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the request takes the mutex");
    // Past the watch delay: the mutex guard's watch is armed, the request waits.
    tokio::time::sleep(Duration::from_millis(300)).await;
    raw.delete(&mutex, None).await.unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the request whose mutex was deleted still waits")
        .unwrap();
    assert!(
        matches!(&answered, Err(e) if e.is_retryable() && format!("{e:?}").contains("internal lock")),
        "{:?}",
        answered.map(|g| g.token())
    );
    assert!(!held.is_lost(), "{:?}", held.lost_reason());
    held.release().await.unwrap();
    locks.close().await.unwrap();
}
