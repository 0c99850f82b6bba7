//! The `held` workload: many locks held at once, renewing, for 5 lease periods.

use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error, LockGuard};
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{CONCURRENCY, check, failed, median_max_micros, options, per_item, progress, rss};
use crate::args::BenchArgs;
use crate::exit::{Failure, code};

/// `count` locks held at once in this process, renewing, for 5 lease periods: none may
/// be lost. Reports memory per held lock and the latency of one more acquire with all
/// of them held against the first one's.
pub(super) async fn held(
    args: &BenchArgs,
    locks: Arc<dyn DistributedLock>,
    other: Arc<dyn DistributedLock>,
    prefix: &str,
) -> Result<Value, Failure> {
    let count = usize::try_from(args.count.unwrap_or(100_000)).unwrap_or(usize::MAX);
    let options = options(args);
    // Warm the client up (connections, scripts, session) outside the measurement.
    let first_begun = Instant::now();
    let first = locks
        .acquire(&format!("{prefix}/held/first"), options.no_wait())
        .await
        .map_err(|e| failed("the first acquire", &e))?;
    let first_latency = first_begun.elapsed();
    let lease = first.valid_until().saturating_duration_since(first_begun);
    // The probes with everything held are spread over the whole hold, so they meet
    // renewal rounds too; the ones before the fill are paced alike, because an acquire
    // after an idle pause is slower than one right after another (cold caches, parked
    // threads): 1 µs against 19 µs on `mem://` with nothing held at all.
    let gap = lease * 5 / PROBES as u32;
    progress(
        args,
        format!("held: {PROBES} timed acquires before the fill, one every {gap:?}"),
    );
    let (probes, other_probes) =
        probes_paced(&locks, &other, prefix, "before", gap, options).await?;
    let (first_p50, first_max) = median_max_micros(&probes).unwrap_or_default();
    let (other_p50, _) = median_max_micros(&other_probes).unwrap_or_default();
    let before = rss();
    let started = Instant::now();
    let names = (0..count).map(|i| format!("{prefix}/held/{i}")).collect();
    let (guards, _) = acquire_all(&locks, names, options).await?;
    let filled = started.elapsed();
    let after = rss();
    progress(
        args,
        format!(
            "held: {count} locks in {filled:?}; holding for 5 lease periods ({:?})",
            lease * 5
        ),
    );
    // More, with everything held: as fast as before?
    let (held_probes, other_held_probes) =
        probes_paced(&locks, &other, prefix, "held", gap, options).await?;
    let (held_p50, held_max) = median_max_micros(&held_probes).unwrap_or_default();
    let (other_held_p50, _) = median_max_micros(&other_held_probes).unwrap_or_default();
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    let held_rss = rss();
    release_all(guards).await?;
    release_all(vec![first]).await?;
    check(
        lost == 0,
        format!("{lost} of {count} held locks were lost within 5 lease periods"),
    )?;
    Ok(json!({
        "workload": "held",
        "backend": locks.backend(),
        "held": count,
        "lease_s": lease.as_secs_f64(),
        "held_for_s": (lease * 5).as_secs_f64(),
        "lost": lost,
        "fill_s": filled.as_secs_f64(),
        "rss_bytes_per_held_lock": per_item(before, after, count),
        "rss_growth_while_held_bytes": held_rss.zip(after).map(|(h, a)| h as i64 - a as i64),
        "first_acquire_us": first_latency.as_micros() as u64,
        "probe_gap_ms": gap.as_secs_f64() * 1e3,
        "acquire_p50_us_before": first_p50,
        "acquire_max_us_before": first_max,
        "acquire_p50_us_all_held": held_p50,
        "acquire_max_us_all_held": held_max,
        "other_client_acquire_p50_us_before": other_p50,
        "other_client_acquire_p50_us_all_held": other_held_p50,
    }))
}

/// How many single acquires the `held` workload times before the fill and while
/// everything is held.
const PROBES: usize = 25;

/// [`PROBES`] timed acquires through `locks`, each followed by one through `other` and a
/// pause of `gap`: the latencies of each.
async fn probes_paced(
    locks: &Arc<dyn DistributedLock>,
    other: &Arc<dyn DistributedLock>,
    prefix: &str,
    phase: &str,
    gap: Duration,
    options: AcquireOptions,
) -> Result<(Vec<Duration>, Vec<Duration>), Failure> {
    let mut own = Vec::with_capacity(PROBES);
    let mut others = Vec::with_capacity(PROBES);
    for i in 0..PROBES {
        own.push(probe(locks, &format!("{prefix}/held/probe-{phase}-{i}"), options).await?);
        others.push(probe(other, &format!("{prefix}/held/other-{phase}-{i}"), options).await?);
        tokio::time::sleep(gap).await;
    }
    Ok((own, others))
}

/// One timed acquire of a fresh name, released at once (not timed).
async fn probe(
    locks: &Arc<dyn DistributedLock>,
    name: &str,
    options: AcquireOptions,
) -> Result<Duration, Failure> {
    let begun = Instant::now();
    let guard = locks
        .acquire(name, options.no_wait())
        .await
        .map_err(|e| failed("a timed acquire", &e))?;
    let took = begun.elapsed();
    guard
        .release()
        .await
        .map_err(|e| failed("a timed release", &e))?;
    Ok(took)
}

/// Acquires `names` concurrently ([`CONCURRENCY`] at a time); returns the guards in
/// order and each acquire's latency.
async fn acquire_all(
    locks: &Arc<dyn DistributedLock>,
    names: Vec<String>,
    options: AcquireOptions,
) -> Result<(Vec<LockGuard>, Vec<Duration>), Failure> {
    // At most CONCURRENCY tasks exist at once: tasks spawned ahead, each waiting for its
    // turn, would count in the memory measured per lock.
    let mut tasks = JoinSet::new();
    let mut out = Vec::with_capacity(names.len());
    let mut names = names.into_iter().enumerate();
    loop {
        while tasks.len() < CONCURRENCY {
            let Some((i, name)) = names.next() else { break };
            let locks = locks.clone();
            tasks.spawn(async move {
                let begun = Instant::now();
                let guard = locks.acquire(&name, options.no_wait()).await?;
                Ok::<_, Error>((i, guard, begun.elapsed()))
            });
        }
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        match joined {
            Ok(Ok(got)) => out.push(got),
            Ok(Err(error)) => return Err(failed("an acquire", &error)),
            Err(error) => return Err(Failure::new(code::INTERNAL, format!("{error}"))),
        }
    }
    out.sort_by_key(|g| g.0);
    Ok(out.into_iter().map(|(_, g, l)| (g, l)).unzip())
}

/// Releases every guard concurrently; the first error wins.
async fn release_all(guards: Vec<LockGuard>) -> Result<(), Failure> {
    let limit = Arc::new(Semaphore::new(CONCURRENCY));
    let mut tasks = JoinSet::new();
    for guard in guards {
        let limit = limit.clone();
        tasks.spawn(async move {
            let _permit = limit.acquire_owned().await;
            guard.release().await
        });
    }
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(failed("a release", &error)),
            Err(error) => return Err(Failure::new(code::INTERNAL, format!("{error}"))),
        }
    }
    Ok(())
}
