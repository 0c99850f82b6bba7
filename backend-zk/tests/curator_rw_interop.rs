//! fencelock's read-write locks and Apache Curator's `InterProcessReadWriteLock`
//! (Debian's `libcurator-recipes-java`, compiled here with `javac`) on the same path of
//! a real ZooKeeper: Curator's writer excludes our readers and writers, our writer
//! excludes Curator's readers, readers of both sides share, and both use the same
//! `_c_<uuid>-__READ__` / `_c_<uuid>-__WRIT__` nodes.

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Error};
use fencelock_testkit::ZkServer;
use fencelock_zk::{ZkConfig, ZkLock};

mod curator;

use curator::{Curator, STEP, compile};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_rw_lock_and_fencelock_exclude_each_other() {
    let server = ZkServer::shared();
    let root = format!("/rw-interop-{:016x}", fastrand::u64(..));
    let config = ZkConfig::new(server.connect_string())
        .with_chroot(&root)
        .unwrap()
        .with_session_timeout(Duration::from_secs(10));
    let locks = ZkLock::connect(config).await.expect("connect");
    let classes = tempfile::tempdir().unwrap();
    let classpath = compile(classes.path(), "CuratorRecipes");
    // fencelock's read-write lock `job` is `{root}/%rw/job`.
    let mut curator = Curator::start(
        &classpath,
        "CuratorRecipes",
        &[
            &server.connect_string(),
            &format!("{root}/%sem/job"),
            "1",
            &format!("{root}/%rw/job"),
        ],
    )
    .await;
    let client = locks.client().await.unwrap();
    let no_wait = || AcquireOptions::new().no_wait();

    // Curator's writer excludes our readers and writers.
    assert_eq!(curator.ask("WRITE 5000").await, "ACQUIRED");
    let nodes = client
        .list_children(&format!("{root}/%rw/job"))
        .await
        .unwrap();
    assert!(
        nodes.len() == 1 && nodes[0].starts_with("_c_") && nodes[0].contains("-__WRIT__"),
        "{nodes:?}"
    );
    assert!(matches!(
        locks.acquire_read("job", no_wait()).await,
        Err(Error::Contended { .. })
    ));
    assert!(matches!(
        locks.acquire_write("job", no_wait()).await,
        Err(Error::Contended { .. })
    ));
    let reader = {
        let locks = locks.clone();
        tokio::spawn(async move {
            locks
                .acquire_read("job", AcquireOptions::new().wait_forever())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !reader.is_finished(),
        "a reader got in past Curator's writer"
    );
    let nodes = client
        .list_children(&format!("{root}/%rw/job"))
        .await
        .unwrap();
    assert!(
        nodes
            .iter()
            .any(|n| n.starts_with("_c_") && n.contains("-__READ__")),
        "{nodes:?}"
    );
    assert_eq!(curator.ask("UNWRITE").await, "RELEASED");
    let reader = tokio::time::timeout(STEP, reader)
        .await
        .expect("our reader gets in once Curator's writer is gone")
        .unwrap()
        .unwrap();

    // Readers of both sides share; a writer of ours waits for Curator's reader.
    assert_eq!(curator.ask("READ 5000").await, "ACQUIRED");
    reader.release().await.unwrap();
    assert!(matches!(
        locks.acquire_write("job", no_wait()).await,
        Err(Error::Contended { .. })
    ));
    assert_eq!(curator.ask("UNREAD").await, "RELEASED");

    // Our writer excludes Curator's readers (and its writer).
    let writer = locks
        .acquire_write("job", no_wait())
        .await
        .expect("the lock is free");
    assert_eq!(curator.ask("READ 300").await, "TIMEOUT");
    assert_eq!(curator.ask("WRITE 300").await, "TIMEOUT");
    curator.send("READ 30000");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        curator.try_line(),
        None,
        "Curator's reader got in past our writer"
    );
    let writer_token = writer.token();
    writer.release().await.unwrap();
    assert_eq!(curator.line().await, "ACQUIRED");

    // A writer of ours queued behind Curator's reader holds back our later readers
    // (no writer starvation), and gets a larger token than the previous writer.
    let queued_writer = {
        let locks = locks.clone();
        tokio::spawn(async move {
            locks
                .acquire_write("job", AcquireOptions::new().wait_forever())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!queued_writer.is_finished());
    assert!(matches!(
        locks.acquire_read("job", no_wait()).await,
        Err(Error::Contended { .. })
    ));
    assert_eq!(curator.ask("UNREAD").await, "RELEASED");
    let queued_writer = tokio::time::timeout(STEP, queued_writer)
        .await
        .expect("our writer gets in once Curator's reader is gone")
        .unwrap()
        .unwrap();
    assert!(queued_writer.token() > writer_token);
    queued_writer.release().await.unwrap();
    locks.close().await.unwrap();
}
