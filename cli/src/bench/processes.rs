//! `fencelock bench --workload waiters --processes P`: the waiters queued from P child
//! processes of this binary (count/P each) instead of one, all on one name, served in
//! one queue.
//!
//! The parent takes the lock, then starts the children one after another: child i+1
//! only once child i reports all of its waiters queued (counted by `inspect` where the
//! backend can, else after a fixed pause per batch, as in one process), so the order
//! they started waiting is known: process order, then batch order within a process.
//! Then it releases the lock. Each child times its grants on the clock all processes
//! share (`SystemTime`, nanoseconds since the UNIX epoch) and prints them, one JSON line
//! each, on stdout once all of its waiters are served; the parent merges them and checks
//! them as the one-process workload checks its own.
//!
//! Child protocol (stdout, JSON lines): `{"queued": n, "rss_before": b, "rss_queued": a}`
//! once all waiters are queued; after all are served, `{"process": i, "batch": b,
//! "grant_ns": t}` per grant and `{"done_ns": t, "served": n}`. A child whose stdin
//! reaches its end (the parent stopped or died) drops its waiters, closes its client and
//! exits non-zero; the parent kills children still running when it fails (`kill_on_drop`).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fencelock::DistributedLock;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use super::scale::{BATCH, check, failed, handoff_medians, options, progress, rss, until_queued};
use crate::args::{Backend, BenchArgs};
use crate::exit::{Failure, code};

mod children;

use children::{ChildReport, Children};

/// Nanoseconds since the UNIX epoch: a clock every process on this machine shares.
fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Checks `--processes` against `--count`: each process queues count/P waiters.
///
/// # Errors
///
/// A usage [`Failure`] when P does not divide the count or exceeds it.
pub fn per_process(count: u64, processes: u16) -> Result<u64, Failure> {
    let processes = u64::from(processes);
    if processes > count || count % processes != 0 {
        return Err(Failure::usage(format!(
            "--processes {processes} must divide --count {count} (each process queues \
             count/processes waiters)"
        )));
    }
    Ok(count / processes)
}

/// Runs the waiters workload from `args.processes` child processes; `locks` holds the
/// lock while they queue.
///
/// # Errors
///
/// A [`Failure`] when the backend fails, a child fails or exits non-zero, a check does
/// not hold, or a signal (SIGINT, SIGTERM, SIGHUP) interrupts the run.
///
/// # Cancel safety
///
/// Dropping it kills the children still running (their waiters then leave the server
/// with their sessions or leases) and drops the holder, released in the background.
pub async fn parent(
    args: &BenchArgs,
    target: &Backend,
    locks: Arc<dyn DistributedLock>,
    prefix: &str,
) -> Result<Value, Failure> {
    let processes = usize::from(args.processes());
    let total = args.count.unwrap_or(10_000);
    let per = per_process(total, args.processes())?;
    let count = usize::try_from(total).unwrap_or(usize::MAX);
    let name = format!("{prefix}/waiters");
    let fifo = locks.capabilities().fifo;
    let mut signals = Interrupts::listen()?;
    let servers = super::server::servers(target);
    let holder = locks
        .acquire(&name, options(args))
        .await
        .map_err(|e| failed("the first holder", &e))?;
    let mut children = Children::new();
    let run = async {
        let mut reports = Vec::with_capacity(processes);
        for index in 0..processes {
            let mut queued = children.start(args, target, &name, index, per)?;
            // Until this child's waiters are queued, any child that fails fails the run.
            loop {
                tokio::select! {
                    done = &mut queued => match done {
                        Ok(()) => break,
                        Err(_) => return Err(children.failure(index).await),
                    },
                    Some(joined) = children.tasks.join_next() => match joined {
                        Ok(Ok(report)) => reports.push(report),
                        Ok(Err(failure)) => return Err(failure),
                        Err(error) => {
                            return Err(Failure::new(code::INTERNAL, format!("a child: {error}")));
                        }
                    },
                }
            }
            progress(
                args,
                format!(
                    "waiters: process {}/{processes}: {} queued",
                    index + 1,
                    per * (index as u64 + 1)
                ),
            );
        }
        progress(args, "waiters: all queued; releasing the holder");
        let counted = match &servers {
            Ok(servers) => super::server::read(servers).await,
            Err(why) => Err(why.clone()),
        };
        let released = now_ns();
        holder
            .release()
            .await
            .map_err(|e| failed("release of the first holder", &e))?;
        while let Some(joined) = children.tasks.join_next().await {
            match joined {
                Ok(Ok(report)) => reports.push(report),
                Ok(Err(failure)) => return Err(failure),
                Err(error) => {
                    return Err(Failure::new(code::INTERNAL, format!("a child: {error}")));
                }
            }
        }
        let after = match &servers {
            Ok(servers) => super::server::read(servers).await,
            Err(why) => Err(why.clone()),
        };
        Ok((
            released,
            reports,
            super::server::per_handoff(&counted, &after, count),
        ))
    };
    let outcome = tokio::select! {
        outcome = run => outcome,
        signal = signals.recv() => Err(Failure::new(
            crate::signals::exit_code(signal),
            format!("interrupted by {signal}: the child processes were stopped"),
        )),
    };
    let (released, mut reports, server) = match outcome {
        Ok(done) => done,
        Err(failure) => {
            children.stop().await;
            return Err(failure);
        }
    };
    reports.sort_by_key(|r| r.index);
    let mut report = summarize(&locks, fifo, count, processes, released, &reports)?;
    report["server_per_handoff"] = server;
    Ok(report)
}

/// The merged report of the children, checked.
fn summarize(
    locks: &Arc<dyn DistributedLock>,
    fifo: bool,
    count: usize,
    processes: usize,
    released: u64,
    reports: &[ChildReport],
) -> Result<Value, Failure> {
    // (grant time, process, batch): the order they started waiting is (process, batch).
    let mut grants: Vec<(u64, usize, usize)> = reports
        .iter()
        .flat_map(|r| r.grants.iter().map(|&(at, batch)| (at, r.index, batch)))
        .collect();
    grants.sort_unstable();
    check(
        grants.len() == count,
        format!("{} of {count} waiters were served", grants.len()),
    )?;
    let inversions = grants
        .windows(2)
        .filter(|w| (w[1].1, w[1].2) < (w[0].1, w[0].2))
        .count();
    // Each process's own waiters, in the order they were served.
    let within: usize = reports
        .iter()
        .map(|r| {
            let mut own = r.grants.clone();
            own.sort_unstable();
            own.windows(2).filter(|w| w[1].1 < w[0].1).count()
        })
        .sum();
    // FIFO as the backends keep it with several clients: each client's waiters in the
    // order they started waiting. Across clients a client's waiters take one place in
    // the server's queue at a time (`fencelock_core::line`): the next queues behind the
    // other clients' when the one before it is granted, so clients take turns.
    if fifo {
        check(
            within == 0,
            format!(
                "{within} waiters were served before a waiter of the same process queued \
                 earlier (FIFO claimed)"
            ),
        )?;
        if inversions > 0 {
            crate::exit::say!(
                "fencelock: note: {inversions} waiters were served before a waiter of an \
                 earlier process (FIFO holds within each process; the processes took turns)"
            );
        }
    }
    let gaps: Vec<Duration> =
        std::iter::once(grants.first().map_or(0, |g| g.0.saturating_sub(released)))
            .chain(grants.windows(2).map(|w| w[1].0.saturating_sub(w[0].0)))
            .map(Duration::from_nanos)
            .collect();
    let drained = Duration::from_nanos(
        reports
            .iter()
            .map(|r| r.done_ns)
            .max()
            .unwrap_or(released)
            .saturating_sub(released),
    );
    let growth: Option<u64> = reports
        .iter()
        .map(|r| Some(r.rss.1?.saturating_sub(r.rss.0?)))
        .sum();
    Ok(json!({
        "workload": "waiters",
        "backend": locks.backend(),
        "processes": processes,
        "waiters": count,
        "waiters_per_process": count / processes.max(1),
        "served_exactly_once": true,
        "fifo_claimed": fifo,
        "batch_order_inversions": inversions,
        "batch_order_inversions_within_processes": within,
        "fifo_checked": fifo.then_some("within_processes"),
        "rss_bytes_per_waiter": growth.map(|g| g as f64 / count.max(1) as f64),
        "handoff_us_median": handoff_medians(&gaps, count),
        "drain_s": drained.as_secs_f64(),
        "handoffs_per_sec": count as f64 / drained.as_secs_f64().max(1e-9),
    }))
}

/// SIGINT, SIGTERM and SIGHUP, which stop the run (and the children) instead of ending
/// the parent at once.
struct Interrupts {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Interrupts {
    fn listen() -> Result<Self, Failure> {
        use tokio::signal::unix::{SignalKind, signal};
        let install = |kind| signal(kind).map_err(|e| Failure::new(code::INTERNAL, e.to_string()));
        Ok(Interrupts {
            interrupt: install(SignalKind::interrupt())?,
            terminate: install(SignalKind::terminate())?,
            hangup: install(SignalKind::hangup())?,
        })
    }

    /// The next signal. Cancel safe.
    async fn recv(&mut self) -> nix::sys::signal::Signal {
        use nix::sys::signal::Signal;
        tokio::select! {
            _ = self.interrupt.recv() => Signal::SIGINT,
            _ = self.terminate.recv() => Signal::SIGTERM,
            _ = self.hangup.recv() => Signal::SIGHUP,
        }
    }
}

/// Child `index` of a `--processes` waiters bench: queues `--count` waiters on `name`
/// in batches, reports when all are queued, then the grants once all are served.
///
/// # Errors
///
/// A [`Failure`] when the backend fails, a check does not hold, or the parent goes away
/// (stdin ends) or a signal (SIGINT, SIGTERM, SIGHUP) comes first.
///
/// # Cancel safety
///
/// Dropping it drops the waiters, which the backend cleans up.
pub async fn child(
    args: &BenchArgs,
    locks: Arc<dyn DistributedLock>,
    index: u16,
    name: &str,
) -> Result<(), Failure> {
    let (gone, parent_gone) = oneshot::channel::<()>();
    // A thread of its own: a blocking read of stdin in the runtime's pool would hold up
    // the runtime's shutdown at exit.
    std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(move || {
            let mut buf = [0u8; 64];
            while let Ok(1..) = std::io::Read::read(&mut std::io::stdin(), &mut buf) {}
            let _ = gone.send(());
        })
        .map_err(|e| Failure::new(code::INTERNAL, format!("cannot watch stdin: {e}")))?;
    // A terminal's Ctrl-C reaches the whole process group: end as when the parent goes.
    let mut signals = Interrupts::listen()?;
    tokio::select! {
        done = queue_and_serve(args, locks, index, name) => done,
        _ = parent_gone => Err(Failure::new(
            code::INTERNAL,
            "the parent bench process went away (stdin closed); waiters dropped",
        )),
        signal = signals.recv() => Err(Failure::new(
            crate::signals::exit_code(signal),
            format!("interrupted by {signal}; waiters dropped"),
        )),
    }
}

/// Writes `line` and a newline to stdout, flushed.
fn emit(out: &mut impl Write, line: &Value) -> Result<(), Failure> {
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| Failure::new(code::INTERNAL, format!("cannot write the report: {e}")))
}

async fn queue_and_serve(
    args: &BenchArgs,
    locks: Arc<dyn DistributedLock>,
    index: u16,
    name: &str,
) -> Result<(), Failure> {
    let count = usize::try_from(args.count.unwrap_or(1)).unwrap_or(usize::MAX);
    // The waiters the earlier processes queued, as this client's `inspect` counts them.
    let earlier = if locks.capabilities().counts_waiters {
        locks
            .inspect(name)
            .await
            .map_err(|e| failed("inspect", &e))?
            .waiters
            .unwrap_or(0)
    } else {
        0
    };
    let before = rss();
    let grants: Arc<std::sync::Mutex<Vec<(u64, usize)>>> =
        Arc::new(std::sync::Mutex::new(Vec::with_capacity(count)));
    let mut tasks = JoinSet::new();
    for start in (0..count).step_by(BATCH) {
        let end = (start + BATCH).min(count);
        for i in start..end {
            let (locks, name, grants) = (locks.clone(), name.to_owned(), grants.clone());
            let options = options(args);
            tasks.spawn(async move {
                let guard = locks.acquire(&name, options).await?;
                let at = now_ns();
                grants
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((at, i / BATCH));
                guard.release().await
            });
        }
        until_queued(&*locks, name, earlier + end).await?;
    }
    let queued = rss();
    emit(
        &mut std::io::stdout().lock(),
        &json!({ "queued": count, "rss_before": before, "rss_queued": queued }),
    )?;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(failed("a waiter", &error)),
            Err(error) => return Err(Failure::new(code::INTERNAL, format!("a waiter: {error}"))),
        }
    }
    let done = now_ns();
    let grants = std::mem::take(
        &mut *grants
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for (at, batch) in &grants {
        emit(
            &mut out,
            &json!({ "process": index, "batch": batch, "grant_ns": at }),
        )?;
    }
    emit(
        &mut out,
        &json!({ "done_ns": done, "served": grants.len() }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_is_split_evenly() {
        assert_eq!(per_process(10_000, 10).unwrap(), 1_000);
        assert_eq!(per_process(60, 3).unwrap(), 20);
        assert_eq!(per_process(5, 5).unwrap(), 1);
        for (count, processes) in [(10, 3), (2, 3)] {
            let failure = per_process(count, processes).unwrap_err();
            assert_eq!(failure.code, code::USAGE);
            assert!(failure.message.contains("--processes"), "{failure}");
        }
    }
}
