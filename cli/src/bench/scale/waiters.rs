//! The `waiters` workload: many waiters queued on one name behind a holder, then
//! served one after the other.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fencelock::DistributedLock;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{check, failed, median_max_micros, options, per_item, progress, rss};
use crate::args::{Backend, BenchArgs};
use crate::bench::server;
use crate::exit::{Failure, code};

/// Waiters are queued in batches of this many; FIFO is checked between batches (each is
/// fully queued before the next starts, so a later batch must never be served before
/// an earlier one).
pub(in crate::bench) const BATCH: usize = 100;

/// One served waiter: the order of its grant, its index, the instant of the grant and
/// its token.
type Grant = (usize, usize, Instant, u64);

/// `count` waiters on one name, queued in batches behind a holder, then served one
/// after the other (each releases at once). Reports memory per waiter, hand-off latency
/// at queue lengths of the whole count, 1,000 and 10, and checks each waiter is served
/// once, in batch order where the backend claims FIFO.
pub(super) async fn waiters(
    args: &BenchArgs,
    target: &Backend,
    locks: Arc<dyn DistributedLock>,
    prefix: &str,
) -> Result<Value, Failure> {
    let count = usize::try_from(args.count.unwrap_or(10_000)).unwrap_or(usize::MAX);
    let name = format!("{prefix}/waiters");
    let fifo = locks.capabilities().fifo;
    let holder = locks
        .acquire(&name, options(args))
        .await
        .map_err(|e| failed("the first holder", &e))?;
    let before = rss();
    // Grant order: (sequence, waiter, the instant of the grant, token) per served waiter;
    // `inside` counts the waiters holding at once (more than one is an overlap).
    let order = Arc::new(AtomicUsize::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let grants: Arc<std::sync::Mutex<Vec<Grant>>> =
        Arc::new(std::sync::Mutex::new(Vec::with_capacity(count)));
    let mut tasks = JoinSet::new();
    for start in (0..count).step_by(BATCH) {
        let end = (start + BATCH).min(count);
        for i in start..end {
            let (locks, name, grants, order) =
                (locks.clone(), name.clone(), grants.clone(), order.clone());
            let (inside, overlaps) = (inside.clone(), overlaps.clone());
            let options = options(args);
            tasks.spawn(async move {
                let guard = locks.acquire(&name, options).await?;
                let at = Instant::now();
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let seq = order.fetch_add(1, Ordering::SeqCst);
                grants
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((seq, i, at, guard.token().get()));
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.release().await
            });
        }
        // Wait until this batch is queued on the server (or a fixed pause where the
        // backend cannot count waiters), so batches are queued in order.
        until_queued(&*locks, &name, end).await?;
        if (end / BATCH) % 20 == 0 {
            progress(args, format!("waiters: {end}/{count} queued"));
        }
    }
    let queued_rss = rss();
    progress(args, "waiters: all queued; releasing the holder");
    let servers = server::servers(target);
    let counted = match &servers {
        Ok(servers) => server::read(servers).await,
        Err(why) => Err(why.clone()),
    };
    let released = Instant::now();
    holder
        .release()
        .await
        .map_err(|e| failed("release of the first holder", &e))?;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(failed("a waiter", &error)),
            Err(error) => return Err(Failure::new(code::INTERNAL, format!("a waiter: {error}"))),
        }
    }
    let drained = released.elapsed();
    let server = match &servers {
        Ok(servers) => server::per_handoff(&counted, &server::read(servers).await, count),
        Err(why) => server::per_handoff(&Err(why.clone()), &counted, count),
    };
    let mut grants = std::mem::take(
        &mut *grants
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    grants.sort_by_key(|g| g.0);
    let mut served: Vec<usize> = grants.iter().map(|g| g.1).collect();
    served.sort_unstable();
    served.dedup();
    check(
        grants.len() == count && served.len() == count,
        format!(
            "{} grants to {} of {count} waiters (each must be served exactly once)",
            grants.len(),
            served.len()
        ),
    )?;
    let overlaps = overlaps.load(Ordering::SeqCst);
    check(
        overlaps == 0,
        format!("{overlaps} waiters were granted while another held the lock"),
    )?;
    let regressions = grants.windows(2).filter(|w| w[1].3 <= w[0].3).count();
    check(
        regressions == 0,
        format!("{regressions} grants had a token not above the previous grant's"),
    )?;
    let inversions = grants
        .windows(2)
        .filter(|w| w[1].1 / BATCH < w[0].1 / BATCH)
        .count();
    if fifo {
        check(
            inversions == 0,
            format!("{inversions} waiters were served before an earlier batch (FIFO claimed)"),
        )?;
    }
    // Hand-off latency: from one grant to the next (the previous holder releases at
    // once), at the start (the whole queue waiting), with 1,000 left and with 10 left.
    let gaps: Vec<Duration> = std::iter::once(
        grants
            .first()
            .map_or(Duration::ZERO, |g| g.2.saturating_duration_since(released)),
    )
    .chain(
        grants
            .windows(2)
            .map(|w| w[1].2.saturating_duration_since(w[0].2)),
    )
    .collect();
    Ok(json!({
        "workload": "waiters",
        "backend": locks.backend(),
        "waiters": count,
        "served_exactly_once": true,
        "overlapping_grants": overlaps,
        "tokens_increasing": true,
        "fifo_claimed": fifo,
        "batch_order_inversions": inversions,
        "rss_bytes_per_waiter": per_item(before, queued_rss, count),
        "handoff_us_median": handoff_medians(&gaps, count),
        "server_per_handoff": server,
        "drain_s": drained.as_secs_f64(),
        "handoffs_per_sec": count as f64 / drained.as_secs_f64().max(1e-9),
    }))
}

/// The median hand-off latencies (`gaps`: from the holder's release to the first grant,
/// then from each grant to the next) over 10 hand-offs with the whole queue of `count`,
/// 1,000 and 10 left, and the longest of them over the shortest.
pub(in crate::bench) fn handoff_medians(gaps: &[Duration], count: usize) -> Value {
    let window = |left: usize| {
        let at = count.saturating_sub(left);
        let from = at.min(gaps.len().saturating_sub(1));
        let to = (from + 10).min(gaps.len());
        median_micros(gaps.get(from..to).unwrap_or_default())
    };
    let at_full = window(count);
    let at_1000 = (count > 1000).then(|| window(1000)).flatten();
    let at_10 = window(10);
    let shortest = [at_full, at_1000, at_10]
        .into_iter()
        .flatten()
        .fold(f64::INFINITY, f64::min);
    let longest = [at_full, at_1000, at_10]
        .into_iter()
        .flatten()
        .fold(0.0, f64::max);
    json!({
        "queue_full": at_full,
        "queue_1000": at_1000,
        "queue_10": at_10,
        "longest_over_shortest": (shortest.is_finite() && shortest > 0.0).then(|| longest / shortest),
    })
}

/// Waits until `inspect` counts `n` waiters on `name` (or, on a backend that cannot
/// count them, until the tasks had a moment to send their requests).
pub(in crate::bench) async fn until_queued(
    locks: &dyn DistributedLock,
    name: &str,
    n: usize,
) -> Result<(), Failure> {
    if !locks.capabilities().counts_waiters {
        tokio::time::sleep(Duration::from_millis(100)).await;
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = locks
            .inspect(name)
            .await
            .map_err(|e| failed("inspect", &e))?;
        if info.waiters.unwrap_or(0) >= n {
            return Ok(());
        }
        check(
            Instant::now() < deadline,
            format!("{n} waiters were not queued within 60 s ({info:?})"),
        )?;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The median of hand-off latencies in microseconds.
fn median_micros(latencies: &[Duration]) -> Option<f64> {
    median_max_micros(latencies).map(|(median, _)| median as f64)
}
