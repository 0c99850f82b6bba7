//! Benchmark: fencelock's Redis backend against the `rslock` crate, side by side in one
//! run over the same throwaway local `redis-server` instances: one instance
//! (`redis://` against rslock with one server) and three (`redlock://a,b,c` against
//! rslock with three).
//!
//! ```text
//! cd bench/redlock-vs-rslock && cargo run --release
//! ```
//!
//! `BENCH_ONLY=1` (or `3`) runs one deployment only; with `BENCH_PROFILE=fencelock` (or
//! `rslock`) it runs only that side's uncontended ops, 5,000 of them, for a profiler
//! (`valgrind --tool=callgrind` counts instructions, repeatable on a busy machine).
//!
//! Workloads, the kinds interleaved in every repeat (`fencelock_testkit::bench`):
//!
//! 1. uncontended acquire + release on one name, one client: p50/p99 and the median over
//!    repeats of fencelock's p50 over rslock's;
//! 2. 4 clients contending on one name for [`RUN`]: hand-overs/s (grants to another
//!    client than the previous grant) and fairness (most / fewest grants of a client);
//! 3. 32 workers on distinct names through one client for [`RUN`]: locks/s, client CPU
//!    per lock, and each instance's CPU time per lock (`INFO cpu`), with the commands
//!    per lock and µs per call that make it up (`INFO commandstats`, reset before each
//!    run; commands a script runs are listed too, and their time is inside the
//!    script's).
//!
//! What each side does per lock:
//!
//! - fencelock: acquire = one script per instance (`SET NX PX` + fencing token; on
//!   Redlock a second round trip that records the token on a majority only when the
//!   instances' answers disagree); release = one script per instance (compare, `DEL`,
//!   and `PUBLISH` only when a waiter marked the lock). The lease (10 s) is renewing, so
//!   renewal is armed and disarmed per lock (also measured with a fixed lease: no
//!   renewal). A waiter sleeps until an unlock message (pub/sub).
//! - rslock: acquire = `SET NX PX` per instance; release = `EVAL(SHA)` compare-and-delete
//!   per instance; no fencing token, no renewal (fixed 10 s TTL). A failed attempt unlocks
//!   everywhere and sleeps a random `0..retry_delay` (default 200 ms, 3 tries per
//!   `lock`, `acquire` loops forever). The contended workload is run with the default
//!   delay and with 5 ms, its only knob; rslock has no way to wake on release.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_testkit::RedisServer;
use fencelock_testkit::bench::{self, ProcessCpu, Rounds};
use rslock::LockManager;

const RUN: Duration = Duration::from_secs(3);
const REPEATS: usize = 3;
const LEASE: Duration = Duration::from_secs(10);
/// Uncontended ops run under `BENCH_PROFILE`.
const PROFILE_OPS: usize = 5_000;

/// One side of the comparison.
#[derive(Clone)]
enum Side {
    /// fencelock with a renewing lease (the default kind) or a fixed one (no renewal).
    Fencelock(Arc<dyn DistributedLock>, bool),
    Rslock(LockManager),
}

impl Side {
    /// Acquire, run `held` while holding, release.
    async fn once_then(&self, name: &str, held: impl FnOnce()) {
        match self {
            Side::Fencelock(locks, fixed) => {
                let options = if *fixed {
                    AcquireOptions::new().fixed_lease(LEASE)
                } else {
                    AcquireOptions::new().lease(LEASE)
                };
                let guard = locks.acquire(name, options).await.unwrap();
                held();
                guard.release().await.unwrap();
            }
            Side::Rslock(manager) => {
                let guard = manager.acquire(name.as_bytes(), LEASE).await.unwrap();
                held();
                guard.release().await;
            }
        }
    }
}

/// The kinds compared: what [`Sides`] builds for each.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Rslock,
    /// rslock with a 5 ms retry delay (contended only).
    Rslock5,
    Fencelock,
    FencelockFixed,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Rslock => "rslock",
            Kind::Rslock5 => "rslock 5ms",
            Kind::Fencelock => "fencelock",
            Kind::FencelockFixed => "fl fixed",
        }
    }
}

/// The servers of one deployment and how each side connects to them.
struct Deployment {
    urls: Vec<String>,
    ports: Vec<u16>,
    fencelock_url: String,
}

impl Deployment {
    async fn side(&self, kind: Kind) -> Side {
        match kind {
            Kind::Rslock | Kind::Rslock5 => {
                let mut manager = LockManager::new(self.urls.clone());
                if kind == Kind::Rslock5 {
                    manager.set_retry(3, Duration::from_millis(5));
                }
                Side::Rslock(manager)
            }
            Kind::Fencelock | Kind::FencelockFixed => Side::Fencelock(
                fencelock_redis::connect(&self.fencelock_url).await.unwrap(),
                kind == Kind::FencelockFixed,
            ),
        }
    }

    /// `redis-cli` on each instance.
    fn cli(&self, args: &[&str]) -> Vec<String> {
        self.ports
            .iter()
            .map(|port| {
                let out = std::process::Command::new("redis-cli")
                    .args(["-p", &port.to_string()])
                    .args(args)
                    .output()
                    .expect("redis-cli");
                String::from_utf8_lossy(&out.stdout).into_owned()
            })
            .collect()
    }

    /// Per instance: the server's CPU time so far (`used_cpu_user + used_cpu_sys` of
    /// `INFO cpu`).
    fn cpu(&self) -> Vec<Duration> {
        self.cli(&["info", "cpu"])
            .iter()
            .map(|info| {
                let seconds: f64 = info
                    .lines()
                    .filter_map(|line| line.trim().split_once(':'))
                    .filter(|(field, _)| *field == "used_cpu_user" || *field == "used_cpu_sys")
                    .filter_map(|(_, value)| value.parse::<f64>().ok())
                    .sum();
                Duration::from_secs_f64(seconds)
            })
            .collect()
    }

    /// Per instance: each command's calls and µs from `INFO commandstats`. Commands
    /// that scripts run are counted too, and inside their script's time as well.
    fn commandstats(&self) -> Vec<BTreeMap<String, (u64, u64)>> {
        self.cli(&["info", "commandstats"])
            .iter()
            .map(|info| {
                let mut stats = BTreeMap::new();
                for line in info.lines() {
                    let Some((name, fields)) = line.trim().split_once(':') else {
                        continue;
                    };
                    let Some(command) = name.strip_prefix("cmdstat_") else {
                        continue;
                    };
                    let field = |key: &str| {
                        fields
                            .split(',')
                            .find_map(|f| f.strip_prefix(key))
                            .and_then(|v| v.parse::<u64>().ok())
                            .unwrap_or(0)
                    };
                    stats.insert(command.to_owned(), (field("calls="), field("usec=")));
                }
                stats
            })
            .collect()
    }
}

/// What one timed run of workers measured.
struct Run {
    locks: u64,
    handoffs: u64,
    per_worker: Vec<u64>,
    cpu: Duration,
    /// Per instance, the server's CPU time over the run.
    server: Vec<Duration>,
    /// Per instance, `INFO commandstats` over the run (the counters were reset first).
    stats: Vec<BTreeMap<String, (u64, u64)>>,
}

/// `sides.len()` workers for [`RUN`]; all on `name` if given, else each on its own name.
async fn workers(sides: Vec<Side>, name: Option<&str>, deployment: &Deployment) -> Run {
    let last = Arc::new(AtomicU64::new(u64::MAX));
    let handoffs = Arc::new(AtomicU64::new(0));
    deployment.cli(&["config", "resetstat"]);
    let server = deployment.cpu();
    let cpu = ProcessCpu::now();
    let deadline = Instant::now() + RUN;
    let tasks: Vec<_> = sides
        .into_iter()
        .enumerate()
        .map(|(i, side)| {
            let (last, handoffs) = (last.clone(), handoffs.clone());
            let name = name.map_or_else(|| format!("d-{i}-{}", fastrand()), str::to_owned);
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    side.once_then(&name, || {
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
    let cpu = ProcessCpu::now().since(&cpu);
    let server = deployment
        .cpu()
        .iter()
        .zip(&server)
        .map(|(after, before)| after.saturating_sub(*before))
        .collect();
    Run {
        locks: per_worker.iter().sum(),
        handoffs: handoffs.load(Ordering::Relaxed),
        per_worker,
        cpu,
        server,
        stats: deployment.commandstats(),
    }
}

/// A name no earlier run used (the counters of the token keys stay).
fn fastrand() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now())
}

async fn compare(label: &str, deployment: &Deployment) {
    println!(
        "== {label} ({} CPUs)",
        std::thread::available_parallelism().map_or(0, usize::from)
    );

    if let Ok(profile) = std::env::var("BENCH_PROFILE") {
        // Only one side's uncontended ops, for a profiler (e.g. callgrind's instruction
        // counts per op): `rslock`, or fencelock's with a renewing lease.
        let kind = if profile == "rslock" {
            Kind::Rslock
        } else {
            Kind::Fencelock
        };
        let side = deployment.side(kind).await;
        for _ in 0..PROFILE_OPS {
            side.once_then("bench-uncontended", || {}).await;
        }
        println!("-- {PROFILE_OPS} uncontended ops of {}", kind.label());
        return;
    }
    let kinds = [Kind::Rslock, Kind::Fencelock, Kind::FencelockFixed];
    let mut sides = Vec::new();
    for kind in kinds {
        sides.push(deployment.side(kind).await);
    }
    let plan = Rounds::new(REPEATS, 5, 300, 50);
    println!("-- uncontended, one client, one name ({plan})");
    let measured = bench::interleave(&[0, 1, 2], plan, |i| {
        let side = &sides[i];
        async move { side.once_then("u", || {}).await }
    })
    .await;
    println!(
        "{}",
        bench::latency_lines(&measured, Some(0), |i| kinds[i].label())
    );

    println!("-- 4 clients contending on one name ({RUN:?} x {REPEATS}, interleaved)");
    let contenders = [Kind::Rslock, Kind::Rslock5, Kind::Fencelock];
    let runs = bench::interleave_runs(&contenders, REPEATS, |kind, repeat| async move {
        let mut four = Vec::new();
        for _ in 0..4 {
            four.push(deployment.side(kind).await);
        }
        let name = format!("c-{}-{repeat}", kind.label());
        workers(four, Some(&name), deployment).await
    })
    .await;
    let rate = |r: &Run| r.handoffs as f64 / RUN.as_secs_f64();
    let rslock_rates: Vec<f64> = runs[0].iter().map(rate).collect();
    for (kind, mine) in contenders.iter().zip(&runs) {
        let rates: Vec<f64> = mine.iter().map(rate).collect();
        let fairness: Vec<f64> = mine
            .iter()
            .map(|r| {
                let min = r.per_worker.iter().copied().min().unwrap_or(0).max(1);
                r.per_worker.iter().copied().max().unwrap_or(0) as f64 / min as f64
            })
            .collect();
        let vs_rslock = bench::over(&rates, &rslock_rates);
        println!(
            "  {:<11} hand-overs/s {:>7.0} (median of {REPEATS})  fairness max/min {}  /rslock {}",
            kind.label(),
            bench::median(rates.clone()),
            bench::ratios(&fairness),
            bench::ratios(&vs_rslock),
        );
    }

    println!(
        "-- 32 workers on distinct names, one shared client ({RUN:?} x {REPEATS}, interleaved)"
    );
    let runs = bench::interleave_runs(&[0, 1, 2], REPEATS, |i, _| {
        let side = sides[i].clone();
        async move { workers(vec![side; 32], None, deployment).await }
    })
    .await;
    let per_lock =
        |r: &Run, instance: usize| r.server[instance].as_secs_f64() * 1e6 / r.locks.max(1) as f64;
    for (i, kind) in kinds.iter().enumerate() {
        let rates: Vec<f64> = runs[i]
            .iter()
            .map(|r| r.locks as f64 / RUN.as_secs_f64())
            .collect();
        let floor: Vec<f64> = runs[0]
            .iter()
            .map(|r| r.locks as f64 / RUN.as_secs_f64())
            .collect();
        let cpu: Vec<f64> = runs[i]
            .iter()
            .map(|r| r.cpu.as_secs_f64() * 1e6 / r.locks.max(1) as f64)
            .collect();
        println!(
            "  {:<11} locks/s {:>7.0} (median of {REPEATS})  /rslock {}  client CPU µs/lock {}",
            kind.label(),
            bench::median(rates.clone()),
            bench::ratios(&bench::over(&rates, &floor)),
            bench::ratios(&cpu),
        );
        for instance in 0..deployment.ports.len() {
            let mine: Vec<f64> = runs[i].iter().map(|r| per_lock(r, instance)).collect();
            let theirs: Vec<f64> = runs[0].iter().map(|r| per_lock(r, instance)).collect();
            // The commands per lock of the last repeat, for what makes up the time.
            let last = runs[i].last().unwrap();
            let commands: Vec<String> = last.stats[instance]
                .iter()
                .filter(|(name, (calls, _))| *calls > 0 && !name.starts_with("config"))
                .map(|(name, (calls, usec))| {
                    format!(
                        "{name} {:.2}x {:.1}µs",
                        *calls as f64 / last.locks.max(1) as f64,
                        *usec as f64 / (*calls).max(1) as f64
                    )
                })
                .collect();
            println!(
                "      instance {instance}: server CPU µs/lock {:.1} ({})  /rslock {}   per lock: {}",
                bench::median(mine.clone()),
                mine.iter()
                    .map(|v| format!("{v:.1}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                bench::ratios(&bench::over(&mine, &theirs)),
                commands.join(", "),
            );
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let only = std::env::var("BENCH_ONLY").ok();
    for (count, label) in [
        (
            1,
            "one redis-server: redis:// against rslock with one server",
        ),
        (3, "Redlock over 3 local redis-server instances"),
    ] {
        if only.as_deref().is_some_and(|o| o != count.to_string()) {
            continue;
        }
        let servers: Vec<RedisServer> = (0..count).map(|_| RedisServer::start()).collect();
        let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
        let deployment = Deployment {
            urls: servers.iter().map(RedisServer::url).collect(),
            ports: servers.iter().map(RedisServer::port).collect(),
            fencelock_url: if count == 1 {
                format!("redis://{}?prefix=bench-fl:", hosts[0])
            } else {
                format!("redlock://{}?prefix=bench-fl:", hosts.join(","))
            },
        };
        compare(label, &deployment).await;
    }
}
