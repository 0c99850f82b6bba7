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
//!   p99 (hdrhistogram), ops/s, and each one's p50 over raw's in each round, with the
//!   median over rounds;
//! - contended: 4 clients (4 connections and sessions) on one name for 3 s, three
//!   interleaved repeats: ops/s, hand-overs/s (grants to another client than the
//!   previous grant) and fairness (most / fewest grants of one client; FIFO waiting
//!   keeps it near 1); on the throwaway server also the watch events etcd sent per
//!   hand-over (`etcd_debugging_mvcc_events_total`: the notifications a hand-over
//!   costs the server, one where only the next waiter watches its predecessor);
//! - distinct: 32 workers on one client, each on its own name: locks/s, the median of
//!   three interleaved rounds, and each one's rate over raw's per round.
//!
//! The interleaving, percentiles and ratios are `fencelock_testkit::bench`'s.
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, LockOptions, PutOptions, Txn, TxnOp};
use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_etcd::{EtcdConfig, EtcdLock};
use fencelock_testkit::bench::{self, Rounds, Run};

const UNCONTENDED_ROUNDS: usize = 10;
const UNCONTENDED_OPS: usize = 300;
const CONTENDED_CLIENTS: usize = 4;
const CONTENDED_RUN: Duration = Duration::from_secs(3);
const CONTENDED_REPEATS: usize = 3;
const DISTINCT_WORKERS: usize = 32;
const DISTINCT_OPS: usize = 150;
const DISTINCT_ROUNDS: usize = 3;

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
        self.op_then(kind, name, || {}).await;
    }

    /// One op, calling `held` while the lock is held.
    async fn op_then(&self, kind: Kind, name: &str, held: impl FnOnce()) {
        match kind {
            Kind::Fencelock => {
                let guard = self
                    .lock
                    .acquire(name, AcquireOptions::new())
                    .await
                    .expect("acquire");
                held();
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
                held();
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
                held();
                lock.unlock(granted.key()).await.expect("unlock");
            }
        }
    }
}

/// One contended run: the ops, the hand-overs, each client's grants, and the watch
/// events the server sent meanwhile (when it is the bench's own).
struct Contended {
    run: Run,
    handoffs: u64,
    per_client: Vec<u64>,
    events: Option<f64>,
}

/// The watch events `server` has sent so far.
fn events_sent(server: Option<&fencelock_testkit::EtcdServer>) -> Option<f64> {
    server?.metric("etcd_debugging_mvcc_events_total")
}

/// Every client of `cs` does ops on one name for [`CONTENDED_RUN`].
async fn contended(
    cs: &[Arc<Contender>],
    kind: Kind,
    repeat: usize,
    server: Option<&fencelock_testkit::EtcdServer>,
) -> Contended {
    let events_before = events_sent(server);
    let name = format!("contended-{repeat}");
    let last = Arc::new(AtomicU64::new(u64::MAX));
    let handoffs = Arc::new(AtomicU64::new(0));
    let deadline = tokio::time::Instant::now() + CONTENDED_RUN;
    let workers = cs.iter().enumerate().map(|(i, c)| {
        let (c, name, last, handoffs) = (c.clone(), name.clone(), last.clone(), handoffs.clone());
        tokio::spawn(async move {
            let mut h = bench::histogram();
            while tokio::time::Instant::now() < deadline {
                let start = std::time::Instant::now();
                c.op_then(kind, &name, || {
                    if last.swap(i as u64, Ordering::Relaxed) != i as u64 {
                        handoffs.fetch_add(1, Ordering::Relaxed);
                    }
                })
                .await;
                bench::record(&mut h, start.elapsed());
            }
            Ok::<_, tokio::task::JoinError>(h)
        })
    });
    let workers = workers.map(|w| async move { w.await? });
    let (elapsed, histograms) = bench::timed_join(workers).await.expect("worker");
    let per_client: Vec<u64> = histograms.iter().map(|h| h.len()).collect();
    let mut pooled = bench::histogram();
    for h in &histograms {
        bench::merge(&mut pooled, h);
    }
    let run = Run {
        histogram: pooled,
        elapsed,
        cpu: Duration::ZERO,
    };
    let events = events_sent(server)
        .zip(events_before)
        .map(|(after, before)| after - before);
    Contended {
        run,
        handoffs: handoffs.load(Ordering::Relaxed),
        per_client,
        events,
    }
}

/// [`DISTINCT_WORKERS`] workers on `c`, each doing [`DISTINCT_OPS`] ops on its own name.
async fn distinct(c: &Arc<Contender>, kind: Kind) -> Run {
    let workers = (0..DISTINCT_WORKERS).map(|w| {
        let c = c.clone();
        let name = format!("distinct-{w}");
        tokio::spawn(async move { bench::timed_ops(DISTINCT_OPS, || c.op(kind, &name)).await })
    });
    bench::run_workers(workers).await.expect("worker")
}

#[tokio::main]
async fn main() {
    let server = std::env::var("ETCD_ENDPOINT")
        .is_err()
        .then(fencelock_testkit::EtcdServer::start);
    let endpoint = match &server {
        Some(server) => server.endpoint(),
        None => std::env::var("ETCD_ENDPOINT").expect("ETCD_ENDPOINT"),
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
    let raw = kinds.iter().position(|k| *k == Kind::Raw);
    if wanted("ETCD_BENCH_WORKLOADS", "uncontended") {
        println!(
            "uncontended ({UNCONTENDED_ROUNDS} interleaved rounds of {UNCONTENDED_OPS} ops per kind)"
        );
        // Each round a repeat of its own: one p50 ratio to raw's per round.
        let plan = Rounds::new(UNCONTENDED_ROUNDS, 1, UNCONTENDED_OPS, 100);
        let c = &contenders[0];
        let measured = bench::interleave(kinds, plan, |kind| c.op(kind, "uncontended")).await;
        println!("{}", bench::latency_lines(&measured, raw, Kind::label));
    }
    if wanted("ETCD_BENCH_WORKLOADS", "contended") {
        println!(
            "contended ({CONTENDED_CLIENTS} clients on one name, {CONTENDED_RUN:?} each, {CONTENDED_REPEATS} interleaved repeats)"
        );
        let results = bench::interleave_runs(kinds, CONTENDED_REPEATS, |kind, repeat| {
            contended(&contenders, kind, repeat, server.as_ref())
        })
        .await;
        let runs: Vec<Vec<Run>> = results
            .iter()
            .map(|rs| rs.iter().map(|r| r.run.clone()).collect())
            .collect();
        println!(
            "{}",
            bench::rate_lines(kinds, &runs, None, "ops/s", Kind::label)
        );
        for (kind, rs) in kinds.iter().zip(&results) {
            let handoffs: Vec<f64> = rs
                .iter()
                .map(|r| r.handoffs as f64 / r.run.elapsed.as_secs_f64())
                .collect();
            let fairness: Vec<f64> = rs
                .iter()
                .map(|r| {
                    let max = r.per_client.iter().copied().max().unwrap_or(0);
                    let min = r.per_client.iter().copied().min().unwrap_or(0);
                    max as f64 / min.max(1) as f64
                })
                .collect();
            let each: Vec<String> = handoffs.iter().map(|r| format!("{r:.0}")).collect();
            let per_handoff: Vec<f64> = rs
                .iter()
                .filter_map(|r| Some(r.events? / r.handoffs.max(1) as f64))
                .collect();
            let events = if per_handoff.is_empty() {
                String::new()
            } else {
                format!("  watch events/hand-over {}", bench::ratios(&per_handoff))
            };
            println!(
                "  {:<11} hand-overs/s median {:.0} ({})  fairness max/min {}{events}",
                kind.label(),
                bench::median(handoffs.clone()),
                each.join(" "),
                bench::ratios(&fairness),
            );
        }
    }
    if wanted("ETCD_BENCH_WORKLOADS", "distinct") {
        println!(
            "distinct ({DISTINCT_WORKERS} workers x {DISTINCT_OPS} ops, own names, one client, {DISTINCT_ROUNDS} interleaved rounds)"
        );
        let runs = bench::interleave_runs(kinds, DISTINCT_ROUNDS, |kind, _| {
            distinct(&contenders[0], kind)
        })
        .await;
        println!(
            "{}",
            bench::rate_lines(kinds, &runs, raw, "locks/s", Kind::label)
        );
    }
}
