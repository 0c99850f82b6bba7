//! Digest authentication and creator-only ACLs on a real ZooKeeper server.

use std::time::Duration;

use fencelock_core::{DistributedLockExt, Error};
use fencelock_testkit::ZkServer;
use fencelock_zk::zookeeper_client as zk;

/// With `acl=creator`, clients authenticated as the same digest user contend normally,
/// while a client without credentials or with other credentials can neither delete the
/// holder's node nor take the lock's place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creator_only_nodes_resist_other_identities() {
    let server = ZkServer::shared();
    let root = format!("/acl-{:x}", std::process::id());
    let url = format!(
        "zk://app:s3cret@{}{root}?acl=creator&session_timeout=4s",
        server.connect_string()
    );
    let a = fencelock_zk::connect(&url)
        .await
        .expect("connect with digest credentials");
    let b = fencelock_zk::connect(&url)
        .await
        .expect("a second client, same identity");
    let guard = a.lock("job").await.unwrap();
    assert!(b.try_lock("job").await.unwrap().is_none());
    let path = guard
        .backend_key()
        .expect("the holder's node path")
        .to_owned();

    let anonymous = zk::Client::connect(&server.connect_string()).await.unwrap();
    assert!(
        matches!(anonymous.delete(&path, None).await, Err(zk::Error::NoAuth)),
        "an anonymous client deleted the node"
    );
    let intruder = zk::Client::connect(&server.connect_string()).await.unwrap();
    intruder.auth("digest", b"intruder:wrong").await.unwrap();
    assert!(
        matches!(intruder.delete(&path, None).await, Err(zk::Error::NoAuth)),
        "another identity deleted the node"
    );
    assert!(!guard.is_lost());

    let waiter = b.acquire(
        "job",
        fencelock_core::AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
    );
    let release = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        guard.release().await.unwrap();
    };
    let (next, ()) = tokio::join!(waiter, release);
    next.expect("the same identity takes over")
        .release()
        .await
        .unwrap();
}

/// `acl=creator` without digest credentials would create nodes nobody can manage: a
/// configuration error at connect. Credentials never show in the configuration's Debug.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creator_acl_without_credentials_is_a_config_error() {
    let server = ZkServer::shared();
    let url = format!("zk://{}/acl-nocreds?acl=creator", server.connect_string());
    let err = fencelock_zk::connect(&url).await.unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    let shown = format!(
        "{:?}",
        fencelock_zk::ZkConfig::from_url(&format!("zk://app:s3cret@{}/x", server.connect_string()))
            .unwrap()
    );
    assert!(!shown.contains("s3cret"), "{shown}");
}

/// A node created through a fence gets the client's ACL policy, like the lock's own
/// nodes: with `acl=creator`, another identity cannot overwrite fenced data without the
/// fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_nodes_keep_the_creator_acl() {
    let server = ZkServer::shared();
    let root = format!("/acl-fence-{:x}", std::process::id());
    let url = format!(
        "zk://app:s3cret@{}{root}?acl=creator",
        server.connect_string()
    );
    let locks = fencelock_zk::ZkLock::connect(fencelock_zk::ZkConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    let guard = locks.lock("data").await.unwrap();
    let fence = locks.fence(&guard).await.unwrap();
    let data = format!("{root}-data");
    fence.create(&data, b"1").await.unwrap();

    let anonymous = zk::Client::connect(&server.connect_string()).await.unwrap();
    let write = anonymous.set_data(&data, b"forged", None).await;
    assert!(
        matches!(write, Err(zk::Error::NoAuth)),
        "an anonymous client overwrote fenced data: {write:?}"
    );
    fence.set_data(&data, b"2", None).await.unwrap();
    fence.delete(&data, None).await.unwrap();
    guard.release().await.unwrap();
}

/// Credentials without `acl=` make the nodes the creator's: another identity cannot
/// delete a holder's node (ZooKeeper's advice for authenticated deployments; S-Z1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_alone_make_the_nodes_the_creators() {
    let server = ZkServer::shared();
    let root = format!("/acl-default-{:x}", std::process::id());
    let url = format!("zk://app:s3cret@{}{root}", server.connect_string());
    let locks = fencelock_zk::connect(&url).await.unwrap();
    let guard = locks.lock("x").await.unwrap();
    let node = guard.backend_key().expect("a node path").to_owned();

    let other = zk::Client::connect(&server.connect_string()).await.unwrap();
    other.auth("digest", b"mallory:other").await.unwrap();
    let deleted = other.delete(&node, None).await;
    assert!(
        matches!(deleted, Err(zk::Error::NoAuth)),
        "another identity deleted the holder's node: {deleted:?}"
    );
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
}
