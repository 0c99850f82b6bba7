//! Benchmark: fencelock's Redis backend against a hand-written baseline
//! (`SET NX PX` + `EVALSHA` compare-and-delete, same client crate), on throwaway servers.
//!
//! ```text
//! cargo run --release -p fencelock-redis --example bench
//! ```
//!
//! Workloads: uncontended acquire+release, in twenty short rounds alternating between raw
//! and fencelock (pooled p50/p99, ops/s, and the median over rounds of the p50 ratio); 4
//! clients contending on one name (handoffs/s); 32 workers on distinct names (locks/s).
//! Single server and Redlock over 3 instances. `BENCH_UNCONTENDED_ONLY=1` runs only the
//! single server's uncontended case; `BENCH_QUANTILES=1` also prints the 5th to 90th
//! percentiles of each uncontended kind (on a VM the latencies are a mix of round trips
//! whose threads were still awake and ones that had to be woken).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_testkit::RedisServer;
use redis::aio::MultiplexedConnection;

const UNCONTENDED_ROUNDS: usize = 20;
const UNCONTENDED_OPS: usize = 500;
const RUN: Duration = Duration::from_secs(3);

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

/// Acquire as one script doing only `SET NX PX`: the floor for any acquire that must be a
/// script (as fencelock's, which issues the token in the same script).
const SCRIPTED_SET: &str = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])";

/// The usual hand-written Redis lock: `SET key random NX PX`, compare-and-delete.
#[derive(Clone)]
struct Raw {
    conns: Vec<MultiplexedConnection>,
    script: Arc<redis::Script>,
    scripted_set: Arc<redis::Script>,
}

impl Raw {
    async fn new(urls: &[String]) -> Self {
        let mut conns = Vec::new();
        for url in urls {
            conns.push(
                redis::Client::open(url.as_str())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap(),
            );
        }
        Raw {
            conns,
            script: Arc::new(redis::Script::new(RELEASE)),
            scripted_set: Arc::new(redis::Script::new(SCRIPTED_SET)),
        }
    }

    async fn try_acquire(&self, key: &str, value: &str) -> bool {
        let mut ok = 0;
        for conn in &self.conns {
            let r: Option<String> = redis::cmd("SET")
                .arg(key)
                .arg(value)
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            ok += usize::from(r.is_some());
        }
        ok > self.conns.len() / 2
    }

    /// [`Raw::try_acquire`] on the first server, with the `SET NX PX` inside a script.
    async fn try_acquire_scripted(&self, key: &str, value: &str) -> bool {
        let r: Option<String> = self
            .scripted_set
            .key(key)
            .arg(value)
            .arg(30_000)
            .invoke_async(&mut self.conns[0].clone())
            .await
            .unwrap();
        r.is_some()
    }

    async fn release(&self, key: &str, value: &str) {
        for conn in &self.conns {
            let _: i64 = self
                .script
                .key(key)
                .arg(value)
                .invoke_async(&mut conn.clone())
                .await
                .unwrap();
        }
    }

    /// Spins with 1 ms sleeps, as hand-written locks do.
    async fn acquire(&self, key: &str, value: &str) {
        while !self.try_acquire(key, value).await {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p) as usize]
}

fn report(what: &str, mut samples: Vec<Duration>, total: Duration) {
    samples.sort();
    if std::env::var_os("BENCH_QUANTILES").is_some() {
        let q: Vec<String> = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
            .iter()
            .map(|p| format!("{:.0}", pct(&samples, *p).as_secs_f64() * 1e6))
            .collect();
        println!("{what}: {}", q.join(" "));
    }
    println!(
        "{what:<34} p50 {:>8.1?}  p99 {:>8.1?}  {:>8.0} ops/s",
        pct(&samples, 0.5),
        pct(&samples, 0.99),
        samples.len() as f64 / total.as_secs_f64()
    );
}

/// One round of [`UNCONTENDED_OPS`] sequential acquire+release on fencelock.
async fn round_fencelock(locks: &Arc<dyn DistributedLock>) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(UNCONTENDED_OPS);
    for _ in 0..UNCONTENDED_OPS {
        let t = Instant::now();
        let g = locks
            .acquire("bench-u", AcquireOptions::new())
            .await
            .unwrap();
        g.release().await.unwrap();
        samples.push(t.elapsed());
    }
    samples
}

/// One round of [`UNCONTENDED_OPS`] sequential acquire+release by hand (with the
/// acquire inside a script if `scripted`).
async fn round_raw(raw: &Raw, scripted: bool) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(UNCONTENDED_OPS);
    for i in 0..UNCONTENDED_OPS {
        let t = Instant::now();
        let value = format!("raw-{i}");
        let granted = if scripted {
            raw.try_acquire_scripted("bench-raw-u", &value).await
        } else {
            raw.try_acquire("bench-raw-u", &value).await
        };
        assert!(granted);
        raw.release("bench-raw-u", &value).await;
        samples.push(t.elapsed());
    }
    samples
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// [`UNCONTENDED_ROUNDS`] short rounds, alternating raw, raw with a scripted acquire (a
/// single server only) and fencelock, so drift on a shared machine hits all alike: pooled
/// percentiles, and the median over rounds of each one's p50 over raw's in that round.
async fn uncontended(raw: &Raw, locks: &Arc<dyn DistributedLock>, single: bool) {
    round_raw(raw, false).await;
    round_fencelock(locks).await;
    let labels = [
        "uncontended raw SET NX + EVALSHA",
        "uncontended raw, acquire scripted",
        "uncontended fencelock",
    ];
    let mut pooled: [Vec<Duration>; 3] = Default::default();
    let mut time = [Duration::ZERO; 3];
    let mut ratios: [Vec<f64>; 3] = Default::default();
    for _ in 0..UNCONTENDED_ROUNDS {
        let mut p50 = [0.0; 3];
        for kind in 0..labels.len() {
            if kind == 1 && !single {
                continue;
            }
            let start = Instant::now();
            let mut samples = match kind {
                0 => round_raw(raw, false).await,
                1 => round_raw(raw, true).await,
                _ => round_fencelock(locks).await,
            };
            time[kind] += start.elapsed();
            samples.sort();
            p50[kind] = pct(&samples, 0.5).as_secs_f64();
            pooled[kind].extend(samples);
        }
        for kind in 0..3 {
            ratios[kind].push(p50[kind] / p50[0]);
        }
    }
    for (kind, label) in labels.iter().enumerate() {
        if pooled[kind].is_empty() {
            continue;
        }
        report(label, std::mem::take(&mut pooled[kind]), time[kind]);
        println!(
            "{:<34} p50 / raw's, median of {UNCONTENDED_ROUNDS} rounds: {:.3}",
            "",
            median(std::mem::take(&mut ratios[kind]))
        );
    }
}

async fn contended(what: &str, workers: usize, same_name: bool, lock: impl Fn(usize) -> Worker) {
    let count = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + RUN;
    let tasks: Vec<_> = (0..workers)
        .map(|i| {
            let (count, work) = (count.clone(), lock(i));
            let name = if same_name {
                "bench-c".to_string()
            } else {
                format!("bench-d-{i}")
            };
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < deadline {
                    work.once(&name, n).await;
                    n += 1;
                    count.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    println!(
        "{what:<34} {:>8.0} locks/s",
        count.load(Ordering::Relaxed) as f64 / RUN.as_secs_f64()
    );
}

enum Worker {
    Fencelock(Arc<dyn DistributedLock>),
    Raw(Raw, usize),
}

impl Worker {
    async fn once(&self, name: &str, n: u64) {
        match self {
            Worker::Fencelock(locks) => {
                let g = locks.acquire(name, AcquireOptions::new()).await.unwrap();
                g.release().await.unwrap();
            }
            Worker::Raw(raw, id) => {
                let key = format!("raw:{name}");
                let value = format!("{id}-{n}");
                raw.acquire(&key, &value).await;
                raw.release(&key, &value).await;
            }
        }
    }
}

async fn suite(label: &str, urls: Vec<String>, fencelock_url: String) {
    let locks = fencelock_redis::connect(&fencelock_url).await.unwrap();
    let raw = Raw::new(&urls).await;
    println!("== {label}");
    uncontended(&raw, &locks, urls.len() == 1).await;
    if std::env::var_os("BENCH_UNCONTENDED_ONLY").is_some() {
        return;
    }
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(fencelock_redis::connect(&fencelock_url).await.unwrap());
    }
    contended("4 clients, one name: raw spin", 4, true, |_| {
        Worker::Raw(raw.clone(), fastrand::usize(..))
    })
    .await;
    contended("4 clients, one name: fencelock", 4, true, |i| {
        Worker::Fencelock(clients[i].clone())
    })
    .await;
    contended("32 workers, own names: raw", 32, false, |i| {
        Worker::Raw(raw.clone(), i)
    })
    .await;
    contended("32 workers, own names: fencelock", 32, false, |_| {
        Worker::Fencelock(locks.clone())
    })
    .await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let single = RedisServer::start();
    suite("single server", vec![single.url()], single.url()).await;
    drop(single);
    if std::env::var_os("BENCH_UNCONTENDED_ONLY").is_some() {
        return;
    }
    let three: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = three.iter().map(RedisServer::url).collect();
    let hosts: Vec<String> = three.iter().map(RedisServer::addr).collect();
    suite(
        "redlock over 3 instances (raw = sequential SET NX on each)",
        urls,
        format!("redlock://{}", hosts.join(",")),
    )
    .await;
}
