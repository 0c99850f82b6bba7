//! Benchmark of the etcd backend against the raw floor and etcd-client's own lock API, side
//! by side in one run, on a throwaway local etcd (fencelock-testkit) or `ETCD_ENDPOINT`.
//!
//! ```text
//! cargo run --release -p fencelock-etcd --example etcd_bench
//! ```
//!
//! Workloads (one acquire + release = one op):
//! - uncontended: one task, one name, sequential ops, in ten short rounds interleaved
//!   across the implementations (so drift of a shared machine hits all alike): pooled p50,
//!   p99, ops/s, and the median over rounds of each one's p50 over raw's in that round;
//! - contended: 4 clients (4 connections and sessions) on one name: handoffs/s;
//! - distinct: 32 workers on one client, each on its own name: locks/s (three interleaved
//!   rounds).
//!
//! Implementations:
//! - `fencelock`: `EtcdLock::acquire` + `LockGuard::release` (one txn; one txn; concurrent
//!   ones on distinct names share transactions);
//! - `raw`: the floor by hand on a pre-granted lease: one put-if-absent txn + one delete
//!   (no waiting, no incarnation check; contended ops spin on the txn);
//! - `raw-checked`: the same, but released by the incarnation-checked delete (compare the
//!   create revision, then delete) that fencelock's release must make (etcd #22082): the
//!   floor for a release that can never delete a newer holder's key;
//! - `etcd-lock`: etcd-client's `lock()` / `unlock()` (server-side v3lock) on a pre-granted,
//!   kept-alive lease.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_etcd::{EtcdConfig, EtcdLock};

const UNCONTENDED_ROUNDS: usize = 10;
const UNCONTENDED_OPS: usize = 300;
const CONTENDED_CLIENTS: usize = 4;
const CONTENDED_OPS: usize = 250;
const DISTINCT_WORKERS: usize = 32;
const DISTINCT_OPS: usize = 150;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Fencelock,
    Raw,
    RawChecked,
    EtcdLock,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Fencelock => "fencelock",
            Kind::Raw => "raw",
            Kind::RawChecked => "raw-checked",
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
            Kind::Raw | Kind::RawChecked => {
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
                let created = loop {
                    let response = kv.txn(txn.clone()).await.expect("txn");
                    if response.succeeded() {
                        break response.header().map_or(0, |h| h.revision());
                    }
                    tokio::task::yield_now().await;
                };
                if kind == Kind::RawChecked {
                    // The incarnation check fencelock's release must make (etcd #22082).
                    let release = Txn::new()
                        .when([Compare::create_revision(
                            key.as_str(),
                            CompareOp::Equal,
                            created,
                        )])
                        .and_then([TxnOp::delete(key.as_str(), None)]);
                    kv.txn(release).await.expect("release txn");
                } else {
                    kv.delete(key, None).await.expect("delete");
                }
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

/// One round of [`UNCONTENDED_OPS`] sequential ops: the samples and the elapsed time.
async fn uncontended(c: &Contender, kind: Kind) -> (Vec<Duration>, Duration) {
    let mut samples = Vec::with_capacity(UNCONTENDED_OPS);
    let start = Instant::now();
    for _ in 0..UNCONTENDED_OPS {
        let t = Instant::now();
        c.op(kind, "uncontended").await;
        samples.push(t.elapsed());
    }
    let elapsed = start.elapsed();
    (samples, elapsed)
}

fn p50(samples: &[Duration]) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    percentile(&sorted, 0.5)
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
    let kinds: Vec<Kind> = [Kind::Raw, Kind::RawChecked, Kind::Fencelock, Kind::EtcdLock]
        .into_iter()
        .filter(|k| wanted("ETCD_BENCH_KINDS", k.label()))
        .collect();
    let kinds = &kinds[..];
    if wanted("ETCD_BENCH_WORKLOADS", "uncontended") {
        println!(
            "uncontended ({UNCONTENDED_ROUNDS} interleaved rounds of {UNCONTENDED_OPS} ops per kind)"
        );
        for &kind in kinds {
            for _ in 0..100 {
                contenders[0].op(kind, "uncontended").await;
            }
        }
        let mut pooled: Vec<Vec<Duration>> = vec![Vec::new(); kinds.len()];
        let mut elapsed = vec![Duration::ZERO; kinds.len()];
        let mut round_p50: Vec<Vec<Duration>> = vec![Vec::new(); kinds.len()];
        for _ in 0..UNCONTENDED_ROUNDS {
            for (i, &kind) in kinds.iter().enumerate() {
                let (samples, took) = uncontended(&contenders[0], kind).await;
                round_p50[i].push(p50(&samples));
                pooled[i].extend(samples);
                elapsed[i] += took;
            }
        }
        let raw = kinds.iter().position(|k| *k == Kind::Raw);
        for (i, &kind) in kinds.iter().enumerate() {
            pooled[i].sort();
            let ratio = raw.map_or(String::new(), |r| {
                // The median over rounds of this kind's p50 over raw's p50 in the same round.
                let mut ratios: Vec<f64> = round_p50[i]
                    .iter()
                    .zip(&round_p50[r])
                    .map(|(mine, raw)| mine.as_secs_f64() / raw.as_secs_f64())
                    .collect();
                ratios.sort_by(f64::total_cmp);
                format!("  p50/raw {:.3}", ratios[ratios.len() / 2])
            });
            println!(
                "  {:<11} p50 {:>5} µs  p99 {:>5} µs  {:>6.0} ops/s{ratio}",
                kind.label(),
                percentile(&pooled[i], 0.5).as_micros(),
                percentile(&pooled[i], 0.99).as_micros(),
                pooled[i].len() as f64 / elapsed[i].as_secs_f64(),
            );
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
