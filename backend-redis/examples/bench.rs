//! Benchmark: fencelock's Redis backend against a hand-written baseline
//! (`SET NX PX` + `EVALSHA` compare-and-delete, same client crate), on throwaway servers.
//!
//! ```text
//! cargo run --release -p fencelock-redis --example bench
//! ```
//!
//! Workloads: uncontended acquire+release (p50/p99, ops/s); 4 clients contending on one
//! name (handoffs/s); 32 workers on distinct names (locks/s). Single server and Redlock
//! over 3 instances.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_testkit::RedisServer;
use redis::aio::MultiplexedConnection;

const UNCONTENDED: usize = 3000;
const RUN: Duration = Duration::from_secs(3);

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

/// The hand-written lock of the seeds.
#[derive(Clone)]
struct Raw {
    conns: Vec<MultiplexedConnection>,
    script: Arc<redis::Script>,
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
    println!(
        "{what:<34} p50 {:>8.1?}  p99 {:>8.1?}  {:>8.0} ops/s",
        pct(&samples, 0.5),
        pct(&samples, 0.99),
        samples.len() as f64 / total.as_secs_f64()
    );
}

async fn uncontended_fencelock(what: &str, locks: &Arc<dyn DistributedLock>) {
    let mut samples = Vec::with_capacity(UNCONTENDED);
    let start = Instant::now();
    for _ in 0..UNCONTENDED {
        let t = Instant::now();
        let g = locks
            .acquire("bench-u", AcquireOptions::new())
            .await
            .unwrap();
        g.release().await.unwrap();
        samples.push(t.elapsed());
    }
    report(what, samples, start.elapsed());
}

async fn uncontended_raw(what: &str, raw: &Raw) {
    let mut samples = Vec::with_capacity(UNCONTENDED);
    let start = Instant::now();
    for i in 0..UNCONTENDED {
        let t = Instant::now();
        let value = format!("raw-{i}");
        assert!(raw.try_acquire("bench-raw-u", &value).await);
        raw.release("bench-raw-u", &value).await;
        samples.push(t.elapsed());
    }
    report(what, samples, start.elapsed());
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
    uncontended_raw("uncontended raw SET NX + EVALSHA", &raw).await;
    uncontended_fencelock("uncontended fencelock", &locks).await;
    uncontended_raw("uncontended raw (again)", &raw).await;
    uncontended_fencelock("uncontended fencelock (again)", &locks).await;
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
