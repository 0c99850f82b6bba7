//! The `cycles` workload: many acquire+release cycles on distinct names, after which
//! the client's memory and the server must be back where they were.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fencelock::{DistributedLock, Error};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{CONCURRENCY, check, failed, options, progress, rss};
use crate::args::BenchArgs;
use crate::exit::{Failure, code};

/// The most the client's resident set may grow over `cycles` acquire+release cycles
/// after the warm-up: [`CYCLES_GROWTH_PER_CYCLE`] bytes a cycle, and never less than
/// [`CYCLES_GROWTH_FLOOR`] (the allocator's own noise). Anything kept per name (a map
/// entry, a task, a channel) costs tens of bytes or more, so at the default million
/// cycles a leak shows as tens of MB against a limit of 16 MB; the backends measured
/// grow by 0.15-0.5 MB.
fn cycles_growth_limit(cycles: usize) -> i64 {
    let per_cycle = i64::try_from(cycles)
        .unwrap_or(i64::MAX)
        .saturating_mul(CYCLES_GROWTH_PER_CYCLE);
    per_cycle.max(CYCLES_GROWTH_FLOOR)
}

/// See [`cycles_growth_limit`].
const CYCLES_GROWTH_PER_CYCLE: i64 = 16;

/// See [`cycles_growth_limit`].
const CYCLES_GROWTH_FLOOR: i64 = 16 << 20;

/// `count` acquire+release cycles on distinct names ([`CONCURRENCY`] at a time): the
/// client's memory must come back to where it was after a warm-up, and no name may
/// be left held or waited on.
pub(super) async fn cycles(
    args: &BenchArgs,
    locks: Arc<dyn DistributedLock>,
    prefix: &str,
) -> Result<Value, Failure> {
    let count = usize::try_from(args.count.unwrap_or(1_000_000)).unwrap_or(usize::MAX);
    let options = options(args);
    let run = |from: usize, to: usize| {
        let locks = locks.clone();
        let prefix = prefix.to_owned();
        async move {
            let next = Arc::new(AtomicU64::new(from as u64));
            let mut tasks = JoinSet::new();
            for _ in 0..CONCURRENCY {
                let (locks, next, prefix) = (locks.clone(), next.clone(), prefix.clone());
                tasks.spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= to as u64 {
                            return Ok::<(), Error>(());
                        }
                        let guard = locks
                            .acquire(&format!("{prefix}/cycles/{i}"), options.no_wait())
                            .await?;
                        guard.release().await?;
                    }
                });
            }
            while let Some(joined) = tasks.join_next().await {
                match joined {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => return Err(failed("a cycle", &error)),
                    Err(error) => return Err(Failure::new(code::INTERNAL, format!("{error}"))),
                }
            }
            Ok(())
        }
    };
    let warmup = (count / 10).clamp(1, 10_000);
    run(0, warmup).await?;
    let baseline = rss();
    let started = Instant::now();
    let mut done = warmup;
    while done < count {
        let to = (done + count / 10).clamp(done + 1, count);
        run(done, to).await?;
        done = to;
        progress(args, format!("cycles: {done}/{count}"));
    }
    let elapsed = started.elapsed();
    let end = rss();
    let left = locks
        .list(&format!("{prefix}/cycles/"))
        .await
        .map_err(|e| failed("list", &e))?;
    check(
        left.is_empty(),
        format!(
            "{} names are still held or waited on after the cycles",
            left.len()
        ),
    )?;
    let growth = baseline.zip(end).map(|(b, e)| e as i64 - b as i64);
    let limit = cycles_growth_limit(count - warmup);
    if let Some(growth) = growth {
        check(
            growth <= limit,
            format!(
                "the client's memory grew by {growth} bytes over {} cycles after the \
                 warm-up (limit {limit}): per-name state is left behind",
                count - warmup
            ),
        )?;
    }
    Ok(json!({
        "workload": "cycles",
        "backend": locks.backend(),
        "cycles": count,
        "cycles_per_sec": (count - warmup) as f64 / elapsed.as_secs_f64().max(1e-9),
        "rss_baseline_bytes": baseline,
        "rss_end_bytes": end,
        "rss_growth_bytes": growth,
        "rss_growth_limit_bytes": limit,
        "names_left": left.len(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cycles_memory_limit_catches_per_name_state_and_never_overflows() {
        assert_eq!(cycles_growth_limit(0), CYCLES_GROWTH_FLOOR);
        assert_eq!(cycles_growth_limit(10_000), CYCLES_GROWTH_FLOOR);
        // The default run: a 64-byte map entry left per name is over the limit, the
        // 0.15-0.5 MB the backends grow by is far under it.
        let limit = cycles_growth_limit(990_000);
        assert!(64 * 990_000 > limit, "{limit}");
        assert!(500_000 < limit);
        assert_eq!(cycles_growth_limit(usize::MAX), i64::MAX);
    }
}
