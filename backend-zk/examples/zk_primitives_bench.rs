//! Benchmark of the ZooKeeper backend's semaphores and read-write locks against a raw
//! floor: the same creates, getChildren, multi-ops and deletes in Curator's layouts, by
//! hand with zookeeper-client, no library. On a throwaway local ZooKeeper
//! (fencelock-testkit).
//!
//! ```text
//! cargo run --release -p fencelock-zk --example zk_primitives_bench
//! ```
//!
//! Workloads (one acquire + release = one op; nothing is held in between):
//! - uncontended: one task, one name, sequential ops. Three repeats, each of [`ROUNDS`]
//!   short rounds interleaved between raw and fencelock (drift of a shared machine hits
//!   both alike); p50 and p99 pooled over everything (hdrhistogram), and for each repeat
//!   fencelock's p50 over raw's, with the median of the three;
//! - contended: 8 clients (8 sessions) on one semaphore of 3 permits, and 6 reader and 2
//!   writer clients on one read-write lock: grants/s, three interleaved repeats.
//!
//! Implementations:
//! - `fencelock`: `acquire_permits(Permits::new(1, 3))` / `acquire_read` /
//!   `acquire_write`, then `LockGuard::release`;
//! - `raw`, semaphore (Curator's `InterProcessSemaphoreV2` layout, as fencelock's): take
//!   the internal mutex (create an EPHEMERAL_SEQUENTIAL node under `locks/`, list, wait
//!   for the predecessor), read the leases directory's data and children (with a
//!   watch), one multi-op that checks the directory's version and creates the lease node
//!   (waiting on the children watch while the permits are taken), delete the mutex node;
//!   release deletes the lease node;
//! - `raw`, RW lock (Curator's `InterProcessReadWriteLock` layout): create
//!   `_c_<id>-__READ__<seq>` or `__WRIT__`, list, wait for the last blocking node
//!   before it (a writer for a reader, any node for a writer) by an exists watch; release
//!   deletes it.
//!
//! `BENCH_CONTENDED=0` runs only the uncontended cases; `BENCH_COUNT=1` prints the packets
//! the server received per op of each (`mntr`'s `zk_packets_received`), uncontended and
//! in the first contended repeat.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Permits};
use fencelock_testkit::ZkServer;
use fencelock_testkit::bench::{self, Rounds, Run};
use fencelock_zk::zookeeper_client as zk;
use fencelock_zk::{ZkConfig, ZkLock};

const ROOT: &str = "/bench";
const REPEATS: usize = 3;
const ROUNDS: usize = 5;
const OPS: usize = 100;
const CONTENDED_OPS: usize = 60;
const SEMAPHORE_CLIENTS: usize = 8;
const SEMAPHORE_LIMIT: u32 = 3;
const READERS: usize = 6;
const WRITERS: usize = 2;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Raw,
    Fencelock,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Raw => "raw",
            Kind::Fencelock => "fencelock",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Work {
    Semaphore,
    Read,
    Write,
}

impl Work {
    fn label(self) -> &'static str {
        match self {
            Work::Semaphore => "semaphore acquire+release (1 of 3)",
            Work::Read => "RW lock read acquire+release",
            Work::Write => "RW lock write acquire+release",
        }
    }
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// The sequence number at the end of a sequential node's name.
fn sequence(child: &str) -> u64 {
    let digits = child.len() - child.chars().rev().take_while(char::is_ascii_digit).count();
    child[digits..].parse().unwrap_or(u64::MAX)
}

/// One client: a fencelock client and its session's zookeeper-client handle.
struct Contender {
    lock: ZkLock,
    client: zk::Client,
    id: u64,
}

impl Contender {
    async fn new(server: &ZkServer) -> Self {
        let config = ZkConfig::new(server.connect_string())
            .with_chroot(ROOT)
            .expect("chroot");
        let lock = ZkLock::connect(config).await.expect("connect");
        let client = lock.client().await.expect("client");
        Contender {
            lock,
            client,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }

    async fn op(&self, kind: Kind, work: Work, name: &str) {
        match kind {
            Kind::Fencelock => {
                let options = AcquireOptions::new();
                let guard = match work {
                    Work::Semaphore => {
                        let permits = Permits::new(1, SEMAPHORE_LIMIT).expect("permits");
                        self.lock.acquire_permits(name, permits, options).await
                    }
                    Work::Read => self.lock.acquire_read(name, options).await,
                    Work::Write => self.lock.acquire_write(name, options).await,
                }
                .expect("acquire");
                guard.release().await.expect("release");
            }
            Kind::Raw => match work {
                Work::Semaphore => self.raw_semaphore(name).await,
                Work::Read | Work::Write => self.raw_rw(name, work == Work::Write).await,
            },
        }
    }

    fn ephemeral_sequential() -> zk::CreateOptions<'static> {
        zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all())
    }

    /// Creates the persistent directories of the raw layouts (once, before timing).
    async fn raw_dirs(&self, name: &str) {
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        let limit = format!("limit={SEMAPHORE_LIMIT}");
        for (path, data) in [
            (ROOT.to_owned(), ""),
            (format!("{ROOT}/raw-sem"), ""),
            (format!("{ROOT}/raw-sem/{name}"), ""),
            (format!("{ROOT}/raw-sem/{name}/locks"), ""),
            (format!("{ROOT}/raw-sem/{name}/leases"), limit.as_str()),
            (format!("{ROOT}/raw-rw"), ""),
            (format!("{ROOT}/raw-rw/{name}"), ""),
        ] {
            match self
                .client
                .create(&path, data.as_bytes(), &persistent)
                .await
            {
                Ok(_) | Err(zk::Error::NodeExists) => {}
                Err(e) => panic!("create {path}: {e}"),
            }
        }
    }

    /// Waits until the node `mine` (a child of `dir`) has no blocking node before it:
    /// `blocks(child)` says which children block; the last one before ours is watched.
    async fn wait_turn(&self, dir: &str, mine: &str, blocks: impl Fn(&str) -> bool) {
        let my_seq = sequence(mine);
        loop {
            let children = self.client.list_children(dir).await.expect("list");
            let predecessor = children
                .iter()
                .filter(|c| sequence(c) < my_seq && blocks(c))
                .max_by_key(|c| sequence(c));
            let Some(predecessor) = predecessor else {
                return;
            };
            let path = format!("{dir}/{predecessor}");
            let (stat, watcher) = self
                .client
                .check_and_watch_stat(&path)
                .await
                .expect("exists");
            if stat.is_some() {
                watcher.changed().await;
            }
        }
    }

    async fn raw_semaphore(&self, name: &str) {
        let base = format!("{ROOT}/raw-sem/{name}");
        let (locks, leases) = (format!("{base}/locks"), format!("{base}/leases"));
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let protection = format!("_c_raw{}x{n}-", self.id);
        let (_, seq) = self
            .client
            .create(
                &format!("{locks}/{protection}lock-"),
                b"",
                &Self::ephemeral_sequential(),
            )
            .await
            .expect("create mutex node");
        let mutex = format!("{protection}lock-{seq}");
        self.wait_turn(&locks, &mutex, |_| true).await;
        let lease = loop {
            let (_, stat) = self.client.get_data(&leases).await.expect("leases data");
            let (children, watcher) = self
                .client
                .list_and_watch_children(&leases)
                .await
                .expect("list leases");
            if children.len() < SEMAPHORE_LIMIT as usize {
                let mut multi = self.client.new_multi_writer();
                multi
                    .add_check_version(&leases, stat.version)
                    .expect("check");
                multi
                    .add_create(
                        &format!("{leases}/{protection}lease-"),
                        b"",
                        &Self::ephemeral_sequential(),
                    )
                    .expect("create");
                match multi.commit().await {
                    Ok(results) => {
                        let path = results.into_iter().find_map(|r| match r {
                            zk::MultiWriteResult::Create { path, .. } => Some(path),
                            _ => None,
                        });
                        break path.expect("lease path");
                    }
                    Err(zk::MultiWriteError::OperationFailed { .. }) => continue,
                    Err(e) => panic!("multi: {e}"),
                }
            }
            watcher.changed().await;
        };
        self.client
            .delete(&format!("{locks}/{mutex}"), None)
            .await
            .expect("delete mutex node");
        self.client
            .delete(&lease, None)
            .await
            .expect("delete lease");
    }

    async fn raw_rw(&self, name: &str, write: bool) {
        let dir = format!("{ROOT}/raw-rw/{name}");
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let side = if write { "__WRIT__" } else { "__READ__" };
        let id = self.id;
        let (_, seq) = self
            .client
            .create(
                &format!("{dir}/_c_raw{id}x{n}-{side}"),
                b"",
                &Self::ephemeral_sequential(),
            )
            .await
            .expect("create");
        let mine = format!("_c_raw{id}x{n}-{side}{seq}");
        if write {
            self.wait_turn(&dir, &mine, |_| true).await;
        } else {
            self.wait_turn(&dir, &mine, |c| c.contains("__WRIT__"))
                .await;
        }
        self.client
            .delete(&format!("{dir}/{mine}"), None)
            .await
            .expect("delete");
    }
}

/// Uncontended latency of `work` per kind: pooled p50/p99 and per-repeat p50 ratios to raw.
async fn uncontended(c: &Contender, work: Work, kinds: &[Kind]) {
    let plan = Rounds::new(REPEATS, ROUNDS, OPS, 50);
    println!("{} uncontended ({plan})", work.label());
    let name = format!("uncontended-{work:?}").to_lowercase();
    c.raw_dirs(&name).await;
    let measured = bench::interleave(kinds, plan, |kind| c.op(kind, work, &name)).await;
    println!("{}", bench::latency_lines(&measured, Some(0), Kind::label));
}

/// One contended run: each client does [`CONTENDED_OPS`] ops of its work on one name.
async fn contended_once(cs: &[(Arc<Contender>, Work)], kind: Kind, name: &str) -> Run {
    let workers = cs.iter().map(|(c, work)| {
        let (c, work, name) = (c.clone(), *work, name.to_owned());
        tokio::spawn(
            async move { bench::timed_ops(CONTENDED_OPS, || c.op(kind, work, &name)).await },
        )
    });
    bench::run_workers(workers).await.expect("worker")
}

async fn contended(what: &str, cs: &[(Arc<Contender>, Work)], kinds: &[Kind], server: &ZkServer) {
    println!(
        "{what} contended ({} clients x {CONTENDED_OPS} ops, {REPEATS} interleaved repeats)",
        cs.len()
    );
    let name = format!("contended-{}", what.replace(' ', "-"));
    cs[0].0.raw_dirs(&name).await;
    let count = std::env::var_os("BENCH_COUNT").is_some();
    let runs = bench::interleave_runs(kinds, REPEATS, |kind, repeat| {
        let name = &name;
        async move {
            let before = (count && repeat == 0).then(|| packets(server));
            let run = contended_once(cs, kind, name).await;
            if let Some(before) = before {
                let per_op = (packets(server) - before) as f64 / run.ops() as f64;
                println!("  {:<10} packets per op {per_op:.2}", kind.label());
            }
            run
        }
    })
    .await;
    println!(
        "{}",
        bench::rate_lines(kinds, &runs, Some(0), "grants/s", Kind::label)
    );
}

/// The packets the server has received so far (`mntr`).
fn packets(server: &ZkServer) -> u64 {
    let mntr = server.four_letter_word("mntr").expect("mntr");
    mntr.lines()
        .find_map(|l| l.strip_prefix("zk_packets_received"))
        .and_then(|v| v.trim().parse().ok())
        .expect("zk_packets_received")
}

/// Prints the packets per uncontended op of each kind.
async fn count_packets(c: &Contender, server: &ZkServer, work: Work, kinds: &[Kind]) {
    const N: u64 = 200;
    print!("{} packets per op (uncontended):", work.label());
    c.raw_dirs("count").await;
    for &kind in kinds {
        c.op(kind, work, "count").await;
        let before = packets(server);
        for _ in 0..N {
            c.op(kind, work, "count").await;
        }
        // Work a guard leaves to the background lands within a moment.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let after = packets(server);
        print!(
            "  {} {:.2}",
            kind.label(),
            (after - before) as f64 / N as f64
        );
    }
    println!("  (pings included)");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = ZkServer::start();
    let mut contenders = Vec::new();
    for _ in 0..SEMAPHORE_CLIENTS.max(READERS + WRITERS) {
        contenders.push(Arc::new(Contender::new(&server).await));
    }
    let c0 = &contenders[0];
    let kinds = [Kind::Raw, Kind::Fencelock];
    if std::env::var_os("BENCH_COUNT").is_some() {
        for work in [Work::Semaphore, Work::Read, Work::Write] {
            count_packets(c0, &server, work, &kinds).await;
        }
    }
    let contention = std::env::var("BENCH_CONTENDED").map_or(true, |v| v != "0");
    uncontended(c0, Work::Semaphore, &kinds).await;
    if contention {
        let cs: Vec<_> = contenders[..SEMAPHORE_CLIENTS]
            .iter()
            .map(|c| (c.clone(), Work::Semaphore))
            .collect();
        contended("semaphore 3 permits", &cs, &kinds, &server).await;
    }
    uncontended(c0, Work::Read, &kinds).await;
    uncontended(c0, Work::Write, &kinds).await;
    if contention {
        let cs: Vec<_> = contenders[..READERS + WRITERS]
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let work = if i < WRITERS { Work::Write } else { Work::Read };
                (c.clone(), work)
            })
            .collect();
        contended("RW lock 6 readers 2 writers", &cs, &kinds, &server).await;
    }
}
