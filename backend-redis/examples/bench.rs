//! Benchmark: fencelock's Redis backend against a hand-written floor that does the same
//! server-side work, on throwaway servers (single server, Sentinel, Cluster; Redlock over
//! 3 instances against hand-written `SET NX` on each).
//!
//! ```text
//! cargo run --release -p fencelock-redis --example bench
//! ```
//!
//! What is compared (all on the same client crate, `redis`, and the same servers):
//!
//! - `floor`: a lock written by hand whose acquire is one `EVALSHA` doing what
//!   fencelock's acquire must do on the server: `SET NX PX`, then the fencing token
//!   `max(counter + 1, server clock in µs)` kept in a counter key with a TTL. Its release
//!   is the usual compare-and-delete script. A waiting acquire spins with 1 ms sleeps.
//!   What fencelock costs beyond this floor is the library's own overhead.
//! - `raw`: the usual hand-written lock, `SET NX PX` and compare-and-delete: no token, so
//!   less work than a fencing lock must do. Shown for users.
//! - `fencelock`: `DistributedLock::acquire` + `LockGuard::release`, default options
//!   (a renewing 30 s lease, so renewal is armed and disarmed per lock).
//!
//! Workloads, each kind interleaved with the others in every round so drift on a shared
//! machine hits all alike:
//!
//! 1. uncontended acquire + release, one task, one name: [`ROUNDS`] rounds of [`OPS`];
//!    p50/p99 from all rounds, the median over rounds of each kind's p50 over the
//!    floor's in that round, and client CPU per lock (this process's CPU time,
//!    `fencelock_testkit::bench::ProcessCpu`: the servers are other processes);
//! 2. 4 clients on one name for [`RUN`], [`REPEATS`] times: hand-overs/s (grants to
//!    another client than the previous grant), fairness (most / fewest grants of one
//!    client), and per hand-over the `PUBLISH` and script calls the servers ran (`INFO
//!    commandstats`): the server's cost of a hand-over, bounded by the waiting clients;
//! 3. 32 workers on distinct names through one client for [`RUN`], [`REPEATS`] times:
//!    locks/s, client CPU per lock and server CPU per lock (`INFO cpu` of every master).
//!
//! Ratios are medians over the repeats of fencelock ÷ floor measured in the same repeat.
//! `BENCH_ONLY=single|sentinel|cluster|redlock` runs one suite; `BENCH_PROFILE=1` runs
//! only fencelock's 32 workers (for `perf record`), `BENCH_PROFILE=floor` the floor's.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_testkit::bench::{Histogram, ProcessCpu, histogram, median, record};
use fencelock_testkit::{RedisCluster, RedisSentinelSet, RedisServer};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;

const ROUNDS: usize = 20;
const OPS: usize = 500;
const RUN: Duration = Duration::from_secs(3);
const REPEATS: usize = 3;
const LEASE_MS: u64 = 30_000;
const TOKEN_TTL_MS: u64 = 24 * 3600 * 1000;
const SPIN: Duration = Duration::from_millis(1);

/// Compare-and-delete: the release of both hand-written locks.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

/// The floor's acquire. KEYS: lock, token counter. ARGV: owner, lease ms, counter ttl ms.
/// Returns the token, or 0 when the lock is taken. The token never repeats: it is above
/// the last one recorded and at least the server's clock (which is above every token
/// recorded before a counter was lost).
const FLOOR_ACQUIRE: &str = r"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
local now = redis.call('TIME')
local clock = tonumber(now[1]) * 1000000 + tonumber(now[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local token = math.max(last + 1, clock)
redis.call('SET', KEYS[2], string.format('%.0f', token), 'PX', ARGV[3])
return token";

/// A connection to one server or to a cluster.
#[derive(Clone)]
enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn open(url: &str) -> Conn {
        let client = redis::Client::open(url).unwrap();
        Conn::Single(client.get_multiplexed_async_connection().await.unwrap())
    }

    /// One cluster connection, seeded with every node.
    async fn open_cluster(urls: &[String]) -> Conn {
        let client = redis::cluster::ClusterClient::new(urls.to_vec()).unwrap();
        Conn::Cluster(client.get_async_connection().await.unwrap())
    }

    async fn invoke<T: redis::FromRedisValue>(&self, inv: &redis::ScriptInvocation<'_>) -> T {
        match self {
            Conn::Single(c) => inv.invoke_async(&mut c.clone()).await.unwrap(),
            Conn::Cluster(c) => inv.invoke_async(&mut c.clone()).await.unwrap(),
        }
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        async fn run<C: ConnectionLike, T: redis::FromRedisValue>(mut c: C, cmd: &redis::Cmd) -> T {
            cmd.query_async(&mut c).await.unwrap()
        }
        match self {
            Conn::Single(c) => run(c.clone(), cmd).await,
            Conn::Cluster(c) => run(c.clone(), cmd).await,
        }
    }
}

/// The two hand-written locks: one connection per server (Redlock's raw uses them all,
/// the floor the first), or one cluster connection.
#[derive(Clone)]
struct Hand {
    conns: Vec<Conn>,
    release: Arc<redis::Script>,
    floor: Arc<redis::Script>,
}

impl Hand {
    async fn new(urls: &[String], cluster: bool) -> Self {
        let mut conns = Vec::new();
        if cluster {
            conns.push(Conn::open_cluster(urls).await);
        } else {
            for url in urls {
                conns.push(Conn::open(url).await);
            }
        }
        Hand {
            conns,
            release: Arc::new(redis::Script::new(RELEASE)),
            floor: Arc::new(redis::Script::new(FLOOR_ACQUIRE)),
        }
    }

    /// `SET NX PX` on every server; granted on a majority.
    async fn try_raw(&self, key: &str, owner: &str) -> bool {
        let mut granted = 0;
        for conn in &self.conns {
            let r: Option<String> = conn
                .query(
                    redis::cmd("SET")
                        .arg(key)
                        .arg(owner)
                        .arg("NX")
                        .arg("PX")
                        .arg(LEASE_MS),
                )
                .await;
            granted += usize::from(r.is_some());
        }
        granted > self.conns.len() / 2
    }

    /// The floor's acquire on the first server: the token, or `None` when taken.
    async fn try_floor(&self, key: &str, owner: &str) -> Option<u64> {
        let token: u64 = self.conns[0]
            .invoke(
                self.floor
                    .key(key)
                    .key(format!("{key}:token"))
                    .arg(owner)
                    .arg(LEASE_MS)
                    .arg(TOKEN_TTL_MS),
            )
            .await;
        (token != 0).then_some(token)
    }

    async fn release(&self, key: &str, owner: &str) {
        for conn in &self.conns {
            let _: i64 = conn.invoke(self.release.key(key).arg(owner)).await;
        }
    }
}

/// One way of taking and releasing a lock.
#[derive(Clone)]
enum Kind {
    Raw(Hand),
    Floor(Hand),
    Fencelock(Arc<dyn DistributedLock>),
}

impl Kind {
    fn label(&self) -> &'static str {
        match self {
            Kind::Raw(_) => "raw SET NX PX",
            Kind::Floor(_) => "floor (EVALSHA with token)",
            Kind::Fencelock(_) => "fencelock",
        }
    }

    /// Acquires `name` (waiting if taken), runs `held`, releases. `n` makes the owner
    /// value unique for the hand-written kinds.
    async fn once(&self, name: &str, n: u64, held: impl FnOnce()) {
        match self {
            Kind::Raw(hand) => {
                let (key, owner) = (format!("raw:{{{name}}}"), format!("{n}-{}", nonce()));
                while !hand.try_raw(&key, &owner).await {
                    tokio::time::sleep(SPIN).await;
                }
                held();
                hand.release(&key, &owner).await;
            }
            Kind::Floor(hand) => {
                let (key, owner) = (format!("floor:{{{name}}}"), format!("{n}-{}", nonce()));
                while hand.try_floor(&key, &owner).await.is_none() {
                    tokio::time::sleep(SPIN).await;
                }
                held();
                hand.release(&key, &owner).await;
            }
            Kind::Fencelock(locks) => {
                let guard = locks.acquire(name, AcquireOptions::new()).await.unwrap();
                held();
                guard.release().await.unwrap();
            }
        }
    }
}

fn nonce() -> u64 {
    fastrand::u64(..)
}

/// CPU time the servers have used (`used_cpu_user + used_cpu_sys` of `INFO cpu`).
async fn server_cpu(servers: &[Conn]) -> Duration {
    let mut seconds = 0.0;
    for conn in servers {
        let info: String = conn.query(redis::cmd("INFO").arg("cpu")).await;
        for line in info.lines() {
            if let Some((field, value)) = line.split_once(':')
                && (field == "used_cpu_user" || field == "used_cpu_sys")
            {
                seconds += value.trim().parse::<f64>().unwrap_or(0.0);
            }
        }
    }
    Duration::from_secs_f64(seconds)
}

fn per_lock_us(cpu: Duration, locks: u64) -> f64 {
    cpu.as_secs_f64() * 1e6 / locks.max(1) as f64
}

/// Workload 1: `ROUNDS` rounds, each running every kind for `OPS` sequential locks.
async fn uncontended(kinds: &[Kind]) {
    for kind in kinds {
        for n in 0..50 {
            kind.once("bench-u", n, || {}).await;
        }
    }
    let mut pooled: Vec<Histogram<u64>> = kinds.iter().map(|_| histogram()).collect();
    let mut cpu_used = vec![Duration::ZERO; kinds.len()];
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let floor = kinds
        .iter()
        .position(|k| matches!(k, Kind::Floor(_)))
        .unwrap_or(0);
    for _ in 0..ROUNDS {
        let mut p50 = vec![0.0; kinds.len()];
        for (i, kind) in kinds.iter().enumerate() {
            let mut round = histogram();
            let start_cpu = ProcessCpu::now();
            for n in 0..OPS {
                let t = Instant::now();
                kind.once("bench-u", n as u64, || {}).await;
                record(&mut round, t.elapsed());
            }
            cpu_used[i] += ProcessCpu::now().since(&start_cpu);
            p50[i] = round.value_at_quantile(0.5) as f64;
            fencelock_testkit::bench::merge(&mut pooled[i], &round);
        }
        for i in 0..kinds.len() {
            ratios[i].push(p50[i] / p50[floor]);
        }
    }
    println!("-- uncontended, one task, one name ({ROUNDS} rounds of {OPS}, interleaved)");
    for (i, kind) in kinds.iter().enumerate() {
        let h = &pooled[i];
        println!(
            "{:<28} p50 {:>6} µs  p99 {:>6} µs  client CPU {:>5.1} µs/lock  p50 / floor's (median of rounds) {:.3}",
            kind.label(),
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            per_lock_us(cpu_used[i], h.len()),
            median(std::mem::take(&mut ratios[i])),
        );
    }
}

/// What one timed run of many workers measured.
struct Run {
    locks: u64,
    handoffs: u64,
    per_worker: Vec<u64>,
    client_cpu: Duration,
    server_cpu: Duration,
    /// `PUBLISH` calls and script calls (`EVALSHA`, `EVAL`) the servers ran, from
    /// `INFO commandstats` (a script's own commands are counted there too).
    publishes: u64,
    scripts: u64,
}

/// The calls of `commands` the servers have run so far (`INFO commandstats`).
async fn command_calls(servers: &[Conn], commands: &[&str]) -> u64 {
    let mut calls = 0;
    for conn in servers {
        let info: String = conn.query(redis::cmd("INFO").arg("commandstats")).await;
        for line in info.lines() {
            let Some((name, stats)) = line.split_once(':') else {
                continue;
            };
            if commands
                .iter()
                .any(|c| name.strip_prefix("cmdstat_") == Some(*c))
            {
                calls += stats
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("calls="))
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    calls
}

/// `sides.len()` workers for [`RUN`]: all on `name` if given, else each on its own.
async fn run(sides: Vec<Kind>, name: Option<&str>, servers: &[Conn]) -> Run {
    let last = Arc::new(AtomicU64::new(u64::MAX));
    let handoffs = Arc::new(AtomicU64::new(0));
    let (cpu_before, server_before) = (ProcessCpu::now(), server_cpu(servers).await);
    let publishes_before = command_calls(servers, &["publish"]).await;
    let scripts_before = command_calls(servers, &["evalsha", "eval"]).await;
    let deadline = Instant::now() + RUN;
    let tasks: Vec<_> = sides
        .into_iter()
        .enumerate()
        .map(|(i, side)| {
            let (last, handoffs) = (last.clone(), handoffs.clone());
            let name = name.map_or_else(|| format!("bench-d-{i}"), str::to_owned);
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    side.once(&name, n, || {
                        if last.swap(i as u64, Ordering::Relaxed) != i as u64 {
                            handoffs.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                    .await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut per_worker = Vec::new();
    for task in tasks {
        per_worker.push(task.await.unwrap());
    }
    Run {
        locks: per_worker.iter().sum(),
        handoffs: handoffs.load(Ordering::Relaxed),
        per_worker,
        client_cpu: ProcessCpu::now().since(&cpu_before),
        server_cpu: server_cpu(servers).await - server_before,
        publishes: command_calls(servers, &["publish"]).await - publishes_before,
        scripts: command_calls(servers, &["evalsha", "eval"]).await - scripts_before,
    }
}

/// Workload 2: `clients[k]` holds 4 clients of kind k, contending on one name.
async fn handovers(clients: &[Vec<Kind>], servers: &[Conn]) {
    println!("-- 4 clients on one name ({RUN:?} each, {REPEATS} repeats, interleaved)");
    let floor = clients
        .iter()
        .position(|k| matches!(k[0], Kind::Floor(_)))
        .unwrap_or(0);
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); clients.len()];
    let mut fairness: Vec<Vec<f64>> = vec![Vec::new(); clients.len()];
    let mut costs: Vec<Vec<(f64, f64)>> = vec![Vec::new(); clients.len()];
    for repeat in 0..REPEATS {
        for (i, four) in clients.iter().enumerate() {
            let name = format!("bench-c-{repeat}-{i}");
            let r = run(four.clone(), Some(&name), servers).await;
            let (min, max) = (
                *r.per_worker.iter().min().unwrap(),
                *r.per_worker.iter().max().unwrap(),
            );
            rates[i].push(r.handoffs as f64 / RUN.as_secs_f64());
            fairness[i].push(max as f64 / min.max(1) as f64);
            let per = |n: u64| n as f64 / r.handoffs.max(1) as f64;
            costs[i].push((per(r.publishes), per(r.scripts)));
        }
    }
    for (i, four) in clients.iter().enumerate() {
        let ratio: Vec<f64> = (0..REPEATS)
            .map(|r| rates[i][r] / rates[floor][r].max(f64::EPSILON))
            .collect();
        println!(
            "{:<28} hand-overs/s {:>7}  fairness max/min {}  / floor's (median) {:.2}",
            four[0].label(),
            list(&rates[i], 0),
            list(&fairness[i], 2),
            median(ratio),
        );
    }
    println!(
        "   per hand-over, what the servers ran (INFO commandstats; each PUBLISH reaches every subscribed waiting client):"
    );
    for (i, four) in clients.iter().enumerate() {
        let publishes: Vec<f64> = costs[i].iter().map(|c| c.0).collect();
        let scripts: Vec<f64> = costs[i].iter().map(|c| c.1).collect();
        println!(
            "{:<28} PUBLISH {}  script calls {}",
            four[0].label(),
            list(&publishes, 2),
            list(&scripts, 2),
        );
    }
}

/// Workload 3: 32 workers of each kind on their own names.
async fn distinct(kinds: &[Kind], servers: &[Conn]) {
    println!(
        "-- 32 workers on distinct names, one client ({RUN:?} each, {REPEATS} repeats, interleaved)"
    );
    let floor = kinds
        .iter()
        .position(|k| matches!(k, Kind::Floor(_)))
        .unwrap_or(0);
    let raw = kinds
        .iter()
        .position(|k| matches!(k, Kind::Raw(_)))
        .unwrap_or(0);
    let mut runs: Vec<Vec<Run>> = kinds.iter().map(|_| Vec::new()).collect();
    for _ in 0..REPEATS {
        for (i, kind) in kinds.iter().enumerate() {
            runs[i].push(run(vec![kind.clone(); 32], None, servers).await);
        }
    }
    for (i, kind) in kinds.iter().enumerate() {
        let rate: Vec<f64> = runs[i]
            .iter()
            .map(|r| r.locks as f64 / RUN.as_secs_f64())
            .collect();
        let client: Vec<f64> = runs[i]
            .iter()
            .map(|r| per_lock_us(r.client_cpu, r.locks))
            .collect();
        let server: Vec<f64> = runs[i]
            .iter()
            .map(|r| per_lock_us(r.server_cpu, r.locks))
            .collect();
        let vs = |other: usize, f: &dyn Fn(&Run) -> f64| {
            median(
                (0..REPEATS)
                    .map(|r| f(&runs[i][r]) / f(&runs[other][r]).max(f64::EPSILON))
                    .collect(),
            )
        };
        let throughput = |r: &Run| r.locks as f64;
        let client_cpu = |r: &Run| per_lock_us(r.client_cpu, r.locks);
        println!(
            "{:<28} locks/s {}  client CPU µs/lock {}  server CPU µs/lock {}  locks/s / floor's {:.2}  client CPU / raw's {:.2}",
            kind.label(),
            list(&rate, 0),
            list(&client, 1),
            list(&server, 1),
            vs(floor, &throughput),
            vs(raw, &client_cpu),
        );
    }
}

fn list(values: &[f64], decimals: usize) -> String {
    values
        .iter()
        .map(|v| format!("{v:.decimals$}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The three workloads with raw, floor and fencelock on one deployment. `hand_urls`: what
/// the hand-written locks connect to (`cluster`: one cluster client over all of them);
/// `masters`: the servers whose CPU is counted.
async fn suite(label: &str, hand_urls: &[String], cluster: bool, url: &str, masters: &[String]) {
    println!("== {label}");
    let hand = Hand::new(hand_urls, cluster).await;
    let locks = fencelock_redis::connect(url).await.unwrap();
    let mut servers = Vec::new();
    for m in masters {
        servers.push(Conn::open(m).await);
    }
    let kinds = [
        Kind::Raw(hand.clone()),
        Kind::Floor(hand.clone()),
        Kind::Fencelock(locks.clone()),
    ];
    if let Some(profile) = std::env::var_os("BENCH_PROFILE") {
        // Only one kind's 32 workers, for a profiler: fencelock's, or the floor's.
        let kind = if profile == "floor" { 1 } else { 2 };
        distinct(&kinds[kind..=kind], &servers).await;
        return;
    }
    uncontended(&kinds).await;
    let mut clients: Vec<Vec<Kind>> = vec![Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..4 {
        let own = Hand::new(hand_urls, cluster).await;
        clients[0].push(Kind::Raw(own.clone()));
        clients[1].push(Kind::Floor(own));
        clients[2].push(Kind::Fencelock(
            fencelock_redis::connect(url).await.unwrap(),
        ));
    }
    handovers(&clients, &servers).await;
    distinct(&kinds, &servers).await;
}

/// Redlock over 3 instances: raw is `SET NX PX` on each, one after the other (see
/// `bench/redlock-vs-rslock` for the comparison with the `rslock` crate).
async fn redlock() {
    println!("== redlock over 3 instances (raw = SET NX on each in turn, no token)");
    let three: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = three.iter().map(RedisServer::url).collect();
    let hosts: Vec<String> = three.iter().map(RedisServer::addr).collect();
    let hand = Hand::new(&urls, false).await;
    let locks = fencelock_redis::connect(&format!("redlock://{}", hosts.join(",")))
        .await
        .unwrap();
    let mut servers = Vec::new();
    for url in &urls {
        servers.push(Conn::open(url).await);
    }
    let kinds = [Kind::Raw(hand), Kind::Fencelock(locks)];
    uncontended(&kinds).await;
    distinct(&kinds, &servers).await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let only = std::env::var("BENCH_ONLY").ok();
    let wanted = |suite: &str| only.as_deref().is_none_or(|o| o == suite);
    if wanted("single") {
        let server = RedisServer::start();
        let url = server.url();
        let one = std::slice::from_ref(&url);
        suite("single server", one, false, &url, one).await;
    }
    if wanted("sentinel") {
        let set = RedisSentinelSet::start();
        let master = set.master().url();
        suite(
            "Sentinel (1 master, 1 replica, 3 sentinels; the floor talks to the master)",
            std::slice::from_ref(&master),
            false,
            &set.url(),
            std::slice::from_ref(&master),
        )
        .await;
    }
    if wanted("cluster") {
        let cluster = RedisCluster::start(3);
        let masters: Vec<String> = cluster.nodes().iter().map(RedisServer::url).collect();
        suite(
            "Cluster (3 masters; the floor uses redis-rs's cluster client)",
            &masters,
            true,
            &cluster.url(),
            &masters,
        )
        .await;
    }
    if wanted("redlock") {
        redlock().await;
    }
}
