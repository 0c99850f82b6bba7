//! Benchmark of the etcd backend's leader election, semaphores and read-write locks against
//! a raw floor (the same etcd requests by hand, with etcd-client, no library) and, for the
//! election, etcd-client's own election API (`campaign` / `resign`, server-side v3election).
//! All on one throwaway local etcd (fencelock-testkit) or `ETCD_ENDPOINT`.
//!
//! ```text
//! cargo run --release -p fencelock-etcd --example etcd_primitives_bench
//! ```
//!
//! Workloads (one acquire + release = one op; nothing is held between acquire and
//! release):
//! - uncontended: one task, one name, sequential ops. Three repeats, each of
//!   [`ROUNDS`] short rounds interleaved across the implementations (drift of a shared
//!   machine hits all alike); p50 and p99 pooled over everything (hdrhistogram), and for
//!   each repeat the ratio of this implementation's p50 over raw's, with the median of
//!   the three;
//! - contended: election: 4 clients campaigning on one election (hand-overs/s);
//!   semaphore: 8 clients on one semaphore of 3 permits (grants/s); RW lock: 6 reader
//!   and 2 writer clients on one lock (grants/s). Three repeats, interleaved.
//!
//! Implementations:
//! - `fencelock`: `campaign` / `acquire_permits(Permits::new(1, 3))` / `acquire_read` /
//!   `acquire_write`, then `LockGuard::release`;
//! - `raw`: the requests fencelock's layouts need, by hand, on a lease granted once and
//!   kept alive: election: the put-if-free-else-queue txn (with the read of the first
//!   candidate) and the incarnation-checked delete txn; semaphore: the put txn, the read
//!   of the earlier holders and the incarnation-checked delete; RW lock: the put txn,
//!   the read of the last blocking key and the incarnation-checked delete. Waiting (only
//!   when contended) watches as fencelock does: the semaphore's range for deletions, the
//!   RW lock's predecessor key;
//! - `etcd-elect` (election only): `ElectionClient::campaign(name, value, lease)` then
//!   `resign` with the returned leader key, on a lease granted once and kept alive (as Go's
//!   `concurrency.Election` does).
//!
//! `BENCH_WORKLOADS=election,semaphore,rwlock` and `BENCH_CONTENDED=0` narrow the run;
//! `BENCH_COUNT=1` first prints the gRPC messages etcd received per uncontended op of each
//! implementation, by method (from etcd's `/metrics`), to explain the differences.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, ResignOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};
use fencelock_core::{AcquireOptions, DistributedLock, Permits};
use fencelock_etcd::{EtcdConfig, EtcdLock};
use fencelock_testkit::bench::{self, Rounds, Run};

const REPEATS: usize = 3;
const ROUNDS: usize = 5;
const OPS: usize = 100;
const CONTENDED_OPS: usize = 60;
const ELECTION_CLIENTS: usize = 4;
const SEMAPHORE_CLIENTS: usize = 8;
const SEMAPHORE_LIMIT: u32 = 3;
const READERS: usize = 6;
const WRITERS: usize = 2;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Raw,
    Fencelock,
    EtcdElect,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Raw => "raw",
            Kind::Fencelock => "fencelock",
            Kind::EtcdElect => "etcd-elect",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Work {
    Elect,
    Semaphore,
    Read,
    Write,
}

impl Work {
    fn label(self) -> &'static str {
        match self {
            Work::Elect => "election campaign+resign",
            Work::Semaphore => "semaphore acquire+release (1 of 3)",
            Work::Read => "RW lock read acquire+release",
            Work::Write => "RW lock write acquire+release",
        }
    }
}

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

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

    async fn op(&self, kind: Kind, work: Work, name: &str) {
        match (kind, work) {
            (Kind::Fencelock, _) => {
                let options = AcquireOptions::new();
                let guard = match work {
                    Work::Elect => self.lock.campaign(name, "candidate", options).await,
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
            (Kind::EtcdElect, _) => {
                let mut election = self.client.election_client();
                let mut campaigned = election
                    .campaign(format!("v3elect/{name}"), "candidate", self.lease)
                    .await
                    .expect("campaign");
                let leader = campaigned.take_leader().expect("leader key");
                election
                    .resign(Some(ResignOptions::new().with_leader(leader)))
                    .await
                    .expect("resign");
            }
            (Kind::Raw, Work::Elect) => self.raw_elect(name).await,
            (Kind::Raw, Work::Semaphore) => self.raw_semaphore(name).await,
            (Kind::Raw, Work::Read | Work::Write) => self.raw_rw(name, work == Work::Write).await,
        }
    }

    /// The election as fencelock lays it out, by hand: one txn puts our key if the
    /// election is empty, and otherwise puts it anyway and reads the first candidate; a
    /// queued candidate waits for its predecessor's deletion. Resigning deletes our key
    /// if it is still the incarnation we created.
    async fn raw_elect(&self, name: &str) {
        let names = format!("raw/{name}/");
        let key = format!("{names}{:x}", self.lease);
        let put = || {
            TxnOp::put(
                key.as_str(),
                "candidate",
                Some(PutOptions::new().with_lease(self.lease)),
            )
        };
        let first = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1)
            .with_keys_only();
        let txn = Txn::new()
            .when([Compare::create_revision(names.as_str(), CompareOp::Equal, 0).with_prefix()])
            .and_then([put()])
            .or_else([put(), TxnOp::get(names.as_str(), Some(first))]);
        let response = self.client.kv_client().txn(txn).await.expect("txn");
        let mine = response.header().map_or(0, |h| h.revision());
        if !response.succeeded() {
            let first = match response.op_responses().get(1) {
                Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.create_revision()),
                _ => None,
            };
            if first != Some(mine) {
                self.wait_predecessor(&names, mine).await;
            }
        }
        self.delete_incarnation(&key, mine).await;
    }

    /// A semaphore of [`SEMAPHORE_LIMIT`] as fencelock lays it out, by hand: put our key
    /// (`1/3`), read the keys created before it; when they leave no permit, watch the
    /// range for deletions and read again.
    async fn raw_semaphore(&self, name: &str) {
        let dir = format!("raw/%sem/{name}/");
        let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let key = format!("{dir}{:x}-{sequence:x}", self.lease);
        let mine = self.put_own(&key, &format!("1/{SEMAPHORE_LIMIT}")).await;
        let mut kv = self.client.kv_client();
        let earlier = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_max_create_revision(mine - 1);
        let fits = |read: &etcd_client::GetResponse| {
            let taken: u64 = read
                .kvs()
                .iter()
                .map(|kv| {
                    std::str::from_utf8(kv.value())
                        .ok()
                        .and_then(|v| v.split_once('/'))
                        .and_then(|(c, _)| c.parse::<u64>().ok())
                        .unwrap_or(0)
                })
                .sum();
            taken < u64::from(SEMAPHORE_LIMIT)
        };
        let read = kv
            .get(dir.as_str(), Some(earlier.clone()))
            .await
            .expect("read");
        if !fits(&read) {
            let mut watch = self.client.watch_client();
            loop {
                let watching = WatchOptions::new()
                    .with_prefix()
                    .with_filters([WatchFilterType::NoPut]);
                let mut events = watch
                    .watch(dir.as_str(), Some(watching))
                    .await
                    .expect("watch");
                let read = kv
                    .get(dir.as_str(), Some(earlier.clone()))
                    .await
                    .expect("read");
                if fits(&read) {
                    break;
                }
                while let Some(response) = events.message().await.expect("watch event") {
                    if response.canceled()
                        || response
                            .events()
                            .iter()
                            .any(|e| e.event_type() == EventType::Delete)
                    {
                        break;
                    }
                }
            }
        }
        self.delete_incarnation(&key, mine).await;
    }

    /// A read-write lock as fencelock (and Go's `recipes.RWMutex`) lays it out, by hand:
    /// put our key under `read/` or `write/`, wait for the last key created before it
    /// that blocks it (a writer for a reader; any key for a writer).
    async fn raw_rw(&self, name: &str, write: bool) {
        let dir = format!("raw/%rw/{name}/");
        let sequence = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let side = if write { "write" } else { "read" };
        let key = format!("{dir}{side}/{:x}-{sequence:x}", self.lease);
        let mine = self.put_own(&key, "").await;
        let blockers = if write {
            dir.clone()
        } else {
            format!("{dir}write/")
        };
        self.wait_predecessor(&blockers, mine).await;
        self.delete_incarnation(&key, mine).await;
    }

    /// Puts `key` on our lease if absent (the txn fencelock sends): its create revision.
    async fn put_own(&self, key: &str, value: &str) -> i64 {
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(self.lease)),
            )]);
        let response = self.client.kv_client().txn(txn).await.expect("put txn");
        response.header().map_or(0, |h| h.revision())
    }

    /// Waits until no key under `range` was created before `mine`: read the last such
    /// key; if there is one, watch it, check it is still there, wait for its deletion,
    /// and read again.
    async fn wait_predecessor(&self, range: &str, mine: i64) {
        let mut kv = self.client.kv_client();
        loop {
            let predecessor = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_max_create_revision(mine - 1)
                .with_limit(1)
                .with_keys_only();
            let read = kv.get(range, Some(predecessor)).await.expect("read");
            let Some((key, created)) = read
                .kvs()
                .first()
                .map(|kv| (kv.key().to_vec(), kv.create_revision()))
            else {
                return;
            };
            let options = WatchOptions::new().with_filters([WatchFilterType::NoPut]);
            let mut events = self
                .client
                .watch_client()
                .watch(key.clone(), Some(options))
                .await
                .expect("watch");
            match events.message().await.expect("watch created") {
                Some(created) if created.created() && created.events().is_empty() => {}
                _ => continue,
            }
            let now = kv
                .get(key, Some(GetOptions::new().with_keys_only()))
                .await
                .expect("read");
            if now.kvs().first().map(|kv| kv.create_revision()) != Some(created) {
                continue;
            }
            while let Some(response) = events.message().await.expect("watch event") {
                if response.canceled()
                    || response
                        .events()
                        .iter()
                        .any(|e| e.event_type() == EventType::Delete)
                {
                    break;
                }
            }
        }
    }

    /// Deletes `key` if it is still the incarnation created at `revision`.
    async fn delete_incarnation(&self, key: &str, revision: i64) {
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, revision)])
            .and_then([TxnOp::delete(key, None)]);
        self.client.kv_client().txn(txn).await.expect("delete txn");
    }
}

/// Uncontended latency of `work` per kind: pooled p50/p99 and per-repeat p50 ratios to raw.
async fn uncontended(c: &Contender, work: Work, kinds: &[Kind]) {
    let plan = Rounds::new(REPEATS, ROUNDS, OPS, 50);
    println!("{} uncontended ({plan})", work.label());
    let name = format!("uncontended-{work:?}").to_lowercase();
    let measured = bench::interleave(kinds, plan, |kind| c.op(kind, work, &name)).await;
    let raw = kinds.iter().position(|k| *k == Kind::Raw);
    println!("{}", bench::latency_lines(&measured, raw, Kind::label));
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

async fn contended(what: &str, cs: &[(Arc<Contender>, Work)], kinds: &[Kind], endpoint: &str) {
    println!(
        "{what} contended ({} clients x {CONTENDED_OPS} ops, {REPEATS} interleaved repeats)",
        cs.len()
    );
    let name = format!("contended-{}", what.replace(' ', "-"));
    let count = std::env::var_os("BENCH_COUNT").is_some();
    let runs = bench::interleave_runs(kinds, REPEATS, |kind, repeat| {
        let name = &name;
        async move {
            let before = (count && repeat == 0).then(|| received(endpoint));
            let run = contended_once(cs, kind, name).await;
            if let Some(before) = before {
                let shown = per_op(&before, &received(endpoint), run.ops());
                println!("  {:<10} per op: {shown}", kind.label());
            }
            run
        }
    })
    .await;
    let raw = kinds.iter().position(|k| *k == Kind::Raw);
    println!(
        "{}",
        bench::rate_lines(kinds, &runs, raw, "grants/s", Kind::label)
    );
}

/// gRPC messages etcd has received so far, by method (`grpc_server_msg_received_total`).
fn received(endpoint: &str) -> BTreeMap<String, u64> {
    use std::io::{Read, Write};
    // Outside any timed section: a blocking read is fine.
    let mut stream = std::net::TcpStream::connect(endpoint).expect("metrics connect");
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .expect("metrics request");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("metrics read");
    let mut counts = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("grpc_server_msg_received_total{") else {
            continue;
        };
        let method = rest
            .split("grpc_method=\"")
            .nth(1)
            .and_then(|m| m.split('"').next())
            .unwrap_or("?");
        let value = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        *counts.entry(method.to_owned()).or_insert(0) += value as u64;
    }
    counts
}

/// Prints the gRPC messages per uncontended op of each kind, by method.
async fn count_requests(c: &Contender, endpoint: &str, work: Work, kinds: &[Kind]) {
    const N: u64 = 100;
    println!("{} requests per op (uncontended)", work.label());
    for &kind in kinds {
        let before = received(endpoint);
        for _ in 0..N {
            c.op(kind, work, "count").await;
        }
        println!(
            "  {:<10} {}",
            kind.label(),
            per_op(&before, &received(endpoint), N)
        );
    }
}

/// The messages by method between two [`received`] counts, per op of `ops`.
fn per_op(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, ops: u64) -> String {
    let shown: Vec<String> = after
        .iter()
        .filter_map(|(method, n)| {
            let d = n - before.get(method).copied().unwrap_or(0);
            // Keepalives and the metrics reads themselves are noise below 0.1 per op.
            (d * 10 >= ops).then(|| format!("{method} {:.1}", d as f64 / ops as f64))
        })
        .collect();
    shown.join(", ")
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
    for _ in 0..SEMAPHORE_CLIENTS.max(READERS + WRITERS) {
        contenders.push(Arc::new(Contender::new(&endpoint).await));
    }
    let wanted = |item: &str| {
        std::env::var("BENCH_WORKLOADS").map_or(true, |v| v.split(',').any(|w| w == item))
    };
    let contention = std::env::var("BENCH_CONTENDED").map_or(true, |v| v != "0");
    let c0 = &contenders[0];
    if std::env::var_os("BENCH_COUNT").is_some() {
        let all = [Kind::Raw, Kind::Fencelock, Kind::EtcdElect];
        count_requests(c0, &endpoint, Work::Elect, &all).await;
        for work in [Work::Semaphore, Work::Read, Work::Write] {
            count_requests(c0, &endpoint, work, &all[..2]).await;
        }
    }
    if wanted("election") {
        let kinds = [Kind::Raw, Kind::Fencelock, Kind::EtcdElect];
        uncontended(c0, Work::Elect, &kinds).await;
        if contention {
            // Hand-overs between candidates; raw's waiting is the same as the RW lock's.
            let cs: Vec<_> = contenders[..ELECTION_CLIENTS]
                .iter()
                .map(|c| (c.clone(), Work::Elect))
                .collect();
            contended("election hand-over", &cs, &kinds, &endpoint).await;
        }
    }
    if wanted("semaphore") {
        let kinds = [Kind::Raw, Kind::Fencelock];
        uncontended(c0, Work::Semaphore, &kinds).await;
        if contention {
            let cs: Vec<_> = contenders[..SEMAPHORE_CLIENTS]
                .iter()
                .map(|c| (c.clone(), Work::Semaphore))
                .collect();
            contended("semaphore 3 permits", &cs, &kinds, &endpoint).await;
        }
    }
    if wanted("rwlock") {
        let kinds = [Kind::Raw, Kind::Fencelock];
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
            contended("RW lock 6 readers 2 writers", &cs, &kinds, &endpoint).await;
        }
    }
}
