//! Random sequences of calls on the real backends (property tests with `proptest`), as
//! `tests/no_panics.rs` does on `mem://`: acquires of every primitive (lock, semaphore
//! permits, read and write locks) with every lease kind, extreme leases and waits,
//! extensions by extreme durations, releases, dropped guards, sleeps, `inspect` and
//! `list`, on etcd, ZooKeeper, Redis (single), Redlock (3 servers) and the migration
//! layer (Redis → etcd, phases `legacy-first` and `target-first`).
//!
//! Each case, on a client of its own with a key prefix (ZooKeeper: a chroot) of its own,
//! checks that:
//!
//! - nothing panics, in any thread: a panic hook counts every panic, including those
//!   inside tasks the backends spawn (renewals, watchers), which tokio would swallow;
//! - every call ends within [`CALL_LIMIT`], but for a wait for ever behind a guard the
//!   case itself holds, which is cut after [`BLOCKED_CAP`] (dropping the acquire, which
//!   must leave nothing behind);
//! - tokens rise: every grant of a lock, of a semaphore or of a read-write lock has a
//!   token larger than every earlier grant of that name and primitive in the case (each
//!   call is made after the previous one ended, so every earlier grant was complete);
//! - once every guard is released (and the dropped ones' background releases had
//!   [`FREE_WITHIN`]), `inspect` reports each name free with no waiter, `list` reports
//!   nothing, and nothing of the case's prefix is left on the servers (C5 probes of
//!   `fencelock_testkit::leftovers`: keys, nodes, Redis keys and channels).
//!
//! It found one defect: a Redis semaphore's or read-write lock's index outlived its
//! last holder when another holder's lease had run out (fixed in `RELEASE`; the case is
//! `an_expired_holders_entry_goes_with_the_last_release` in backend-redis's tests).
//!
//! Real time, so waits are short (at most 200 ms, or for ever behind nobody the case
//! knows of) and sleeps at most 50 ms; leases are extreme (zero, 1 ns, the backend's
//! minimum and 1 ns below it, [`MAX_LEASE`] and 1 ns above it, [`FOREVER`],
//! `Duration::MAX`, `u64::MAX` seconds) or ordinary (2 s to 60 s). The servers are the
//! shared ones of the test process (Redlock: three of its own), started once per test;
//! cases are few (see [`CASES`]) to keep the file within ~30 s. Failing cases are not
//! persisted (`failure_persistence: None`): the shrunk case is in the failure message.
#![cfg(all(feature = "etcd", feature = "zookeeper", feature = "redis"))]

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, Once};
use std::time::Duration;

use fencelock::{
    AcquireOptions, DistributedLock, Error, FOREVER, LockGuard, MAX_LEASE, MAX_NAME_LEN,
    MigrationPhase, Permits, Wait,
};
use fencelock_testkit::{EtcdServer, RedisServer, ZkServer};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestError, TestRunner};
use tokio::time::{Instant, timeout};

mod common;
use common::Servers;

/// Cases per backend.
const CASES: u32 = 30;
/// The longest any call may take (but a wait for ever behind the case's own guard).
const CALL_LIMIT: Duration = Duration::from_secs(4);
/// When a wait for ever behind a guard the case holds is cut.
const BLOCKED_CAP: Duration = Duration::from_millis(300);
/// The longest wait timeout asked for.
const MAX_WAIT: Duration = Duration::from_millis(200);
/// The longest sleep between calls.
const MAX_SLEEP: Duration = Duration::from_millis(50);
/// How long, once every guard is released, the names may take to be free everywhere
/// (a dropped guard's or a cut acquire's release runs in the background).
const FREE_WITHIN: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------
// Panics in any thread.

/// Panics seen since the process started (but [`expect_panic`]'s).
static PANICS: AtomicUsize = AtomicUsize::new(0);
/// Where and why, for the failure message.
static PANIC_NOTES: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    /// Set by a test thread about to report its own failure by panicking.
    static EXPECTED: Cell<bool> = const { Cell::new(false) };
}

/// Installs (once) a panic hook that counts every panic in any thread, then runs the
/// default hook.
fn count_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !EXPECTED.with(Cell::get) {
                PANICS.fetch_add(1, Ordering::SeqCst);
                let thread = std::thread::current();
                let note = format!("thread {:?}: {info}", thread.name().unwrap_or("unnamed"));
                PANIC_NOTES
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push(note);
            }
            default(info);
        }));
    });
}

/// Fails when a panic happened since `before` (a count of [`PANICS`]).
fn no_panic_since(before: usize, when: &str) -> Result<(), TestCaseError> {
    let now = PANICS.load(Ordering::SeqCst);
    if now == before {
        return Ok(());
    }
    let notes = PANIC_NOTES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    Err(TestCaseError::fail(format!(
        "{} panic(s) {when} (every panic of the process so far: {notes:?})",
        now - before
    )))
}

/// Panics with `message` without counting it (the test's own failure report).
fn expect_panic(message: String) -> ! {
    EXPECTED.with(|expected| expected.set(true));
    panic!("{message}");
}

// ---------------------------------------------------------------------------------------
// Deployments.

/// A deployment under test, its servers started once per test.
enum Deployment {
    Etcd,
    Zk,
    Redis,
    /// Three Redis servers of its own.
    Redlock(Vec<RedisServer>),
    /// Redis (raw layout) as the legacy leg, etcd as the target.
    Migration(MigrationPhase),
}

impl Deployment {
    /// Starts the servers (the shared ones of the process are started on first use).
    fn start(self) -> Self {
        match &self {
            Deployment::Etcd => {
                EtcdServer::shared();
            }
            Deployment::Zk => {
                ZkServer::shared();
            }
            Deployment::Redis => {
                RedisServer::shared();
            }
            Deployment::Redlock(_) => {}
            Deployment::Migration(_) => {
                RedisServer::shared();
                EtcdServer::shared();
            }
        }
        self
    }

    fn tag(&self) -> &'static str {
        match self {
            Deployment::Etcd => "rc-etcd",
            Deployment::Zk => "rc-zk",
            Deployment::Redis => "rc-redis",
            Deployment::Redlock(_) => "rc-redlock",
            Deployment::Migration(_) => "rc-migrate",
        }
    }

    /// The URL of a client whose locks live under `prefix`.
    fn url(&self, prefix: &str) -> String {
        match self {
            Deployment::Etcd => format!("etcd://{}/{prefix}", EtcdServer::shared().endpoint()),
            Deployment::Zk => format!("zk://{}/{prefix}", ZkServer::shared().connect_string()),
            Deployment::Redis => format!("{}?prefix={prefix}:", RedisServer::shared().url()),
            Deployment::Redlock(servers) => {
                let hosts: Vec<String> = servers.iter().map(RedisServer::addr).collect();
                format!("redlock://{}?prefix={prefix}:", hosts.join(","))
            }
            Deployment::Migration(phase) => fencelock::migration_url(
                *phase,
                &format!(
                    "{}?layout=raw&prefix={prefix}:",
                    RedisServer::shared().url()
                ),
                &format!("etcd://{}/{prefix}", EtcdServer::shared().endpoint()),
            ),
        }
    }

    /// Where the locks of `prefix` live on the servers.
    fn servers<'a>(&self, prefix: &'a str) -> Servers<'a> {
        match self {
            Deployment::Etcd => Servers::Etcd(EtcdServer::shared(), prefix),
            Deployment::Zk => Servers::Zk(ZkServer::shared(), prefix),
            Deployment::Redis => Servers::redis(RedisServer::shared(), prefix),
            Deployment::Redlock(servers) => {
                Servers::Redis(servers.iter().map(RedisServer::port).collect(), prefix)
            }
            Deployment::Migration(_) => Servers::Both(
                Box::new(Servers::redis(RedisServer::shared(), prefix)),
                Box::new(Servers::Etcd(EtcdServer::shared(), prefix)),
            ),
        }
    }

    /// A prefix (chroot) no other case or run uses.
    fn next_prefix(&self) -> String {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        format!(
            "{}-{}",
            common::unique(self.tag()),
            SEQ.fetch_add(1, Ordering::Relaxed)
        )
    }
}

// ---------------------------------------------------------------------------------------
// Inputs.

/// Leases (and extensions) at the limits the library checks, around `min` (the
/// backend's minimum lease), and ordinary ones of 2 s to 60 s.
fn lease(min: Duration) -> impl Strategy<Value = Duration> {
    let extreme = vec![
        Duration::ZERO,
        Duration::from_nanos(1),
        min.saturating_sub(Duration::from_nanos(1)),
        min,
        MAX_LEASE,
        MAX_LEASE + Duration::from_nanos(1),
        FOREVER,
        Duration::MAX,
        Duration::from_secs(u64::MAX),
    ];
    prop_oneof![
        2 => prop::sample::select(extreme),
        2 => (2u64..=60).prop_map(Duration::from_secs),
        1 => (2_000u64..60_000).prop_map(Duration::from_millis),
    ]
}

/// Waits: none, short timeouts, and for ever (three ways of asking for it).
fn wait() -> impl Strategy<Value = Wait> {
    prop_oneof![
        2 => Just(Wait::NoWait),
        3 => prop_oneof![
            Just(Duration::ZERO),
            Just(Duration::from_nanos(1)),
            (1u64..=MAX_WAIT.as_millis() as u64).prop_map(Duration::from_millis),
        ]
        .prop_map(Wait::Timeout),
        1 => prop::sample::select(vec![
            Wait::Forever,
            Wait::Timeout(FOREVER),
            Wait::Timeout(Duration::MAX),
        ]),
    ]
}

/// Acquire options from every lease kind (none: the backend's default) and wait.
fn options(min: Duration) -> impl Strategy<Value = AcquireOptions> {
    (0..3usize, lease(min), wait()).prop_map(|(kind, lease, wait)| {
        let options = match kind {
            0 => AcquireOptions::new(),
            1 => AcquireOptions::new().lease(lease),
            _ => AcquireOptions::new().fixed_lease(lease),
        };
        options.wait(wait)
    })
}

/// A lock name: ordinary, odd but valid, or refused.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => prop::sample::select(vec!["a", "b", "c", "orders/42"]).prop_map(str::to_owned),
        2 => prop::sample::select(vec![
            "a/b", "..", "{tag}", "*?[", "é ü", "", "a\0b", "a\nb"
        ])
        .prop_map(str::to_owned),
        1 => "\\PC{1,8}",
        1 => prop::sample::select(vec![MAX_NAME_LEN, MAX_NAME_LEN + 1]).prop_map(|n| "x".repeat(n)),
    ]
}

/// One call.
#[derive(Debug, Clone)]
enum Call {
    Acquire(usize, AcquireOptions),
    Permits(usize, u32, u32, AcquireOptions),
    Read(usize, AcquireOptions),
    Write(usize, AcquireOptions),
    /// Extends guard `g % held` by the duration.
    Extend(usize, Duration),
    /// Releases guard `g % held`.
    Release(usize),
    /// Drops guard `g % held` without releasing it (released in the background).
    Drop(usize),
    Sleep(Duration),
    Inspect(usize),
    List,
}

fn call(min: Duration) -> impl Strategy<Value = Call> {
    let permits = prop_oneof![
        3 => 1u32..=2,
        1 => prop::sample::select(vec![0, u32::MAX]),
        1 => any::<u32>(),
    ];
    let limit = prop_oneof![
        3 => prop::sample::select(vec![1u32, 3]),
        1 => prop::sample::select(vec![0, u32::MAX]),
        1 => any::<u32>(),
    ];
    prop_oneof![
        3 => (0..3usize, options(min)).prop_map(|(n, o)| Call::Acquire(n, o)),
        2 => (0..3usize, permits, limit, options(min))
            .prop_map(|(n, p, l, o)| Call::Permits(n, p, l, o)),
        2 => (0..3usize, options(min)).prop_map(|(n, o)| Call::Read(n, o)),
        2 => (0..3usize, options(min)).prop_map(|(n, o)| Call::Write(n, o)),
        2 => (0..8usize, lease(min)).prop_map(|(g, d)| Call::Extend(g, d)),
        2 => (0..8usize).prop_map(Call::Release),
        1 => (0..8usize).prop_map(Call::Drop),
        1 => (0..=MAX_SLEEP.as_millis() as u64)
            .prop_map(|ms| Call::Sleep(Duration::from_millis(ms))),
        1 => (0..3usize).prop_map(Call::Inspect),
        1 => Just(Call::List),
    ]
}

// ---------------------------------------------------------------------------------------
// A case.

/// The primitive a guard holds (each is a namespace of its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Primitive {
    Lock,
    Semaphore,
    RwLock,
}

/// A guard the case holds.
struct Held {
    guard: LockGuard,
    primitive: Primitive,
    name: String,
    /// Write lock (read-write locks); permits taken of a limit (semaphores).
    write: bool,
    permits: (u32, u32),
}

impl Held {
    /// Releases the guard (a loss it reports is no failure: leases here run out).
    async fn release(self) {
        let _ = self.guard.release().await;
    }
}

/// Whether an acquire of `call` could wait behind a guard the case holds (a lost one
/// too: its server-side lease may not have run out yet).
fn behind_own_guard(call: &Call, names: &[String], held: &[Held]) -> bool {
    let on = |primitive: Primitive, n: usize| {
        held.iter()
            .filter(move |h| h.primitive == primitive && h.name == names[n])
    };
    match call {
        Call::Acquire(n, _) => on(Primitive::Lock, *n).next().is_some(),
        Call::Write(n, _) => on(Primitive::RwLock, *n).next().is_some(),
        Call::Read(n, _) => on(Primitive::RwLock, *n).any(|h| h.write),
        Call::Permits(n, count, limit, _) => {
            let taken: u64 = on(Primitive::Semaphore, *n)
                .map(|h| u64::from(h.permits.0))
                .sum();
            let other_limit = on(Primitive::Semaphore, *n).any(|h| h.permits.1 != *limit);
            other_limit || taken + u64::from(*count) > u64::from(*limit)
        }
        _ => false,
    }
}

/// The options of an acquire call.
fn options_of(call: &Call) -> Option<&AcquireOptions> {
    match call {
        Call::Acquire(_, o) | Call::Permits(_, _, _, o) | Call::Read(_, o) | Call::Write(_, o) => {
            Some(o)
        }
        _ => None,
    }
}

/// Runs `calls` on a fresh client of `deployment`, then checks that nothing is left.
async fn case(
    deployment: &Deployment,
    names: &[String],
    calls: &[Call],
) -> Result<(), TestCaseError> {
    let panics = PANICS.load(Ordering::SeqCst);
    let prefix = deployment.next_prefix();
    let url = deployment.url(&prefix);
    let lock = match timeout(CALL_LIMIT, fencelock::connect(&url)).await {
        Ok(Ok(lock)) => lock,
        Ok(Err(e)) => return Err(TestCaseError::fail(format!("connect {url}: {e:?}"))),
        Err(_) => return Err(TestCaseError::fail(format!("connect {url}: timed out"))),
    };
    let mut held: Vec<Held> = Vec::new();
    // The largest token granted so far per primitive and name.
    let mut tokens: HashMap<(Primitive, String), u64> = HashMap::new();
    for (i, call) in calls.iter().enumerate() {
        let forever = options_of(call).is_some_and(|o| o.wait_kind() == Wait::Forever);
        let blocked = forever && behind_own_guard(call, names, &held);
        let limit = if blocked { BLOCKED_CAP } else { CALL_LIMIT };
        let granted = timeout(limit, one_call(&*lock, call, names, &mut held)).await;
        let granted = match granted {
            Ok(granted) => granted,
            Err(_) if blocked => None,
            Err(_) => {
                return Err(TestCaseError::fail(format!(
                    "call {i}, {call:?}: no answer within {limit:?} (prefix {prefix})"
                )));
            }
        };
        if let Some(guard) = granted {
            let (primitive, n, write, permits) = match *call {
                Call::Acquire(n, _) => (Primitive::Lock, n, false, (0, 0)),
                Call::Permits(n, p, l, _) => (Primitive::Semaphore, n, false, (p, l)),
                Call::Read(n, _) => (Primitive::RwLock, n, false, (0, 0)),
                Call::Write(n, _) => (Primitive::RwLock, n, true, (0, 0)),
                _ => unreachable!("only acquires grant"),
            };
            let token = guard.token().get();
            let last = tokens.entry((primitive, names[n].clone())).or_default();
            prop_assert!(
                token > *last,
                "call {i}, {call:?}: token {token} of {:?} not above {last}, an earlier \
                 grant's (prefix {prefix})",
                names[n]
            );
            *last = token;
            held.push(Held {
                guard,
                primitive,
                name: names[n].clone(),
                write,
                permits,
            });
        }
    }
    for h in held.drain(..) {
        let name = h.name.clone();
        match timeout(CALL_LIMIT, h.release()).await {
            Ok(()) => {}
            Err(_) => {
                return Err(TestCaseError::fail(format!(
                    "release of {name:?}: no answer within {CALL_LIMIT:?} (prefix {prefix})"
                )));
            }
        }
    }
    all_free(&*lock, deployment, &prefix, names).await?;
    no_panic_since(panics, &format!("in the case (prefix {prefix})"))?;
    match timeout(CALL_LIMIT, lock.close()).await {
        Ok(_) => {}
        Err(_) => {
            return Err(TestCaseError::fail(format!(
                "close: no answer within {CALL_LIMIT:?} (prefix {prefix})"
            )));
        }
    }
    drop(lock);
    no_panic_since(panics, &format!("closing the client (prefix {prefix})"))
}

/// Makes `call`; returns the guard an acquire was granted.
async fn one_call(
    lock: &dyn DistributedLock,
    call: &Call,
    names: &[String],
    held: &mut Vec<Held>,
) -> Option<LockGuard> {
    match call {
        Call::Acquire(n, o) => lock.acquire(&names[*n], *o).await.ok(),
        Call::Permits(n, p, l, o) => match Permits::new(*p, *l) {
            Ok(permits) => lock.acquire_permits(&names[*n], permits, *o).await.ok(),
            Err(_) => None,
        },
        Call::Read(n, o) => lock.acquire_read(&names[*n], *o).await.ok(),
        Call::Write(n, o) => lock.acquire_write(&names[*n], *o).await.ok(),
        Call::Extend(g, d) => {
            if !held.is_empty() {
                let _ = held[g % held.len()].guard.extend(*d).await;
            }
            None
        }
        Call::Release(g) => {
            if !held.is_empty() {
                held.remove(g % held.len()).release().await;
            }
            None
        }
        Call::Drop(g) => {
            if !held.is_empty() {
                drop(held.remove(g % held.len()));
            }
            None
        }
        Call::Sleep(d) => {
            tokio::time::sleep(*d).await;
            None
        }
        Call::Inspect(n) => {
            let _ = lock.inspect(&names[*n]).await;
            None
        }
        Call::List => {
            let _ = lock.list("").await;
            None
        }
    }
}

/// Polls until `inspect` reports every (valid) name free with no waiter, `list` reports
/// nothing and the servers hold nothing of `prefix`; fails after [`FREE_WITHIN`].
async fn all_free(
    lock: &dyn DistributedLock,
    deployment: &Deployment,
    prefix: &str,
    names: &[String],
) -> Result<(), TestCaseError> {
    let servers = deployment.servers(prefix);
    let deadline = Instant::now() + FREE_WITHIN;
    loop {
        let mut left = Vec::new();
        for name in names {
            match timeout(CALL_LIMIT, lock.inspect(name)).await {
                Ok(Ok(info)) if info.holder.is_none() && info.waiters.unwrap_or(0) == 0 => {}
                Ok(Err(Error::InvalidName { .. })) => {}
                other => left.push(format!("inspect {name:?}: {other:?}")),
            }
        }
        match timeout(CALL_LIMIT, lock.list("")).await {
            Ok(Ok(listed)) if listed.is_empty() => {}
            other => left.push(format!("list: {other:?}")),
        }
        left.extend(servers.left());
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(TestCaseError::fail(format!(
                "{FREE_WITHIN:?} after every guard was released (prefix {prefix}): {left:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------
// The tests.

/// Runs [`CASES`] random cases on `deployment`.
fn random_calls(deployment: Deployment) {
    count_panics();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(deployment.tag())
        .enable_all()
        .build()
        .expect("a runtime");
    let deployment = deployment.start();
    // The backend's minimum lease, for the leases around it.
    let min = runtime.block_on(async {
        let url = deployment.url(&deployment.next_prefix());
        let lock = fencelock::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("connect {url}: {e:?}"));
        let min = lock.capabilities().min_lease;
        lock.close().await.expect("close");
        min
    });
    let mut runner = TestRunner::new(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        // Each case takes real time on real servers: shrink for at most two minutes.
        max_shrink_iters: 200,
        max_shrink_time: 120_000,
        ..ProptestConfig::default()
    });
    let strategy = (
        prop::collection::vec(name(), 3),
        prop::collection::vec(call(min), 1..24),
    );
    let outcome = runner.run(&strategy, |(names, calls)| {
        runtime.block_on(case(&deployment, &names, &calls))
    });
    let panics = PANICS.load(Ordering::SeqCst);
    drop(runtime);
    let late = no_panic_since(panics, "after the last case");
    match (outcome, late) {
        (Ok(()), Ok(())) => {}
        (Err(TestError::Fail(why, (names, calls))), _) => expect_panic(format!(
            "{}: {why}\nminimal failing input: names = {names:?}, calls = {calls:#?}",
            deployment.tag()
        )),
        (Err(e), _) => expect_panic(format!("{}: {e}", deployment.tag())),
        (Ok(()), Err(e)) => expect_panic(format!("{}: {e}", deployment.tag())),
    }
}

#[test]
fn random_calls_on_etcd() {
    random_calls(Deployment::Etcd);
}

#[test]
fn random_calls_on_zookeeper() {
    random_calls(Deployment::Zk);
}

#[test]
fn random_calls_on_redis() {
    random_calls(Deployment::Redis);
}

#[test]
fn random_calls_on_redlock() {
    random_calls(Deployment::Redlock(
        (0..3).map(|_| RedisServer::start()).collect(),
    ));
}

#[test]
fn random_calls_on_migration_legacy_first() {
    random_calls(Deployment::Migration(MigrationPhase::LegacyFirst));
}

#[test]
fn random_calls_on_migration_target_first() {
    random_calls(Deployment::Migration(MigrationPhase::TargetFirst));
}
