//! Fault tests on real ZooKeeper servers: a holder process frozen with SIGSTOP past its
//! session timeout, and a 3-server ensemble losing its leader during contention.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, DistributedLockExt, Error};
use fencelock_testkit::{ZkEnsemble, ZkServer};
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};
use tokio::time::Instant;

/// Set in the child process that plays the holder to be frozen.
const HOLDER_ENV: &str = "FENCELOCK_ZK_PAUSED_HOLDER";
/// The holder's session timeout.
const HOLDER_SESSION: Duration = Duration::from_secs(2);

/// Kills the child process (even a stopped one) if the test fails half-way.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// A line for the parent, straight to the stdout pipe (not through the test harness's
/// output capture).
fn report(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn random_root(prefix: &str) -> String {
    format!("/{prefix}-{:016x}", fastrand::u64(..))
}

/// The holder, run in a child process by `paused_holder_is_fenced_off`: takes the lock,
/// writes the register through its fence, prints `HELD <token>`, and after being
/// resumed (it sees the marker file) reports whether its guard is lost and whether its
/// fenced write went through. A no-op in a normal test run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holder_role() {
    let Ok(setting) = std::env::var(HOLDER_ENV) else {
        return;
    };
    let parts: Vec<&str> = setting.split('|').collect();
    let [hosts, root, register, marker] = parts[..] else {
        panic!("bad {HOLDER_ENV}: {setting}");
    };
    let config = ZkConfig::new(hosts)
        .with_chroot(root)
        .unwrap()
        .with_session_timeout(HOLDER_SESSION)
        .with_min_lease(Duration::from_secs(1));
    let locks = ZkLock::connect(config).await.expect("connect");
    let guard = locks.lock("zombie").await.expect("acquire");
    let fence = locks.fence(&guard).await.expect("fence");
    let token = guard.token().get();
    fence
        .set_data(register, token.to_string().as_bytes(), None)
        .await
        .expect("first write");
    report(&format!("HELD {token}"));
    while !Path::new(marker).exists() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resumed = Instant::now();
    let lost = tokio::time::timeout(Duration::from_secs(1), guard.lost())
        .await
        .is_ok();
    let lost_after = resumed.elapsed();
    let write = fence
        .set_data(register, format!("{token}-zombie").as_bytes(), None)
        .await;
    let rejected = matches!(write, Err(Error::Lost { .. }));
    let release = guard.release().await;
    // The outcomes come last, for the failure message only.
    report(&format!(
        "ZOMBIE lost={lost} lost_after_ms={} write_rejected={rejected} release_lost={} \
         (write: {write:?}; release: {release:?})",
        lost_after.as_millis(),
        matches!(release, Err(Error::Lost { .. }))
    ));
}

/// F3: the holder process is frozen past its session timeout. The session expires, the
/// next holder gets a larger czxid, and after SIGCONT the zombie's guard reports loss at
/// once, its fenced write is refused and its release says `Lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_holder_is_fenced_off() {
    if std::env::var(HOLDER_ENV).is_ok() {
        return;
    }
    let server = ZkServer::shared();
    let root = random_root("paused-holder");
    let register = format!("{root}-register");
    let locks = ZkLock::connect(
        ZkConfig::new(server.connect_string())
            .with_chroot(&root)
            .unwrap()
            .with_session_timeout(Duration::from_secs(10)),
    )
    .await
    .unwrap();
    let client = locks.client().await.unwrap();
    let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    client.create(&register, b"0", &persistent).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("resumed");

    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "paused_holder_role",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            HOLDER_ENV,
            format!(
                "{}|{root}|{register}|{}",
                server.connect_string(),
                marker.display()
            ),
        )
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the holder");
    let mut child = ChildGuard(child);
    let pid = child.0.id();
    let (lines_tx, lines_rx) = std::sync::mpsc::channel::<String>();
    let stdout = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines_tx.send(line);
        }
    });
    let wait_line = |prefix: &str| -> String {
        loop {
            let line = lines_rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("no {prefix} line from the holder: {e}"));
            // The harness prints `test NAME ... ` without a newline first.
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].to_owned();
            }
        }
    };
    let old_token: u64 = wait_line("HELD ").parse().unwrap();

    signal(pid, "-STOP");
    let paused_at = Instant::now();
    let next = locks
        .acquire(
            "zombie",
            AcquireOptions::new().wait_timeout(Duration::from_secs(20)),
        )
        .await
        .expect("the next holder acquires once the frozen session expires");
    let waited = paused_at.elapsed();
    assert!(
        waited >= HOLDER_SESSION - Duration::from_millis(100),
        "granted {waited:?} after the pause: before the holder's session could expire"
    );
    assert!(next.token().get() > old_token, "token did not grow");
    let fence = locks.fence(&next).await.unwrap();
    fence
        .set_data(&register, next.token().to_string().as_bytes(), None)
        .await
        .expect("the new holder writes");

    std::fs::write(&marker, b"go").unwrap();
    signal(pid, "-CONT");
    let report = wait_line("ZOMBIE ");
    eprintln!("zombie {report}; the next holder waited {waited:?}");
    // Whole fields: "release_lost=true" must not pass for "lost=true".
    let field = |kv: &str| report.split_whitespace().any(|f| f == kv);
    assert!(field("lost=true"), "{report}");
    assert!(field("write_rejected=true"), "{report}");
    assert!(field("release_lost=true"), "{report}");
    let lost_after: u64 = report
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("lost_after_ms="))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        lost_after <= 1000,
        "loss reported {lost_after} ms after SIGCONT"
    );
    let status = child.0.wait().unwrap();
    assert!(status.success(), "holder process: {status}");

    // The register holds the new holder's write, not the zombie's.
    let (data, _) = client.get_data(&register).await.unwrap();
    assert_eq!(data, next.token().to_string().as_bytes());
    assert!(!next.is_lost());
    next.release().await.unwrap();
}

/// A grant as the checker sees it: [acquired, released or lost], with its token.
#[derive(Debug, Clone, Copy)]
struct Grant {
    start: Instant,
    end: Instant,
    token: u64,
}

/// A 3-server ensemble loses its leader while 3 clients (one session each) contend for
/// one lock: no two grants overlap (C1), tokens grow in grant order (C4), and grants
/// continue after the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_during_contention() {
    if std::env::var(HOLDER_ENV).is_ok() {
        return;
    }
    let ensemble = ZkEnsemble::start(3);
    let root = random_root("leader-kill");
    let mut clients = Vec::new();
    for _ in 0..3 {
        let config = ZkConfig::new(ensemble.connect_string())
            .with_chroot(&root)
            .unwrap()
            .with_session_timeout(Duration::from_secs(10));
        clients.push(ZkLock::connect(config).await.expect("connect"));
    }
    let grants = Arc::new(Mutex::new(Vec::<Grant>::new()));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = tokio_util_stop();
    let mut tasks = Vec::new();
    for locks in clients.clone() {
        let (grants, errors, stop) = (grants.clone(), errors.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let options = AcquireOptions::new().wait_timeout(Duration::from_secs(15));
                let guard = match locks.acquire("job", options).await {
                    Ok(guard) => guard,
                    Err(e) => {
                        errors.lock().unwrap().push(format!("acquire: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let start = Instant::now();
                tokio::select! {
                    _ = guard.lost() => {}
                    _ = tokio::time::sleep(Duration::from_millis(3)) => {}
                }
                let end = Instant::now();
                grants.lock().unwrap().push(Grant {
                    start,
                    end,
                    token: guard.token().get(),
                });
                if let Err(e) = guard.release().await {
                    errors.lock().unwrap().push(format!("release: {e}"));
                }
            }
        }));
    }
    let count = || grants.lock().unwrap().len();
    let errors_now = || errors.lock().unwrap().clone();
    let wait_for = |n: usize, what: &'static str| async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        while count() < n {
            assert!(
                Instant::now() < deadline,
                "{what}: only {} grants; errors: {:?}",
                count(),
                errors_now()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    wait_for(30, "before the kill").await;
    let leader = ensemble.wait_for_leader(Duration::from_secs(10));
    ensemble.kill_member(leader);
    let killed = Instant::now();
    let killed_at = count();
    wait_for(killed_at + 30, "after the leader was killed").await;
    let recovered = killed.elapsed();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("worker stops")
            .unwrap();
    }

    let new_leader = ensemble.wait_for_leader(Duration::from_secs(10));
    assert_ne!(new_leader, leader, "the killed member cannot lead");

    let mut grants = grants.lock().unwrap().clone();
    grants.sort_by_key(|g| g.start);
    for pair in grants.windows(2) {
        assert!(
            pair[0].end <= pair[1].start,
            "overlap: {:?} and {:?}",
            pair[0],
            pair[1]
        );
        assert!(
            pair[0].token < pair[1].token,
            "tokens not increasing: {pair:?}"
        );
    }
    eprintln!(
        "{} grants, leader {leader} killed after {killed_at}, 30 more within {recovered:?}; \
         errors during failover: {:?}",
        grants.len(),
        errors.lock().unwrap()
    );
}

fn tokio_util_stop() -> Arc<std::sync::atomic::AtomicBool> {
    Arc::new(std::sync::atomic::AtomicBool::new(false))
}

/// F7: the server killed (SIGKILL) and restarted from the same data directory, once
/// within the session timeout and once after three of them. Tokens are czxids, which
/// survive the restart: every token after it is larger than every token before. A lock
/// held across the short outage is either kept (its session lives on) or reported lost,
/// never held by another client meanwhile; one held across the long outage is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f7_tokens_keep_growing_across_a_server_restart() {
    let server = ZkServer::start();
    let session = Duration::from_secs(4);
    let url = format!(
        "zk://{}/f7-restart?session_timeout=4s",
        server.connect_string()
    );
    let connect = || async {
        ZkLock::connect(ZkConfig::from_url(&url).unwrap())
            .await
            .unwrap()
    };
    let (locks, other) = (connect().await, connect().await);
    let mut before = 0;
    for _ in 0..10 {
        let guard = locks.lock("restart").await.unwrap();
        before = before.max(guard.token().get());
        guard.release().await.unwrap();
    }
    // Grants work again after the restart, with a larger token than any before.
    let grant_again = |before: u64| {
        let locks = &locks;
        async move {
            let guard = tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    match locks
                        .acquire(
                            "restart",
                            AcquireOptions::new().wait_timeout(Duration::from_secs(5)),
                        )
                        .await
                    {
                        Ok(guard) => return guard,
                        Err(e) => {
                            assert!(e.is_retryable(), "{e:?}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            })
            .await
            .expect("locks work again after the restart");
            let token = guard.token().get();
            assert!(
                token > before,
                "token {token} after the restart, {before} before"
            );
            guard.release().await.unwrap();
            token
        }
    };

    // Killed for half a session timeout.
    let held = locks.lock("held-across").await.unwrap();
    server.kill();
    tokio::time::sleep(session / 2).await;
    server.restart();
    let after = grant_again(before).await;
    let taken = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match other.try_lock("held-across").await {
                Ok(taken) => return taken,
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
    .await
    .expect("the other client reaches the server");
    if let Some(guard) = taken {
        assert!(
            held.is_lost(),
            "two holders: the other client took a held lock"
        );
        assert!(guard.token() > held.token());
        guard.release().await.unwrap();
    }
    if held.is_lost() {
        assert!(held.release().await.is_err(), "the release of a lost lock");
    } else {
        let info = other.inspect("held-across").await.unwrap();
        assert_eq!(info.holder.map(|h| h.token), Some(held.token()));
        held.release()
            .await
            .expect("a lock kept across the restart releases");
    }

    // Killed for three session timeouts: a lock held across it is lost.
    let held = locks.lock("held-across-long").await.unwrap();
    server.kill();
    tokio::time::sleep(session * 3).await;
    assert!(
        held.is_lost(),
        "a lock held while the server was down for 3 session timeouts"
    );
    server.restart();
    grant_again(after).await;
    let held_token = held.token();
    assert!(held.release().await.is_err(), "the release of a lost lock");
    let next = other
        .acquire(
            "held-across-long",
            AcquireOptions::new().wait_timeout(Duration::from_secs(15)),
        )
        .await
        .expect("the lost holder's node goes with its session");
    assert!(next.token() > held_token);
    next.release().await.unwrap();
}

/// A semaphore request waiting for a permit whose internal mutex is lost meanwhile (the
/// session's deadline passed in a partition shorter than the session timeout, so the
/// session lives on and the mutex node is deleted) answers a retryable error at once. It
/// used to wait only for the leases to change, the session to end or its timeout: with
/// no permit changing hands it waited for ever, a ghost no longer in the mutex's queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_request_that_lost_its_mutex_while_waiting_says_so() {
    use fencelock_core::Permits;
    use fencelock_testkit::{Fault, FaultProxy};
    let server = ZkServer::shared();
    let proxy = FaultProxy::start(&server.connect_string());
    let root = random_root("sem-mutex");
    let connect = |address: String, session: Duration| {
        let root = root.clone();
        async move {
            ZkLock::connect(
                ZkConfig::new(address)
                    .with_chroot(&root)
                    .unwrap()
                    .with_session_timeout(session),
            )
            .await
            .unwrap()
        }
    };
    let direct = connect(server.connect_string(), Duration::from_secs(10)).await;
    let proxied = connect(proxy.addr(), Duration::from_secs(8)).await;
    let one = Permits::new(1, 1).unwrap();
    let held = direct
        .acquire_permits("pool", one, AcquireOptions::new().no_wait())
        .await
        .unwrap();
    // On the proxied client's session, as the request's mutex: lost at its deadline.
    let probe = proxied
        .acquire("probe", AcquireOptions::new().no_wait())
        .await
        .unwrap();
    let session = proxied.client().await.unwrap().session_id();
    let waiting = tokio::spawn({
        let proxied = proxied.clone();
        async move {
            proxied
                .acquire_permits("pool", one, AcquireOptions::new().wait_forever())
                .await
        }
    });
    // The request holds the mutex and waits for the leases.
    let raw = direct.client().await.unwrap();
    let mutex_dir = format!("{root}/%sem/pool/locks");
    tokio::time::timeout(Duration::from_secs(10), async {
        while raw
            .list_children(&mutex_dir)
            .await
            .unwrap_or_default()
            .len()
            != 1
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the request takes the mutex");
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Cut until the session's deadline has passed, then restored before the server
    // expires the session (the deadline leaves a quarter of the timeout at least).
    proxy.set(Fault::Blackhole);
    tokio::time::timeout(Duration::from_secs(10), probe.lost())
        .await
        .expect("the session's deadline passes");
    proxy.set(Fault::Pass);
    let answered = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the request that lost its mutex still waits")
        .unwrap();
    assert!(
        matches!(&answered, Err(e) if e.is_retryable() && format!("{e:?}").contains("internal lock")),
        "{:?}",
        answered.map(|g| g.token())
    );
    assert_eq!(
        proxied.client().await.unwrap().session_id(),
        session,
        "the session lived on"
    );
    // Nothing of the request is left: asked again, it gets the permit once it is free.
    held.release().await.unwrap();
    let again = proxied
        .acquire_permits(
            "pool",
            one,
            AcquireOptions::new().wait_timeout(Duration::from_secs(10)),
        )
        .await
        .expect("the permit is granted when asked again");
    again.release().await.unwrap();
    proxied.close().await.unwrap();
    direct.close().await.unwrap();
}
