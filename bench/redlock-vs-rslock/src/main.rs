//! Benchmark: fencelock's Redlock (`redlock://a,b,c`) against the `rslock` crate, side by
//! side in one run, over the same 3 throwaway local `redis-server` instances.
//!
//! ```text
//! cd bench/redlock-vs-rslock && cargo run --release
//! ```
//!
//! Workloads (the same three as `backend-redis/examples/bench.rs`):
//!
//! 1. uncontended acquire + release on one name, one client: p50/p99 and ops/s;
//! 2. 4 clients contending on one name for a fixed time: handoffs/s and the p50/p99 of
//!    acquire + release as seen by a client (including its wait);
//! 3. 32 workers on distinct names through one client: locks/s and p50/p99.
//!
//! Runs alternate (rslock, fencelock, rslock, fencelock) so warm-up and CPU contention
//! hit both. What each side does per lock:
//!
//! - fencelock: acquire = one script per instance (`SET NX PX` + fencing token; a second
//!   round trip that records the token on a majority only when the instances' answers
//!   disagree); release = one script per instance (compare, `DEL`, and `PUBLISH` only
//!   when a waiter marked the lock). The lease (10 s) is renewing, so renewal is
//!   armed and disarmed per lock (also measured with a fixed lease: no renewal). A waiter
//!   sleeps until an unlock message (pub/sub).
//! - rslock: acquire = `SET NX PX` per instance; release = `EVAL(SHA)` compare-and-delete
//!   per instance; no fencing token, no renewal (fixed 10 s TTL). A failed attempt unlocks
//!   everywhere and sleeps a random `0..retry_delay` (default 200 ms, 3 tries per
//!   `lock`, `acquire` loops forever). The contended workload is run with the default
//!   delay and with 5 ms, its only knob; rslock has no way to wake on release.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_testkit::RedisServer;
use rslock::LockManager;

const UNCONTENDED: usize = 3000;
const RUN: Duration = Duration::from_secs(3);
const LEASE: Duration = Duration::from_secs(10);

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p) as usize]
}

fn report(what: &str, mut samples: Vec<Duration>, total: Duration) {
    samples.sort();
    println!(
        "{what:<44} p50 {:>9.1?}  p99 {:>9.1?}  {:>8.0} ops/s  (n={})",
        pct(&samples, 0.5),
        pct(&samples, 0.99),
        samples.len() as f64 / total.as_secs_f64(),
        samples.len()
    );
}

/// One side of the comparison.
#[derive(Clone)]
enum Side {
    /// fencelock with a renewing lease (the default kind) or a fixed one (no renewal).
    Fencelock(Arc<dyn DistributedLock>, bool),
    Rslock(LockManager),
}

impl Side {
    async fn once(&self, name: &str) {
        self.once_then(name, || {}).await;
    }

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

async fn uncontended(what: &str, side: &Side, name: &str) {
    let mut samples = Vec::with_capacity(UNCONTENDED);
    let start = Instant::now();
    for _ in 0..UNCONTENDED {
        let t = Instant::now();
        side.once(name).await;
        samples.push(t.elapsed());
    }
    report(what, samples, start.elapsed());
}

/// `sides.len()` workers for [`RUN`]; all on `name` if given, else each on its own name.
/// On one name it also reports real handoffs (grants to a different worker than the
/// previous grant) and the fewest and most grants of one worker.
async fn workers(what: &str, sides: Vec<Side>, name: Option<&str>) {
    let count = Arc::new(AtomicU64::new(0));
    let last = Arc::new(AtomicU64::new(u64::MAX));
    let handoffs = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + RUN;
    let tasks: Vec<_> = sides
        .into_iter()
        .enumerate()
        .map(|(i, side)| {
            let (count, last, handoffs) = (count.clone(), last.clone(), handoffs.clone());
            let name = name.map_or_else(|| format!("{what}-{i}"), str::to_owned);
            tokio::spawn(async move {
                let mut samples = Vec::new();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    side.once_then(&name, || {
                        if last.swap(i as u64, Ordering::Relaxed) != i as u64 {
                            handoffs.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                    .await;
                    samples.push(t.elapsed());
                    count.fetch_add(1, Ordering::Relaxed);
                }
                samples
            })
        })
        .collect();
    let mut samples = Vec::new();
    let mut per_worker = Vec::new();
    for task in tasks {
        let mine = task.await.unwrap();
        per_worker.push(mine.len());
        samples.extend(mine);
    }
    let total = start.elapsed();
    report(what, samples, total);
    if name.is_some() {
        println!(
            "{:<44} {:>8.0} handoffs/s  grants per worker: min {} max {}",
            "",
            handoffs.load(Ordering::Relaxed) as f64 / total.as_secs_f64(),
            per_worker.iter().min().unwrap_or(&0),
            per_worker.iter().max().unwrap_or(&0)
        );
    }
}

async fn fencelock_client(hosts: &str) -> Side {
    Side::Fencelock(
        fencelock_redis::connect(&format!("redlock://{hosts}?prefix=bench-fl:"))
            .await
            .unwrap(),
        false,
    )
}

fn fixed(side: &Side) -> Side {
    match side {
        Side::Fencelock(locks, _) => Side::Fencelock(locks.clone(), true),
        Side::Rslock(_) => unreachable!(),
    }
}

fn rslock_client(urls: &[String], retry_delay: Option<Duration>) -> Side {
    let mut manager = LockManager::new(urls.to_vec());
    if let Some(delay) = retry_delay {
        manager.set_retry(3, delay);
    }
    Side::Rslock(manager)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let hosts = servers
        .iter()
        .map(RedisServer::addr)
        .collect::<Vec<_>>()
        .join(",");
    println!(
        "== Redlock over 3 local redis-server instances ({} CPUs)",
        std::thread::available_parallelism().map_or(0, usize::from)
    );

    // BENCH_ONLY=fencelock32|rslock32 runs just that 32-worker case (for profiling).
    if let Ok(only) = std::env::var("BENCH_ONLY") {
        let side = if only.starts_with("rslock") {
            rslock_client(&urls, None)
        } else {
            fencelock_client(&hosts).await
        };
        workers(&only, vec![side; 32], None).await;
        for server in &servers {
            let stats = std::process::Command::new("redis-cli")
                .args(["-p", &server.port().to_string(), "info", "commandstats"])
                .output()
                .expect("redis-cli");
            println!("{}", String::from_utf8_lossy(&stats.stdout));
        }
        return;
    }
    let fl = fencelock_client(&hosts).await;
    let rs = rslock_client(&urls, None);
    // Warm both up (connections, script cache).
    for _ in 0..50 {
        fl.once("warm").await;
        rs.once("warm").await;
    }
    println!("-- uncontended, one client, one name ({UNCONTENDED} acquire+release)");
    for round in ["", " (again)"] {
        uncontended(&format!("rslock{round}"), &rs, "u-rs").await;
        uncontended(&format!("fencelock{round}"), &fl, "u-fl").await;
        uncontended(
            &format!("fencelock, fixed lease{round}"),
            &fixed(&fl),
            "u-flf",
        )
        .await;
    }

    println!("-- 4 clients contending on one name ({RUN:?}; ops/s = grants/s)");
    for round in ["", " (again)"] {
        let rs4 = (0..4).map(|_| rslock_client(&urls, None)).collect();
        workers(&format!("rslock, retry 0..200ms{round}"), rs4, Some("c-rs")).await;
        let rs4 = (0..4)
            .map(|_| rslock_client(&urls, Some(Duration::from_millis(5))))
            .collect();
        workers(&format!("rslock, retry 0..5ms{round}"), rs4, Some("c-rs5")).await;
        let mut fl4 = Vec::new();
        for _ in 0..4 {
            fl4.push(fencelock_client(&hosts).await);
        }
        workers(&format!("fencelock{round}"), fl4, Some("c-fl")).await;
    }

    println!("-- 32 workers on distinct names, one shared client ({RUN:?})");
    for round in ["", " (again)"] {
        workers(&format!("rslock{round}"), vec![rs.clone(); 32], None).await;
        workers(&format!("fencelock{round}"), vec![fl.clone(); 32], None).await;
        workers(
            &format!("fencelock, fixed lease{round}"),
            vec![fixed(&fl); 32],
            None,
        )
        .await;
    }
}
