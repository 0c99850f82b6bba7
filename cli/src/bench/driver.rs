//! Running a workload: clients looping acquire + release until a deadline.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use fencelock::{AcquireOptions, DistributedLock, Error};
use tokio::time::Instant;

use crate::args::Workload;
use crate::exit::Failure;

/// One way of taking and releasing a lock: the library or a raw-client floor.
#[async_trait]
pub trait Cycle: Send + Sync {
    /// Acquires `name`, waiting at most until `deadline`, and releases it. `Ok(false)`
    /// when the deadline came first.
    async fn cycle(&self, name: &str, deadline: Instant) -> Result<bool, Failure>;
}

/// The library, through `DistributedLock`.
pub struct Library(pub Arc<dyn DistributedLock>);

#[async_trait]
impl Cycle for Library {
    async fn cycle(&self, name: &str, deadline: Instant) -> Result<bool, Failure> {
        let wait = deadline.saturating_duration_since(Instant::now());
        match self
            .0
            .acquire(name, AcquireOptions::new().wait_timeout(wait))
            .await
        {
            Ok(guard) => {
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
    /// Cycle latencies, sorted.
    pub latencies: Vec<Duration>,
    /// Completed cycles per client.
    pub per_client: Vec<u64>,
}

impl Measurement {
    /// Cycles per second.
    pub fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }

    /// The latency at quantile `q` (0..=1); zero without samples.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let index = ((self.latencies.len() - 1) as f64 * q).round() as usize;
        self.latencies[index.min(self.latencies.len() - 1)]
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
    }
}

/// Runs `workload` with one task per client for `duration`, printing a progress line to
/// stderr every second.
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
    clients: Vec<Arc<dyn Cycle>>,
    duration: Duration,
) -> Result<Measurement, Failure> {
    let start = Instant::now();
    let deadline = start + duration;
    let total = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, client)| {
            let name = lock_name(workload, prefix, i);
            let total = total.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while Instant::now() < deadline {
                    let begun = Instant::now();
                    if !client.cycle(&name, deadline).await? {
                        break;
                    }
                    latencies.push(begun.elapsed());
                    total.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, Failure>(latencies)
            })
        })
        .collect();
    let progress = tokio::spawn(progress(label, workload, total, start, duration));
    let mut measurement = Measurement {
        label,
        description,
        ops: 0,
        elapsed: Duration::ZERO,
        latencies: Vec::new(),
        per_client: Vec::new(),
    };
    let mut failure = None;
    for task in tasks {
        match task.await {
            Ok(Ok(latencies)) => {
                measurement.per_client.push(latencies.len() as u64);
                measurement.latencies.extend(latencies);
            }
            Ok(Err(f)) => failure = failure.or(Some(f)),
            Err(e) => failure = failure.or(Some(Failure::new(70, e.to_string()))),
        }
    }
    progress.abort();
    let _ = progress.await;
    end_progress_line();
    if let Some(failure) = failure {
        return Err(failure);
    }
    measurement.elapsed = start.elapsed();
    measurement.ops = measurement.latencies.len() as u64;
    measurement.latencies.sort();
    Ok(measurement)
}

async fn progress(
    label: &str,
    workload: Workload,
    total: Arc<AtomicU64>,
    start: Instant,
    duration: Duration,
) {
    let terminal = std::io::stderr().is_terminal();
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

fn end_progress_line() {
    if std::io::stderr().is_terminal() {
        eprint!("\r\x1b[K");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measurement(per_client: Vec<u64>) -> Measurement {
        Measurement {
            label: "fencelock",
            description: String::new(),
            ops: per_client.iter().sum(),
            elapsed: Duration::from_secs(2),
            latencies: (1..=100).map(Duration::from_millis).collect(),
            per_client,
        }
    }

    #[test]
    fn statistics() {
        let m = measurement(vec![50, 50]);
        assert_eq!(m.ops_per_sec(), 50.0);
        assert_eq!(m.quantile(0.5), Duration::from_millis(51));
        assert_eq!(m.quantile(0.99), Duration::from_millis(99));
        assert_eq!(m.fairness(), 1.0);
        assert_eq!(measurement(vec![100, 0, 0, 0]).fairness(), 0.25);
    }
}
