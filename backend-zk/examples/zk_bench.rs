//! Benchmark of the ZooKeeper backend against a raw baseline and zookeeper-client's own
//! lock recipe, on a throwaway local ZooKeeper server (fencelock-testkit).
//!
//! ```text
//! cargo run --release -p fencelock-zk --example zk_bench
//! ```
//!
//! Workloads (one acquire + release = one op):
//! - uncontended: one task, one name, sequential ops (p50/p99 and ops/s);
//! - contended: 4 clients (4 sessions) on one name;
//! - distinct: 32 workers on one client, each on its own name.
//!
//! Implementations:
//! - `fencelock`: `ZkLock::acquire` + `LockGuard::release` (create, list; delete);
//! - `raw-2rt`: create EPHEMERAL_SEQUENTIAL + delete by hand (the floor; no exclusion);
//! - `raw-3rt`: create + getChildren + delete (same round trips as fencelock's
//!   uncontended path, still no waiting);
//! - `zkc-recipe`: `zookeeper_client::Client::lock` with a Curator prefix + delete.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencelock_core::{AcquireOptions, DistributedLock};
use fencelock_testkit::ZkServer;
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};

const UNCONTENDED_OPS: usize = 2_000;
const CONTENDED_CLIENTS: usize = 4;
const CONTENDED_OPS: usize = 250;
const DISTINCT_WORKERS: usize = 32;
const DISTINCT_OPS: usize = 100;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Fencelock,
    Raw2,
    Raw3,
    Recipe,
}

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
        let dir = format!("{root}/{name}");
        match kind {
            Kind::Fencelock => {
                let guard = self
                    .lock
                    .acquire(name, AcquireOptions::new())
                    .await
                    .unwrap();
                guard.release().await.unwrap();
            }
            Kind::Raw2 | Kind::Raw3 => {
                let prefix = format!("{dir}/_c_raw-lock-");
                let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
                let (_, seq) = self.client.create(&prefix, &[], &options).await.unwrap();
                if kind == Kind::Raw3 {
                    self.client.list_children(&dir).await.unwrap();
                }
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
                self.client.delete(lock.lock_path(), None).await.unwrap();
                // Deleted above; skip the recipe's own background delete.
                std::mem::forget(lock);
            }
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn line(workload: &str, kind: Kind, mut latencies: Vec<Duration>, elapsed: Duration) {
    latencies.sort();
    println!(
        "{workload:<12} {:<11} ops={:<5} p50={:>7.3}ms p99={:>7.3}ms  {:>8.0} ops/s",
        kind.label(),
        latencies.len(),
        percentile(&latencies, 0.50).as_secs_f64() * 1e3,
        percentile(&latencies, 0.99).as_secs_f64() * 1e3,
        latencies.len() as f64 / elapsed.as_secs_f64(),
    );
}

async fn timed_loop(c: &Contender, kind: Kind, root: &str, name: &str, n: usize) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let start = Instant::now();
        c.op(kind, root, name).await;
        out.push(start.elapsed());
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = ZkServer::start();
    let root = "/bench";
    let main_client = Arc::new(Contender::new(&server, root).await);
    // Create the lock directories up front so every implementation finds them.
    for kind in [Kind::Fencelock, Kind::Raw2, Kind::Raw3, Kind::Recipe] {
        main_client
            .op(Kind::Fencelock, root, &format!("warm-{}", kind.label()))
            .await;
    }
    for i in 0..DISTINCT_WORKERS {
        main_client
            .op(Kind::Fencelock, root, &format!("d{i}"))
            .await;
    }
    main_client.op(Kind::Fencelock, root, "contended").await;
    main_client.op(Kind::Fencelock, root, "uncontended").await;
    // Warm-up.
    for kind in [Kind::Fencelock, Kind::Raw2, Kind::Raw3, Kind::Recipe] {
        timed_loop(&main_client, kind, root, "uncontended", 200).await;
    }

    println!("# ZooKeeper 3.8 standalone on loopback, tickTime=500, release build");
    for kind in [Kind::Raw2, Kind::Raw3, Kind::Recipe, Kind::Fencelock] {
        let start = Instant::now();
        let lat = timed_loop(&main_client, kind, root, "uncontended", UNCONTENDED_OPS).await;
        line("uncontended", kind, lat, start.elapsed());
    }

    let mut contenders = Vec::new();
    for _ in 0..CONTENDED_CLIENTS {
        contenders.push(Arc::new(Contender::new(&server, root).await));
    }
    for kind in [Kind::Recipe, Kind::Fencelock] {
        let start = Instant::now();
        let tasks: Vec<_> = contenders
            .iter()
            .map(|c| {
                let c = c.clone();
                tokio::spawn(async move {
                    timed_loop(&c, kind, "/bench", "contended", CONTENDED_OPS).await
                })
            })
            .collect();
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await.unwrap());
        }
        line("contended-4", kind, lat, start.elapsed());
    }

    for kind in [Kind::Raw2, Kind::Raw3, Kind::Recipe, Kind::Fencelock] {
        let start = Instant::now();
        let tasks: Vec<_> = (0..DISTINCT_WORKERS)
            .map(|i| {
                let c = main_client.clone();
                tokio::spawn(async move {
                    timed_loop(&c, kind, "/bench", &format!("d{i}"), DISTINCT_OPS).await
                })
            })
            .collect();
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await.unwrap());
        }
        line("distinct-32", kind, lat, start.elapsed());
    }
}
