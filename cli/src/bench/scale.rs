//! `fencelock bench --workload waiters|held|cycles`: how the client scales with many
//! waiters on one name, many held locks, and many names over time, on the user's own
//! deployment.
//!
//! Memory is the resident set of this process (`VmRSS` in `/proc/self/status`), before
//! and after; so run nothing else in the process. Every workload checks what it
//! measures: each waiter is served exactly once (in FIFO order where the backend claims
//! FIFO), no held lock is lost, every name is free at the end.

use std::sync::Arc;
use std::time::Duration;

use fencelock::{AcquireOptions, DistributedLock, Error};
use hdrhistogram::Histogram;
use serde_json::Value;

use crate::args::{Backend, BenchArgs, Workload};
use crate::exit::{Failure, code};

mod cycles;
mod held;
mod waiters;

pub(super) use waiters::{BATCH, handoff_medians, until_queued};

/// How many requests run at once when filling or draining (acquiring many names).
const CONCURRENCY: usize = 64;

/// The resident set of this process, in bytes (`None` off Linux).
pub(super) fn rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes per item of the growth from `before` to `after`.
fn per_item(before: Option<u64>, after: Option<u64>, items: usize) -> Option<f64> {
    let (before, after) = (before?, after?);
    Some(after.saturating_sub(before) as f64 / items.max(1) as f64)
}

pub(super) fn failed(what: &str, error: &Error) -> Failure {
    Failure::new(
        crate::exit::code_of(error),
        format!("{what}: {}", crate::exit::one_line(error)),
    )
}

pub(super) fn check(ok: bool, what: impl Into<String>) -> Result<(), Failure> {
    if ok {
        Ok(())
    } else {
        Err(Failure::new(code::INTERNAL, what.into()))
    }
}

pub(super) fn options(args: &BenchArgs) -> AcquireOptions {
    match args.lease {
        Some(lease) => AcquireOptions::new().lease(lease),
        None => AcquireOptions::new(),
    }
}

pub(super) fn progress(args: &BenchArgs, line: impl AsRef<str>) {
    if !args.quiet {
        crate::exit::say!("{}", line.as_ref());
    }
}

/// Runs a scale workload against `locks` and returns its report.
///
/// # Errors
///
/// A [`Failure`] when the backend fails or a check does not hold.
///
/// # Cancel safety
///
/// Dropping it drops the waiters and guards, which the backend cleans up.
///
/// `other`, for the `held` workload, is a second client: its acquires are timed beside
/// those of the client that holds everything.
pub async fn run(
    args: &BenchArgs,
    target: &Backend,
    locks: Arc<dyn DistributedLock>,
    other: Option<Arc<dyn DistributedLock>>,
    prefix: &str,
) -> Result<Value, Failure> {
    match args.workload {
        Workload::Waiters => waiters::waiters(args, target, locks, prefix).await,
        Workload::Held => {
            let other = other.unwrap_or_else(|| locks.clone());
            held::held(args, locks, other, prefix).await
        }
        Workload::Cycles => cycles::cycles(args, locks, prefix).await,
        Workload::Uncontended | Workload::Contended | Workload::ManyKeys => Err(Failure::usage(
            "not a scale workload (waiters, held, cycles)",
        )),
    }
}

/// The median and the largest of `latencies` in microseconds, `None` for none.
fn median_max_micros(latencies: &[Duration]) -> Option<(u64, u64)> {
    let mut histogram = Histogram::<u64>::new(3).ok()?;
    for l in latencies {
        let _ = histogram.record(u64::try_from(l.as_micros()).unwrap_or(u64::MAX).max(1));
    }
    (!latencies.is_empty()).then(|| (histogram.value_at_quantile(0.5), histogram.max()))
}

/// The report as text: one `key: value` line per measurement.
pub fn text(report: &Value) -> String {
    fn lines(prefix: &str, value: &Value, out: &mut String) {
        match value {
            Value::Object(map) => {
                for (key, value) in map {
                    let key = if prefix.is_empty() {
                        key.clone()
                    } else {
                        format!("{prefix}.{key}")
                    };
                    lines(&key, value, out);
                }
            }
            Value::Number(n) => {
                let shown = n
                    .as_f64()
                    .filter(|f| f.fract() != 0.0)
                    .map_or_else(|| n.to_string(), |f| format!("{f:.2}"));
                out.push_str(&format!("{prefix}: {shown}\n"));
            }
            other => out.push_str(&format!("{prefix}: {other}\n")),
        }
    }
    let mut out = String::new();
    lines("", report, &mut out);
    out
}
