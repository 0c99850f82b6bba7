//! F18 on Redis Cluster: the master of a held lock's slot is SIGKILLed and its replica
//! promoted (3 masters with a replica each, `cluster-node-timeout` 2 s). What
//! backend-redis/README.md promises:
//!
//! - "Exclusion holds while the master keeps the key": a grant that reached the replica
//!   before the failover survives it. The holder keeps the lock (its renewals go on at
//!   the promoted replica, no loss is reported), others are refused until it releases,
//!   and the next token is larger.
//! - "Asynchronous replication can lose a lock on failover, and then a second holder
//!   appears. Pass the guard's token to the resource and let it reject stale tokens":
//!   with replication blocked before the grant (the replica is pointed at an ACL user
//!   that does not exist and its link is killed, as in backend-redis/tests/failover.rs),
//!   the promoted replica never saw the lock, and another client is granted it while the
//!   first guard still claims it. The new token is larger than every token issued before
//!   the failover, although the promoted replica's token counter is stale (only the
//!   `max(counter + 1, server clock)` rule keeps it from going back), the fenced register
//!   (the [`Checker`]) rejects the stale holder's write, and the stale holder reports the
//!   loss at its next renewal ("a key found ... re-owned → that guard reports loss at
//!   once"); its `release()` is `Err(Lost)`.
//!
//! Right after the failover a lock call may fail, but only with a retryable error (the
//! tests retry those for up to 10 s): a transient state of the cluster is not a reason
//! to give up.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, DistributedLockExt, Error};
use fencelock_testkit::checker::Checker;
use fencelock_testkit::{RedisCluster, RedisServer};
use tokio::time::Instant;

/// The lock's name and its keys under `prefix=f18c:`.
const NAME: &str = "orders";
const KEY: &str = "f18c:{orders}";
const TOKEN_KEY: &str = "f18c:{orders}:token";

/// A fresh raw connection to one node (fresh: a promotion closes normal clients).
async fn conn(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn info_replication(server: &RedisServer) -> String {
    redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn(server).await)
        .await
        .unwrap()
}

/// `GET key` on `server` itself, also on a replica (`READONLY`).
async fn get_local(server: &RedisServer, key: &str) -> Option<String> {
    let mut conn = conn(server).await;
    let () = redis::cmd("READONLY").query_async(&mut conn).await.unwrap();
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// Waits (polling every 50 ms) until `check` holds, or panics after `limit`.
async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A cluster of 3 masters with a replica each, [`KEY`]'s slot, the master serving it and
/// its replica (as indexes into `nodes()` and `replicas()`), and the client URL (every
/// node a seed, prefix `f18c:`).
struct Setup {
    cluster: Arc<RedisCluster>,
    slot: u16,
    master: usize,
    replica: usize,
    url: String,
}

impl Setup {
    async fn start() -> Setup {
        let cluster = Arc::new(
            tokio::task::spawn_blocking(|| RedisCluster::start_with_replicas(3, 1))
                .await
                .unwrap(),
        );
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(KEY)
            .query_async(&mut conn(&cluster.nodes()[0]).await)
            .await
            .unwrap();
        let c = cluster.clone();
        let (master, replica) = tokio::task::spawn_blocking(move || {
            let master = c.master_of_slot(slot).expect("a master for the slot");
            let replicas = c.replicas_of(master);
            assert_eq!(replicas.len(), 1, "one replica of {}", master.addr());
            let m = c.nodes().iter().position(|n| n.port() == master.port());
            let r = c
                .replicas()
                .iter()
                .position(|n| n.port() == replicas[0].port());
            (
                m.expect("the slot's master is an initial master"),
                r.expect("its replica is an initial replica"),
            )
        })
        .await
        .unwrap();
        let seeds: Vec<String> = cluster
            .nodes()
            .iter()
            .chain(cluster.replicas())
            .map(RedisServer::addr)
            .collect();
        let url = format!("redis+cluster://{}?prefix=f18c:", seeds.join(","));
        Setup {
            cluster,
            slot,
            master,
            replica,
            url,
        }
    }

    fn master(&self) -> &RedisServer {
        &self.cluster.nodes()[self.master]
    }

    fn replica(&self) -> &RedisServer {
        &self.cluster.replicas()[self.replica]
    }

    /// Whether the replica acknowledged every write the master took so far: a probe
    /// write in the lock's slot, then `WAIT 1 2000` on the same connection (`WAIT` counts
    /// acknowledgements of its own client's writes, and the replication stream is in
    /// order).
    async fn replicated(&self) -> bool {
        let mut master = conn(self.master()).await;
        let () = redis::cmd("SET")
            .arg("f18c:{orders}:probe")
            .arg(1)
            .query_async(&mut master)
            .await
            .unwrap();
        let acked: i64 = redis::cmd("WAIT")
            .arg(1)
            .arg(2000)
            .query_async(&mut master)
            .await
            .unwrap();
        acked == 1
    }

    /// Blocks replication master → replica (see the module documentation) and waits
    /// until both sides see the link down.
    async fn block_replication(&self) {
        let mut replica = conn(self.replica()).await;
        for (parameter, value) in [
            ("masteruser", "fencelock-no-such-user"),
            ("masterauth", "replication-blocked"),
        ] {
            let () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(parameter)
                .arg(value)
                .query_async(&mut replica)
                .await
                .unwrap();
        }
        let killed: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("replica")
            .query_async(&mut conn(self.master()).await)
            .await
            .unwrap();
        assert_eq!(killed, 1, "the master had one replica link to kill");
        wait_until("replication link down", Duration::from_secs(5), || async {
            info_replication(self.master())
                .await
                .contains("connected_slaves:0")
                && info_replication(self.replica())
                    .await
                    .contains("master_link_status:down")
        })
        .await;
    }

    /// SIGKILLs the master and waits until the replica is master of the slot, as it says
    /// itself and as the surviving nodes agree (every running node `cluster_state:ok`).
    /// Returns how long the failover took.
    async fn fail_over(&self) -> Duration {
        let cluster = self.cluster.clone();
        let master = self.master;
        tokio::task::spawn_blocking(move || cluster.nodes()[master].kill())
            .await
            .unwrap();
        let port = self.replica().port();
        let slot = self.slot;
        wait_until("cluster failover", Duration::from_secs(20), || async {
            let cluster = self.cluster.clone();
            let agreed = tokio::task::spawn_blocking(move || {
                let slot_owner = cluster
                    .nodes()
                    .iter()
                    .chain(cluster.replicas())
                    .find(|n| n.port() == port)
                    .is_some_and(|promoted| {
                        cluster.replicas_of(promoted).is_empty()
                            && cluster
                                .master_of_slot(slot)
                                .is_some_and(|m| m.port() == port)
                    });
                slot_owner && cluster.running_nodes_ok()
            })
            .await
            .unwrap();
            agreed
                && info_replication(self.replica())
                    .await
                    .contains("role:master")
        })
        .await
    }
}

/// Runs `attempt` until it is not a retryable error (the cluster may answer
/// `CLUSTERDOWN` or a refused connection for a moment after a failover), for up to 10 s.
async fn settled<T, F, Fut>(mut attempt: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match attempt().await {
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                println!("retrying after a retryable error: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// Replication blocked before the grant: the failover loses the lock, a second holder
/// appears with a larger token than any issued before, fencing rejects the stale holder,
/// and the stale holder reports the loss at its next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f18_cluster_failover_loses_an_unreplicated_grant_and_fencing_stops_the_stale_holder() {
    let setup = Setup::start().await;
    let checker = Checker::new();
    let mut issued = Vec::new();
    let mut writes = 0;
    // A renews every lease / 3 = 10 s: after the failover and B's grant, so A's guard is
    // still valid (and not yet told) when B is granted.
    let lease = Duration::from_secs(30);
    let a_locks = fencelock::connect(&setup.url).await.unwrap();

    // Grants before the failover: three replicated, then two while replication is
    // blocked (on the master only).
    let grant = async |who: &str| {
        let guard = a_locks.lock(NAME).await.unwrap();
        let token = guard.token().get();
        checker.enter(who, token);
        assert!(checker.write(who, token));
        checker.exit(who, token);
        guard.release().await.unwrap();
        token
    };
    for i in 0..3 {
        issued.push(grant(&format!("replicated-{i}")).await);
        writes += 1;
    }
    assert!(setup.replicated().await, "the replica did not catch up");
    let replicated_counter: u64 = get_local(setup.replica(), TOKEN_KEY)
        .await
        .expect("the replica has the token counter")
        .parse()
        .unwrap();
    setup.block_replication().await;
    for i in 0..2 {
        issued.push(grant(&format!("unreplicated-{i}")).await);
        writes += 1;
    }
    let a = a_locks
        .acquire(NAME, AcquireOptions::new().lease(lease))
        .await
        .expect("without a replica check, A is granted on the master alone");
    let a_token = a.token().get();
    issued.push(a_token);
    checker.enter("A", a_token);
    assert!(checker.write("A", a_token));
    writes += 1;
    assert!(get_local(setup.master(), KEY).await.is_some());
    assert_eq!(
        get_local(setup.replica(), KEY).await,
        None,
        "replication was not blocked: the replica has A's key"
    );
    let stale_counter: u64 = get_local(setup.replica(), TOKEN_KEY)
        .await
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(stale_counter, replicated_counter);
    // The promoted replica's counter lags: `counter + 1` alone would re-issue a token.
    let highest = *issued.iter().max().unwrap();
    assert!(stale_counter < highest, "{stale_counter} vs {issued:?}");

    let failover = setup.fail_over().await;
    let b_locks = fencelock::connect(&setup.url)
        .await
        .expect("connect after the failover (the dead master is one of the seeds)");
    let b = settled(|| {
        b_locks.acquire(
            NAME,
            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
        )
    })
    .await
    .expect("B is granted on the promoted replica, which never saw A's key");
    let b_granted = Instant::now();
    let b_token = b.token().get();
    checker.enter("B", b_token);
    println!(
        "failover took {failover:?}; tokens before {issued:?}, stale counter {stale_counter}, \
         B {b_token}"
    );
    // Two holders: A's guard still claims the lock (the documented loss on failover).
    assert!(
        !a.is_lost() && a.valid_until() > b_granted,
        "A already knew it lost the lock when B was granted ({:?})",
        a.lost_reason()
    );
    assert!(
        issued.iter().all(|&t| b_token > t),
        "the token went backwards across the failover: B {b_token}, before {issued:?}"
    );
    assert!(checker.write("B", b_token), "B's write");
    writes += 1;
    assert!(
        !checker.write("A", a_token),
        "the stale holder's write after B's must be rejected"
    );

    // A finds B's key at its next renewal (lease / 3 after its grant).
    tokio::time::timeout(lease / 3 + Duration::from_secs(3), a.lost())
        .await
        .expect("A reports the loss at its next renewal");
    checker.lost("A", a_token, a.valid_until().into_std());
    println!("A told of the loss: {:?}", a.lost_reason());
    let released = a.release().await;
    assert!(
        matches!(released, Err(Error::Lost { .. })),
        "A's late release: {released:?}"
    );
    assert!(!b.is_lost(), "{:?}", b.lost_reason());
    assert!(get_local(setup.replica(), KEY).await.is_some(), "B's key");
    checker.exit("B", b_token);
    b.release().await.unwrap();

    checker.assert_no_stale_write_accepted();
    checker.assert_no_lost_update(writes);
    checker.assert_tokens_increase();
    checker.assert_loss_reported_in_time();
    assert_eq!(checker.rejected_writes(), 1);
}

/// A grant that reached the replica survives the failover: the holder keeps the lock
/// (its renewals go on at the promoted replica, which had never run the scripts, and no
/// loss is reported), others are refused while it holds, and the next token is larger.
/// The scripts reach the promoted replica as `EVAL` from the call it refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f18_cluster_failover_keeps_a_replicated_grant() {
    let setup = Setup::start().await;
    let checker = Checker::new();
    // Renewals every 4 s; the failover (node timeout 2 s) ends well inside one lease.
    let lease = Duration::from_secs(12);
    let a_locks = fencelock::connect(&setup.url).await.unwrap();
    let before = a_locks.lock(NAME).await.unwrap();
    let before_token = before.token().get();
    before.release().await.unwrap();
    let a = a_locks
        .acquire(NAME, AcquireOptions::new().lease(lease))
        .await
        .unwrap();
    let a_token = a.token().get();
    assert!(a_token > before_token);
    checker.enter("A", a_token);
    assert!(checker.write("A", a_token));
    assert!(setup.replicated().await, "the replica did not catch up");
    assert!(
        get_local(setup.replica(), KEY).await.is_some(),
        "the replica has A's key"
    );

    let failover = setup.fail_over().await;
    println!("failover took {failover:?}");
    // A renewal after the failover reached the promoted replica: its TTL is back near the
    // full lease.
    let renewed = wait_until(
        "A's renewal on the promoted replica",
        lease / 3 + Duration::from_secs(5),
        || async {
            let mut conn = conn(setup.replica()).await;
            let pttl: i64 = redis::cmd("PTTL")
                .arg(KEY)
                .query_async(&mut conn)
                .await
                .unwrap();
            pttl > (lease - lease / 6).as_millis() as i64
        },
    )
    .await;
    println!("renewed on the promoted replica {renewed:?} after the failover");
    assert!(
        !a.is_lost(),
        "A lost a replicated grant: {:?}",
        a.lost_reason()
    );

    let b_locks = fencelock::connect(&setup.url)
        .await
        .expect("connect after the failover (the dead master is one of the seeds)");
    let refused = settled(|| b_locks.try_lock(NAME)).await.unwrap();
    assert!(refused.is_none(), "B was granted a lock A holds");
    assert!(checker.write("A", a_token), "A still writes");
    checker.exit("A", a_token);
    assert!(!a.is_lost(), "{:?}", a.lost_reason());
    a.release()
        .await
        .expect("A's release on the promoted replica");
    let b = settled(|| b_locks.try_lock(NAME))
        .await
        .unwrap()
        .expect("free after A's release");
    let b_token = b.token().get();
    checker.enter("B", b_token);
    assert!(b_token > a_token, "B {b_token} after A {a_token}");
    assert!(checker.write("B", b_token));
    checker.exit("B", b_token);
    b.release().await.unwrap();
    assert_eq!(get_local(setup.replica(), KEY).await, None, "a key is left");
    // The promoted replica had never run a script (a replica applies a script's writes,
    // not the script): the first call there was refused with NOSCRIPT and sent again as
    // EVAL to it, never as a SCRIPT LOAD routed by the client's view of the cluster.
    let stats: String = redis::cmd("INFO")
        .arg("all")
        .query_async(&mut conn(setup.replica()).await)
        .await
        .unwrap();
    assert!(
        stats.contains("errorstat_NOSCRIPT:"),
        "no NOSCRIPT:\n{stats}"
    );
    assert!(stats.contains("cmdstat_eval:"), "no EVAL:\n{stats}");
    assert!(
        !stats.contains("cmdstat_script|load:"),
        "a SCRIPT LOAD reached the promoted replica:\n{stats}"
    );

    checker.assert_no_overlap();
    checker.assert_no_stale_write_accepted();
    checker.assert_no_lost_update(3);
    checker.assert_tokens_increase();
    assert_eq!(checker.rejected_writes(), 0);
}
