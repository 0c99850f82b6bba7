//! Fault tests on real Redis servers: a holder process frozen past its lease (SIGSTOP),
//! a Redis restart without persistence, Redlock with instances killed, renewals
//! answered after the holder's deadline, and a failed grant's undo cut off by a partition.
//!
//! The frozen holder is this test binary re-run as a child process (the `holder_child`
//! test, which does nothing unless `FENCELOCK_HOLDER_URL` is set).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencelock_core::{
    AcquireOptions, DistributedLock, DistributedLockExt, FencedRegister, FencingToken,
};
use fencelock_testkit::RedisServer;
use redis::AsyncCommands;

const HOLDER_URL: &str = "FENCELOCK_HOLDER_URL";

/// The child side of `frozen_holder_is_fenced_and_told`: takes the lock with a renewing
/// 1 s lease and then "works": it asks the parent to write with its token every 20 ms,
/// whether or not it still holds the lock (as a paused process would), and says when it
/// learns of the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_child() {
    let Ok(url) = std::env::var(HOLDER_URL) else {
        return;
    };
    let locks = fencelock_redis::connect(&url).await.unwrap();
    let guard = locks
        .acquire(
            "zombie",
            AcquireOptions::new().lease(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    let token = guard.token().get();
    println!("token {token}");
    let mut reported = false;
    for _ in 0..400 {
        println!("write {token}");
        if guard.is_lost() && !reported {
            println!("lost");
            reported = true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The holder child, resumed and killed when dropped: a test that fails while the child
/// is SIGSTOPped must not leave it stopped for ever.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // Not once it has been waited for: its pid may belong to another process by now.
        if let Ok(None) = self.0.try_wait() {
            let _ = Command::new("kill")
                .args(["-CONT", &self.0.id().to_string()])
                .status();
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// F3: the holder is SIGSTOPped for 3 leases. The next holder gets the lock with a larger
/// token; every write the zombie makes after the new holder's first write is rejected by
/// the fenced register; the zombie reports the loss within 1 s of SIGCONT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_holder_is_fenced_and_told() {
    let server = RedisServer::start();
    let url = format!("{}?prefix=f3:", server.url());
    let mut child = ChildGuard(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "holder_child", "--nocapture", "--test-threads=1"])
            .env(HOLDER_URL, &url)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let register = Arc::new(FencedRegister::new(0u64));
    let events = Arc::new(Mutex::new(Vec::<(Instant, String)>::new()));
    let (token_tx, token_rx) = std::sync::mpsc::channel();
    let reader = {
        let (register, events) = (register.clone(), events.clone());
        let stdout = child.0.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let now = Instant::now();
                // libtest prints "test holder_child ... " before the first line.
                if let Some(t) = line.find("token ").map(|i| &line[i + 6..]) {
                    let _ = token_tx.send(t.parse::<u64>().unwrap());
                } else if let Some(t) = line.strip_prefix("write ") {
                    let t = FencingToken::new(t.parse().unwrap());
                    let ok = register.write(t, register.read() + 1).is_ok();
                    events
                        .lock()
                        .unwrap()
                        .push((now, if ok { "accepted" } else { "stale" }.into()));
                } else if line == "lost" {
                    events.lock().unwrap().push((now, "lost".into()));
                }
            }
        })
    };
    let token_a =
        tokio::task::spawn_blocking(move || token_rx.recv_timeout(Duration::from_secs(30)))
            .await
            .unwrap()
            .expect("the holder child acquired");
    tokio::time::sleep(Duration::from_millis(200)).await;
    signal(pid, "-STOP");
    let stopped = Instant::now();

    let locks = fencelock_redis::connect(&url).await.unwrap();
    let b = locks
        .acquire(
            "zombie",
            AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("next holder acquires while the first is frozen");
    assert!(
        stopped.elapsed() < Duration::from_millis(2500),
        "took {:?}",
        stopped.elapsed()
    );
    assert!(b.token().get() > token_a, "{} <= {token_a}", b.token());
    register
        .write(b.token(), register.read() + 1)
        .expect("B's write");
    let b_wrote = Instant::now();
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(stopped.elapsed())).await;

    signal(pid, "-CONT");
    let resumed = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let _ = child.0.kill();
    let _ = child.0.wait();
    reader.join().unwrap();

    let events = events.lock().unwrap().clone();
    let lost = events
        .iter()
        .find(|(_, e)| e == "lost")
        .map(|(at, _)| *at)
        .expect("the zombie reported the loss");
    assert!(
        lost.saturating_duration_since(resumed) < Duration::from_secs(1),
        "loss reported {:?} after SIGCONT",
        lost.saturating_duration_since(resumed)
    );
    let late: Vec<_> = events
        .iter()
        .filter(|(at, e)| *at > b_wrote && e != "lost")
        .collect();
    assert!(!late.is_empty(), "the zombie wrote nothing after resuming");
    assert!(
        late.iter().all(|(_, e)| e == "stale"),
        "a zombie write was accepted after the new holder's"
    );
    assert!(!b.is_lost());
    b.release().await.unwrap();
}

/// F7: Redis restarted without persistence while locks are in use: the holder learns of
/// the loss, and no token issued after the restart is ≤ any token issued before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_without_persistence_never_reissues_a_token() {
    let server = Arc::new(RedisServer::start());
    let locks = fencelock_redis::connect(&server.url()).await.unwrap();
    let opts = AcquireOptions::new()
        .lease(Duration::from_millis(900))
        .wait_timeout(Duration::from_secs(10));
    let mut before = Vec::new();
    for _ in 0..5 {
        let g = locks.acquire("restart", opts).await.unwrap();
        before.push(g.token());
        g.release().await.unwrap();
    }
    let holder = locks.acquire("restart", opts).await.unwrap();
    before.push(holder.token());
    let s = server.clone();
    tokio::task::spawn_blocking(move || s.restart())
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(3), holder.lost())
        .await
        .expect("the holder reports the loss after the restart");
    let max_before = *before.iter().max().unwrap();
    let mut after = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while after.len() < 5 {
        match locks.acquire("restart", opts).await {
            Ok(g) => {
                after.push(g.token());
                g.release().await.unwrap();
            }
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(
        after.iter().all(|t| *t > max_before),
        "before {before:?}, after {after:?}"
    );
    assert!(after.windows(2).all(|w| w[0] < w[1]), "{after:?}");
}

/// Three fresh Redis servers and a Redlock client over them.
async fn redlock_over_three() -> (Vec<RedisServer>, Arc<dyn DistributedLock>) {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let locks = fencelock_redis::connect(&format!("redlock://{}", hosts.join(",")))
        .await
        .unwrap();
    (servers, locks)
}

/// F17: Redlock over 3 instances keeps working with 1 killed, and with 2 killed fails
/// cleanly (retryable error, no hang) leaving no lock key on the survivor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_survives_one_loss_and_fails_cleanly_on_two() {
    let (servers, locks) = redlock_over_three().await;
    let opts = AcquireOptions::new()
        .lease(Duration::from_secs(1))
        .wait_timeout(Duration::from_secs(5));
    let first = locks.acquire("quorum", opts).await.unwrap();
    let t1 = first.token();
    first.release().await.unwrap();

    servers[0].kill();
    let second = locks.acquire("quorum", opts).await.expect("2 of 3 suffice");
    assert!(second.token() > t1);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!second.is_lost(), "renewal with 2 of 3 failed");
    second.release().await.unwrap();

    servers[1].kill();
    let started = Instant::now();
    let err = locks.acquire("quorum", opts).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut survivor = redis::Client::open(servers[2].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let exists: bool = survivor.exists("fencelock:{quorum}").await.unwrap();
    assert!(
        !exists,
        "a failed Redlock acquire left its key on the survivor"
    );
}

/// Whether `key` exists on `server` (a connection of its own).
async fn exists_on(server: &RedisServer, key: &str) -> bool {
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    conn.exists(key).await.unwrap()
}

/// F17(c): two of three instances slower (1.5 s each way) than the client waits for an
/// instance (`timeout=200ms`): no majority answers in time. The acquire gives up on them
/// after that bound, fails with a retryable error, and waits for its undo no longer than
/// that bound either (0.4 s in all, not the slow instances' 3 s). Its key is deleted at
/// once from the instance that answered, and from the slow ones when the release
/// (queued behind the late request on the same connection) lands there: long before the
/// 5 s lease would have expired it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_slower_than_its_instances_bound_fails_and_leaves_no_partial_key() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<fencelock_testkit::FaultProxy> = servers[1..]
        .iter()
        .map(|s| fencelock_testkit::FaultProxy::start(&s.addr()))
        .collect();
    let hosts = [servers[0].addr(), proxies[0].addr(), proxies[1].addr()];
    let url = format!("redlock://{}?timeout=200ms", hosts.join(","));
    let locks = fencelock_redis::connect(&url).await.unwrap();
    let lease = Duration::from_secs(5);
    let opts = AcquireOptions::new().fixed_lease(lease).no_wait();
    // Connected and the scripts loaded while answers are quick.
    let warm = locks.acquire("slow", opts).await.unwrap();
    let key = warm.backend_key().unwrap().to_owned();
    warm.release().await.unwrap();
    let slow = Duration::from_millis(1500);
    for proxy in &proxies {
        proxy.set(fencelock_testkit::Fault::Delay {
            min: slow,
            max: slow,
        });
    }
    let started = Instant::now();
    let outcome = locks.acquire("slow", opts).await;
    let took = started.elapsed();
    match &outcome {
        Err(e) => assert!(e.is_retryable(), "{e:?}"),
        Ok(guard) => panic!("granted without a majority in time: {guard:?}"),
    }
    // 200 ms for the answers, at most 200 ms for the undo.
    assert!(
        took < Duration::from_secs(1),
        "the acquire took {took:?}: it waited for the slow instances"
    );
    assert!(
        !exists_on(&servers[0], &key).await,
        "the answering instance kept the failed acquire's key"
    );
    // The late requests land at 1.5 s, the releases behind them by about 3.2 s; the keys
    // would expire at 6.5 s.
    tokio::time::sleep_until((started + Duration::from_millis(4500)).into()).await;
    for (i, server) in servers.iter().enumerate() {
        assert!(
            !exists_on(server, &key).await,
            "a partial grant's key was left on instance {i}"
        );
    }
    for proxy in &proxies {
        proxy.set(fencelock_testkit::Fault::Pass);
    }
    let again = locks.acquire("slow", opts).await.expect("free again");
    again.release().await.unwrap();
}

/// F17(d): an instance restarted without persistence within the lease forgets the
/// holder's key. Where that key was on a bare majority (here the third instance lost it
/// too: deleted, as if it had never granted it), another client then gets a majority
/// while the holder still counts on its lease: Redlock's known gap, which fencelock does
/// not close (it does not watch `run_id` to hold a restarted instance back for a lease).
/// What must hold: the second holder's token is larger, the fenced register refuses the
/// first holder's writes after the second's, the first holder learns of the loss at its
/// next renewal, and its release is `Err(Lost)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_restart_within_the_lease_gives_a_second_holder_that_fencing_stops() {
    let (servers, first) = redlock_over_three().await;
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let second = fencelock_redis::connect(&format!("redlock://{}", hosts.join(",")))
        .await
        .unwrap();
    let lease = Duration::from_secs(3);
    let register = FencedRegister::new(0u64);
    let a = first
        .acquire("restarted", AcquireOptions::new().lease(lease).no_wait())
        .await
        .unwrap();
    register.update(a.token(), |n| n + 1).expect("A's write");
    let key = a.backend_key().unwrap().to_owned();
    let mut third = redis::Client::open(servers[2].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let deleted: u64 = third.del(&key).await.unwrap();
    assert_eq!(deleted, 1);
    tokio::task::block_in_place(|| servers[1].restart());
    let restarted = Instant::now();

    let b = second
        .acquire(
            "restarted",
            AcquireOptions::new()
                .lease(lease)
                .wait_timeout(Duration::from_secs(5)),
        )
        .await
        .expect("a majority (the restarted instance and the third) grants B");
    let overlapped = !a.is_lost();
    assert!(b.token() > a.token(), "{} after {}", b.token(), a.token());
    register.update(b.token(), |n| n + 1).expect("B's write");
    assert!(
        register.update(a.token(), |n| n + 1).is_err(),
        "A's write after B's was accepted"
    );
    assert_eq!(register.read(), 2);
    tokio::time::timeout(lease / 3 + Duration::from_millis(500), a.lost())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "A was not told of the loss within a renewal interval ({:?} after the restart)",
                restarted.elapsed()
            )
        });
    eprintln!(
        "F17(d): B granted {:?} after the restart, while A still counted on its lease: \
         {overlapped}; A told {:?} after the restart",
        b.token(),
        restarted.elapsed()
    );
    assert!(matches!(
        a.release().await,
        Err(fencelock_core::Error::Lost { .. })
    ));
    assert!(!b.is_lost());
    b.release().await.unwrap();
    for (i, server) in servers.iter().enumerate() {
        assert!(!exists_on(server, &key).await, "key left on instance {i}");
    }
}

/// Redlock tokens stay above every earlier token when the only instance that remembers
/// one refuses the next grant: X is granted on instances 0 and 1 (2 holds a foreign
/// key), with a token from counters running far ahead of the clocks (a client whose
/// clock ran ahead); 0 restarts empty; Y is granted by 0 and 2, which never saw X's
/// token, while 1, which did, refuses (it still holds X's key). Y's token must still be
/// above X's: a refusing instance's counter counts too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_token_passes_a_counter_only_a_refusing_instance_remembers() {
    let (servers, x) = redlock_over_three().await;
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    let y = fencelock_redis::connect(&format!("redlock://{}", hosts.join(",")))
        .await
        .unwrap();
    let (lock, counter) = ("fencelock:{refused}", "fencelock:{refused}:token");
    let conn = |i: usize| {
        let url = servers[i].url();
        async move {
            redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap()
        }
    };
    let () = conn(2)
        .await
        .set_options(
            lock,
            "foreign",
            redis::SetOptions::default().with_expiration(redis::SetExpiry::PX(1000)),
        )
        .await
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let ahead = now + 1_000_000_000_000;
    for i in [0, 1] {
        let () = conn(i).await.set(counter, ahead).await.unwrap();
    }
    let lease = Duration::from_secs(10);
    let a = x
        .acquire("refused", AcquireOptions::new().lease(lease).no_wait())
        .await
        .unwrap();
    assert_eq!(a.token().get(), ahead + 1);
    while exists_on(&servers[2], lock).await {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::task::block_in_place(|| servers[0].restart());
    // Waits a little: Y's first try may find its connection to 0 reset by the restart.
    let b = y
        .acquire(
            "refused",
            AcquireOptions::new()
                .lease(lease)
                .wait_timeout(Duration::from_secs(2)),
        )
        .await
        .expect("instances 0 (restarted) and 2 grant B");
    assert!(b.token() > a.token(), "{} after {}", b.token(), a.token());
    let recorded = counters(&servers, counter).await;
    assert!(
        recorded
            .iter()
            .filter(|c| **c == Some(b.token().get()))
            .count()
            >= 2,
        "B's token is on a majority: {recorded:?}"
    );
    b.release().await.unwrap();
    drop(a);
}

async fn counters(servers: &[RedisServer], key: &str) -> Vec<Option<u64>> {
    let mut out = Vec::new();
    for server in servers {
        let value = match redis::Client::open(server.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
        {
            Ok(mut conn) => conn.get(key).await.unwrap_or(None),
            Err(_) => None,
        };
        out.push(value);
    }
    out
}

/// Redlock tokens: when the instances agree the token is recorded on all of them in the
/// acquire itself; when one instance's counter is ahead (it granted while the others
/// were unreachable), the highest token wins and is written back to a majority before
/// the guard is returned, so killing that instance and wiping another's data (restart
/// without persistence) never lets a later token fall to or below an earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_tokens_survive_disagreeing_and_lost_counters() {
    let (servers, locks) = redlock_over_three().await;
    let opts = AcquireOptions::new()
        .lease(Duration::from_secs(2))
        .wait_timeout(Duration::from_secs(5));
    let key = "fencelock:{tokens}:token";
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let g = locks.acquire("tokens", opts).await.unwrap();
        tokens.push(g.token().get());
        g.release().await.unwrap();
    }
    let last = *tokens.last().unwrap();
    assert_eq!(
        counters(&servers, key).await,
        vec![Some(last); 3],
        "agreeing instances record the token in the acquire itself"
    );

    // Instance 0 ran ahead (far beyond any clock): the next token must pass it, and a
    // majority must know it before the guard is handed out.
    let ahead = last + 1_000_000_000_000;
    let mut first = redis::Client::open(servers[0].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = first.set(key, ahead).await.unwrap();
    let g = locks.acquire("tokens", opts).await.unwrap();
    assert_eq!(g.token().get(), ahead + 1);
    let recorded = counters(&servers, key).await;
    assert!(
        recorded.iter().filter(|c| **c == Some(ahead + 1)).count() >= 2,
        "the highest token is on a majority: {recorded:?}"
    );
    g.release().await.unwrap();
    tokens.push(ahead + 1);

    // Lose the instance that was ahead, and wipe another: the third still remembers.
    servers[0].kill();
    servers[1].restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokens.len() < 9 {
        match locks.acquire("tokens", opts).await {
            Ok(g) => {
                tokens.push(g.token().get());
                g.release().await.unwrap();
            }
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

/// A holder's renewals reach the server at once but their answers come 4.3 s late (a
/// link slow one way). The holder counts the lock lost at its deadline (8 s less the
/// drift margin: it last heard a renewal sent at 2 s), while the server applied renewals
/// that keep the key for up to a lease past that. The key is released once the holder
/// counts the loss, so the next holder need not wait for that key to expire.
///
/// Two holders on a 6 s lease, renewed every 2 s, replies delayed from 2.3 s on:
/// - `timeout=10s`: the renewal sent at 4 s is applied (the key now expires at 10 s) and
///   answered at 8.3 s, after the deadline; released then.
/// - `timeout=1s`: it times out at 5 s and is retried every 0.6 s, each retry applied (the
///   last at about 7.2 s: the key would expire at 13.2 s); released when the round ends
///   after the deadline, at about 8.2 s.
///
/// Both keys must be gone by 9.2 s, before either would have expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_lost_while_its_renewals_were_answered_late_is_released() {
    let server = RedisServer::shared();
    let proxy = fencelock_testkit::FaultProxy::start(&server.addr());
    let prefix = format!("late-renewal-{:x}:", std::process::id());
    let lease = Duration::from_secs(6);
    let scenarios = [("1s", "times-out"), ("10s", "answered-late")];
    let start = Instant::now();
    let mut holders = Vec::new();
    for (timeout, name) in scenarios {
        let url = format!("redis://{}?prefix={prefix}&timeout={timeout}", proxy.addr());
        let holder = fencelock_redis::connect(&url).await.unwrap();
        // Loads the release script on the server, which a late answer would hold up.
        let warm_up = holder.try_lock("warm-up").await.unwrap().unwrap();
        warm_up.release().await.unwrap();
        let guard = holder
            .acquire(name, AcquireOptions::new().lease(lease))
            .await
            .unwrap();
        holders.push((holder, guard));
    }
    // After the first renewal (which also loads the renewal script), answered on time.
    tokio::time::sleep_until((start + Duration::from_millis(2_300)).into()).await;
    proxy.set(fencelock_testkit::Fault::DelayReplies(
        Duration::from_millis(4_300),
    ));
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let check_by = start + Duration::from_millis(9_200);
    for ((_, name), (_, guard)) in scenarios.iter().zip(&holders) {
        let key = format!("{prefix}{{{name}}}");
        while conn.exists::<_, bool>(&key).await.unwrap() && Instant::now() < check_by {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let pttl: i64 = conn.pttl(&key).await.unwrap();
        assert!(
            pttl == -2,
            "{name}: the key of the lost lock is still there {:?} after the acquire, for {pttl} ms more",
            start.elapsed()
        );
        assert!(
            guard.is_lost(),
            "{name}: the key was deleted under a live guard"
        );
    }
    proxy.set(fencelock_testkit::Fault::Pass);
}

/// A free lock granted by a server whose answer arrives after the lease has run out is
/// released and the acquire fails with `Unavailable` (retryable: the servers were too
/// slow), not `Contended`: nobody held it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_answered_after_its_lease_is_unavailable_not_contended() {
    let server = RedisServer::shared();
    let proxy = fencelock_testkit::FaultProxy::start(&server.addr());
    let prefix = format!("slow-grant-{:x}:", std::process::id());
    let url = format!("redis://{}?prefix={prefix}", proxy.addr());
    let locks = fencelock_redis::connect(&url).await.unwrap();
    // Loads the scripts while answers are quick.
    locks
        .try_lock("warm-up")
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    proxy.set(fencelock_testkit::Fault::DelayReplies(
        Duration::from_millis(300),
    ));
    let outcome = locks
        .acquire(
            "slow",
            AcquireOptions::new()
                .no_wait()
                .fixed_lease(Duration::from_millis(100)),
        )
        .await;
    proxy.set(fencelock_testkit::Fault::Pass);
    match outcome {
        Err(error @ fencelock_core::Error::Unavailable { .. }) => assert!(error.is_retryable()),
        other => panic!("a grant answered after its lease: {other:?}"),
    }
    // Released: the name is free at once, long before the 100 ms lease would matter.
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let exists: bool = conn.exists(format!("{prefix}{{slow}}")).await.unwrap();
    assert!(!exists, "the late grant's key was left");
}

/// One Redlock instance of three goes silent (partitioned: its connection stays open and
/// nothing is answered; it does not refuse connections). The two that answer are a
/// majority, so a renewing lock they granted and keep renewing stays held, and its
/// release succeeds.
///
/// The grant waits for the silent instance (up to half the lease, 1.5 s here: the token
/// is the highest of every answer). Each renewal used to wait for it too before counting
/// any answer: the first renewal, scheduled a third of the lease after the grant
/// returned, was sent at 2.5 s and counted at 4 s, past the 2.97 s deadline, and the
/// guard reported the loss of a lock a majority held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_with_a_silent_instance_keeps_a_renewing_lock() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxy = fencelock_testkit::FaultProxy::start(&servers[2].addr());
    let hosts = [servers[0].addr(), servers[1].addr(), proxy.addr()];
    let locks = fencelock_redis::connect(&format!("redlock://{}", hosts.join(",")))
        .await
        .unwrap();
    // Connected to every instance, and the scripts loaded, while all of them answer.
    let warm = locks.try_lock("silent").await.unwrap().unwrap();
    warm.release().await.unwrap();
    proxy.set(fencelock_testkit::Fault::Blackhole);
    let guard = locks
        .acquire(
            "silent",
            AcquireOptions::new()
                .lease(Duration::from_secs(3))
                .no_wait(),
        )
        .await
        .expect("two of three instances grant");
    // Granted at 1.5 s; past the first deadline (2.97 s, where the old code lost the
    // lock) and the next (4.47 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !guard.is_lost(),
        "a lock held by a majority was reported lost: {:?}",
        guard.lost_reason()
    );
    guard.release().await.expect("released on the majority");
    proxy.set(fencelock_testkit::Fault::Pass);
}

/// A renewing lock over a link whose answers come 400 ms late (a 1 s lease, 988 ms of
/// which the client counts on from when the acquire was sent) stays held: its first
/// renewal is due a third of the lease after the acquire was *sent*, the instant its
/// deadline counts from, so it is sent as soon as the grant arrives and answered at
/// 0.8 s. It used to be scheduled a third of the lease after the grant *arrived*, sent
/// at 0.73 s and answered at 1.13 s, past the deadline: the lock was reported lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewing_lock_on_a_slow_link_is_renewed_in_time() {
    let server = RedisServer::shared();
    let proxy = fencelock_testkit::FaultProxy::start(&server.addr());
    let prefix = format!("slow-link-{:x}:", std::process::id());
    let url = format!("redis://{}?prefix={prefix}", proxy.addr());
    let locks = fencelock_redis::connect(&url).await.unwrap();
    // Loads the acquire, renewal and release scripts while answers are quick.
    let warm = locks
        .acquire(
            "warm-up",
            AcquireOptions::new()
                .fixed_lease(Duration::from_secs(1))
                .no_wait(),
        )
        .await
        .unwrap();
    warm.extend(Duration::from_secs(1)).await.unwrap();
    warm.release().await.unwrap();
    proxy.set(fencelock_testkit::Fault::DelayReplies(
        Duration::from_millis(400),
    ));
    let guard = locks
        .acquire(
            "slow-link",
            AcquireOptions::new()
                .lease(Duration::from_secs(1))
                .no_wait(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !guard.is_lost(),
        "a lock renewed on time over a slow link was reported lost: {:?}",
        guard.lost_reason()
    );
    guard.release().await.unwrap();
    proxy.set(fencelock_testkit::Fault::Pass);
}

/// A grant whose replica check fails on a reset connection, and whose undo fails too
/// (the reconnect's `SELECT` cannot get through a partition within `connect_timeout`),
/// is released again in the background: the keys, which nobody holds, are gone soon
/// after the server is reachable again, not kept for their 30 s lease (a semaphore's
/// permit with them). The undo used to count a release that returned an error as done
/// and send nothing more. A lock and a semaphore permit, side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_undo_of_a_grant_is_sent_again_in_the_background() {
    let server = RedisServer::shared();
    let proxy = fencelock_testkit::FaultProxy::start(&server.addr());
    let prefix = format!("undo-{:x}:", std::process::id());
    let url = format!(
        "redis://{}/1?wait_replicas=1&wait_timeout=500ms&connect_timeout=100ms&timeout=2s&prefix={prefix}",
        proxy.addr()
    );
    let options = AcquireOptions::new()
        .fixed_lease(Duration::from_secs(30))
        .no_wait();
    let locks = fencelock_redis::connect(&url).await.unwrap();
    let lock = tokio::spawn(async move { locks.acquire("k", options).await });
    let locks = fencelock_redis::connect(&url).await.unwrap();
    let permit = tokio::spawn(async move {
        let one = fencelock_core::Permits::new(1, 3).unwrap();
        locks.acquire_permits("s", one, options).await
    });
    // Granted, and their `WAIT`s (no replica will answer) block for 500 ms.
    tokio::time::sleep(Duration::from_millis(250)).await;
    proxy.set(fencelock_testkit::Fault::Blackhole);
    proxy.reset_connections();
    let lock = lock.await.unwrap();
    assert!(lock.is_err(), "the lock was granted: {lock:?}");
    let permit = permit.await.unwrap();
    assert!(permit.is_err(), "the permit was granted: {permit:?}");
    proxy.set(fencelock_testkit::Fault::Pass);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut conn = redis::Client::open(format!("{}/1", server.url()))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let left: Vec<String> = conn.keys(format!("{prefix}*")).await.unwrap();
    let left: Vec<&String> = left.iter().filter(|k| !k.ends_with(":token")).collect();
    assert!(
        left.is_empty(),
        "the failed grants left {left:?} ({lock:?}, {permit:?})"
    );
}

/// A master and a replica of it (started by this test), once the replica's link is up;
/// and the replica's process id.
async fn master_and_replica() -> (RedisServer, RedisServer, u32) {
    let master = RedisServer::start();
    let port = master.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let mut conn = redis::Client::open(replica.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await
            .unwrap();
        if info.contains("master_link_status:up") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the replica never synced: {info}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .unwrap();
    let pid = info
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|p| p.trim().parse().ok())
        .unwrap();
    (master, replica, pid)
}

/// The replica check answers after the lease has run out (the replica, stopped, resumes
/// and acknowledges 700 ms into a 500 ms lease): the grant is undone and refused as
/// Unavailable, as a grant answered too late is, for a lock and for a semaphore permit,
/// never handed out as a guard that is already past its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_check_answered_after_the_lease_is_refused() {
    let (master, _replica, pid) = master_and_replica().await;
    let url = format!(
        "{}?wait_replicas=1&wait_timeout=1500ms&timeout=3s&prefix=late-ack:",
        master.url()
    );
    let locks = fencelock_redis::connect(&url).await.unwrap();
    let options = AcquireOptions::new()
        .lease(Duration::from_millis(500))
        .no_wait();
    for what in ["lock", "permit"] {
        signal(pid, "-STOP");
        let resume = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(700));
            signal(pid, "-CONT");
        });
        let outcome = match what {
            "lock" => locks.acquire("k", options).await.map(|g| g.valid_until()),
            _ => {
                let one = fencelock_core::Permits::new(1, 3).unwrap();
                locks
                    .acquire_permits("s", one, options)
                    .await
                    .map(|g| g.valid_until())
            }
        };
        resume.join().unwrap();
        let err = outcome.expect_err(&format!(
            "{what}: granted although the replica check answered after the lease"
        ));
        assert!(
            matches!(err, fencelock_core::Error::Unavailable { .. }),
            "{what}: {err:?}"
        );
        assert!(
            format!("{err:?}").contains("lease ran out"),
            "{what}: {err:?}"
        );
        let mut conn = redis::Client::open(master.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let left: Vec<String> = conn.keys("late-ack:*").await.unwrap();
        let left: Vec<&String> = left.iter().filter(|k| !k.ends_with(":token")).collect();
        assert!(left.is_empty(), "{what}: the refused grant left {left:?}");
    }
}

/// The replica check's `WAIT` runs on the grant's connection, and only after a grant:
/// a `WAIT` sent on another connection (the connection manager reconnected, or
/// Sentinel's cached connection was replaced, between the script's reply and the
/// `WAIT`) has no write of its own to wait for and returns at once, checking nothing; so
/// the script goes in one pipeline with `CLIENT ID`, and the `WAIT` in one with `CLIENT
/// ID` again, which must name the same connection. A refused try sends no `WAIT`. Seen
/// from the server (`MONITOR`): after each grant script (a lock and a semaphore permit),
/// the same client runs `CLIENT`, `CLIENT`, `WAIT`; after refused tries, no `WAIT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_check_runs_on_the_grants_connection_and_only_after_a_grant() {
    use futures_util::StreamExt;

    let (master, _replica, _pid) = master_and_replica().await;
    let url = format!(
        "{}?wait_replicas=1&wait_timeout=500ms&timeout=3s&prefix=same-conn:",
        master.url()
    );
    let locks = fencelock_redis::connect(&url).await.unwrap();
    let mut monitor = redis::Client::open(master.url())
        .unwrap()
        .get_async_monitor()
        .await
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let watcher = tokio::spawn({
        let seen = seen.clone();
        async move {
            let mut lines = monitor.on_message::<String>();
            while let Some(line) = lines.next().await {
                seen.lock().unwrap().push(line);
            }
        }
    });
    // `1700000000.123456 [0 127.0.0.1:54321] "EVALSHA" ...`; commands run by scripts
    // show as `[0 lua]`. The client's, in order: (client, verb).
    let take = |seen: &Mutex<Vec<String>>| -> Vec<(String, String)> {
        std::mem::take(&mut *seen.lock().unwrap())
            .iter()
            .filter_map(|line| {
                let (_, rest) = line.split_once(' ')?;
                let (client, command) = rest.split_once("] ")?;
                let client = client.split_whitespace().nth(1)?.to_owned();
                let verb = command.split('"').nth(1)?.to_ascii_uppercase();
                (client != "lua").then_some((client, verb))
            })
            .collect()
    };
    let options = AcquireOptions::new()
        .lease(Duration::from_secs(10))
        .no_wait();
    // The scripts loaded first (no `NOSCRIPT` fallback below), then only what follows
    // is looked at.
    locks
        .acquire("warm", options)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let one = fencelock_core::Permits::new(1, 3).unwrap();
    let warm = locks.acquire_permits("warm-s", one, options).await.unwrap();
    warm.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    take(&seen);

    let lock = locks.acquire("k", options).await.unwrap();
    let permit = locks.acquire_permits("s", one, options).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let granted = take(&seen);
    let scripts: Vec<usize> = (0..granted.len())
        .filter(|&i| matches!(granted[i].1.as_str(), "EVALSHA" | "EVAL"))
        .collect();
    assert_eq!(scripts.len(), 2, "{granted:?}");
    for i in scripts {
        let client = &granted[i].0;
        let after: Vec<&str> = granted[i + 1..]
            .iter()
            .filter(|(c, _)| c == client)
            .map(|(_, verb)| verb.as_str())
            .take(3)
            .collect();
        assert_eq!(after, ["CLIENT", "CLIENT", "WAIT"], "{granted:?}");
    }

    // Refused: the lock is held, and 3 permits of 3 are not free.
    let refused = locks.acquire("k", options).await.map(|g| g.token());
    assert!(
        matches!(refused, Err(fencelock_core::Error::Contended { .. })),
        "{refused:?}"
    );
    let three = fencelock_core::Permits::new(3, 3).unwrap();
    let refused = locks
        .acquire_permits("s", three, options)
        .await
        .map(|g| g.token());
    assert!(
        matches!(refused, Err(fencelock_core::Error::Contended { .. })),
        "{refused:?}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refusals = take(&seen);
    assert!(
        refusals.iter().any(|(_, verb)| verb == "EVALSHA"),
        "{refusals:?}"
    );
    assert!(
        !refusals.iter().any(|(_, verb)| verb == "WAIT"),
        "a refused try waited for replicas: {refusals:?}"
    );
    watcher.abort();
    lock.release().await.unwrap();
    permit.release().await.unwrap();
}

/// With the replica check on and replicas that do not acknowledge (here the replica is
/// stopped, so every `WAIT` runs to `wait_timeout`), a refused try answers at once: it
/// sends no `WAIT`, which would hold the client's shared connection (and every other
/// request on it, renewals among them) for `wait_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_try_does_not_wait_for_replicas() {
    let (master, _replica, pid) = master_and_replica().await;
    let url = format!(
        "{}?wait_replicas=1&wait_timeout=1500ms&timeout=3s&prefix=refused-wait:",
        master.url()
    );
    let holder = fencelock_redis::connect(&url).await.unwrap();
    let held = holder
        .acquire("h", AcquireOptions::new().no_wait())
        .await
        .unwrap();
    let locks = fencelock_redis::connect(&url).await.unwrap();
    signal(pid, "-STOP");
    let started = Instant::now();
    let refused = locks
        .acquire("h", AcquireOptions::new().no_wait())
        .await
        .map(|g| g.token());
    let took = started.elapsed();
    signal(pid, "-CONT");
    assert!(
        matches!(refused, Err(fencelock_core::Error::Contended { .. })),
        "{refused:?}"
    );
    assert!(
        took < Duration::from_millis(700),
        "a refused try took {took:?}: it waited for the replicas"
    );
    held.release().await.unwrap();
}

/// Script calls (`EVALSHA` and `EVAL`) `server` has run so far.
async fn script_calls(server: &RedisServer) -> u64 {
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// A Redlock holder on a bare majority (instances 0 and 1; 2 was held by someone else
/// when it acquired) leaves 2 free: every try of a waiter is granted there and refused
/// by the majority. That is no split vote: the holder holds a majority, and a waiter
/// that backs off a few ms after each such try polls the free instance (a grant and its
/// undo each time) for the holder's whole hold (over 200 script calls there in 3 s). It
/// must wait for the unlock message or the holder's PTTL instead: a handful of tries
/// (9 script calls there, the `NOSCRIPT` fallback of the first undo included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_waiter_does_not_poll_while_a_bare_majority_holds() {
    let (servers, locks) = redlock_over_three().await;
    let lock = "fencelock:{bare}";
    let mut third = redis::Client::open(servers[2].url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = third
        .set_options(
            lock,
            "foreign",
            redis::SetOptions::default().with_expiration(redis::SetExpiry::PX(500)),
        )
        .await
        .unwrap();
    // A lease long enough that no renewal falls in the wait below.
    let holder = locks
        .acquire(
            "bare",
            AcquireOptions::new()
                .lease(Duration::from_secs(30))
                .no_wait(),
        )
        .await
        .unwrap();
    while exists_on(&servers[2], lock).await {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = script_calls(&servers[2]).await;
    let waited = locks
        .acquire(
            "bare",
            AcquireOptions::new().wait_timeout(Duration::from_secs(3)),
        )
        .await;
    assert!(
        matches!(waited, Err(fencelock_core::Error::Timeout { .. })),
        "{waited:?}"
    );
    let calls = script_calls(&servers[2]).await - before;
    println!("{calls} script calls on the free instance during the wait");
    assert!(
        calls < 20,
        "the waiter polled the free instance: {calls} script calls there in 3 s"
    );
    holder.release().await.unwrap();
}
