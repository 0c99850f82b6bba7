//! Benchmark of the Redis backend's semaphores and read-write locks against a raw floor:
//! the same grant and release scripts, by `EVALSHA` on the same client crate, with no
//! library around them. On one throwaway local Redis (fencelock-testkit) or `REDIS_URL`.
//!
//! ```text
//! cargo run --release -p fencelock-redis --example redis_primitives_bench
//! ```
//!
//! Workloads (one acquire + release = one op; nothing is held in between):
//! - uncontended: one task, one name, sequential ops. Three repeats, each of [`ROUNDS`]
//!   short rounds interleaved between raw and fencelock (drift of a shared machine hits
//!   both alike); p50 and p99 pooled over everything (hdrhistogram), and for each repeat
//!   fencelock's p50 over raw's, with the median of the three;
//! - contended: 8 clients (8 connections) on one semaphore of 3 permits, and 6 reader and
//!   2 writer clients on one read-write lock: grants/s, three interleaved repeats.
//!
//! Implementations:
//! - `fencelock`: `acquire_permits(Permits::new(1, 3))` / `acquire_read` /
//!   `acquire_write`, then `LockGuard::release`;
//! - `raw`: the library's own grant script (`MEMBER_ACQUIRE`, its text taken from
//!   `src/scripts.rs` at compile time, so the floor cannot drift from it) and release
//!   script (`RELEASE`) by `EVALSHA`, with the same keys and arguments (marked as a
//!   waiter, so a refused writer or semaphore request records its intent as fencelock's
//!   does); a refused raw request tries again after 1 ms, as hand-written locks do.
//!
//! `BENCH_CONTENDED=0` runs only the uncontended cases; `BENCH_COUNT=1` first prints the
//! commands Redis ran per uncontended op of each (from `INFO commandstats`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fencelock_core::{AcquireOptions, DistributedLock, Permits};
use fencelock_testkit::bench::{self, Rounds, Run};
use redis::aio::MultiplexedConnection;

const REPEATS: usize = 3;
const ROUNDS: usize = 5;
const OPS: usize = 200;
const CONTENDED_OPS: usize = 100;
const SEMAPHORE_CLIENTS: usize = 8;
const SEMAPHORE_LIMIT: u32 = 3;
const READERS: usize = 6;
const WRITERS: usize = 2;
const LEASE_MS: u64 = 30_000;
const TOKEN_TTL_MS: u64 = 24 * 3600 * 1000;

/// The text of `static {name}` in the library's `src/scripts.rs`: the raw string between
/// `r"` and the line `",`.
fn library_script(name: &str) -> String {
    let source = include_str!("../src/scripts.rs");
    let at = source
        .find(&format!("static {name}: LazyLock<Lua>"))
        .unwrap_or_else(|| panic!("no script {name} in src/scripts.rs"));
    let start = at + source[at..].find("r\"").expect("raw string") + 2;
    let end = start + source[start..].find("\n\",").expect("end of raw string") + 1;
    source[start..end].to_owned()
}

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

    fn mode(self) -> &'static str {
        match self {
            Work::Semaphore => "s",
            Work::Read => "r",
            Work::Write => "w",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Work::Semaphore => "sem",
            Work::Read | Work::Write => "rw",
        }
    }
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// One client: a fencelock client and a raw connection of its own.
struct Contender {
    lock: Arc<dyn DistributedLock>,
    conn: MultiplexedConnection,
    acquire: Arc<redis::Script>,
    release: Arc<redis::Script>,
    id: u64,
}

impl Contender {
    async fn new(url: &str, acquire: &Arc<redis::Script>, release: &Arc<redis::Script>) -> Self {
        Contender {
            lock: fencelock_redis::connect(url).await.expect("connect"),
            conn: redis::Client::open(url)
                .expect("url")
                .get_multiplexed_async_connection()
                .await
                .expect("connect raw"),
            acquire: acquire.clone(),
            release: release.clone(),
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
            Kind::Raw => self.raw(work, name).await,
        }
    }

    /// The grant script until granted (1 ms between tries), then the release script, with
    /// the keys and arguments fencelock's default layout gives them.
    async fn raw(&self, work: Work, name: &str) {
        let base = format!("raw:{{{name}}}:{}", work.kind());
        let (holders, token_key, waiters, channel, intent) = (
            format!("{base}:h:"),
            format!("{base}:token"),
            format!("{base}:waiters"),
            format!("{base}:unlock"),
            format!("{base}:intent"),
        );
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let owner = format!("raw{}:{n}", self.id);
        let intent_id = format!("raw{}:i{n}", self.id);
        let holder = format!("{holders}{owner}");
        let (count, limit) = match work {
            Work::Semaphore => (1, SEMAPHORE_LIMIT),
            Work::Read | Work::Write => (1, 0),
        };
        let mut conn = self.conn.clone();
        let token = loop {
            let reply: (i64, String) = self
                .acquire
                .key(&base)
                .key(&holder)
                .key(&token_key)
                .key(&waiters)
                .key(&intent)
                .arg(&owner)
                .arg(LEASE_MS)
                .arg(TOKEN_TTL_MS)
                .arg(1)
                .arg(work.mode())
                .arg(count)
                .arg(limit)
                .arg(&holders)
                .arg(&intent_id)
                .invoke_async(&mut conn)
                .await
                .expect("grant script");
            match reply {
                (1, token) => break token,
                (0, _) => tokio::time::sleep(Duration::from_millis(1)).await,
                other => panic!("unexpected grant reply {other:?}"),
            }
        };
        let released: i64 = self
            .release
            .key(&holder)
            .key(&waiters)
            .key(&token_key)
            .arg(&owner)
            .arg(&channel)
            .arg(&token)
            .invoke_async(&mut conn)
            .await
            .expect("release script");
        assert_eq!(released, 1, "raw release");
    }
}

/// Uncontended latency of `work` per kind: pooled p50/p99 and per-repeat p50 ratios to raw.
async fn uncontended(c: &Contender, work: Work, kinds: &[Kind]) {
    let plan = Rounds::new(REPEATS, ROUNDS, OPS, 100);
    println!("{} uncontended ({plan})", work.label());
    let name = format!("uncontended-{work:?}").to_lowercase();
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

async fn contended(what: &str, cs: &[(Arc<Contender>, Work)], kinds: &[Kind]) {
    println!(
        "{what} contended ({} clients x {CONTENDED_OPS} ops, {REPEATS} interleaved repeats)",
        cs.len()
    );
    let name = format!("contended-{}", what.replace(' ', "-"));
    let runs =
        bench::interleave_runs(kinds, REPEATS, |kind, _| contended_once(cs, kind, &name)).await;
    println!(
        "{}",
        bench::rate_lines(kinds, &runs, Some(0), "grants/s", Kind::label)
    );
}

/// The commands Redis has run so far, by name (`INFO commandstats`).
async fn commands(conn: &mut MultiplexedConnection) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    let mut counts = BTreeMap::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(":calls="))
        else {
            continue;
        };
        let calls = rest.split(',').next().and_then(|c| c.parse().ok());
        counts.insert(name.to_owned(), calls.unwrap_or(0));
    }
    counts
}

/// Prints the commands per uncontended op of each kind (scripts count once; the calls
/// they make inside are listed too, as Redis counts them).
async fn count_commands(c: &Contender, work: Work, kinds: &[Kind]) {
    const N: u64 = 100;
    println!("{} commands per op (uncontended)", work.label());
    let mut conn = c.conn.clone();
    for &kind in kinds {
        let before = commands(&mut conn).await;
        for _ in 0..N {
            c.op(kind, work, "count").await;
        }
        // Work a guard leaves to the background lands within a moment.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = commands(&mut conn).await;
        let per_op: Vec<String> = after
            .iter()
            .filter_map(|(name, n)| {
                let d = n - before.get(name).copied().unwrap_or(0);
                // The INFO calls themselves and renewals are noise below 0.1 per op.
                (d * 10 >= N).then(|| format!("{name} {:.1}", d as f64 / N as f64))
            })
            .collect();
        println!("  {:<10} {}", kind.label(), per_op.join(", "));
    }
}

#[tokio::main]
async fn main() {
    let server;
    let url = match std::env::var("REDIS_URL") {
        Ok(url) => url,
        Err(_) => {
            server = fencelock_testkit::RedisServer::start();
            server.url()
        }
    };
    let acquire = Arc::new(redis::Script::new(&library_script("MEMBER_ACQUIRE")));
    let release = Arc::new(redis::Script::new(&library_script("RELEASE")));
    let mut contenders = Vec::new();
    for _ in 0..SEMAPHORE_CLIENTS.max(READERS + WRITERS) {
        contenders.push(Arc::new(Contender::new(&url, &acquire, &release).await));
    }
    let c0 = &contenders[0];
    let kinds = [Kind::Raw, Kind::Fencelock];
    // The library loads its scripts on first use: once it has, the floor's copies must
    // be the same scripts (same SHA1), or the floor measures something else.
    c0.op(Kind::Fencelock, Work::Semaphore, "check").await;
    let loaded: Vec<bool> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(acquire.get_hash())
        .arg(release.get_hash())
        .query_async(&mut c0.conn.clone())
        .await
        .expect("SCRIPT EXISTS");
    assert_eq!(
        loaded,
        [true, true],
        "the raw floor's scripts are not the library's"
    );
    if std::env::var_os("BENCH_COUNT").is_some() {
        for work in [Work::Semaphore, Work::Read, Work::Write] {
            count_commands(c0, work, &kinds).await;
        }
    }
    let contention = std::env::var("BENCH_CONTENDED").map_or(true, |v| v != "0");
    uncontended(c0, Work::Semaphore, &kinds).await;
    if contention {
        let cs: Vec<_> = contenders[..SEMAPHORE_CLIENTS]
            .iter()
            .map(|c| (c.clone(), Work::Semaphore))
            .collect();
        contended("semaphore 3 permits", &cs, &kinds).await;
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
        contended("RW lock 6 readers 2 writers", &cs, &kinds).await;
    }
}
