//! Benchmark of the etcd backend against the raw floor and etcd-client's own lock API, side
//! by side in one run, on a throwaway local etcd (fencelock-testkit) or `ETCD_ENDPOINT`.
//!
//! ```text
//! cargo run --release -p fencelock-etcd --example etcd_bench
//! ```
//!
//! Workloads (one acquire + release = one op):
//! - uncontended: one task, one name, sequential ops: p50, p99, ops/s;
//! - contended: 4 clients (4 connections and sessions) on one name: handoffs/s;
//! - distinct: 32 workers on one client, each on its own name: locks/s (three interleaved
//!   rounds).
//!
//! Implementations:
//! - `fencelock`: `EtcdLock::acquire` + `LockGuard::release` (one txn; one txn);
//! - `raw`: the floor by hand on a pre-granted lease: one put-if-absent txn + one delete
//!   (no waiting, no incarnation check; contended ops spin on the txn);
//! - `etcd-lock`: etcd-client's `lock()` / `unlock()` (server-side v3lock) on a pre-granted,
//!   kept-alive lease.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_etcd::{EtcdConfig, EtcdLock};

const UNCONTENDED_OPS: usize = 2_000;
const CONTENDED_CLIENTS: usize = 4;
const CONTENDED_OPS: usize = 250;
const DISTINCT_WORKERS: usize = 32;
const DISTINCT_OPS: usize = 150;

#[derive(Clone, Copy)]
enum Kind {
    Fencelock,
    Raw,
    EtcdLock,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Fencelock => "fencelock",
            Kind::Raw => "raw",
            Kind::EtcdLock => "etcd-lock",
        }
    }
}

/// One client connection with what each implementation needs.
struct Contender {
    lock: EtcdLock,
    client: Client,
    lease: i64,
}

impl Contender {
    async fn new(endpoint: &str) -> Self {
        let config = EtcdConfig {
            endpoints: vec![endpoint.to_owned()],
            prefix: "bench".into(),
            ..EtcdConfig::default()
        };
        let lock = EtcdLock::connect(config).await.expect("connect");
        let client = Client::connect([endpoint], None)
            .await
            .expect("connect raw");
        let lease = client
            .lease_client()
            .grant(60, None)
            .await
            .expect("grant")
            .id();
        let (mut keeper, mut stream) = client
            .lease_client()
            .keep_alive(lease)
            .await
            .expect("keepalive");
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(20)).await;
                if keeper.keep_alive().await.is_err() || stream.message().await.is_err() {
                    return;
                }
            }
        });
        Contender {
            lock,
            client,
            lease,
        }
    }

    async fn op(&self, kind: Kind, name: &str) {
        match kind {
            Kind::Fencelock => {
                let guard = self
                    .lock
                    .acquire(name, AcquireOptions::new())
                    .await
                    .expect("acquire");
                guard.release().await.expect("release");
            }
            Kind::Raw => {
                let key = format!("raw/{name}/{:x}", self.lease);
                let txn = Txn::new()
                    .when([
                        Compare::create_revision(format!("raw/{name}/"), CompareOp::Equal, 0)
                            .with_prefix(),
                    ])
                    .and_then([TxnOp::put(
                        key.as_str(),
                        "",
                        Some(PutOptions::new().with_lease(self.lease)),
                    )]);
                let mut kv = self.client.kv_client();
                while !kv.txn(txn.clone()).await.expect("txn").succeeded() {
                    tokio::task::yield_now().await;
                }
                kv.delete(key, None).await.expect("delete");
            }
            Kind::EtcdLock => {
                let mut lock = self.client.lock_client();
                let options = LockOptions::new().with_lease(self.lease);
                let granted = lock
                    .lock(format!("v3lock/{name}"), Some(options))
                    .await
                    .expect("lock");
                lock.unlock(granted.key()).await.expect("unlock");
            }
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn uncontended(c: &Contender, kind: Kind) -> (Duration, Duration, f64) {
    for _ in 0..100 {
        c.op(kind, "uncontended").await;
    }
    let mut samples = Vec::with_capacity(UNCONTENDED_OPS);
    let start = Instant::now();
    for _ in 0..UNCONTENDED_OPS {
        let t = Instant::now();
        c.op(kind, "uncontended").await;
        samples.push(t.elapsed());
    }
    let ops = UNCONTENDED_OPS as f64 / start.elapsed().as_secs_f64();
    samples.sort();
    (percentile(&samples, 0.5), percentile(&samples, 0.99), ops)
}

async fn contended(cs: &[Arc<Contender>], kind: Kind) -> f64 {
    let start = Instant::now();
    let tasks: Vec<_> = cs
        .iter()
        .map(|c| {
            let c = c.clone();
            tokio::spawn(async move {
                for _ in 0..CONTENDED_OPS {
                    c.op(kind, "contended").await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (cs.len() * CONTENDED_OPS) as f64 / start.elapsed().as_secs_f64()
}

async fn distinct(c: &Arc<Contender>, kind: Kind) -> f64 {
    let start = Instant::now();
    let tasks: Vec<_> = (0..DISTINCT_WORKERS)
        .map(|w| {
            let c = c.clone();
            tokio::spawn(async move {
                let name = format!("distinct-{w}");
                for _ in 0..DISTINCT_OPS {
                    c.op(kind, &name).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (DISTINCT_WORKERS * DISTINCT_OPS) as f64 / start.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let server;
    let endpoint = match std::env::var("ETCD_ENDPOINT") {
        Ok(endpoint) => endpoint,
        Err(_) => {
            server = fencelock_testkit::EtcdServer::start();
            server.endpoint()
        }
    };
    let mut contenders = Vec::new();
    for _ in 0..CONTENDED_CLIENTS {
        contenders.push(Arc::new(Contender::new(&endpoint).await));
    }
    // ETCD_BENCH_KINDS=fencelock,raw and ETCD_BENCH_WORKLOADS=distinct narrow the run
    // (for profiling one case).
    let wanted = |var: &str, item: &str| {
        std::env::var(var).map_or(true, |v| v.split(',').any(|w| w == item))
    };
    let kinds: Vec<Kind> = [Kind::Raw, Kind::Fencelock, Kind::EtcdLock]
        .into_iter()
        .filter(|k| wanted("ETCD_BENCH_KINDS", k.label()))
        .collect();
    let kinds = &kinds[..];
    if wanted("ETCD_BENCH_WORKLOADS", "uncontended") {
        println!("uncontended ({UNCONTENDED_OPS} ops, interleaved rounds)");
        for round in 0..3 {
            for &kind in kinds {
                let (p50, p99, ops) = uncontended(&contenders[0], kind).await;
                println!(
                    "  round {round} {:<10} p50 {:>6} µs  p99 {:>6} µs  {ops:>7.0} ops/s",
                    kind.label(),
                    p50.as_micros(),
                    p99.as_micros()
                );
            }
        }
    }
    if wanted("ETCD_BENCH_WORKLOADS", "contended") {
        println!("contended ({CONTENDED_CLIENTS} clients x {CONTENDED_OPS} ops on one name)");
        for &kind in kinds {
            println!(
                "  {:<10} {:>7.0} handoffs/s",
                kind.label(),
                contended(&contenders, kind).await
            );
        }
    }
    if wanted("ETCD_BENCH_WORKLOADS", "distinct") {
        println!(
            "distinct ({DISTINCT_WORKERS} workers x {DISTINCT_OPS} ops, own names, one client)"
        );
        for round in 0..3 {
            for &kind in kinds {
                println!(
                    "  round {round} {:<10} {:>7.0} locks/s",
                    kind.label(),
                    distinct(&contenders[0], kind).await
                );
            }
        }
    }
}
