//! A rolling migration from Redis locks to etcd locks, with no downtime and never two
//! holders.
//!
//! Three kinds of workers update one fenced stock counter under the lock
//! `order:SKU-8842`:
//!
//! - an **old fleet** configured with the Redis URL (raw key layout: the key is exactly
//!   `lock:order:SKU-8842`), like services that were never touched;
//! - a **hand-written** service doing `SET lock:order:SKU-8842 <random> NX PX 300` and a
//!   compare-and-delete script, the usual hand-written Redis lock (it has no token, so it
//!   only proves exclusion);
//! - a **new fleet** configured with `migrate://` URLs. The configuration moves through
//!   the phases `legacy` → `legacy-first` → `target-first` → `target` while the workers
//!   keep running; each new-fleet worker picks the new phase up at its next lock, as a
//!   rolling restart would.
//!
//! The old fleet is retired before `target-first` (from then on tokens come from etcd),
//! the hand-written service before `target` (from then on nothing takes the Redis lock).
//! The program prints per-phase counts and ends with `violations: 0`.
//!
//! ```text
//! FENCELOCK_MIGRATE_LEGACY=redis://127.0.0.1:6379 \
//! FENCELOCK_MIGRATE_TARGET=etcd://127.0.0.1:2379/fencelock-example \
//!     cargo run --example migrate --features redis,etcd
//! ```
//!
//! Without those variables it starts its own throwaway `redis-server` and `etcd` (from
//! the Debian packages `redis-server` and `etcd-server`) if they are installed, and
//! otherwise prints how to run it. `FENCELOCK_MIGRATE_PHASE_SECS` sets how long each
//! phase runs (default 3).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use fencelock::{DistributedLock, DistributedLockExt, FencedRegister, MigrationPhase};

/// The lock every worker takes, and its key under the raw layout.
const NAME: &str = "order:SKU-8842";
/// The pause of every worker between two orders.
const THINK_TIME: Duration = Duration::from_millis(5);
const PREFIX: &str = "lock:";

/// What one run counted, per phase.
#[derive(Debug, Default)]
struct Report {
    /// Grants to (old fleet, hand-written service, new fleet), per phase.
    grants: [[u64; 3]; 4],
    /// Fenced writes (accepted, refused as stale), per phase.
    writes: [[u64; 2]; 4],
    /// Two holders inside the critical section at once, or a lost update.
    violations: u64,
}

/// Shared state of the workers.
struct Shared {
    phase: AtomicUsize,
    stock: FencedRegister<u64>,
    accepted: AtomicU64,
    inside: AtomicUsize,
    overlaps: AtomicU64,
    grants: [[AtomicU64; 3]; 4],
    writes: [[AtomicU64; 2]; 4],
}

impl Shared {
    fn phase(&self) -> usize {
        self.phase.load(Ordering::SeqCst)
    }

    /// The critical section: read, pause, write with the token. Returns whether the write
    /// was accepted.
    async fn critical(&self, kind: usize, token: Option<fencelock::FencingToken>) {
        let phase = self.phase();
        self.grants[phase][kind].fetch_add(1, Ordering::Relaxed);
        if self.inside.fetch_add(1, Ordering::SeqCst) != 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let stock = self.stock.read();
        tokio::time::sleep(Duration::from_millis(2)).await;
        if let Some(token) = token {
            match self.stock.write(token, stock + 1) {
                Ok(()) => {
                    self.accepted.fetch_add(1, Ordering::SeqCst);
                    self.writes[phase][0].fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    self.writes[phase][1].fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs the rollout against a Redis server (`redis://host:port`) and an etcd URL, each
/// phase for `phase_time`.
async fn run(redis: &str, etcd: &str, phase_time: Duration) -> Result<Report, fencelock::Error> {
    let legacy = format!("{redis}?layout=raw&prefix={PREFIX}");
    let phase_url = |phase: MigrationPhase| {
        format!(
            "{}&second_leg_wait=100ms",
            fencelock::migration_url(phase, &legacy, etcd)
        )
    };
    let old_fleet = fencelock::connect(&legacy).await?;
    let mut new_fleet: Vec<Arc<dyn DistributedLock>> = Vec::new();
    for phase in MigrationPhase::ALL {
        new_fleet.push(fencelock::connect(&phase_url(phase)).await?);
    }
    let client =
        redis::Client::open(redis).map_err(|e| fencelock::Error::backend("redis", false, e))?;
    let hand = client
        .get_connection_manager()
        .await
        .map_err(|e| fencelock::Error::unavailable("redis", e))?;

    let shared = Arc::new(Shared {
        phase: AtomicUsize::new(0),
        stock: FencedRegister::new(0),
        accepted: AtomicU64::new(0),
        inside: AtomicUsize::new(0),
        overlaps: AtomicU64::new(0),
        grants: Default::default(),
        writes: Default::default(),
    });
    let old_running = Arc::new(AtomicBool::new(true));
    let hand_running = Arc::new(AtomicBool::new(true));
    let new_running = Arc::new(AtomicBool::new(true));

    let mut old = Vec::new();
    for _ in 0..3 {
        let (lock, shared, running) = (old_fleet.clone(), shared.clone(), old_running.clone());
        old.push(tokio::spawn(async move {
            while running.load(Ordering::SeqCst) {
                let guard = lock.lock(NAME).await?;
                shared.critical(0, Some(guard.token())).await;
                guard.release().await?;
                // Other work between orders: Redis locks are not FIFO, and a service that
                // re-locks at once could starve the others.
                tokio::time::sleep(THINK_TIME).await;
            }
            Ok::<(), fencelock::Error>(())
        }));
    }
    let mut hand_task = Some(tokio::spawn(hand_written(
        hand,
        shared.clone(),
        hand_running.clone(),
    )));
    let mut new = Vec::new();
    for _ in 0..3 {
        let (locks, shared, running) = (new_fleet.clone(), shared.clone(), new_running.clone());
        new.push(tokio::spawn(async move {
            while running.load(Ordering::SeqCst) {
                let guard = locks[shared.phase()].lock(NAME).await?;
                shared.critical(2, Some(guard.token())).await;
                guard.release().await?;
                tokio::time::sleep(THINK_TIME).await;
            }
            Ok::<(), fencelock::Error>(())
        }));
    }

    for (i, phase) in MigrationPhase::ALL.into_iter().enumerate() {
        if phase == MigrationPhase::TargetFirst {
            // Every service that writes with Redis tokens is on the migration URL now.
            old_running.store(false, Ordering::SeqCst);
            for task in old.drain(..) {
                task.await.expect("old-fleet worker")?;
            }
        }
        if phase == MigrationPhase::Target {
            // Nothing takes the Redis lock by hand any more.
            hand_running.store(false, Ordering::SeqCst);
            if let Some(task) = hand_task.take() {
                task.await.expect("hand-written service");
            }
        }
        shared.phase.store(i, Ordering::SeqCst);
        tokio::time::sleep(phase_time).await;
    }
    new_running.store(false, Ordering::SeqCst);
    for task in new {
        task.await.expect("new-fleet worker")?;
    }

    let mut report = Report::default();
    for phase in 0..4 {
        for kind in 0..3 {
            report.grants[phase][kind] = shared.grants[phase][kind].load(Ordering::SeqCst);
        }
        for outcome in 0..2 {
            report.writes[phase][outcome] = shared.writes[phase][outcome].load(Ordering::SeqCst);
        }
    }
    let lost_updates = shared.stock.read() != shared.accepted.load(Ordering::SeqCst);
    report.violations = shared.overlaps.load(Ordering::SeqCst) + u64::from(lost_updates);
    Ok(report)
}

/// The usual hand-written Redis lock: `SET key random NX PX 300`, compare-and-delete.
async fn hand_written(
    mut redis: redis::aio::ConnectionManager,
    shared: Arc<Shared>,
    running: Arc<AtomicBool>,
) {
    let key = format!("{PREFIX}{NAME}");
    let release = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    );
    let mut n = 0u64;
    while running.load(Ordering::SeqCst) {
        n += 1;
        let value = format!("hand-{}-{n}", std::process::id());
        let set: Result<Option<String>, _> = redis::cmd("SET")
            .arg(&key)
            .arg(&value)
            .arg("NX")
            .arg("PX")
            .arg(300)
            .query_async(&mut redis)
            .await;
        // Like most hand-written locks: spin on SET NX with a short sleep while the lock
        // is taken, pause longer after a turn of its own.
        let pause = if let Ok(Some(_)) = set {
            shared.critical(1, None).await;
            let _: Result<i64, _> = release.key(&key).arg(&value).invoke_async(&mut redis).await;
            Duration::from_millis(50)
        } else {
            Duration::from_millis(5)
        };
        tokio::time::sleep(pause).await;
    }
}

fn print(report: &Report) {
    println!(
        "{:<13} {:>9} {:>13} {:>9} {:>9} {:>8}",
        "phase", "old fleet", "hand-written", "new fleet", "accepted", "refused"
    );
    for (i, phase) in MigrationPhase::ALL.into_iter().enumerate() {
        let [old, hand, new] = report.grants[i];
        let [accepted, refused] = report.writes[i];
        println!(
            "{:<13} {old:>9} {hand:>13} {new:>9} {accepted:>9} {refused:>8}",
            phase.as_str()
        );
    }
    println!("violations: {}", report.violations);
}

/// Whether `program` is on the `PATH`.
fn installed(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let phase_time = std::env::var("FENCELOCK_MIGRATE_PHASE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(3), Duration::from_secs);
    let given = (
        std::env::var("FENCELOCK_MIGRATE_LEGACY").ok(),
        std::env::var("FENCELOCK_MIGRATE_TARGET").ok(),
    );
    let report = match given {
        (Some(redis), Some(etcd)) => run(&redis, &etcd, phase_time).await?,
        _ if installed("redis-server") && installed("etcd") => {
            println!("starting throwaway redis-server and etcd on free loopback ports");
            let redis = fencelock_testkit::RedisServer::start();
            let etcd = fencelock_testkit::EtcdServer::start();
            let target = format!("etcd://{}/fencelock-example", etcd.endpoint());
            run(&redis.url(), &target, phase_time).await?
        }
        _ => {
            println!(
                "This example needs a Redis server and an etcd server. Either install them\n\
                 (apt-get install redis-server etcd-server) and run it again, or point it at\n\
                 running servers:\n\n\
                 FENCELOCK_MIGRATE_LEGACY=redis://127.0.0.1:6379 \\\n\
                 FENCELOCK_MIGRATE_TARGET=etcd://127.0.0.1:2379/fencelock-example \\\n\
                 \x20   cargo run --example migrate --features redis,etcd"
            );
            return Ok(());
        }
    };
    print(&report);
    if report.violations != 0 {
        return Err("mutual exclusion was violated".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same rollout against the test harness's servers, with shorter phases.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_rollout_has_no_violations() {
        let redis = fencelock_testkit::RedisServer::start();
        let etcd = fencelock_testkit::EtcdServer::shared();
        let target = format!("etcd://{}/fencelock-example-test", etcd.endpoint());
        let report = run(&redis.url(), &target, Duration::from_millis(1500))
            .await
            .expect("the rollout runs");
        print(&report);
        assert_eq!(report.violations, 0);
        for (i, phase) in MigrationPhase::ALL.into_iter().enumerate() {
            let [old, hand, new] = report.grants[i];
            assert!(new > 0, "{phase}: the new fleet never got the lock");
            assert_eq!(old > 0, i < 2, "{phase}: old fleet grants {old}");
            assert!(
                hand > 0 || i == 3,
                "{phase}: the hand-written service never got in"
            );
            assert!(report.writes[i][0] > 0, "{phase}: no write was accepted");
        }
    }
}
