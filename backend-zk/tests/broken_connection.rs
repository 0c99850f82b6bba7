//! Requests whose connection breaks while the session lives on.
//!
//! A ZooKeeper follower that loses its leader resets its client connections. The
//! requests in flight then fail with an I/O error (`zk::Error::Custom`: "connection reset
//! by peer", or "no response from connection" when the server went silent), not with
//! `ConnectionLoss`. The session survives: the client reconnects within its timeout. A
//! release or clean-up delete that gave up on such an error left the lock node in a live
//! session, where it blocked every later waiter forever (seen as "no grant for 60 s after
//! the leader was killed" in `faults.rs`).
//!
//! Here a loopback proxy between the client and the server goes silent on demand: the
//! client sees no answer, fails the requests in flight with "no response from
//! connection" (a `Custom` error) after 40 % of the session timeout, and reconnects
//! through the proxy on a fresh connection, which is forwarded again.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, Error};
use fencelock_testkit::{Fault, FaultProxy, ZkServer};
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};
use tokio::time::Instant;

/// The session timeout of the client behind the proxy: it notices a silent connection
/// after 40 % of it (1.6 s) and reconnects long before the server expires the session.
const SESSION: Duration = Duration::from_secs(4);

/// A TCP proxy to one server. [`Proxy::silence`] makes every connection open at that
/// moment swallow all traffic in both directions (without closing it); connections
/// opened later are forwarded normally.
struct Proxy {
    port: u16,
    generation: Arc<AtomicU64>,
}

impl Proxy {
    fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let generation = Arc::new(AtomicU64::new(0));
        let current = generation.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let born = current.load(Ordering::SeqCst);
                let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
                    continue;
                };
                pump(client, server, current.clone(), born);
                pump(server2, client2, current.clone(), born);
            }
        });
        Proxy { port, generation }
    }

    fn connect_string(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// From now on, the connections open now carry nothing.
    fn silence(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, generation: Arc<AtomicU64>, born: u64) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) if generation.load(Ordering::SeqCst) != born => {}
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

fn random_root(prefix: &str) -> String {
    format!("/{prefix}-{:016x}", fastrand::u64(..))
}

/// A client through the proxy at `proxied` (session [`SESSION`]) and one straight to
/// the server.
async fn clients(server: &ZkServer, proxied: &str, root: &str) -> (ZkLock, ZkLock) {
    let behind_proxy = ZkLock::connect(
        ZkConfig::new(proxied)
            .with_chroot(root)
            .unwrap()
            .with_session_timeout(SESSION),
    )
    .await
    .expect("connect through the proxy");
    let direct = ZkLock::connect(
        ZkConfig::new(server.connect_string())
            .with_chroot(root)
            .unwrap()
            .with_session_timeout(Duration::from_secs(10)),
    )
    .await
    .expect("connect");
    (behind_proxy, direct)
}

/// The number of lock nodes under `name`, read with `client`.
async fn nodes(client: &zk::Client, root: &str, name: &str) -> usize {
    match client.list_children(&format!("{root}/{name}")).await {
        Ok(children) => children.len(),
        Err(zk::Error::NoNode) => 0,
        Err(err) => panic!("list {root}/{name}: {err}"),
    }
}

/// A release whose delete is lost with its connection is repeated on the next one: it
/// succeeds, and the next client gets the lock at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_is_repeated_when_the_connection_breaks() {
    let server = ZkServer::shared();
    let proxy = Proxy::start(server.port());
    let root = random_root("broken-release");
    let (behind_proxy, direct) = clients(server, &proxy.connect_string(), &root).await;
    let admin = direct.client().await.unwrap();
    let session = behind_proxy.client().await.unwrap().session_id();

    let guard = behind_proxy.lock("job").await.unwrap();
    proxy.silence();
    let released = Instant::now();
    guard
        .release()
        .await
        .expect("the release is repeated on the new connection");
    assert!(released.elapsed() < SESSION, "{:?}", released.elapsed());
    assert_eq!(nodes(&admin, &root, "job").await, 0);
    assert_eq!(
        behind_proxy.client().await.unwrap().session_id(),
        session,
        "the session behind the proxy lives on (its node was not removed by expiry)"
    );
    let next = direct
        .acquire(
            "job",
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("the lock is free after the release");
    next.release().await.unwrap();
}

/// A fenced write lost with its connection while the session lives on has an unknown
/// outcome: a retryable `Unavailable`, not a permanent backend error, and the lock is
/// still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_write_on_a_broken_connection_is_retryable() {
    let server = ZkServer::shared();
    let proxy = Proxy::start(server.port());
    let root = random_root("broken-fence");
    let (behind_proxy, direct) = clients(server, &proxy.connect_string(), &root).await;
    let register = format!("{root}-register");
    let admin = direct.client().await.unwrap();
    admin
        .create(
            &register,
            b"0",
            &zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
        )
        .await
        .unwrap();

    let guard = behind_proxy.lock("job").await.unwrap();
    let fence = behind_proxy.fence(&guard).await.unwrap();
    proxy.silence();
    let error = fence
        .set_data(&register, b"1", None)
        .await
        .expect_err("a write on a silent connection cannot be confirmed");
    assert!(
        matches!(error, fencelock_core::Error::Unavailable { .. }),
        "{error:?}"
    );
    assert!(error.is_retryable(), "{error:?}");
    assert!(
        !guard.is_lost(),
        "the session survived the broken connection"
    );
    fence
        .set_data(&register, b"2", None)
        .await
        .expect("the next write goes through the new connection");
    guard.release().await.unwrap();
}

/// A waiting acquire that is dropped while its connection is silent still deletes its
/// node once the client has reconnected: the node does not block later waiters for
/// the life of the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_acquire_cleans_up_after_the_connection_breaks() {
    let server = ZkServer::shared();
    let proxy = Proxy::start(server.port());
    let root = random_root("broken-cleanup");
    let (behind_proxy, direct) = clients(server, &proxy.connect_string(), &root).await;
    let admin = direct.client().await.unwrap();

    let session = behind_proxy.client().await.unwrap().session_id();
    let holder = direct.lock("job").await.unwrap();
    let waiter = {
        let locks = behind_proxy.clone();
        tokio::spawn(async move { locks.lock("job").await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes(&admin, &root, "job").await < 2 {
        assert!(Instant::now() < deadline, "the waiter never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.silence();
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    holder.release().await.unwrap();

    // The waiter's node goes once its client has reconnected (1.6 s of silence, then a
    // new connection), long before its session could expire.
    let next = direct
        .acquire("job", AcquireOptions::new().wait_timeout(SESSION * 2))
        .await
        .expect("the abandoned node of the dropped acquire was deleted");
    assert_eq!(
        behind_proxy.client().await.unwrap().session_id(),
        session,
        "the session behind the proxy lives on (its nodes were not removed by expiry)"
    );
    next.release().await.unwrap();
    assert_eq!(nodes(&admin, &root, "job").await, 0);
}

/// Whether `session` watches `path` on `server`, by its `wchc` four-letter word (a
/// session id, then one indented line per path it watches).
fn watched_by(server: &ZkServer, session: zk::SessionId, path: &str) -> bool {
    let listing = server.four_letter_word("wchc").expect("wchc");
    let session = session.to_string();
    let mut lines = listing.lines().skip_while(|line| line.trim() != session);
    lines.next().is_some()
        && lines
            .take_while(|line| line.starts_with(char::is_whitespace))
            .any(|line| line.trim() == path)
}

/// F9 (ZOOKEEPER-1262): a create whose reply was lost, applied and then sent again,
/// leaves two nodes of one uuid in the waiter's session. A waiter dropped before a
/// listing of its own could delete the first deletes both, not only the node it knows
/// by path: otherwise the first blocks the name for as long as the session lives.
///
/// The first create is played by a node of the waiter's uuid made in its session while
/// it waits (after its first listing, so that only the clean-up of the drop can see it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_acquire_deletes_every_node_of_its_uuid() {
    let server = ZkServer::shared();
    let root = random_root("lost-create-orphan");
    let connect = || async {
        ZkLock::connect(
            ZkConfig::new(server.connect_string())
                .with_chroot(&root)
                .unwrap()
                .with_session_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("connect")
    };
    let (holder_side, waiter_side) = (connect().await, connect().await);
    let admin = holder_side.client().await.unwrap();
    let waiter_client = waiter_side.client().await.unwrap();
    let dir = format!("{root}/x");

    let holder = holder_side.lock("x").await.unwrap();
    let holder_path = holder.backend_key().unwrap().to_owned();
    let waiter = {
        let locks = waiter_side.clone();
        tokio::spawn(async move { locks.lock("x").await })
    };
    // The waiter's node, once it watches the holder's (its first listing is done).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !watched_by(server, waiter_client.session_id(), &holder_path) {
        assert!(Instant::now() < deadline, "the waiter never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let children = admin.list_children(&dir).await.unwrap();
    let waiter_node = children
        .iter()
        .find(|c| format!("{dir}/{c}") != holder_path)
        .expect("the waiter's node");
    // `_c_<uuid>-lock-` and a 10-digit sequence number.
    let prefix = &waiter_node[..waiter_node.len() - 10];
    assert!(prefix.ends_with("-lock-"), "{waiter_node}");
    let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    waiter_client
        .create(&format!("{dir}/{prefix}"), b"", &ephemeral)
        .await
        .expect("the first create's node, in the waiter's session");

    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    holder.release().await.unwrap();
    let next = match holder_side
        .acquire(
            "x",
            AcquireOptions::new().wait_timeout(Duration::from_secs(1)),
        )
        .await
    {
        Ok(next) => next,
        Err(e) => panic!(
            "the next holder waits behind a node of the dropped acquire: {e}; left: {:?}",
            admin.list_children(&dir).await
        ),
    };
    next.release().await.unwrap();
    assert_eq!(nodes(&admin, &root, "x").await, 0);
}

/// A release whose delete was lost with its connection, while someone else (an
/// operator's revoke, a raw delete) removed the node, finds the node gone when it repeats
/// the delete. It cannot tell that from its own first delete having been applied, so it
/// does not answer `Ok`: the lock may have been lost before the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_after_a_broken_connection_does_not_claim_a_node_deleted_by_another() {
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let root = random_root("broken-release-revoked");
    let (behind_proxy, direct) = clients(server, &proxy.addr(), &root).await;
    let admin = direct.client().await.unwrap();
    let session = behind_proxy.client().await.unwrap().session_id();

    let guard = behind_proxy.lock("job").await.unwrap();
    let path = guard.backend_key().unwrap().to_owned();
    proxy.set(Fault::Blackhole);
    let release = tokio::spawn(async move { guard.release().await });
    // The release's delete is sent and held by the partition.
    tokio::time::sleep(Duration::from_millis(100)).await;
    admin
        .delete(&path, None)
        .await
        .expect("the operator's revoke deletes the holder's node");
    // The connection breaks with the delete unanswered (and never delivered); the client
    // reconnects and repeats it.
    proxy.reset_connections();
    proxy.set(Fault::Pass);
    let released = tokio::time::timeout(Duration::from_secs(10), release)
        .await
        .expect("the release answers")
        .unwrap();
    assert!(
        matches!(
            released,
            Err(Error::Unavailable { .. } | Error::Lost { .. })
        ),
        "release answered {released:?} for a node someone else deleted"
    );
    assert_eq!(
        behind_proxy.client().await.unwrap().session_id(),
        session,
        "the session behind the proxy lives on"
    );
    let next = direct
        .try_lock("job")
        .await
        .unwrap()
        .expect("the lock is free");
    next.release().await.unwrap();
}

/// The other case the repeated delete cannot tell apart: the first delete was applied
/// and only its answer was lost. The release is unconfirmed (`Unavailable`), not a loss
/// (which would count as one, and raise the lock-loss alarm), and the lock is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_whose_applied_delete_lost_its_answer_is_unconfirmed() {
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let root = random_root("broken-release-applied");
    let (behind_proxy, direct) = clients(server, &proxy.addr(), &root).await;
    let admin = direct.client().await.unwrap();

    let guard = behind_proxy.lock("job").await.unwrap();
    proxy.set(Fault::DropReplies);
    let release = tokio::spawn(async move { guard.release().await });
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes(&admin, &root, "job").await > 0 {
        assert!(
            Instant::now() < deadline,
            "the release's delete never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.reset_connections();
    proxy.set(Fault::Pass);
    let released = tokio::time::timeout(Duration::from_secs(10), release)
        .await
        .expect("the release answers")
        .unwrap();
    assert!(
        matches!(released, Err(Error::Unavailable { .. })),
        "{released:?}"
    );
    let next = direct
        .try_lock("job")
        .await
        .unwrap()
        .expect("the lock is free");
    next.release().await.unwrap();
}
