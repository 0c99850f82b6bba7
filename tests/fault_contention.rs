//! F1, baseline contention between processes: [`PROCESSES`] client processes (this test
//! binary, run as `contender_child`) each take one lock [`ROUNDS`] times and, while
//! holding it, read a counter kept by this process, sleep a millisecond, and write the
//! counter plus one with their token through the fenced register. Then:
//!
//! - C1: no process enters (is granted) while another is between its `enter` and its
//!   `leave` (told, and acknowledged, before its release);
//! - C3: the counter equals the number of acknowledged writes, which is
//!   `PROCESSES × ROUNDS` (two holders at once would lose an increment or have one
//!   refused);
//! - C2: no write was refused (no holder wrote after a newer one had);
//! - C4: the tokens are `PROCESSES × ROUNDS` distinct values, increasing in the order
//!   the writes were applied;
//! - C5: nothing is left on the servers once the processes have exited.
//!
//! On etcd, ZooKeeper, Redis single, Sentinel, Cluster and Redlock, and the migration
//! layer (Redis legacy leg, etcd target leg, both mixed phases).
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, FencedRegister, FencingToken};
use fencelock_testkit::{EtcdServer, RedisCluster, RedisSentinelSet, RedisServer, ZkServer};

mod common;
use common::Servers;

/// Client processes.
const PROCESSES: usize = 8;
/// Acquisitions per process.
const ROUNDS: usize = 50;
/// How long the contenders may take in all before they are killed.
const BOUND: Duration = Duration::from_secs(120);
/// How long what the run left on the servers may take to go (C5).
const LEFT_BOUND: Duration = Duration::from_secs(3);
/// The environment variable that makes `contender_child` a contender: `NAME|URL`.
const CONTENDER: &str = "FENCELOCK_F1_CONTENDER";

/// A contender, when run as a child with [`CONTENDER`] set: [`ROUNDS`] times, takes the
/// lock, prints `enter TOKEN`, reads the counter from stdin, sleeps 1 ms, prints
/// `write TOKEN VALUE+1`, reads `ok` or `stale`, prints `leave TOKEN`, reads `left`,
/// releases; prints `done` at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contender_child() {
    let Ok(setting) = std::env::var(CONTENDER) else {
        return;
    };
    let (name, url) = setting.split_once('|').expect("NAME|URL");
    let lock = fencelock::connect(url).await.expect("connect");
    let (lines, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let options = AcquireOptions::new().wait_timeout(Duration::from_secs(60));
    for _ in 0..ROUNDS {
        let guard = lock.acquire(name, options).await.expect("acquire");
        let token = guard.token().get();
        println!("enter {token}");
        let value: u64 = rx
            .recv()
            .await
            .expect("the counter")
            .parse()
            .expect("a number");
        tokio::time::sleep(Duration::from_millis(1)).await;
        println!("write {token} {}", value + 1);
        let answer = rx.recv().await.expect("the write's outcome");
        assert!(answer == "ok" || answer == "stale", "{answer}");
        // Out of the critical section, acknowledged before the release, so the parent
        // has seen it before anyone's next `enter`.
        println!("leave {token}");
        let answer = rx.recv().await.expect("the leave's acknowledgement");
        assert_eq!(answer, "left");
        guard.release().await.expect("release");
    }
    lock.close().await.expect("close");
    println!("done");
}

/// What the contenders did, as this process applied it.
#[derive(Default)]
struct History {
    /// Tokens of accepted writes, in the order they were applied.
    accepted: Vec<u64>,
    /// Refused writes: (token, holder index).
    refused: Vec<(u64, usize)>,
    /// The process inside its critical section (between `enter` and `leave`), if any.
    inside: Option<(usize, u64)>,
    /// Entries while another process was inside (C1): (entering, already inside).
    overlaps: Vec<((usize, u64), (usize, u64))>,
}

/// Runs [`PROCESSES`] contenders on `url`, each with its own connection.
fn contend(backend: &str, url: &str) {
    let name = common::unique("f1");
    let register = Arc::new(FencedRegister::new(0u64));
    let history = Arc::new(Mutex::new(History::default()));
    let mut children = Vec::new();
    let mut readers = Vec::new();
    for index in 0..PROCESSES {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                "contender_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CONTENDER, format!("{name}|{url}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a contender");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stdin = child.stdin.take().expect("piped stdin");
        let (register, history) = (register.clone(), history.clone());
        readers.push(std::thread::spawn(move || {
            let mut done = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest prints `test contender_child ... ` before the first line.
                let line = line.trim_start_matches("test contender_child ... ");
                let words: Vec<&str> = line.split_whitespace().collect();
                // A contender that died leaves a broken pipe: its exit status says more.
                match words.as_slice() {
                    ["enter", token] => {
                        let token: u64 = token.parse().expect("a token");
                        let mut history = history.lock().unwrap();
                        if let Some(other) = history.inside {
                            history.overlaps.push(((index, token), other));
                        }
                        history.inside = Some((index, token));
                        drop(history);
                        let _ = writeln!(stdin, "{}", register.read());
                    }
                    ["leave", token] => {
                        let token: u64 = token.parse().expect("a token");
                        let mut history = history.lock().unwrap();
                        if history.inside == Some((index, token)) {
                            history.inside = None;
                        }
                        drop(history);
                        let _ = writeln!(stdin, "left");
                    }
                    ["write", token, value] => {
                        let token: u64 = token.parse().expect("a token");
                        let value: u64 = value.parse().expect("a value");
                        let mut history = history.lock().unwrap();
                        let answer = match register.write(FencingToken::new(token), value) {
                            Ok(()) => {
                                history.accepted.push(token);
                                "ok"
                            }
                            Err(_) => {
                                history.refused.push((token, index));
                                "stale"
                            }
                        };
                        drop(history);
                        let _ = writeln!(stdin, "{answer}");
                    }
                    ["done"] => done = true,
                    _ => {}
                }
            }
            done
        }));
        children.push(child);
    }
    let started = std::time::Instant::now();
    // A contender that hangs (a release or close that never returns) is killed after
    // [`BOUND`], so the run fails instead of hanging.
    let pids: Vec<u32> = children.iter().map(std::process::Child::id).collect();
    let (finish, finished_rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if finished_rx.recv_timeout(BOUND).is_err() {
            for pid in pids {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    });
    let finished: Vec<bool> = readers
        .into_iter()
        .map(|reader| reader.join().expect("a reader thread"))
        .collect();
    let statuses: Vec<_> = children
        .iter_mut()
        .map(|child| child.wait().expect("wait for a contender"))
        .collect();
    let _ = finish.send(());
    watchdog.join().expect("the watchdog");
    for status in statuses {
        assert!(
            status.success(),
            "{backend}: a contender failed (killed if it ran past {BOUND:?}): {status}"
        );
    }
    assert!(
        finished.iter().all(|done| *done),
        "{backend}: a contender did not finish: {finished:?}"
    );
    let history = history.lock().unwrap();
    let total = PROCESSES * ROUNDS;
    assert!(
        history.overlaps.is_empty(),
        "{backend}: {} entries while another process was inside (C1), the first \
         ((process, token) entering, inside): {:?}",
        history.overlaps.len(),
        &history.overlaps[..history.overlaps.len().min(10)]
    );
    assert!(
        history.refused.is_empty(),
        "{backend}: {} writes refused (C2: a holder wrote after a newer one), the first \
         (token, process): {:?}",
        history.refused.len(),
        &history.refused[..history.refused.len().min(10)]
    );
    assert_eq!(
        history.accepted.len(),
        total,
        "{backend}: acknowledged writes"
    );
    assert_eq!(
        register.read(),
        total as u64,
        "{backend}: increments lost (C3: two holders at once)"
    );
    assert!(
        history.accepted.windows(2).all(|w| w[0] < w[1]),
        "{backend}: tokens not strictly increasing in the order of the writes (C4)"
    );
    eprintln!(
        "F1 {backend}: {PROCESSES} processes × {ROUNDS} rounds in {:?}",
        started.elapsed()
    );
}

/// [`contend`] in a blocking section, then the leftover check.
async fn run(backend: &str, url: &str, servers: &Servers<'_>) {
    tokio::task::block_in_place(|| contend(backend, url));
    servers.assert_nothing_left_within(&format!("{backend} F1"), LEFT_BOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_etcd() {
    let server = EtcdServer::shared();
    let prefix = common::unique("f1-etcd");
    let url = format!("etcd://{}/{prefix}", server.endpoint());
    run("etcd", &url, &Servers::Etcd(server, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_zookeeper() {
    let server = ZkServer::shared();
    let chroot = common::unique("f1-zk");
    let url = format!("zk://{}/{chroot}", server.connect_string());
    run("zookeeper", &url, &Servers::Zk(server, &chroot)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_redis() {
    let server = RedisServer::shared();
    let prefix = common::unique("f1-redis");
    let url = format!("{}?prefix={prefix}:", server.url());
    run("redis", &url, &Servers::redis(server, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_redis_sentinel() {
    let set = tokio::task::block_in_place(RedisSentinelSet::start);
    let prefix = common::unique("f1-sentinel");
    let url = format!("{}?prefix={prefix}:", set.url());
    run("sentinel", &url, &Servers::redis(set.master(), &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_redis_cluster() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
    let prefix = common::unique("f1-cluster");
    let url = format!("{}?prefix={prefix}:", cluster.url());
    let ports = cluster.nodes().iter().map(RedisServer::port).collect();
    run("cluster", &url, &Servers::Redis(ports, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_redlock() {
    let instances: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let prefix = common::unique("f1-redlock");
    let hosts: Vec<String> = instances.iter().map(RedisServer::addr).collect();
    let url = format!("redlock://{}?prefix={prefix}:", hosts.join(","));
    let ports = instances.iter().map(RedisServer::port).collect();
    run("redlock", &url, &Servers::Redis(ports, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_migration() {
    let (redis, etcd) = (RedisServer::shared(), EtcdServer::shared());
    for phase in [
        fencelock::MigrationPhase::LegacyFirst,
        fencelock::MigrationPhase::TargetFirst,
    ] {
        let prefix = common::unique("f1-migrate");
        let url = fencelock::migration_url(
            phase,
            &format!("{}?layout=raw&prefix={prefix}:", redis.url()),
            &format!("etcd://{}/{prefix}", etcd.endpoint()),
        );
        let servers = Servers::Both(
            Box::new(Servers::redis(redis, &prefix)),
            Box::new(Servers::Etcd(etcd, &prefix)),
        );
        run(&format!("migration {phase:?}"), &url, &servers).await;
    }
}
