//! `ZkLock::fence` for every kind of grant: a lock, a write and a read lock, and a
//! semaphore's permits. A fenced write goes through while the grant is held and is
//! refused (`Lost`) once it was released.

use fencelock_core::{AcquireOptions, DistributedLock, Error, LockGuard, Permits};
use fencelock_testkit::ZkServer;
use fencelock_zk::{ZkConfig, ZkLock};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_grant_has_a_fence() {
    let root = format!("/fence-{:x}", std::process::id());
    let url = format!("zk://{}{root}", ZkServer::shared().connect_string());
    let locks = ZkLock::connect(ZkConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    let options = || AcquireOptions::new().no_wait();
    let grants: Vec<(&str, LockGuard)> = vec![
        ("lock", locks.acquire("l", options()).await.unwrap()),
        (
            "write lock",
            locks.acquire_write("w", options()).await.unwrap(),
        ),
        (
            "read lock",
            locks.acquire_read("r", options()).await.unwrap(),
        ),
        (
            "permits",
            locks
                .acquire_permits("s", Permits::new(2, 3).unwrap(), options())
                .await
                .unwrap(),
        ),
    ];
    let register = format!("{root}-register");
    let raw = locks.client().await.unwrap();
    let _ = raw
        .create(
            &register,
            b"",
            &fencelock_zk::zookeeper_client::CreateMode::Persistent
                .with_acls(fencelock_zk::zookeeper_client::Acls::anyone_all()),
        )
        .await;
    for (what, guard) in grants {
        let fence = locks
            .fence(&guard)
            .await
            .unwrap_or_else(|e| panic!("the fence of a held {what}: {e}"));
        fence
            .set_data(&register, what.as_bytes(), None)
            .await
            .unwrap_or_else(|e| panic!("a fenced write under a held {what}: {e}"));
        guard.release().await.unwrap();
        let after = fence.set_data(&register, b"stale", None).await;
        assert!(
            matches!(after, Err(Error::Lost { .. })),
            "a fenced write after the {what} was released: {after:?}"
        );
    }
}

/// A fence is made only for this client's own ZooKeeper grants. A guard of another
/// backend, or of another client, is a caller's mistake (`InvalidConfig`), not a lost
/// lock: a caller reacting to `Lost` would drop work whose lock is still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_refuses_guards_it_did_not_grant() {
    let root = format!("/fence-foreign-{:x}", std::process::id());
    let url = format!("zk://{}{root}", ZkServer::shared().connect_string());
    let connect = || async {
        ZkLock::connect(ZkConfig::from_url(&url).unwrap())
            .await
            .unwrap()
    };
    let (a, b) = (connect().await, connect().await);
    let options = || AcquireOptions::new().no_wait();

    let mem = fencelock_core::MemoryLock::new();
    let mem_guard = mem.acquire("l", options()).await.unwrap();
    let err = a.fence(&mem_guard).await.unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig(_)),
        "a mem guard: {err:?}"
    );

    let bs = b.acquire("l", options()).await.unwrap();
    let err = a.fence(&bs).await.unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig(_)),
        "another client's held guard: {err:?}"
    );
    b.fence(&bs).await.expect("its own client fences it");
    bs.release().await.unwrap();
}
