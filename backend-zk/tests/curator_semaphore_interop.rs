//! fencelock's semaphores and Apache Curator's `InterProcessSemaphoreV2` (Debian's
//! `libcurator-recipes-java`, compiled here with `javac`) on the same semaphore path of a
//! real ZooKeeper share one limit: neither side gets a permit the other's holders fill,
//! permits pass both ways, a multi-permit request is all or nothing, and together they
//! never hold more than the limit (a holder count in ZooKeeper, written with version
//! checks by both sides, never passes it).

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Error, Permits};
use fencelock_testkit::ZkServer;
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};

mod curator;

use curator::{Curator, STEP, compile};

const LIMIT: u32 = 2;

/// A fencelock client chrooted at a fresh root, the Curator participant on the same
/// semaphore (`{root}/%sem/job`, fencelock's path of semaphore `job`), and the root.
async fn start(classes: &tempfile::TempDir) -> (ZkLock, Curator, String) {
    let server = ZkServer::shared();
    let root = format!("/sem-interop-{:016x}", fastrand::u64(..));
    let config = ZkConfig::new(server.connect_string())
        .with_chroot(&root)
        .unwrap()
        .with_session_timeout(Duration::from_secs(10));
    let locks = ZkLock::connect(config).await.expect("connect");
    let classpath = compile(classes.path(), "CuratorRecipes");
    let curator = Curator::start(
        &classpath,
        "CuratorRecipes",
        &[
            &server.connect_string(),
            &format!("{root}/%sem/job"),
            &LIMIT.to_string(),
            &format!("{root}/%rw/job"),
        ],
    )
    .await;
    (locks, curator, root)
}

fn permits(count: u32) -> Permits {
    Permits::new(count, LIMIT).unwrap()
}

async fn leases(locks: &ZkLock, root: &str) -> Vec<String> {
    let client = locks.client().await.unwrap();
    client
        .list_children(&format!("{root}/%sem/job/leases"))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_semaphore_and_fencelock_share_one_limit() {
    let classes = tempfile::tempdir().unwrap();
    let (locks, mut curator, root) = start(&classes).await;
    let no_wait = || AcquireOptions::new().no_wait();

    // Curator takes one lease, we take the other: the semaphore is full for both.
    assert_eq!(curator.ask("SEM_ACQUIRE 5000").await, "ACQUIRED");
    let ours = locks
        .acquire_permits("job", permits(1), no_wait())
        .await
        .expect("the second permit is free");
    assert!(matches!(
        locks.acquire_permits("job", permits(1), no_wait()).await,
        Err(Error::Contended { .. })
    ));
    assert_eq!(curator.ask("SEM_ACQUIRE 300").await, "TIMEOUT");

    // Both sides' lease nodes are Curator's protected `lease-` nodes; the limit is the
    // leases directory's data, and another limit is refused.
    let nodes = leases(&locks, &root).await;
    assert_eq!(nodes.len(), 2, "{nodes:?}");
    assert!(
        nodes
            .iter()
            .all(|n| n.starts_with("_c_") && n.contains("-lease-")),
        "{nodes:?}"
    );
    let client = locks.client().await.unwrap();
    let (data, _) = client
        .get_data(&format!("{root}/%sem/job/leases"))
        .await
        .unwrap();
    assert_eq!(data, b"limit=2");
    assert!(matches!(
        locks
            .acquire_permits("job", Permits::one_of(3).unwrap(), no_wait())
            .await,
        Err(Error::InvalidConfig(_))
    ));

    // A waiting fencelock request gets the permit Curator returns, with a larger token.
    let first_token = ours.token();
    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move {
            locks
                .acquire_permits("job", permits(1), AcquireOptions::new().wait_forever())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "granted past the limit");
    assert_eq!(curator.ask("SEM_RELEASE").await, "RELEASED");
    let second = tokio::time::timeout(STEP, waiter)
        .await
        .expect("granted once Curator returned its lease")
        .unwrap()
        .unwrap();
    assert!(second.token() > first_token);

    // Two permits are all or nothing: a timed-out request leaves no lease behind.
    ours.release().await.unwrap();
    assert!(matches!(
        locks
            .acquire_permits(
                "job",
                permits(2),
                AcquireOptions::new().wait_timeout(Duration::from_millis(300))
            )
            .await,
        Err(Error::Timeout { .. })
    ));
    assert_eq!(leases(&locks, &root).await.len(), 1);
    second.release().await.unwrap();
    let both = locks
        .acquire_permits("job", permits(2), no_wait())
        .await
        .expect("both permits are free");
    assert_eq!(leases(&locks, &root).await.len(), 2);
    assert_eq!(curator.ask("SEM_ACQUIRE 300").await, "TIMEOUT");

    // Curator waits for the permits we return.
    curator.send("SEM_ACQUIRE 30000");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(curator.try_line(), None, "Curator passed the limit");
    both.release().await.unwrap();
    assert_eq!(curator.line().await, "ACQUIRED");
    assert_eq!(curator.ask("SEM_RELEASE").await, "RELEASED");
    locks.close().await.unwrap();
}

/// Adds `delta` to the holder count of the register `holders:total` (version-checked);
/// returns the new holder count.
async fn add(client: &zk::Client, register: &str, delta: i64) -> i64 {
    loop {
        let (data, stat) = client.get_data(register).await.unwrap();
        let text = String::from_utf8(data).unwrap();
        let (holders, total) = text.split_once(':').unwrap();
        let holders = holders.parse::<i64>().unwrap() + delta;
        let total = total.parse::<i64>().unwrap() + i64::from(delta > 0);
        match client
            .set_data(
                register,
                format!("{holders}:{total}").as_bytes(),
                Some(stat.version),
            )
            .await
        {
            Ok(_) => return holders,
            Err(zk::Error::BadVersion) => continue,
            Err(err) => panic!("register write: {err}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_fencelock_never_pass_the_limit_together() {
    const JAVA_ROUNDS: usize = 40;
    const RUST_ROUNDS: usize = 20;
    let classes = tempfile::tempdir().unwrap();
    let (locks, mut curator, root) = start(&classes).await;
    let client = locks.client().await.unwrap();
    // The register, beside the root.
    let register = format!("{root}-register");
    client
        .create(
            &register,
            b"0:0",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .unwrap();
    curator.send(&format!("SEM_LOOP {JAVA_ROUNDS} {register}"));
    let contender = |task: usize| {
        let locks = locks.clone();
        let client = client.clone();
        let register = register.clone();
        async move {
            for round in 0..RUST_ROUNDS {
                // One task sometimes asks for both permits at once.
                let count = if task == 0 && round % 3 == 0 { 2 } else { 1 };
                let guard = locks
                    .acquire_permits("job", permits(count), AcquireOptions::new().wait_forever())
                    .await
                    .expect("acquire");
                let holders = add(&client, &register, i64::from(count)).await;
                assert!(holders <= i64::from(LIMIT), "{holders} holders of {LIMIT}");
                tokio::time::sleep(Duration::from_millis(3)).await;
                add(&client, &register, -i64::from(count)).await;
                guard.release().await.expect("release");
            }
        }
    };
    futures_util::future::join_all((0..2).map(contender)).await;
    let answer = tokio::time::timeout(Duration::from_secs(120), curator.line())
        .await
        .expect("Curator finishes");
    assert_eq!(answer, "DONE", "Curator saw more holders than the limit");
    let (data, _) = client.get_data(&register).await.unwrap();
    let rust_total = 2 * RUST_ROUNDS;
    assert_eq!(
        String::from_utf8(data).unwrap(),
        format!("0:{}", JAVA_ROUNDS + rust_total)
    );
    locks.close().await.unwrap();
}
