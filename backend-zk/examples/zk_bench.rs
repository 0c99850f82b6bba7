//! Benchmark of the ZooKeeper backend against a raw baseline and zookeeper-client's own
//! lock recipe, on a throwaway local ZooKeeper server (fencelock-testkit).
//!
//! ```text
//! cargo run --release -p fencelock-zk --example zk_bench
//! ```
//!
//! Workloads (one acquire + release = one op), every one run side by side in one process,
//! alternating between the implementations (`fencelock_testkit::bench`), so drift of a
//! shared machine hits all alike:
//! - uncontended: one task, one name, sequential ops: 3 repeats of 5 interleaved rounds;
//!   p50/p99 pooled (hdrhistogram), ops/s, and per repeat each one's p50 over raw-3rt's;
//! - contended: 4 clients (4 sessions) on one name: ops/s, 3 interleaved repeats, with
//!   the hand-overs (grants to another client than the previous one) and the watch
//!   notifications the server fired on deletions per hand-over (`mntr`'s
//!   `node_deleted_watch_count`: one where only the next waiter watches its
//!   predecessor);
//! - distinct: 32 workers on one client, each on its own name: locks/s, 3 interleaved
//!   repeats, each one's rate over raw-3rt's per repeat.
//!
//! Client CPU per lock: this process's user + system CPU time (`bench::ProcessCpu`) over
//! each kind's uncontended rounds and over each 32-name run, divided by its ops. The
//! ZooKeeper server runs in its own JVM process, so this is the client's CPU alone
//! (the tokio runtime, zookeeper-client and the implementation under test). The last
//! lines give issue 17's ratios: medians over the repeats, each repeat's in parentheses.
//!
//! `ZK_BENCH_KINDS=fencelock,zkc-recipe` and `ZK_BENCH_WORKLOADS=distinct` narrow the run
//! (for profiling one case).
//!
//! Implementations:
//! - `fencelock`: `ZkLock::acquire` + `LockGuard::release` (create, list; delete);
//! - `raw-2rt`: create EPHEMERAL_SEQUENTIAL + delete by hand (the floor; no exclusion);
//! - `raw-3rt`: create + getChildren + delete (same round trips as fencelock's
//!   uncontended path, still no waiting);
//! - `zkc-recipe`: `zookeeper_client::Client::lock` with a Curator prefix + delete.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_testkit::ZkServer;
use fencelock_testkit::bench::{self, Histogram, Rounds, Run};
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};

const ROOT: &str = "/bench";
const REPEATS: usize = 3;
const ROUNDS: usize = 5;
const UNCONTENDED_OPS: usize = 150;
const CONTENDED_CLIENTS: usize = 4;
const CONTENDED_OPS: usize = 250;
const DISTINCT_WORKERS: usize = 32;
const DISTINCT_OPS: usize = 100;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Fencelock,
    Raw2,
    Raw3,
    Recipe,
}

const ALL: [Kind; 4] = [Kind::Raw2, Kind::Raw3, Kind::Recipe, Kind::Fencelock];

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Fencelock => "fencelock",
            Kind::Raw2 => "raw-2rt",
            Kind::Raw3 => "raw-3rt",
            Kind::Recipe => "zkc-recipe",
        }
    }
}

struct Contender {
    lock: ZkLock,
    client: zk::Client,
}

impl Contender {
    async fn new(server: &ZkServer, root: &str) -> Self {
        let config = ZkConfig::new(server.connect_string())
            .with_chroot(root)
            .unwrap();
        let lock = ZkLock::connect(config).await.unwrap();
        let client = lock.client().await.unwrap();
        Contender { lock, client }
    }

    async fn op(&self, kind: Kind, root: &str, name: &str) {
        self.op_then(kind, root, name, || {}).await;
    }

    /// One op, calling `held` while the lock is held.
    async fn op_then(&self, kind: Kind, root: &str, name: &str, held: impl FnOnce()) {
        let dir = format!("{root}/{name}");
        match kind {
            Kind::Fencelock => {
                let guard = self
                    .lock
                    .acquire(name, AcquireOptions::new())
                    .await
                    .unwrap();
                held();
                guard.release().await.unwrap();
            }
            Kind::Raw2 | Kind::Raw3 => {
                let prefix = format!("{dir}/_c_raw-lock-");
                let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
                let (_, seq) = match self.client.create(&prefix, &[], &options).await {
                    // fencelock's release removed the directory it left empty: make it
                    // again (once per round of another kind's ops), as a raw client would.
                    Err(zk::Error::NoNode) => {
                        let dir_options =
                            zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                        match self.client.mkdir(&dir, &dir_options).await {
                            Ok(()) | Err(zk::Error::NodeExists) => {}
                            Err(err) => panic!("{err}"),
                        }
                        self.client.create(&prefix, &[], &options).await
                    }
                    created => created,
                }
                .unwrap();
                if kind == Kind::Raw3 {
                    self.client.list_children(&dir).await.unwrap();
                }
                held();
                self.client
                    .delete(&format!("{prefix}{seq}"), None)
                    .await
                    .unwrap();
            }
            Kind::Recipe => {
                let options = zk::LockOptions::new(zk::Acls::anyone_all())
                    .with_ancestor_options(
                        zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all()),
                    )
                    .unwrap();
                let prefix = zk::LockPrefix::new_curator(&dir, "lock-").unwrap();
                let lock = self.client.lock(prefix, b"", options).await.unwrap();
                held();
                self.client.delete(lock.lock_path(), None).await.unwrap();
                // Deleted above; skip the recipe's own background delete.
                std::mem::forget(lock);
            }
        }
    }
}

/// `ops` sequential ops of `kind` on `name`: their latencies.
async fn worker(c: Arc<Contender>, kind: Kind, name: String, ops: usize) -> Histogram<u64> {
    bench::timed_ops(ops, || c.op(kind, ROOT, &name)).await
}

/// The watches ZooKeeper has fired on node deletions so far (`mntr`).
fn deletion_notifications(server: &ZkServer) -> Option<f64> {
    let mntr = server.four_letter_word("mntr").ok()?;
    mntr.lines().find_map(|line| {
        let (key, value) = line.split_once('\t')?;
        (key == "zk_sum_node_deleted_watch_count").then(|| value.trim().parse().ok())?
    })
}

/// Every client of `cs` does [`CONTENDED_OPS`] ops of `kind` on one name. Returns the
/// run, the hand-overs, and the deletion notifications per hand-over.
async fn contended(
    cs: &[Arc<Contender>],
    kind: Kind,
    server: &ZkServer,
) -> (Run, u64, Option<f64>) {
    let last = Arc::new(AtomicU64::new(u64::MAX));
    let handoffs = Arc::new(AtomicU64::new(0));
    let before = deletion_notifications(server);
    let workers = cs.iter().enumerate().map(|(i, c)| {
        let (c, last, handoffs) = (c.clone(), last.clone(), handoffs.clone());
        tokio::spawn(async move {
            let mut h = bench::histogram();
            for _ in 0..CONTENDED_OPS {
                let start = std::time::Instant::now();
                c.op_then(kind, ROOT, "contended", || {
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
    let run = bench::run_workers(workers.map(|w| async move { w.await? }))
        .await
        .expect("worker");
    let handoffs = handoffs.load(Ordering::Relaxed);
    let per_handoff = deletion_notifications(server)
        .zip(before)
        .map(|(after, before)| (after - before) / handoffs.max(1) as f64);
    (run, handoffs, per_handoff)
}

/// [`DISTINCT_WORKERS`] workers on `c`, each doing [`DISTINCT_OPS`] ops of `kind` on its
/// own name.
async fn distinct(c: &Arc<Contender>, kind: Kind) -> Run {
    let workers = (0..DISTINCT_WORKERS).map(|i| {
        let c = c.clone();
        tokio::spawn(worker(c, kind, format!("d{i}"), DISTINCT_OPS))
    });
    bench::run_workers(workers).await.expect("worker")
}

/// `median (each repeat)` of per-op CPU times, µs; `-` for a workload not run.
fn cpu_cell(values: &[f64]) -> String {
    if values.is_empty() {
        return "-".into();
    }
    let shown: Vec<String> = values.iter().map(|v| format!("{v:.1}")).collect();
    format!(
        "{:>6.1} ({})",
        bench::median(values.to_vec()),
        shown.join(" ")
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let wanted = |var: &str, item: &str| {
        std::env::var(var).map_or(true, |v| v.split(',').any(|w| w == item))
    };
    let kinds: Vec<Kind> = ALL
        .into_iter()
        .filter(|k| wanted("ZK_BENCH_KINDS", k.label()))
        .collect();
    let at = |kind: Kind| kinds.iter().position(|k| *k == kind);
    let server = ZkServer::start();
    let main_client = Arc::new(Contender::new(&server, ROOT).await);
    // Create the lock directories up front so every implementation finds them.
    for kind in ALL {
        main_client
            .op(Kind::Fencelock, ROOT, &format!("warm-{}", kind.label()))
            .await;
    }
    for i in 0..DISTINCT_WORKERS {
        main_client
            .op(Kind::Fencelock, ROOT, &format!("d{i}"))
            .await;
    }
    main_client.op(Kind::Fencelock, ROOT, "contended").await;
    main_client.op(Kind::Fencelock, ROOT, "uncontended").await;

    println!("# ZooKeeper 3.8 standalone on loopback, tickTime=500, release build");
    let mut cpu_uncontended: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let mut cpu_distinct: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let mut uncontended_p50: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let mut distinct_rates: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    if wanted("ZK_BENCH_WORKLOADS", "uncontended") {
        let plan = Rounds::new(REPEATS, ROUNDS, UNCONTENDED_OPS, 200);
        println!("uncontended ({plan})");
        let measured = bench::interleave(&kinds, plan, |kind| {
            main_client.op(kind, ROOT, "uncontended")
        })
        .await;
        println!(
            "{}",
            bench::latency_lines(&measured, at(Kind::Raw3), Kind::label)
        );
        for (i, m) in measured.into_iter().enumerate() {
            cpu_uncontended[i] = m.repeat_cpu_per_op;
            uncontended_p50[i] = m.repeat_p50;
        }
    }

    if wanted("ZK_BENCH_WORKLOADS", "contended") {
        let mut contenders = Vec::new();
        for _ in 0..CONTENDED_CLIENTS {
            contenders.push(Arc::new(Contender::new(&server, ROOT).await));
        }
        let these: Vec<Kind> = [Kind::Recipe, Kind::Fencelock]
            .into_iter()
            .filter(|k| kinds.contains(k))
            .collect();
        println!(
            "contended-4 ({CONTENDED_CLIENTS} clients x {CONTENDED_OPS} ops on one name, {REPEATS} interleaved repeats)"
        );
        let results = bench::interleave_runs(&these, REPEATS, |kind, _| {
            contended(&contenders, kind, &server)
        })
        .await;
        let runs: Vec<Vec<Run>> = results
            .iter()
            .map(|rs| rs.iter().map(|r| r.0.clone()).collect())
            .collect();
        let recipe = these.iter().position(|k| *k == Kind::Recipe);
        println!(
            "{}",
            bench::rate_lines(&these, &runs, recipe, "ops/s", Kind::label,)
        );
        for (kind, rs) in these.iter().zip(&results) {
            let handoffs: Vec<String> = rs.iter().map(|r| r.1.to_string()).collect();
            let notes: Vec<f64> = rs.iter().filter_map(|r| r.2).collect();
            println!(
                "  {:<11} hand-overs {}  deletion notifications per hand-over {}",
                kind.label(),
                handoffs.join(" "),
                if notes.is_empty() {
                    "-".to_owned()
                } else {
                    bench::ratios(&notes)
                }
            );
        }
    }

    if wanted("ZK_BENCH_WORKLOADS", "distinct") {
        println!(
            "distinct-32 ({DISTINCT_WORKERS} workers x {DISTINCT_OPS} ops, own names, one client, {REPEATS} interleaved repeats)"
        );
        let runs =
            bench::interleave_runs(&kinds, REPEATS, |kind, _| distinct(&main_client, kind)).await;
        println!(
            "{}",
            bench::rate_lines(&kinds, &runs, at(Kind::Raw3), "locks/s", Kind::label,)
        );
        for (i, runs) in runs.iter().enumerate() {
            cpu_distinct[i] = runs.iter().map(Run::cpu_per_op).collect();
            distinct_rates[i] = runs.iter().map(Run::rate).collect();
        }
    }

    println!(
        "client CPU per lock (µs of this process's user+system time; median of {REPEATS} (each repeat))"
    );
    println!("  {:<11} {:<28} distinct-32", "", "uncontended");
    for (i, kind) in kinds.iter().enumerate() {
        println!(
            "  {:<11} {:<28} {}",
            kind.label(),
            cpu_cell(&cpu_uncontended[i]),
            cpu_cell(&cpu_distinct[i])
        );
    }

    // Issue 17's targets: 32 names >= 1.0x raw-3rt, uncontended p50 <= 1.05x raw-3rt,
    // client CPU per lock <= zookeeper-client's.
    let Some(fencelock) = at(Kind::Fencelock) else {
        return;
    };
    let ratio = |what: &str, values: &[Vec<f64>], floor: Kind| {
        if let Some(floor) = at(floor).filter(|&f| !values[f].is_empty()) {
            let r = bench::over(&values[fencelock], &values[floor]);
            if !r.is_empty() {
                println!(
                    "{what}: fencelock / {} {}",
                    kinds[floor].label(),
                    bench::ratios(&r)
                );
            }
        }
    };
    ratio("32 names", &distinct_rates, Kind::Raw3);
    ratio("uncontended p50", &uncontended_p50, Kind::Raw3);
    for (what, cpu) in [
        ("client CPU per lock, uncontended", &cpu_uncontended),
        ("client CPU per lock, 32 names", &cpu_distinct),
    ] {
        ratio(what, cpu, Kind::Recipe);
        ratio(what, cpu, Kind::Raw3);
    }
}
