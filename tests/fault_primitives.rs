//! The fault scenarios applied to every primitive: the plain lock (`acquire`), an
//! election term (`campaign`), a semaphore permit (`acquire_permits`), a read lock and a
//! write lock (`acquire_read`, `acquire_write`). Leases are 2 s; a semaphore has
//! [`LIMIT`] permits. (The plain lock's F4 is `tests/fault_partition.rs`.)
//!
//! - **F3, a paused holder**: the holder is a child process (this test binary, run as
//!   `holder_child`) that writes through the fenced register every 50 ms; it is
//!   SIGSTOPped for 3 × lease. Another client gets the primitive (the next term, a
//!   permit, the write lock) with a larger token once the lease runs out, within the
//!   lease and 1 s of the pause; the zombie's writes after SIGCONT are refused (C2); it
//!   reports loss within 1 s of SIGCONT; its release is `Err(Lost)`. Semaphore: with all [`LIMIT`] permits held and two
//!   contenders waiting, the pause lets exactly one contender in, never `LIMIT + 1`.
//! - **F4, a partition of a running holder**: the holder's connections are blackholed
//!   by a [`FaultProxy`] for 3 × lease, then healed. It reports loss before the heal, on
//!   its own timer (C6); another client takes over within lease + 1 s with a larger
//!   token, never while the cut holder still claimed to be valid (C1; for the
//!   semaphore: never more than [`LIMIT`] holders claiming validity, and the second
//!   contender stays out); the late write is refused (C2); the release after the heal is
//!   `Err(Lost)`; nothing is left on the servers (C5).
//! - **F8, a cancellation storm**: while the primitive is held, another client makes
//!   [`STORM`] requests, each dropped by a `tokio::time::timeout` of a random 0–50 ms
//!   (some in the middle of an RPC, most while waiting); a held write lock is stormed
//!   with reads and writes alternately, a held read lock with writes (queued) and reads
//!   (granted, then dropped). Then the holder releases and a fresh client gets the
//!   primitive within 1 s (a semaphore: all [`LIMIT`] permits at once; a read-write lock:
//!   the write lock); nothing is left: no key, node, queue entry, lease (etcd, on a
//!   server of the test's own) or Redis key (one whose PTTL kept being refreshed would
//!   outlive the bound of lease + 1 s).
//!
//! Each test runs one scenario on one backend for every primitive of the backend's row of
//! the expectation table ([`expected`]), at once (one after the other behind the shared
//! proxies of Sentinel and Cluster), each on a name of its own, and fails naming every
//! primitive that failed. A backend whose capabilities disagree with its row fails
//! loudly instead of skipping. F3 and F8 run on every remote backend and on the
//! migration layer (in its two mixed phases); F4 on every remote backend.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use fencelock::{
    AcquireOptions, Capabilities, DistributedLock, Error, LockGuard, MigrationPhase, Permits,
};
use fencelock_testkit::checker::{Checker, LOSS_BOUND};
use fencelock_testkit::{
    EtcdServer, Fault, FaultProxy, RedisCluster, RedisSentinelSet, RedisServer, ZkServer, leftovers,
};
use tokio::sync::mpsc;
use tokio::time::Instant;

mod common;
use common::{Proxied, Rng, Servers};

const LEASE: Duration = Duration::from_secs(2);
/// How long a holder is paused (F3) or cut off (F4): 3 × lease.
const FAULT: Duration = Duration::from_secs(6);
/// How long, after SIGCONT, the F3 holder's first late write may take to be recorded
/// (it writes every 50 ms; generous against a loaded machine).
const ZOMBIE_WRITE_WITHIN: Duration = Duration::from_secs(5);
/// A semaphore's permits.
const LIMIT: u32 = 3;
/// Cancelled requests per primitive (F8).
const STORM: usize = 200;
/// How long what a scenario left on the servers may take to go (C5): a Redis key whose
/// PTTL keeps being refreshed outlives it.
const LEFT_BOUND: Duration = Duration::from_secs(3);
/// The environment variable that makes `holder_child` the F3 holder: `KIND|NAME|URL`.
const HOLDER: &str = "FENCELOCK_FAULT_PRIMITIVES_HOLDER";

type Lock = Arc<dyn DistributedLock>;

/// A primitive of the trait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Primitive {
    /// The plain lock (`acquire`).
    Plain,
    /// A term of `campaign`.
    Election,
    /// One permit of a semaphore of [`LIMIT`].
    Semaphore,
    /// A read lock.
    ReadLock,
    /// A write lock.
    WriteLock,
}

use Primitive::{Election, Plain, ReadLock, Semaphore, WriteLock};

const ALL: [Primitive; 5] = [Plain, Election, Semaphore, ReadLock, WriteLock];

/// The expectation table: the primitives each backend must have, all of which this file
/// runs on it. A capability that is false for a primitive listed here, or true for one
/// not listed, fails the test: add a row when a backend gains a primitive.
fn expected(backend: &str) -> &'static [Primitive] {
    match backend {
        "etcd" => &ALL,
        // Semaphore and read-write rows: since commit e1d9b6f.
        "zookeeper" => &ALL,
        // Semaphore and read-write rows: since commit 6a3f8ea (single, Sentinel, Cluster).
        "redis" | "sentinel" | "cluster" => &ALL,
        "redlock" => &[Plain, Election],
        "migration" => &[Plain],
        _ => &[],
    }
}

impl Primitive {
    fn claimed(self, caps: &Capabilities) -> bool {
        match self {
            Plain => true,
            Election => caps.election,
            Semaphore => caps.semaphore,
            ReadLock | WriteLock => caps.rw_lock,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Plain => "lock",
            Election => "election",
            Semaphore => "semaphore",
            ReadLock => "read",
            WriteLock => "write",
        }
    }

    fn parse(label: &str) -> Option<Primitive> {
        ALL.into_iter().find(|p| p.label() == label)
    }

    /// The name a scenario on `backend` uses for this primitive (each its own).
    fn name(self, backend: &str) -> String {
        format!("{backend}-{}", self.label())
    }

    /// Takes the primitive (one permit of a semaphore), campaigning with `value`.
    async fn take(
        self,
        lock: &dyn DistributedLock,
        name: &str,
        options: AcquireOptions,
        value: &str,
    ) -> Result<LockGuard, Error> {
        match self {
            Plain => lock.acquire(name, options).await,
            Election => lock.campaign(name, value, options).await,
            Semaphore => {
                let one = Permits::one_of(LIMIT)?;
                lock.acquire_permits(name, one, options).await
            }
            ReadLock => lock.acquire_read(name, options).await,
            WriteLock => lock.acquire_write(name, options).await,
        }
    }

    /// What another client takes over with: the next term, a permit, the write lock.
    fn successor(self) -> Primitive {
        match self {
            ReadLock => WriteLock,
            other => other,
        }
    }
}

fn options() -> AcquireOptions {
    AcquireOptions::new().lease(LEASE)
}

/// Asserts that `lock`'s capabilities match `backend`'s row of [`expected`]; returns the
/// row.
fn primitives_of(backend: &str, lock: &dyn DistributedLock) -> &'static [Primitive] {
    let caps = lock.capabilities();
    let row = expected(backend);
    let wrong: Vec<String> = ALL
        .into_iter()
        .filter(|p| p.claimed(&caps) != row.contains(p))
        .map(|p| {
            format!(
                "{}: capability {}, expected {}",
                p.label(),
                p.claimed(&caps),
                row.contains(&p)
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{backend}: capabilities disagree with the expectation table: {}",
        wrong.join("; ")
    );
    row
}

/// Runs `scenario` for every primitive, each in a task of its own, all at once (or one
/// after the other, `in_turn`), and fails naming every primitive that failed.
async fn for_each<F, Fut>(what: &str, primitives: &[Primitive], in_turn: bool, scenario: F)
where
    F: Fn(Primitive) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut tasks = Vec::new();
    let mut results = Vec::new();
    for &p in primitives {
        let task = tokio::spawn(scenario(p));
        if in_turn {
            results.push((p, task.await));
        } else {
            tasks.push((p, task));
        }
    }
    for (p, task) in tasks {
        results.push((p, task.await));
    }
    let mut failures = Vec::new();
    for (p, result) in results {
        if let Err(e) = result {
            let message = if e.is_panic() {
                let payload = e.into_panic();
                payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default()
            } else {
                e.to_string()
            };
            failures.push(format!("[{}] {message}", p.label()));
        }
    }
    assert!(
        failures.is_empty(),
        "{what}: {} of {} primitives failed:\n{}",
        failures.len(),
        primitives.len(),
        failures.join("\n")
    );
}

/// Requests in flight, raced by [`first_of`].
type Pending<'a> = Vec<Pin<Box<dyn Future<Output = Result<LockGuard, Error>> + Send + 'a>>>;

/// The first of `pending` to finish (removed from it); the others stay in flight.
async fn first_of(pending: &mut Pending<'_>) -> Result<LockGuard, Error> {
    std::future::poll_fn(|cx| {
        for i in 0..pending.len() {
            if let Poll::Ready(result) = pending[i].as_mut().poll(cx) {
                drop(pending.remove(i));
                return Poll::Ready(result);
            }
        }
        Poll::Pending
    })
    .await
}

/// The contenders that wait for the faulty holder's grant: for a semaphore two (exactly
/// one of them may get in), else one.
fn contenders<'a>(p: Primitive, lock: &'a dyn DistributedLock, name: &'a str) -> Pending<'a> {
    let count = if p == Semaphore { 2 } else { 1 };
    (0..count)
        .map(|i| {
            let wait = options().wait_timeout(FAULT + Duration::from_secs(10));
            Box::pin(p.successor().take(lock, name, wait, ["next", "second"][i]))
                as Pin<Box<dyn Future<Output = Result<LockGuard, Error>> + Send + 'a>>
        })
        .collect()
}

/// For a semaphore, the other `LIMIT - 1` permits, held by `lock` (so that the faulty
/// holder's permit is the only one that can come free).
async fn fill(
    p: Primitive,
    lock: &dyn DistributedLock,
    name: &str,
    checker: &Checker,
) -> Vec<LockGuard> {
    let mut kept = Vec::new();
    if p == Semaphore {
        for i in 0..LIMIT - 1 {
            let guard = p
                .take(lock, name, options().no_wait(), "kept")
                .await
                .expect("a permit is free");
            checker.enter(&format!("kept{i}"), guard.token().get());
            kept.push(guard);
        }
    }
    kept
}

/// The term's leader is now the next holder's value and token.
async fn assert_leader_is(lock: &dyn DistributedLock, name: &str, next: &LockGuard) {
    let leader = lock.leader(name).await.expect("leader").expect("a leader");
    assert_eq!(leader.value, "next", "{leader:?}");
    assert_eq!(leader.token, next.token(), "{leader:?}");
}

/// After the faulty holder made room (and `next` got in), a semaphore lets nobody else
/// in until one of `kept` leaves; then the second contender gets in within 1 s.
async fn semaphore_after(
    checker: &Checker,
    mut kept: Vec<LockGuard>,
    mut pending: Pending<'_>,
    until: Instant,
) {
    if kept.is_empty() {
        return;
    }
    let early = tokio::time::timeout_at(until, first_of(&mut pending)).await;
    assert!(
        early.is_err(),
        "a second contender got a permit while {LIMIT} were held: {early:?}"
    );
    let first = kept.remove(0);
    checker.exit("kept0", first.token().get());
    first.release().await.expect("a kept permit is released");
    let second = tokio::time::timeout(Duration::from_secs(1), first_of(&mut pending))
        .await
        .expect("the second contender gets the freed permit within 1 s")
        .expect("the second contender gets a permit");
    let token = second.token().get();
    checker.enter("second", token);
    checker.exit("second", token);
    second
        .release()
        .await
        .expect("the second contender releases");
    for (i, guard) in kept.into_iter().enumerate() {
        checker.exit(&format!("kept{}", i + 1), guard.token().get());
        guard.release().await.expect("a kept permit is released");
    }
}

// ---------------------------------------------------------------------------------------
// F3: a paused holder.

/// The child side of F3 (a no-op in a normal run): takes the primitive, prints
/// `token N`, then `write N` every 50 ms (as a process that does not know it is paused
/// would keep working) and `lost` once its guard reports loss; on `release` from stdin
/// it releases and prints `release lost` or `release <other outcome>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_child() {
    let Ok(setting) = std::env::var(HOLDER) else {
        return;
    };
    let mut parts = setting.splitn(3, '|');
    let (Some(kind), Some(name), Some(url)) = (parts.next(), parts.next(), parts.next()) else {
        panic!("bad {HOLDER}: {setting}");
    };
    let p = Primitive::parse(kind).expect("a primitive");
    let lock = fencelock::connect(url).await.expect("connect");
    let guard = p
        .take(&*lock, name, options().no_wait(), "zombie")
        .await
        .expect("the holder takes the primitive");
    let token = guard.token().get();
    println!("token {token}");
    let (lines, mut rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let mut reported = false;
    loop {
        tokio::select! {
            () = guard.lost(), if !reported => {
                println!("lost");
                reported = true;
            }
            () = tokio::time::sleep(Duration::from_millis(50)) => println!("write {token}"),
            line = rx.recv() => match line.as_deref() {
                Some("release") => break,
                Some(_) => {}
                // The parent is gone.
                None => return,
            },
        }
    }
    match guard.release().await {
        Err(Error::Lost { .. }) => println!("release lost"),
        other => println!("release {other:?}"),
    }
}

/// The F3 holder: a child process, its zombie writes applied to `checker` as they come.
struct Child {
    process: std::process::Child,
    lines: mpsc::UnboundedReceiver<(Instant, String)>,
}

impl Child {
    fn spawn(p: Primitive, name: &str, url: &str, checker: Arc<Checker>) -> Child {
        let mut process = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", "holder_child", "--nocapture", "--test-threads=1"])
            .env(HOLDER, format!("{}|{name}|{url}", p.label()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the holder");
        let stdout = process.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest prints `test holder_child ... ` before the first line.
                let line = line.trim_start_matches("test holder_child ... ");
                if let Some(token) = line.strip_prefix("write ") {
                    if let Ok(token) = token.trim().parse() {
                        checker.write("zombie", token);
                    }
                } else {
                    let _ = tx.send((Instant::now(), line.to_owned()));
                }
            }
        });
        Child { process, lines }
    }

    /// The next line starting with `prefix` (the rest of it, and when it came).
    async fn line(&mut self, prefix: &str, within: Duration) -> (Instant, String) {
        let deadline = Instant::now() + within;
        loop {
            let next = tokio::time::timeout_at(deadline, self.lines.recv()).await;
            match next {
                Ok(Some((at, line))) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return (at, rest.trim().to_owned());
                    }
                }
                Ok(None) => panic!("the holder exited before `{prefix}`"),
                Err(_) => panic!("no `{prefix}` from the holder within {within:?}"),
            }
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.process.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal}");
    }

    fn send(&mut self, line: &str) {
        let stdin = self.process.stdin.as_mut().expect("piped stdin");
        writeln!(stdin, "{line}").expect("write to the holder");
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.process.id().to_string()])
            .status();
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// F3 on one primitive: the holder a child process on `url`, the others on `other`.
async fn paused(p: Primitive, url: String, other: Lock, name: String) {
    let checker = Arc::new(Checker::new());
    let mut child = Child::spawn(p, &name, &url, checker.clone());
    let (_, token) = child.line("token ", Duration::from_secs(20)).await;
    let token: u64 = token.parse().expect("a token");
    checker.enter("zombie", token);
    let kept = fill(p, &*other, &name, &checker).await;
    let mut pending = contenders(p, &*other, &name);
    // A first zombie write lands before the pause.
    tokio::time::sleep(Duration::from_millis(300)).await;

    child.signal("-STOP");
    let paused_at = Instant::now();
    let next = first_of(&mut pending)
        .await
        .expect("another client gets it once the paused holder's lease runs out");
    let waited = paused_at.elapsed();
    // F3's liveness bound: the lease (session timeout) + 1 s after the pause began.
    assert!(
        waited <= LEASE + Duration::from_secs(1),
        "another client got it {waited:?} into the pause"
    );
    let next_token = next.token().get();
    checker.enter("next", next_token);
    assert!(checker.write("next", next_token), "the next holder's write");
    assert!(next_token > token, "token {next_token} after {token}");
    if p == Election {
        assert_leader_is(&*other, &name, &next).await;
    }
    // Semaphore: nobody else gets in while the pause lasts (LIMIT holders, never more).
    if p == Semaphore {
        let early = tokio::time::timeout_at(paused_at + FAULT, first_of(&mut pending)).await;
        assert!(
            early.is_err(),
            "a second contender got a permit during the pause: {early:?}"
        );
    } else {
        tokio::time::sleep_until(paused_at + FAULT).await;
    }

    child.signal("-CONT");
    let resumed_at = Instant::now();
    let (lost_at, _) = child.line("lost", Duration::from_secs(5)).await;
    let lost_after = lost_at - resumed_at;
    assert!(
        lost_after < Duration::from_secs(1),
        "the paused holder reported loss {lost_after:?} after SIGCONT"
    );
    // Its late writes (every 50 ms while it believed it held) are refused. Waits for the
    // first of them to be recorded (not a fixed time, which under load can end before
    // the resumed child's output is read), for at most ZOMBIE_WRITE_WITHIN.
    let late_writes = || -> Vec<bool> {
        checker
            .history()
            .into_iter()
            .filter(|r| r.at >= resumed_at.into_std())
            .filter_map(|r| match r.event {
                fencelock_testkit::checker::Event::Write {
                    holder, accepted, ..
                } if holder == "zombie" => Some(accepted),
                _ => None,
            })
            .collect()
    };
    let write_deadline = Instant::now() + ZOMBIE_WRITE_WITHIN;
    let late = loop {
        let late = late_writes();
        if !late.is_empty() || Instant::now() >= write_deadline {
            break late;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        !late.is_empty(),
        "the paused holder wrote nothing after SIGCONT"
    );
    assert!(
        late.iter().all(|accepted| !accepted),
        "a late write of the paused holder was accepted: {late:?}"
    );
    eprintln!(
        "F3 {name}: taken over {waited:?} into the pause, loss reported {lost_after:?} after \
         SIGCONT, {} late writes refused",
        late.len()
    );
    child.send("release");
    let (_, released) = child.line("release ", Duration::from_secs(5)).await;
    assert_eq!(released, "lost", "the paused holder's release");

    semaphore_after(&checker, kept, pending, Instant::now()).await;
    checker.exit("next", next_token);
    next.release().await.expect("the next holder releases");
    checker.assert_no_stale_write_accepted();
    checker.assert_tokens_increase();
}

/// F3 for every primitive of `backend`: children on `child_url`, the others on `other`.
async fn paused_each(backend: &str, child_url: &str, other: Lock, servers: &Servers<'_>) {
    let primitives = primitives_of(backend, &*other);
    for_each(&format!("{backend} F3"), primitives, false, |p| {
        paused(p, child_url.to_owned(), other.clone(), p.name(backend))
    })
    .await;
    servers.assert_nothing_left_within(&format!("{backend} F3"), LEFT_BOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_etcd() {
    let server = EtcdServer::shared();
    let prefix = common::unique("f3p-etcd");
    let url = format!("etcd://{}/{prefix}?lease=2s", server.endpoint());
    let other = connect(&url).await;
    paused_each("etcd", &url, other, &Servers::Etcd(server, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_zookeeper() {
    let server = ZkServer::shared();
    let chroot = common::unique("f3p-zk");
    let url = zk_url(&server.connect_string(), &chroot);
    let other = connect(&url).await;
    paused_each("zookeeper", &url, other, &Servers::Zk(server, &chroot)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_redis() {
    let server = RedisServer::shared();
    let prefix = common::unique("f3p-redis");
    let url = format!("{}?prefix={prefix}:", server.url());
    let other = connect(&url).await;
    paused_each("redis", &url, other, &Servers::redis(server, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_redlock() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let prefix = common::unique("f3p-redlock");
    let url = redlock_url(&servers, &prefix);
    let other = connect(&url).await;
    let ports = servers.iter().map(RedisServer::port).collect();
    paused_each("redlock", &url, other, &Servers::Redis(ports, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_redis_sentinel() {
    let set = tokio::task::block_in_place(RedisSentinelSet::start);
    let prefix = common::unique("f3p-sentinel");
    let url = format!("{}?prefix={prefix}:", set.url());
    let other = connect(&url).await;
    let servers = Servers::redis(set.master(), &prefix);
    paused_each("sentinel", &url, other, &servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_redis_cluster() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
    let prefix = common::unique("f3p-cluster");
    let url = format!("{}?prefix={prefix}:", cluster.url());
    let other = connect(&url).await;
    let ports = cluster.nodes().iter().map(RedisServer::port).collect();
    paused_each("cluster", &url, other, &Servers::Redis(ports, &prefix)).await;
}

/// The migration layer in its mixed phases (Redis legacy leg, etcd target leg): the
/// paused holder holds both legs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_migration() {
    for phase in MIXED {
        let prefix = common::unique("f3p-migrate");
        let url = migration_url(phase, &prefix);
        let other = connect(&url).await;
        paused_each("migration", &url, other, &migration_servers(&prefix)).await;
    }
}

// ---------------------------------------------------------------------------------------
// F4: a partition of a running holder.

/// F4 on one primitive: `holder` goes through `proxies` (cut), `other` does not.
async fn partitioned(
    p: Primitive,
    holder: &dyn DistributedLock,
    other: &dyn DistributedLock,
    proxies: &[&FaultProxy],
    name: &str,
) {
    let checker = Checker::new();
    let kept = fill(p, other, name, &checker).await;
    let guard = p
        .take(holder, name, options().no_wait(), "cut")
        .await
        .expect("the holder takes it");
    let token = guard.token().get();
    checker.enter("cut", token);
    assert!(checker.write("cut", token));
    let mut pending = contenders(p, other, name);
    // Let a renewal or two happen first.
    tokio::time::sleep(LEASE / 2).await;
    assert!(!guard.is_lost(), "lost before the partition");

    for proxy in proxies {
        proxy.set(Fault::Blackhole);
    }
    let partitioned_at = Instant::now();
    // Nothing passes the cut, but a renewal's reply already past the proxy may still be
    // handled after it (under load, well after it), moving the deadline once more. So
    // the deadline at the cut is the one the guard holds once it reports loss (no reply
    // handled later matters), checked independently of the guard: between the deadline
    // sampled at the cut and one a renewal sent before the cut can give.
    let sampled_at_cut = guard.valid_until();
    let loss = async {
        guard.lost().await;
        let valid_at_loss = guard.valid_until();
        checker.lost("cut", token, valid_at_loss.into_std());
        (Instant::now(), valid_at_loss)
    };
    let next = async {
        let next = first_of(&mut pending)
            .await
            .expect("another client gets it during the partition");
        let granted_at = Instant::now();
        checker.enter("next", next.token().get());
        assert!(checker.write("next", next.token().get()));
        (next, granted_at)
    };
    let ((lost_at, valid_at_cut), (next, granted_at)) = tokio::join!(loss, next);
    assert!(
        valid_at_cut >= sampled_at_cut,
        "the guard's deadline went back after the cut"
    );
    assert!(
        valid_at_cut <= partitioned_at + LEASE,
        "the guard's deadline moved {:?} past what a renewal sent before the cut can give",
        valid_at_cut - (partitioned_at + LEASE)
    );
    let lost_after = lost_at - partitioned_at;
    assert!(
        lost_after < FAULT,
        "loss reported {lost_after:?} into the partition, not before the heal"
    );
    assert!(
        lost_at <= valid_at_cut + LOSS_BOUND && lost_at <= partitioned_at + LEASE + LOSS_BOUND,
        "loss reported {lost_after:?} into the partition, past the deadline at the cut or a lease"
    );
    let granted_after = granted_at - partitioned_at;
    assert!(
        granted_after <= LEASE + Duration::from_secs(1),
        "another client got it {granted_after:?} into the partition"
    );
    // C1 by the clock: the other client's grant came after the holder's deadline.
    assert!(
        granted_at >= guard.valid_until(),
        "another client got it {:?} before the holder's deadline",
        guard.valid_until() - granted_at
    );
    let next_token = next.token().get();
    assert!(next_token > token, "token {next_token} after {token}");
    eprintln!(
        "F4 {name}: loss reported {lost_after:?}, taken over {granted_after:?} into the partition"
    );
    assert!(
        !checker.write("cut", token),
        "the partitioned holder's late write was accepted"
    );
    if p == Election {
        assert_leader_is(other, name, &next).await;
    }
    if p == Semaphore {
        let early = tokio::time::timeout_at(partitioned_at + FAULT, first_of(&mut pending)).await;
        assert!(
            early.is_err(),
            "a second contender got a permit during the partition: {early:?}"
        );
    } else {
        tokio::time::sleep_until(partitioned_at + FAULT).await;
    }
    for proxy in proxies {
        proxy.set(Fault::Pass);
    }
    let released = guard.release().await;
    assert!(
        matches!(released, Err(Error::Lost { .. })),
        "the partitioned holder's release after the heal: {released:?}"
    );
    semaphore_after(&checker, kept, pending, Instant::now()).await;
    checker.exit("next", next_token);
    next.release().await.expect("the next holder releases");

    if p == Semaphore {
        let most = checker.assert_at_most_inside(LIMIT as usize);
        assert_eq!(most, LIMIT as usize, "the semaphore was never full");
    } else {
        checker.assert_no_overlap();
    }
    checker.assert_no_stale_write_accepted();
    checker.assert_tokens_increase();
    checker.assert_loss_reported_in_time();
}

/// The primitives F4 runs on here: the plain lock's F4 is `tests/fault_partition.rs`.
fn but_the_lock(row: &[Primitive]) -> Vec<Primitive> {
    row.iter().copied().filter(|&p| p != Plain).collect()
}

/// F4 for every primitive of `backend`: each holder a client of its own through a proxy
/// of its own to `upstream` (`url(proxy address)`), the others on `other`.
async fn partitioned_each<U>(
    backend: &str,
    upstream: &str,
    url: U,
    other: Lock,
    servers: &Servers<'_>,
) where
    U: Fn(&str) -> String,
{
    let primitives = but_the_lock(primitives_of(backend, &*other));
    for_each(&format!("{backend} F4"), &primitives, false, |p| {
        let proxy = FaultProxy::start(upstream);
        let url = url(&proxy.addr());
        let other = other.clone();
        let name = p.name(backend);
        async move {
            let holder = connect(&url).await;
            partitioned(p, &*holder, &*other, &[&proxy], &name).await;
        }
    })
    .await;
    servers.assert_nothing_left_within(&format!("{backend} F4"), LEFT_BOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_etcd() {
    let server = EtcdServer::shared();
    let prefix = common::unique("f4p-etcd");
    let url = |addr: &str| format!("etcd://{addr}/{prefix}?lease=2s");
    let other = connect(&url(&server.endpoint())).await;
    let servers = Servers::Etcd(server, &prefix);
    partitioned_each("etcd", &server.endpoint(), url, other, &servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_zookeeper() {
    let server = ZkServer::shared();
    let chroot = common::unique("f4p-zk");
    let url = |hosts: &str| zk_url(hosts, &chroot);
    let other = connect(&url(&server.connect_string())).await;
    let servers = Servers::Zk(server, &chroot);
    partitioned_each("zookeeper", &server.connect_string(), url, other, &servers).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_redis() {
    let server = RedisServer::shared();
    let prefix = common::unique("f4p-redis");
    let url = |addr: &str| format!("redis://{addr}?prefix={prefix}:");
    let other = connect(&url(&server.addr())).await;
    let servers = Servers::redis(server, &prefix);
    partitioned_each("redis", &server.addr(), url, other, &servers).await;
}

/// Redlock (elections only): the term of a holder cut from all 3 instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_redlock_election() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<FaultProxy> = servers
        .iter()
        .map(|s| FaultProxy::start(&s.addr()))
        .collect();
    let prefix = common::unique("f4p-redlock");
    let via = |addrs: Vec<String>| format!("redlock://{}?prefix={prefix}:", addrs.join(","));
    let holder = connect(&via(proxies.iter().map(FaultProxy::addr).collect())).await;
    let other = connect(&via(servers.iter().map(RedisServer::addr).collect())).await;
    assert_eq!(primitives_of("redlock", &*other), [Plain, Election]);
    let proxies: Vec<&FaultProxy> = proxies.iter().collect();
    partitioned(
        Election,
        &*holder,
        &*other,
        &proxies,
        &Election.name("redlock"),
    )
    .await;
    Servers::Redis(servers.iter().map(RedisServer::port).collect(), &prefix)
        .assert_nothing_left_within("redlock F4", LEFT_BOUND);
}

/// F4 on a deployment behind announced proxies, for every primitive of `backend`, one
/// after the other (the proxies are shared): the other client's connections (and the
/// servers' own links) are exempt, the holder's (one client for all) are cut.
async fn partitioned_behind_proxies(deployment: Proxied, backend: &'static str) {
    let prefix = common::unique(&format!("f4p-{backend}"));
    let other = connect(&deployment.url(&prefix)).await;
    deployment.exempt();
    let holder = connect(&deployment.cut_url(&prefix)).await;
    let primitives = but_the_lock(primitives_of(backend, &*other));
    let deployment = Arc::new(deployment);
    for_each(&format!("{backend} F4"), &primitives, true, |p| {
        let (deployment, holder, other) = (deployment.clone(), holder.clone(), other.clone());
        async move {
            let proxies = deployment.proxies();
            partitioned(p, &*holder, &*other, &proxies, &p.name(backend)).await;
        }
    })
    .await;
    deployment
        .servers(&prefix)
        .assert_nothing_left_within(&format!("{backend} F4"), LEFT_BOUND);
    deployment.assert_no_failover();
}

/// Sentinel: the Sentinels name the master's proxy; the holder's connections to it are
/// cut (no failover follows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_redis_sentinel() {
    partitioned_behind_proxies(Proxied::sentinel().await, "sentinel").await;
}

/// Cluster: every node announces its proxy; all of the holder's connections are cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_redis_cluster() {
    partitioned_behind_proxies(Proxied::cluster().await, "cluster").await;
}

// ---------------------------------------------------------------------------------------
// F8: a cancellation storm.

/// F8 on one primitive: `a` holds, `b` storms, `c` (fresh) takes it after `a` releases.
async fn storm(p: Primitive, a: Lock, b: Lock, c: Lock, name: String) {
    let name = name.as_str();
    let held: Vec<LockGuard> = if p == Semaphore {
        let mut all = Vec::new();
        for _ in 0..LIMIT {
            all.push(
                p.take(&*a, name, options().no_wait(), "a")
                    .await
                    .expect("a permit"),
            );
        }
        all
    } else {
        vec![
            p.take(&*a, name, options().no_wait(), "a")
                .await
                .expect("the holder takes it"),
        ]
    };
    let mut rng = Rng::new();
    let (mut cancelled, mut granted) = (0, 0);
    for i in 0..STORM {
        // A held read lock is stormed by writers (queued) and readers (granted, then
        // dropped); a held write lock by readers and writers, all queued.
        let request = match p {
            ReadLock | WriteLock if i % 2 == 0 => WriteLock,
            ReadLock | WriteLock => ReadLock,
            other => other,
        };
        let limit = Duration::from_millis(rng.below(51));
        let attempt = request.take(
            &*b,
            name,
            options().wait_timeout(Duration::from_secs(10)),
            "b",
        );
        match tokio::time::timeout(limit, attempt).await {
            Err(_) => cancelled += 1,
            Ok(Ok(guard)) => {
                assert!(
                    p == ReadLock && request == ReadLock,
                    "request {i} ({}) granted while {} held",
                    request.label(),
                    p.label()
                );
                granted += 1;
                drop(guard);
            }
            Ok(Err(e)) => panic!("request {i} ({}): {e:?}", request.label()),
        }
    }
    assert!(
        cancelled >= STORM / 2,
        "only {cancelled} of {STORM} requests were cancelled ({granted} granted)"
    );
    for guard in held {
        assert!(!guard.is_lost(), "the holder lost it during the storm");
        guard.release().await.expect("the holder releases");
    }
    let released_at = Instant::now();
    let within = Duration::from_secs(1);
    let fresh = match p {
        Plain => c.acquire(name, options().wait_timeout(within)).await,
        Election => c.campaign(name, "c", options().wait_timeout(within)).await,
        Semaphore => {
            let all = Permits::new(LIMIT, LIMIT).expect("valid");
            c.acquire_permits(name, all, options().wait_timeout(within))
                .await
        }
        ReadLock | WriteLock => c.acquire_write(name, options().wait_timeout(within)).await,
    };
    let waited = released_at.elapsed();
    let fresh = fresh.unwrap_or_else(|e| {
        panic!("a fresh client did not get it within {within:?} of the release ({cancelled} cancelled, {granted} granted): {e:?}")
    });
    assert!(
        waited <= within,
        "a fresh client got it {waited:?} after the release"
    );
    eprintln!(
        "F8 {name}: {cancelled} requests cancelled, {granted} granted; a fresh client got it \
         {waited:?} after the release"
    );
    fresh.release().await.expect("the fresh client releases");
}

/// F8 for every primitive of `backend` on clients of `url`.
async fn storm_each(backend: &str, url: &str, servers: &Servers<'_>) -> [Lock; 3] {
    let clients = [connect(url).await, connect(url).await, connect(url).await];
    let primitives = primitives_of(backend, &*clients[0]);
    for_each(&format!("{backend} F8"), primitives, false, |p| {
        let [a, b, c] = clients.clone();
        storm(p, a, b, c, p.name(backend))
    })
    .await;
    // The stormer is still connected: a queue entry or permit of its own would show.
    servers.assert_nothing_left_within(&format!("{backend} F8"), LEFT_BOUND);
    clients
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f8_etcd() {
    // A server of its own: its leases are checked too.
    let server = EtcdServer::start();
    let prefix = common::unique("f8p-etcd");
    let url = format!("etcd://{}/{prefix}?lease=2s", server.endpoint());
    let clients = storm_each("etcd", &url, &Servers::Etcd(&server, &prefix)).await;
    // The clients' session leases end with the clients; no lease of a cancelled request
    // is kept alive.
    for client in &clients {
        client.close().await.expect("close");
    }
    drop(clients);
    tokio::task::block_in_place(|| {
        leftovers::assert_none_within("etcd F8 leases", LEFT_BOUND, || {
            leftovers::etcd_leases(&server.endpoint())
        })
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f8_zookeeper() {
    let server = ZkServer::shared();
    let chroot = common::unique("f8p-zk");
    let url = zk_url(&server.connect_string(), &chroot);
    storm_each("zookeeper", &url, &Servers::Zk(server, &chroot)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f8_redis() {
    let server = RedisServer::shared();
    let prefix = common::unique("f8p-redis");
    let url = format!("{}?prefix={prefix}:", server.url());
    storm_each("redis", &url, &Servers::redis(server, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f8_redlock() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let prefix = common::unique("f8p-redlock");
    let url = redlock_url(&servers, &prefix);
    let ports = servers.iter().map(RedisServer::port).collect();
    storm_each("redlock", &url, &Servers::Redis(ports, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f8_redis_sentinel() {
    let set = tokio::task::block_in_place(RedisSentinelSet::start);
    let prefix = common::unique("f8p-sentinel");
    let url = format!("{}?prefix={prefix}:", set.url());
    storm_each("sentinel", &url, &Servers::redis(set.master(), &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f8_redis_cluster() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3));
    let prefix = common::unique("f8p-cluster");
    let url = format!("{}?prefix={prefix}:", cluster.url());
    let ports = cluster.nodes().iter().map(RedisServer::port).collect();
    storm_each("cluster", &url, &Servers::Redis(ports, &prefix)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f8_migration() {
    for phase in MIXED {
        let prefix = common::unique("f8p-migrate");
        let url = migration_url(phase, &prefix);
        storm_each("migration", &url, &migration_servers(&prefix)).await;
    }
}

// ---------------------------------------------------------------------------------------

/// The migration layer's phases that hold both legs.
const MIXED: [MigrationPhase; 2] = [MigrationPhase::LegacyFirst, MigrationPhase::TargetFirst];

/// A `migrate://` URL: the shared Redis server (raw layout) as the legacy leg, the shared
/// etcd server as the target.
fn migration_url(phase: MigrationPhase, prefix: &str) -> String {
    fencelock::migration_url(
        phase,
        &format!(
            "{}?layout=raw&prefix={prefix}:",
            RedisServer::shared().url()
        ),
        &format!(
            "etcd://{}/{prefix}?lease=2s",
            EtcdServer::shared().endpoint()
        ),
    )
}

/// Both legs of [`migration_url`].
fn migration_servers(prefix: &str) -> Servers<'_> {
    Servers::Both(
        Box::new(Servers::redis(RedisServer::shared(), prefix)),
        Box::new(Servers::Etcd(EtcdServer::shared(), prefix)),
    )
}

fn redlock_url(servers: &[RedisServer], prefix: &str) -> String {
    let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
    format!("redlock://{}?prefix={prefix}:", hosts.join(","))
}

fn zk_url(hosts: &str, chroot: &str) -> String {
    format!("zk://{hosts}/{chroot}?session_timeout=2s&min_lease=2s")
}

async fn connect(url: &str) -> Lock {
    fencelock::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e:?}"))
}
