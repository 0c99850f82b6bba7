//! Running a workload: clients looping acquire + release until a deadline.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use fencelock::{AcquireOptions, DistributedLock, Error};
use hdrhistogram::Histogram;
use tokio::time::Instant;

use crate::args::Workload;
use crate::exit::Failure;

/// Called by [`Cycle::cycle`] once the lock is granted, while it is held: so the calls
/// of the clients of one name are in grant order.
pub type Granted<'a> = &'a (dyn Fn() + Send + Sync);

/// One way of taking and releasing a lock: the library or a raw-client floor.
#[async_trait]
pub trait Cycle: Send + Sync {
    /// Acquires `name`, waiting at most until `deadline`, calls `granted`, holds the
    /// lock for `hold`, and releases it. `Ok(false)` when the deadline came first.
    async fn cycle(
        &self,
        name: &str,
        deadline: Instant,
        hold: Duration,
        granted: Granted<'_>,
    ) -> Result<bool, Failure>;
}

/// The library, through `DistributedLock`, with these options (`--lease`); the wait is
/// each cycle's own.
pub struct Library {
    /// The client.
    pub locks: Arc<dyn DistributedLock>,
    /// The acquire options, but for the wait.
    pub options: AcquireOptions,
}

#[async_trait]
impl Cycle for Library {
    async fn cycle(
        &self,
        name: &str,
        deadline: Instant,
        hold: Duration,
        granted: Granted<'_>,
    ) -> Result<bool, Failure> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self
            .locks
            .acquire(name, self.options.wait_timeout(wait))
            .await
        {
            Ok(guard) => {
                granted();
                if !hold.is_zero() {
                    tokio::time::sleep(hold).await;
                }
                guard.release().await?;
                Ok(true)
            }
            Err(Error::Timeout { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

/// The results of one implementation on one workload.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// `fencelock` or `baseline`.
    pub label: &'static str,
    /// What was measured, for humans.
    pub description: String,
    /// Completed acquire + release cycles.
    pub ops: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Cycle latencies in microseconds (3 significant digits, up to an hour).
    pub latencies: Histogram<u64>,
    /// Completed cycles per client.
    pub per_client: Vec<u64>,
    /// Contended: grants to another client than the grant before (the lock changing
    /// hands, not one client taking it again); `None` for other workloads.
    pub handoffs: Option<u64>,
}

/// An empty latency histogram: microseconds from 1 µs to an hour, 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

impl Measurement {
    /// Cycles per second.
    pub fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    /// Hand-overs per second (contended only).
    pub fn handoffs_per_sec(&self) -> Option<f64> {
        self.handoffs
            .map(|h| h as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON))
    }

    /// The latency at quantile `q` (0..=1; 1 is the maximum); zero without samples.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_micros(self.latencies.value_at_quantile(q))
    }

    /// Adds another round of the same implementation.
    pub fn merge(&mut self, other: Measurement) {
        self.ops += other.ops;
        self.elapsed += other.elapsed;
        let _ = self.latencies.add(&other.latencies);
        if self.per_client.len() < other.per_client.len() {
            self.per_client.resize(other.per_client.len(), 0);
        }
        for (mine, theirs) in self.per_client.iter_mut().zip(other.per_client) {
            *mine += theirs;
        }
        self.handoffs = match (self.handoffs, other.handoffs) {
            (Some(mine), Some(theirs)) => Some(mine + theirs),
            (mine, theirs) => mine.or(theirs),
        };
    }

    /// Jain's fairness index of the per-client counts: 1 when all clients got the lock
    /// equally often, 1/N when one got it every time.
    pub fn fairness(&self) -> f64 {
        let n = self.per_client.len() as f64;
        let sum: f64 = self.per_client.iter().map(|&c| c as f64).sum();
        let squares: f64 = self.per_client.iter().map(|&c| (c as f64).powi(2)).sum();
        if squares == 0.0 {
            return 1.0;
        }
        sum * sum / (n * squares)
    }
}

/// The lock name of client `i` in `workload`, under `prefix`.
pub fn lock_name(workload: Workload, prefix: &str, i: usize) -> String {
    match workload {
        Workload::Uncontended => format!("{prefix}/uncontended"),
        Workload::Contended => format!("{prefix}/contended"),
        Workload::ManyKeys => format!("{prefix}/key-{i}"),
        // Scale workloads name their own locks (see `scale`).
        Workload::Waiters | Workload::Held | Workload::Cycles => format!("{prefix}/scale-{i}"),
    }
}

/// How a run is driven.
#[derive(Debug, Clone, Copy)]
pub struct Drive {
    /// How long the run lasts.
    pub duration: Duration,
    /// How long each holder keeps the lock.
    pub hold: Duration,
    /// No progress line.
    pub quiet: bool,
}

/// Runs `workload` with one task per client for `drive.duration`, printing a progress
/// line to stderr every second unless quiet.
///
/// # Errors
///
/// The first error of any client.
///
/// # Cancel safety
///
/// Dropping it drops the clients' guards (released in the background).
pub async fn drive(
    label: &'static str,
    description: String,
    workload: Workload,
    prefix: &str,
    clients: &[Arc<dyn Cycle>],
    drive: Drive,
) -> Result<Measurement, Failure> {
    let Drive {
        duration,
        hold,
        quiet,
    } = drive;
    let start = Instant::now();
    let deadline = start + duration;
    let total = Arc::new(AtomicU64::new(0));
    // The client granted last and the hand-overs, counted under the lock (contended:
    // one name for all clients).
    let last = Arc::new(AtomicUsize::new(usize::MAX));
    let handoffs = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, client)| {
            let client = client.clone();
            let name = lock_name(workload, prefix, i);
            let total = total.clone();
            let (last, handoffs) = (last.clone(), handoffs.clone());
            tokio::spawn(async move {
                let granted = move || {
                    let before = last.swap(i, Ordering::AcqRel);
                    if before != i && before != usize::MAX {
                        handoffs.fetch_add(1, Ordering::Relaxed);
                    }
                };
                let mut latencies = new_histogram();
                while Instant::now() < deadline {
                    let begun = Instant::now();
                    if !client.cycle(&name, deadline, hold, &granted).await? {
                        break;
                    }
                    let micros = u64::try_from(begun.elapsed().as_micros()).unwrap_or(u64::MAX);
                    latencies.saturating_record(micros.max(1));
                    total.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, Failure>(latencies)
            })
        })
        .collect();
    let progress =
        (!quiet).then(|| tokio::spawn(progress(label, workload, total, start, duration)));
    let mut measurement = Measurement {
        label,
        description,
        ops: 0,
        elapsed: Duration::ZERO,
        latencies: new_histogram(),
        per_client: Vec::new(),
        handoffs: None,
    };
    let mut failure = None;
    for task in tasks {
        match task.await {
            Ok(Ok(latencies)) => {
                measurement.per_client.push(latencies.len());
                let _ = measurement.latencies.add(&latencies);
            }
            Ok(Err(f)) => failure = failure.or(Some(f)),
            Err(e) => failure = failure.or(Some(Failure::new(70, e.to_string()))),
        }
    }
    if let Some(progress) = progress {
        progress.abort();
        let _ = progress.await;
        end_progress_line();
    }
    if let Some(failure) = failure {
        return Err(failure);
    }
    measurement.elapsed = start.elapsed();
    measurement.ops = measurement.latencies.len();
    // On distinct names (uncontended, many-keys) nothing changes hands.
    measurement.handoffs =
        (workload == Workload::Contended).then(|| handoffs.load(Ordering::Relaxed));
    Ok(measurement)
}

async fn progress(
    label: &str,
    workload: Workload,
    total: Arc<AtomicU64>,
    start: Instant,
    duration: Duration,
) {
    let terminal = rewrite_in_place();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let ops = total.load(Ordering::Relaxed);
        let elapsed = start.elapsed().min(duration).as_secs_f64();
        let line = format!(
            "{label} {}: {elapsed:.0}/{:.0} s, {ops} ops, {:.0} ops/s",
            workload.as_str(),
            duration.as_secs_f64(),
            ops as f64 / elapsed.max(f64::EPSILON)
        );
        let mut err = std::io::stderr().lock();
        let _ = if terminal {
            write!(err, "\r\x1b[K{line}")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }
}

/// Whether the progress line is rewritten in place (an ANSI erase): only on a terminal,
/// and not when `NO_COLOR` is set. Otherwise each update is a line of its own.
fn rewrite_in_place() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn end_progress_line() {
    if rewrite_in_place() {
        crate::exit::say_more!("\r\x1b[K");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measurement(per_client: Vec<u64>) -> Measurement {
        let mut latencies = new_histogram();
        for ms in 1..=100 {
            latencies.record(ms * 1000).unwrap();
        }
        Measurement {
            label: "fencelock",
            description: String::new(),
            ops: per_client.iter().sum(),
            elapsed: Duration::from_secs(2),
            latencies,
            per_client,
            handoffs: None,
        }
    }

    /// Equal within the histogram's 3 significant digits.
    fn close(a: Duration, b: Duration) -> bool {
        a.abs_diff(b) <= b / 500
    }

    #[test]
    fn statistics() {
        let m = measurement(vec![50, 50]);
        assert_eq!(m.ops_per_sec(), 50.0);
        assert!(
            close(m.quantile(0.5), Duration::from_millis(50)),
            "{:?}",
            m.quantile(0.5)
        );
        assert!(close(m.quantile(0.99), Duration::from_millis(99)));
        assert!(close(m.quantile(1.0), Duration::from_millis(100)));
        assert_eq!(m.fairness(), 1.0);
        assert_eq!(measurement(vec![100, 0, 0, 0]).fairness(), 0.25);
        let mut merged = measurement(vec![10, 20]);
        merged.merge(measurement(vec![5, 5]));
        assert_eq!(merged.per_client, [15, 25]);
        assert_eq!(merged.latencies.len(), 200);
        assert_eq!(merged.elapsed, Duration::from_secs(4));
    }
}
