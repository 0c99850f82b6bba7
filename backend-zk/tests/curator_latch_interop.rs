//! fencelock's elections and Apache Curator's `LeaderLatch` (Debian's
//! `libcurator-recipes-java`, compiled here with `javac`) on the same election path of a
//! real ZooKeeper elect one leader between them: each excludes the other, each sees the
//! other's value (participant id) as the leader, and leadership passes both ways with
//! tokens (czxids) that only grow.

use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Error, FencingToken, Leader, LeaderChanges};
use fencelock_testkit::ZkServer;
use fencelock_zk::{ZkConfig, ZkLock};

mod curator;

use curator::{Curator, STEP, compile};

/// Starts the `CuratorLatch` participant.
async fn start_latch(classpath: &str, connect: &str, path: &str, id: &str) -> Curator {
    Curator::start(classpath, "CuratorLatch", &[connect, path, id]).await
}

/// The czxid from a `LEADER <czxid>` answer.
async fn leads(curator: &mut Curator) -> u64 {
    let answer = curator.line().await;
    answer
        .strip_prefix("LEADER ")
        .and_then(|czxid| czxid.parse().ok())
        .unwrap_or_else(|| panic!("Curator did not become leader: {answer}"))
}

/// The next leader the observer reports, skipping "nobody leads" in between.
async fn next_leader(changes: &mut LeaderChanges) -> Leader {
    tokio::time::timeout(STEP, async {
        loop {
            match changes.next().await {
                Some(Ok(Some(leader))) => return leader,
                Some(Ok(None)) => {}
                Some(Err(error)) => panic!("observing failed: {error}"),
                None => panic!("the observation ended"),
            }
        }
    })
    .await
    .expect("the observer reports the next leader")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_leader_latch_and_fencelock_elect_one_leader() {
    let server = ZkServer::shared();
    let root = format!("/latch-interop-{:016x}", fastrand::u64(..));
    let election = "leader-job";
    let path = format!("{root}/{election}");
    let config = ZkConfig::new(server.connect_string())
        .with_chroot(&root)
        .unwrap()
        .with_session_timeout(Duration::from_secs(10));
    let ours = ZkLock::connect(config.clone()).await.expect("connect");
    let observer = ZkLock::connect(config).await.expect("connect");
    let mut changes = observer.observe(election).await.expect("observe");
    assert_eq!(changes.next().await.unwrap().unwrap(), None);

    let classes = tempfile::tempdir().unwrap();
    let classpath = compile(classes.path(), "CuratorLatch");
    let mut curator = start_latch(&classpath, &server.connect_string(), &path, "curator").await;

    // Curator's latch leads an empty election, in the layout fencelock expects.
    let started = curator.ask("start").await;
    let node = started.strip_prefix("STARTED ").unwrap_or_default();
    assert!(
        node.starts_with("_c_") && node.contains("-latch-"),
        "Curator's latch node: {started}"
    );
    curator.send("await");
    let first = leads(&mut curator).await;
    let curator_leads = Leader::new("curator", FencingToken::new(first));
    assert_eq!(next_leader(&mut changes).await, curator_leads);
    assert_eq!(
        ours.leader(election).await.unwrap(),
        Some(curator_leads.clone())
    );
    assert_eq!(curator.ask("leader").await, "SEES curator true true");

    // fencelock cannot lead while Curator does: refused without waiting, queued otherwise.
    assert!(matches!(
        ours.campaign(election, "fencelock", AcquireOptions::new().no_wait())
            .await,
        Err(Error::Contended { .. })
    ));
    let campaign = tokio::spawn({
        let ours = ours.clone();
        async move {
            ours.campaign(
                election,
                "fencelock",
                AcquireOptions::new().wait_timeout(STEP),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!campaign.is_finished(), "elected while Curator leads");
    assert_eq!(curator.ask("leader").await, "SEES curator true true");

    // Curator resigns: the waiting fencelock candidate is elected with a larger token.
    assert_eq!(curator.ask("close").await, "CLOSED");
    let term = tokio::time::timeout(STEP, campaign)
        .await
        .expect("elected once Curator resigned")
        .unwrap()
        .expect("campaign");
    assert!(term.token().get() > first);
    let fencelock_leads = Leader::new("fencelock", term.token());
    assert_eq!(next_leader(&mut changes).await, fencelock_leads);

    // A new Curator latch waits behind us and sees our value as the leader's id.
    let started = curator.ask("start").await;
    assert!(started.contains("-latch-"), "{started}");
    assert_eq!(curator.ask("leader").await, "SEES fencelock true false");
    assert_eq!(ours.leader(election).await.unwrap(), Some(fencelock_leads));

    // We resign: Curator leads, with a larger token, and our observer says so.
    curator.send("await");
    let resigned = term.token();
    term.release().await.expect("resign");
    let second = leads(&mut curator).await;
    assert!(second > resigned.get());
    let curator_again = Leader::new("curator", FencingToken::new(second));
    assert_eq!(next_leader(&mut changes).await, curator_again);
    assert_eq!(ours.leader(election).await.unwrap(), Some(curator_again));
    assert!(matches!(
        ours.campaign(election, "fencelock", AcquireOptions::new().no_wait())
            .await,
        Err(Error::Contended { .. })
    ));

    // Curator resigns and nobody leads.
    assert_eq!(curator.ask("close").await, "CLOSED");
    let nobody = tokio::time::timeout(STEP, changes.next())
        .await
        .expect("the observer learns that nobody leads");
    assert!(matches!(nobody, Some(Ok(None))), "{nobody:?}");
    assert_eq!(ours.leader(election).await.unwrap(), None);
    assert_eq!(curator.ask("quit").await, "BYE");
}
