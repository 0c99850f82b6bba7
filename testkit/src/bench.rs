//! The shared harness of the backend benchmarks (`examples/*bench*.rs`): latencies in
//! hdrhistogram, medians and ratios over repeats, kinds interleaved round by round, and
//! the process's own CPU time.
//!
//! Every comparison runs its kinds (the library, a raw floor, a peer) side by side in one
//! process, alternating between them in short rounds, so drift of a shared machine hits
//! all alike; a ratio is taken per repeat, between values measured in the same repeat,
//! and reported as the median over repeats with every repeat's value beside it.
//!
//! The harness has no async runtime of its own: the interleaving helpers are `async fn`s
//! generic over "do one op of kind K" ([`interleave`]) or "one run of kind K"
//! ([`interleave_runs`]), and [`run_workers`] / [`timed_join`] await handles the bench
//! spawned on its own runtime.
//!
//! ```no_run
//! # async fn op(kind: &str) {}
//! use fencelock_testkit::bench::{self, Rounds};
//!
//! # async fn run() {
//! let kinds = ["raw", "fencelock"];
//! let rounds = Rounds::new(3, 5, 100, 50);
//! println!("uncontended ({rounds})"); // "3 repeats x 5 interleaved rounds x 100 ops"
//! let measured = bench::interleave(&kinds, rounds, |kind| op(kind)).await;
//! // "  fencelock   p50 … µs  p99 … µs  … ops/s  p50/raw median 1.04 (1.03 1.04 1.06)"
//! println!("{}", bench::latency_lines(&measured, Some(0), |kind| kind));
//! let cpu = bench::ratios(&bench::over(
//!     &measured[1].repeat_cpu_per_op,
//!     &measured[0].repeat_cpu_per_op,
//! ));
//! println!("client CPU per op, fencelock / raw: {cpu}");
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

pub use hdrhistogram::Histogram;

mod cpu;

pub use cpu::{ProcessCpu, USER_HZ};

/// The largest latency a [`histogram`] tells apart: one hour, in µs. Longer ones are
/// recorded as this.
pub const MAX_MICROS: u64 = 3_600_000_000;

/// An empty latency histogram in µs: 1 µs to one hour ([`MAX_MICROS`]), 3 significant
/// digits.
#[must_use]
pub fn histogram() -> Histogram<u64> {
    // Constant bounds that hdrhistogram accepts (1 <= low, 2 * low <= high, sigfig <=
    // 5; the unit tests build one): the error is unreachable, whatever the input.
    Histogram::new_with_bounds(1, MAX_MICROS, 3).expect("constant, valid bounds")
}

/// `d` in whole µs, at least 1 (a histogram's lowest value) and at most [`MAX_MICROS`].
#[must_use]
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros())
        .unwrap_or(u64::MAX)
        .clamp(1, MAX_MICROS)
}

/// Records the latency `d` in `h` (µs, clamped as [`micros`] does).
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    h.saturating_record(micros(d));
}

/// Adds `from` into `into` (histograms from [`histogram`], whose bounds agree).
pub fn merge(into: &mut Histogram<u64>, from: &Histogram<u64>) {
    // Same bounds: cannot fail; a value out of `into`'s range would be the only reason.
    let _ = into.add(from);
}

/// What one line of a bench reports about a histogram: count, p50, p99, max (µs) and
/// the rate over `elapsed`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// The number of recorded ops.
    pub ops: u64,
    /// The median latency, µs.
    pub p50: u64,
    /// The 99th percentile latency, µs.
    pub p99: u64,
    /// The largest latency, µs.
    pub max: u64,
    /// The wall-clock time the ops took, for [`Summary::ops_per_sec`].
    pub elapsed: Duration,
}

impl Summary {
    /// The summary of `h`, whose ops took `elapsed` of wall-clock time.
    #[must_use]
    pub fn new(h: &Histogram<u64>, elapsed: Duration) -> Self {
        Summary {
            ops: h.len(),
            p50: h.value_at_quantile(0.5),
            p99: h.value_at_quantile(0.99),
            max: h.max(),
            elapsed,
        }
    }

    /// Ops per second over [`Summary::elapsed`] (0 when nothing was timed).
    #[must_use]
    pub fn ops_per_sec(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.ops as f64 / secs
        } else {
            0.0
        }
    }
}

impl fmt::Display for Summary {
    /// `ops=N  p50 … µs  p99 … µs  max … µs  … ops/s`, in fixed-width columns.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ops={:<6} p50 {:>6} µs  p99 {:>7} µs  max {:>7} µs  {:>7.0} ops/s",
            self.ops,
            self.p50,
            self.p99,
            self.max,
            self.ops_per_sec()
        )
    }
}

/// The median of `values` (the upper one of an even count; NaN for none).
#[must_use]
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `median M (r1 r2 …)`: the median of `values` and each of them, two decimals.
#[must_use]
pub fn ratios(values: &[f64]) -> String {
    let shown: Vec<String> = values.iter().map(|r| format!("{r:.2}")).collect();
    format!(
        "median {:.2} ({})",
        median(values.to_vec()),
        shown.join(" ")
    )
}

/// `mine[i] / floor[i]` for each repeat `i` both have.
#[must_use]
pub fn over(mine: &[f64], floor: &[f64]) -> Vec<f64> {
    mine.iter().zip(floor).map(|(m, f)| m / f).collect()
}

/// `ops` sequential ops, `once()` each, every one timed: their latencies (µs). The body
/// of a worker of [`run_workers`].
///
/// # Errors
///
/// None: an op that fails is `once`'s to report (a bench panics on it).
///
/// # Cancel safety
///
/// Dropped, it stops between ops (or inside one, as `once`'s future allows); the ops
/// already done are not reported.
pub async fn timed_ops<F, Fut>(ops: usize, mut once: F) -> Histogram<u64>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut latencies = histogram();
    for _ in 0..ops {
        let start = Instant::now();
        once().await;
        record(&mut latencies, start.elapsed());
    }
    latencies
}

/// How [`interleave`] runs: `warmup` untimed ops of each kind, then `repeats` repeats of
/// `rounds` rounds, each round `ops` timed ops of every kind in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rounds {
    /// Repeats: each gives one p50 per kind, and so one ratio.
    pub repeats: usize,
    /// Rounds per repeat: the kinds alternate once per round.
    pub rounds: usize,
    /// Timed ops of one kind in one round.
    pub ops: usize,
    /// Untimed ops of each kind before the first repeat.
    pub warmup: usize,
}

impl Rounds {
    /// `repeats` repeats of `rounds` rounds of `ops` ops, after `warmup` untimed ops of
    /// each kind.
    #[must_use]
    pub fn new(repeats: usize, rounds: usize, ops: usize, warmup: usize) -> Self {
        Rounds {
            repeats,
            rounds,
            ops,
            warmup,
        }
    }

    /// The timed ops of one kind over the whole run.
    #[must_use]
    pub fn ops_per_kind(&self) -> usize {
        self.repeats * self.rounds * self.ops
    }
}

impl fmt::Display for Rounds {
    /// `R repeats x N interleaved rounds x M ops`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} repeats x {} interleaved rounds x {} ops",
            self.repeats, self.rounds, self.ops
        )
    }
}

/// One kind's latencies from [`interleave`].
#[derive(Clone, Debug)]
pub struct Measured<K> {
    /// The kind measured.
    pub kind: K,
    /// Every timed op of the kind, pooled over all repeats (µs).
    pub histogram: Histogram<u64>,
    /// The p50 of each repeat (µs), in order.
    pub repeat_p50: Vec<f64>,
    /// The wall-clock time of the kind's rounds, summed.
    pub elapsed: Duration,
    /// The process's CPU time per op in each repeat (µs; [`ProcessCpu`] over the kind's
    /// rounds, divided by their ops), in order.
    pub repeat_cpu_per_op: Vec<f64>,
}

impl<K> Measured<K> {
    /// The pooled summary (ops/s over the kind's own rounds).
    #[must_use]
    pub fn summary(&self) -> Summary {
        Summary::new(&self.histogram, self.elapsed)
    }

    /// This kind's p50 over `floor`'s, repeat by repeat (feed it to [`ratios`]).
    #[must_use]
    pub fn p50_over(&self, floor: &Measured<K>) -> Vec<f64> {
        over(&self.repeat_p50, &floor.repeat_p50)
    }
}

/// Sequential latency of each of `kinds`, interleaved as `plan` says: `once(kind)` does
/// one op of `kind`, which this times. Returns one [`Measured`] per kind, in the order of
/// `kinds`.
///
/// # Errors
///
/// None: an op that fails is `once`'s to report (a bench panics on it).
///
/// # Cancel safety
///
/// Dropped, it stops inside the current op as `once`'s future allows; nothing measured
/// so far is returned.
pub async fn interleave<K, F, Fut>(kinds: &[K], plan: Rounds, mut once: F) -> Vec<Measured<K>>
where
    K: Copy,
    F: FnMut(K) -> Fut,
    Fut: Future<Output = ()>,
{
    for &kind in kinds {
        for _ in 0..plan.warmup {
            once(kind).await;
        }
    }
    let mut measured: Vec<Measured<K>> = kinds
        .iter()
        .map(|&kind| Measured {
            kind,
            histogram: histogram(),
            repeat_p50: Vec::with_capacity(plan.repeats),
            elapsed: Duration::ZERO,
            repeat_cpu_per_op: Vec::with_capacity(plan.repeats),
        })
        .collect();
    for _ in 0..plan.repeats {
        let mut repeat: Vec<(Histogram<u64>, Duration)> = kinds
            .iter()
            .map(|_| (histogram(), Duration::ZERO))
            .collect();
        for _ in 0..plan.rounds {
            for (m, (h, cpu)) in measured.iter_mut().zip(&mut repeat) {
                let round_cpu = ProcessCpu::now();
                let round = Instant::now();
                for _ in 0..plan.ops {
                    let t = Instant::now();
                    once(m.kind).await;
                    record(h, t.elapsed());
                }
                m.elapsed += round.elapsed();
                *cpu += ProcessCpu::now().since(&round_cpu);
            }
        }
        for (m, (h, cpu)) in measured.iter_mut().zip(&repeat) {
            m.repeat_p50.push(h.value_at_quantile(0.5) as f64);
            m.repeat_cpu_per_op.push(per_op_micros(*cpu, h.len()));
            merge(&mut m.histogram, h);
        }
    }
    measured
}

/// `cpu` per op of `ops`, µs (0 for no ops).
fn per_op_micros(cpu: Duration, ops: u64) -> f64 {
    if ops == 0 {
        0.0
    } else {
        cpu.as_secs_f64() * 1e6 / ops as f64
    }
}

/// One line per kind of `measured` (joined by newlines, none at the end): `  label  p50 …
/// µs  p99 … µs  … ops/s`, and with a `floor` (an index into `measured`) `  p50/<floor's
/// label> median … (…)`, the ratios of [`Measured::p50_over`].
#[must_use]
pub fn latency_lines<K: Copy>(
    measured: &[Measured<K>],
    floor: Option<usize>,
    label: impl Fn(K) -> &'static str,
) -> String {
    let floor = floor.and_then(|f| measured.get(f));
    measured
        .iter()
        .map(|m| {
            let s = m.summary();
            let vs = floor.map_or(String::new(), |f| {
                format!("  p50/{} {}", label(f.kind), ratios(&m.p50_over(f)))
            });
            format!(
                "  {:<11} p50 {:>6} µs  p99 {:>7} µs  {:>7.0} ops/s{vs}",
                label(m.kind),
                s.p50,
                s.p99,
                s.ops_per_sec()
            )
        })
        .collect::<Vec<String>>()
        .join("\n")
}

/// One run of many ops by concurrent workers (throughput, contention), from
/// [`run_workers`].
#[derive(Clone, Debug)]
pub struct Run {
    /// Every worker's op latencies (µs), merged.
    pub histogram: Histogram<u64>,
    /// Wall-clock time from before the first worker started to the last one's end.
    pub elapsed: Duration,
    /// The process's CPU time over the same span ([`ProcessCpu`]).
    pub cpu: Duration,
}

impl Run {
    /// The ops done (the latencies recorded).
    #[must_use]
    pub fn ops(&self) -> u64 {
        self.histogram.len()
    }

    /// Ops per second of wall-clock time (0 for an untimed run).
    #[must_use]
    pub fn rate(&self) -> f64 {
        Summary::new(&self.histogram, self.elapsed).ops_per_sec()
    }

    /// The process's CPU time per op, µs (0 for no ops).
    #[must_use]
    pub fn cpu_per_op(&self) -> f64 {
        per_op_micros(self.cpu, self.ops())
    }
}

/// Runs workers to completion as one [`Run`]: `spawn` is a lazy iterator that spawns
/// them on the bench's runtime, each returning the [`histogram`] of its ops' latencies
/// (e.g. `(0..n).map(|i| tokio::spawn(...))`). The clock and the CPU reading start
/// before the first spawn.
///
/// # Errors
///
/// The first worker's error, as [`timed_join`].
///
/// # Cancel safety
///
/// Dropped, it drops the handles it awaits; workers spawned with `tokio::spawn` go on
/// running to their end (abort them through their handles if that matters).
pub async fn run_workers<I, H, E>(spawn: I) -> Result<Run, E>
where
    I: IntoIterator<Item = H>,
    H: Future<Output = Result<Histogram<u64>, E>>,
{
    let start = ProcessCpu::now();
    let (elapsed, histograms) = timed_join(spawn).await?;
    let cpu = ProcessCpu::now().since(&start);
    let mut pooled = histogram();
    for h in &histograms {
        merge(&mut pooled, h);
    }
    Ok(Run {
        histogram: pooled,
        elapsed,
        cpu,
    })
}

/// One line per kind of repeated [`Run`]s (`runs[i]` are `kinds[i]`'s, from
/// [`interleave_runs`]; joined by newlines, none at the end): `  label  R <unit> (median
/// of N)  p50 … µs  p99 … µs`, latencies pooled over the runs, and with a `floor` (an
/// index into `kinds`) `  /<floor's label> median … (…)`, the rates' ratios run by run.
#[must_use]
pub fn rate_lines<K: Copy>(
    kinds: &[K],
    runs: &[Vec<Run>],
    floor: Option<usize>,
    unit: &str,
    label: impl Fn(K) -> &'static str,
) -> String {
    let rates = |runs: &[Run]| runs.iter().map(Run::rate).collect::<Vec<f64>>();
    let floor = floor.and_then(|f| Some((*kinds.get(f)?, rates(runs.get(f)?))));
    kinds
        .iter()
        .zip(runs)
        .map(|(&kind, runs)| {
            let mine = rates(runs);
            let mut pooled = histogram();
            for run in runs {
                merge(&mut pooled, &run.histogram);
            }
            let vs = floor.as_ref().map_or(String::new(), |(f, floor)| {
                format!("  /{} {}", label(*f), ratios(&over(&mine, floor)))
            });
            format!(
                "  {:<11} {:>7.0} {unit} (median of {})  p50 {:>6} µs  p99 {:>7} µs{vs}",
                label(kind),
                median(mine.clone()),
                runs.len(),
                pooled.value_at_quantile(0.5),
                pooled.value_at_quantile(0.99),
            )
        })
        .collect::<Vec<String>>()
        .join("\n")
}

/// `repeats` rounds of whole runs, one `run(kind, repeat)` of each of `kinds` in turn per
/// round (for throughput, contention and CPU, where one run is many ops). Returns, per
/// kind in the order of `kinds`, what each of its runs returned, in order.
///
/// # Errors
///
/// None: a run that fails is `run`'s to report (a bench panics on it).
///
/// # Cancel safety
///
/// Dropped, it drops the run in progress; nothing measured so far is returned.
pub async fn interleave_runs<K, T, F, Fut>(kinds: &[K], repeats: usize, mut run: F) -> Vec<Vec<T>>
where
    K: Copy,
    F: FnMut(K, usize) -> Fut,
    Fut: Future<Output = T>,
{
    let mut out: Vec<Vec<T>> = kinds.iter().map(|_| Vec::with_capacity(repeats)).collect();
    for repeat in 0..repeats {
        for (&kind, results) in kinds.iter().zip(&mut out) {
            results.push(run(kind, repeat).await);
        }
    }
    out
}

/// Starts the clock, then takes every handle from `spawn` (a lazy iterator that spawns
/// workers on the bench's runtime, e.g. `(0..n).map(|i| tokio::spawn(...))`), and awaits
/// them all. Returns the wall-clock time from before the first spawn to the last
/// worker's end, and the workers' outputs in order.
///
/// # Errors
///
/// The first worker's error (e.g. a `JoinError` of a worker that panicked), after all
/// workers were spawned; the others are not awaited.
///
/// # Cancel safety
///
/// Dropped, it drops the handles it awaits; workers spawned with `tokio::spawn` go on
/// running to their end (abort them through their handles if that matters).
pub async fn timed_join<I, H, T, E>(spawn: I) -> Result<(Duration, Vec<T>), E>
where
    I: IntoIterator<Item = H>,
    H: Future<Output = Result<T, E>>,
{
    let start = Instant::now();
    let handles: Vec<H> = spawn.into_iter().collect();
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        out.push(handle.await?);
    }
    Ok((start.elapsed(), out))
}

#[cfg(test)]
mod tests;
