//! Metrics and tracing: how long callers wait for locks, how long they hold them, and how
//! often they lose them.
//!
//! [`Metrics`] wraps any [`DistributedLock`] and reports through the
//! [`metrics`](https://docs.rs/metrics) facade (install any recorder, for example
//! `metrics-exporter-prometheus`; without one, recording costs next to nothing) and opens
//! `tracing` spans around acquire and release. Every metric is described (`describe_*`)
//! with its unit and help text when a `Metrics` layer is created.
//!
//! | metric | kind | labels | what |
//! |---|---|---|---|
//! | `fencelock_lock_acquires_total` | counter | `result` | acquires by outcome: `acquired`, `timeout` (ran out of its wait), `contended` (a `no_wait` acquire found the lock held), `error` (backend down, bad input) |
//! | `fencelock_lock_wait_seconds` | histogram | `result` | time `acquire` took, for every outcome (the seeds' `lock_wait_ms`: alert on its p99 for `result="acquired"`, and on the rate of `result="timeout"`) |
//! | `fencelock_lock_hold_seconds` | histogram | | time from grant to release, drop or loss |
//! | `fencelock_lock_lost_total` | counter | `cause` | granted locks lost before release (the seeds' `lock_loss_count`: alert when it rises) |
//! | `fencelock_locks_held` | gauge | | guards currently holding a lock (granted, not released, dropped or lost) |
//! | `fencelock_lock_retries_total` | counter | `operation` | retries of the [`Retry`](crate::Retry) layer (`acquire`, `inspect`, `list`), with or without this layer |
//! | `fencelock_renewals_total` | counter | `result` | lease renewal requests the backend sent, by outcome: `renewed`, `failed` (no answer; retried before the deadline), `gone` (the server says the lease or key is gone), with or without this layer |
//! | `fencelock_renewal_seconds` | histogram | | time a renewal request took to be answered |
//!
//! Every metric has the label `backend` (`"etcd"`, `"redis"`, ...). `cause` is the
//! guard's [`crate::LossCause`] (`lease_expired` when its own conservative
//! deadline passed without a successful renewal, `key_gone`, `taken_over`,
//! `session_ended`, `client_closed`, `migration_leg`, `other`), or `found_at_release`
//! when the loss was only discovered by the release.
//!
//! # Cardinality
//!
//! Lock names are often ids (`orders/SKU-8842`): a label per name would make one time
//! series per order. So the `name` label is off by default; turn it on with
//! [`MetricsOptions::with_name_label`] (URL option `metrics_names=true`) for a fixed,
//! small set of names (`nightly-report`, `orders-sync`).
//!
//! # Renewals
//!
//! Renewals happen inside each backend, so they are counted by the backend itself
//! ([`record_renewal`](crate::record_renewal)), with or without this layer: one request
//! is a batch of up to 100 keys on Redis (per node), one keepalive of a session lease on
//! etcd (covering every lock on it), one session check (`sync` + `exists`) on ZooKeeper,
//! whose own client library sends the session's pings; on `mem://`, one renewal per lock.
//! A rising `result="failed"` rate is the early warning: locks are lost
//! (`cause="lease_expired"`) only when renewals keep failing until the deadline.
//!
//! # Prometheus
//!
//! With `metrics-exporter-prometheus`, give the wait and hold histograms buckets that
//! cover lock waits (the exporter's defaults are for request latencies in seconds and
//! suit them too):
//!
//! ```text
//! PrometheusBuilder::new()
//!     .set_buckets_for_metric(Matcher::Prefix("fencelock_lock_".into()),
//!         &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0])?
//! ```
//!
//! and alert, for example:
//!
//! ```text
//! - alert: FencelockLockLost          # the seeds' lock_loss_count > 0
//!   expr: increase(fencelock_lock_lost_total[5m]) > 0
//! - alert: FencelockSlowLockWait      # the seeds' lock_wait_ms P99
//!   expr: histogram_quantile(0.99, sum by (le, backend)
//!           (rate(fencelock_lock_wait_seconds_bucket{result="acquired"}[5m]))) > 1
//! - alert: FencelockRenewalsFailing  # leases at risk before any lock is lost
//!   expr: sum by (backend) (rate(fencelock_renewals_total{result="failed"}[5m])) > 0
//! ```
//!
//! # Tracing
//!
//! Spans `fencelock.acquire` (fields `backend`, `lock`, and `token` once granted) and
//! `fencelock.release` (`backend`, `lock`, `token`). A loss is a `warn` event with the
//! lock, token, backend and cause, logged by every guard with or without this layer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use metrics::{
    Label, Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use tokio::time::Instant;
use tracing::Instrument;

use crate::{
    AcquireOptions, Capabilities, DistributedLock, Error, FencingToken, HeldLock, HolderInfo,
    Leader, LeaderChanges, ListedLock, Liveness, LockGuard, LockInfo, LossCause, Permits,
};

/// Counter of acquires, labelled `result` (`acquired`, `timeout`, `contended`, `error`).
pub const LOCK_ACQUIRES_TOTAL: &str = "fencelock_lock_acquires_total";
/// Histogram of the time `acquire` took, in seconds, labelled `result`.
pub const LOCK_WAIT_SECONDS: &str = "fencelock_lock_wait_seconds";
/// Histogram of the time a lock was held, in seconds.
pub const LOCK_HOLD_SECONDS: &str = "fencelock_lock_hold_seconds";
/// Counter of granted locks lost before release, labelled `cause`.
pub const LOCK_LOST_TOTAL: &str = "fencelock_lock_lost_total";
/// Gauge of guards currently holding a lock.
pub const LOCKS_HELD: &str = "fencelock_locks_held";
/// Counter of retries of the [`Retry`](crate::Retry) layer, labelled `operation`.
pub const LOCK_RETRIES_TOTAL: &str = "fencelock_lock_retries_total";

/// Registers the unit and help text of every metric with the installed recorder.
pub(crate) fn describe() {
    describe_counter!(
        LOCK_ACQUIRES_TOTAL,
        Unit::Count,
        "Lock acquires by result: acquired, timeout, contended, error."
    );
    describe_histogram!(
        LOCK_WAIT_SECONDS,
        Unit::Seconds,
        "Time an acquire took, by result."
    );
    describe_histogram!(
        LOCK_HOLD_SECONDS,
        Unit::Seconds,
        "Time from grant to release, drop or loss."
    );
    describe_counter!(
        LOCK_LOST_TOTAL,
        Unit::Count,
        "Granted locks lost before release, by cause."
    );
    describe_gauge!(LOCKS_HELD, Unit::Count, "Guards currently holding a lock.");
    describe_counter!(
        crate::RENEWALS_TOTAL,
        Unit::Count,
        "Lease renewal requests by result: renewed, failed, gone."
    );
    describe_histogram!(
        crate::RENEWAL_SECONDS,
        Unit::Seconds,
        "Time a lease renewal request took to be answered."
    );
    describe_counter!(
        LOCK_RETRIES_TOTAL,
        Unit::Count,
        "Retries of the retry layer, by operation."
    );
}

/// Options of the [`Metrics`] layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetricsOptions {
    name_label: bool,
}

impl MetricsOptions {
    /// The label `backend` only (see the module's "Cardinality").
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the `name` label (the lock name): only for a small, fixed set of names.
    pub fn with_name_label(mut self) -> Self {
        self.name_label = true;
        self
    }

    /// Leaves the `name` label out (the default).
    pub fn without_name_label(mut self) -> Self {
        self.name_label = false;
        self
    }

    /// Whether the `name` label is set.
    pub fn has_name_label(&self) -> bool {
        self.name_label
    }
}

/// A lock that records metrics and tracing spans for another lock.
///
/// See the [module documentation](self) for the metrics. Put it outermost (see
/// [`crate::layer`]), so it measures what the application sees.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use fencelock_core::layer::metrics::{Metrics, MetricsOptions};
/// use fencelock_core::{DistributedLock, DistributedLockExt, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
/// // Install a `metrics` recorder (e.g. metrics-exporter-prometheus) first.
/// let locks: Arc<dyn DistributedLock> =
///     Arc::new(Metrics::new(Arc::new(MemoryLock::new()), MetricsOptions::default()));
/// let guard = locks.lock("nightly-report").await?;
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Metrics {
    inner: Arc<dyn DistributedLock>,
    options: MetricsOptions,
    /// Where a held guard's loss is watched first: the runtime this was made on, so
    /// that a loss is counted when it happens also for a guard acquired on a runtime
    /// that has ended since. `None` when made outside a runtime: then the one the
    /// backend made the guard's record on, else the acquire's. A watch whose runtime
    /// ends goes on on the next of these.
    runtime: Option<tokio::runtime::Handle>,
}

impl Metrics {
    /// Wraps a granted guard so its hold time, loss and release are recorded.
    fn metered(&self, name: &str, guard: LockGuard) -> LockGuard {
        let backend = self.inner.backend();
        let labels = self.labels(name);
        gauge!(LOCKS_HELD, labels.clone()).increment(1.0);

        let liveness = guard.liveness().clone();
        let record = Arc::new(HoldRecord {
            labels,
            backend,
            name: name.to_owned(),
            token: guard.token().get(),
            acquired_at: Instant::now(),
            releasing: AtomicBool::new(false),
            unheld: AtomicBool::new(false),
            ended: AtomicBool::new(false),
        });
        record.watch(self.runtime.as_ref(), liveness.clone());
        let held = Arc::new(MeteredHeld {
            held: guard.held().clone(),
            liveness: liveness.clone(),
            guard: Mutex::new(Some(guard)),
            record: record.clone(),
        });
        LockGuard::new(
            name,
            FencingToken::new(held.record.token),
            backend,
            liveness,
            held,
        )
    }

    /// Wraps `inner`, and describes the metrics to the installed recorder.
    ///
    /// Made inside a Tokio runtime, the losses of held guards are watched on it,
    /// whichever runtime acquired them; made outside one, or once that runtime has
    /// ended, on the runtime the backend made the guard's record on, else on the
    /// acquire's. When the runtime a held guard's watch runs on ends, the watch goes on
    /// on the next of these, so the loss is still counted and the held gauge moved.
    pub fn new(inner: Arc<dyn DistributedLock>, options: MetricsOptions) -> Self {
        describe();
        Metrics {
            inner,
            options,
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// The wrapped lock.
    pub fn inner(&self) -> &Arc<dyn DistributedLock> {
        &self.inner
    }

    fn labels(&self, name: &str) -> Vec<Label> {
        let mut labels = vec![Label::new("backend", self.inner.backend())];
        if self.options.name_label {
            labels.push(Label::new("name", name.to_owned()));
        }
        labels
    }
}

#[async_trait]
impl DistributedLock for Metrics {
    /// Acquires through the inner lock, recording wait time and the outcome.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as the inner lock's `acquire`; a cancelled acquire records nothing.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let backend = self.inner.backend();
        let labels = self.labels(name);
        let span = tracing::info_span!(
            "fencelock.acquire",
            backend,
            lock = name,
            token = tracing::field::Empty
        );
        let start = Instant::now();
        let result = self
            .inner
            .acquire(name, options)
            .instrument(span.clone())
            .await;
        let outcome = match &result {
            Ok(_) => "acquired",
            Err(Error::Timeout { .. }) => "timeout",
            Err(Error::Contended { .. }) => "contended",
            Err(Error::TooManyWaiters { .. }) => "too_many_waiters",
            Err(_) => "error",
        };
        let mut with_result = labels.clone();
        with_result.push(Label::new("result", outcome));
        histogram!(LOCK_WAIT_SECONDS, with_result.clone()).record(start.elapsed().as_secs_f64());
        counter!(LOCK_ACQUIRES_TOTAL, with_result).increment(1);
        let guard = result?;
        span.record("token", guard.token().get());
        Ok(self.metered(name, guard))
    }

    /// Forwards to the inner lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        self.inner.inspect(name).await
    }

    /// Forwards to the inner lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        self.inner.list(prefix).await
    }

    /// Forwards to the inner lock, in a `fencelock.revoke` span.
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `revoke`.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        let span = tracing::info_span!(
            "fencelock.revoke",
            backend = self.inner.backend(),
            lock = name
        );
        self.inner.revoke(name).instrument(span).await
    }

    /// Takes a read lock through the inner lock, in a `fencelock.acquire_read` span; a
    /// grant is counted like any held lock.
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `acquire_read`.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let span = tracing::info_span!(
            "fencelock.acquire_read",
            backend = self.inner.backend(),
            lock = name
        );
        let grant = self
            .inner
            .acquire_read(name, options)
            .instrument(span)
            .await?;
        Ok(self.metered(name, grant))
    }

    /// Takes a write lock through the inner lock, in a `fencelock.acquire_write` span; a
    /// grant is counted like any held lock.
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `acquire_write`.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        let span = tracing::info_span!(
            "fencelock.acquire_write",
            backend = self.inner.backend(),
            lock = name
        );
        let grant = self
            .inner
            .acquire_write(name, options)
            .instrument(span)
            .await?;
        Ok(self.metered(name, grant))
    }

    /// Takes permits through the inner lock, in a `fencelock.acquire_permits` span; a
    /// grant is counted like any held lock (held gauge, hold time, losses).
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `acquire_permits`.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let span = tracing::info_span!(
            "fencelock.acquire_permits",
            backend = self.inner.backend(),
            semaphore = name
        );
        let grant = self
            .inner
            .acquire_permits(name, permits, options)
            .instrument(span)
            .await?;
        Ok(self.metered(name, grant))
    }

    /// Campaigns through the inner lock, in a `fencelock.campaign` span. A term is
    /// counted like any held lock (held gauge, hold time, losses): it is the election's
    /// lock.
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `campaign`.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let span = tracing::info_span!(
            "fencelock.campaign",
            backend = self.inner.backend(),
            election
        );
        let term = self
            .inner
            .campaign(election, value, options)
            .instrument(span)
            .await?;
        Ok(self.metered(election, term))
    }

    /// Forwards to the inner lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        self.inner.leader(election).await
    }

    /// Forwards to the inner lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        self.inner.observe(election).await
    }

    /// Forwards to the inner lock, in a `fencelock.close` span.
    ///
    /// # Cancel safety
    ///
    /// As the inner lock's `close`.
    ///
    /// # Errors
    ///
    /// Exactly the inner lock's.
    async fn close(&self) -> Result<(), Error> {
        let span = tracing::info_span!("fencelock.close", backend = self.inner.backend());
        self.inner.close().instrument(span).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn wrapped(&self) -> Option<&dyn DistributedLock> {
        Some(&*self.inner)
    }
}

/// What is recorded about one grant until it ends.
#[derive(Debug)]
struct HoldRecord {
    labels: Vec<Label>,
    backend: &'static str,
    name: String,
    token: u64,
    acquired_at: Instant,
    /// An explicit release is under way: a loss seen now is judged by its result.
    releasing: AtomicBool,
    /// The gauge was decremented (at loss or end).
    unheld: AtomicBool,
    /// Hold time was recorded (at release or drop).
    ended: AtomicBool,
}

impl HoldRecord {
    /// Watches the grant until it is lost (counted) or ends: on `runtime` (the
    /// layer's), else on the runtime `liveness` was made on (the backend's), else this
    /// acquire's (which may be one the caller enters only now and then); when the one it
    /// runs on ends while the guard is held, on the next of these. With none of them
    /// running nothing watches: the loss is counted when the guard is released or
    /// dropped.
    fn watch(self: &Arc<Self>, runtime: Option<&tokio::runtime::Handle>, liveness: Liveness) {
        let record = self.clone();
        let runtimes = runtime
            .cloned()
            .into_iter()
            .chain(liveness.runtime().cloned())
            .chain(tokio::runtime::Handle::try_current().ok());
        crate::kept::spawn_kept(
            runtimes,
            move || {
                let (record, liveness) = (record.clone(), liveness.clone());
                async move {
                    tokio::select! {
                        biased;
                        _ = liveness.ended() => {}
                        _ = liveness.lost() => {
                            if !record.releasing.load(Ordering::SeqCst) {
                                record.lost_by(&liveness);
                            }
                        }
                    }
                }
            },
            || {},
        );
    }

    /// Counts the loss `liveness` reports.
    fn lost_by(&self, liveness: &Liveness) {
        let cause = liveness.lost_cause().unwrap_or(LossCause::Other);
        self.lost(cause.as_str());
    }

    /// Counts a loss (once) and takes the lock out of the held gauge. (The loss itself
    /// is logged by [`Liveness::mark_lost`], with or without this layer.)
    fn lost(&self, cause: &'static str) {
        if self.unheld.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut labels = self.labels.clone();
        labels.push(Label::new("cause", cause));
        counter!(LOCK_LOST_TOTAL, labels).increment(1);
        gauge!(LOCKS_HELD, self.labels.clone()).decrement(1.0);
    }

    /// Records the hold time and leaves the gauge (once).
    fn end(&self) {
        if self.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        histogram!(LOCK_HOLD_SECONDS, self.labels.clone())
            .record(self.acquired_at.elapsed().as_secs_f64());
        if !self.unheld.swap(true, Ordering::SeqCst) {
            gauge!(LOCKS_HELD, self.labels.clone()).decrement(1.0);
        }
    }
}

/// The outer guard's handle: the inner guard, kept alive (so it does not release on its
/// own), and the record.
#[derive(Debug)]
struct MeteredHeld {
    held: Arc<dyn HeldLock>,
    liveness: Liveness,
    guard: Mutex<Option<LockGuard>>,
    record: Arc<HoldRecord>,
}

impl MeteredHeld {
    /// Counts the loss the guard already reports (once: see [`HoldRecord::lost`]), at
    /// the release or drop that ends the record.
    fn count_loss_seen(&self) {
        if self.liveness.is_lost() {
            self.record.lost_by(&self.liveness);
        }
    }
}

#[async_trait]
impl HeldLock for MeteredHeld {
    async fn release(&self) -> Result<(), Error> {
        let record = &self.record;
        self.count_loss_seen();
        record.releasing.store(true, Ordering::SeqCst);
        let span = tracing::info_span!(
            "fencelock.release",
            backend = record.backend,
            lock = %record.name,
            token = record.token
        );
        // The inner handle's release is idempotent; the inner guard stays in place so a
        // failed release is still retried in the background when this handle is dropped.
        let result = self.held.release().instrument(span).await;
        if let Err(Error::Lost { .. }) = &result {
            record.lost("found_at_release");
        }
        record.end();
        result
    }

    fn release_in_background(&self) {
        // Dropped right after learning of a loss (as `with_lock` does), before this
        // layer's watch ran: the loss is counted here, before `end` takes the lock out
        // of the held gauge (after which a loss is not counted).
        self.count_loss_seen();
        let guard = self
            .guard
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(guard);
        self.record.end();
    }

    fn backend_key(&self) -> Option<&str> {
        self.held.backend_key()
    }

    fn can_extend(&self) -> Result<(), Error> {
        self.held.can_extend()
    }

    fn check_extension(&self, lease: Duration) -> Result<(), Error> {
        self.held.check_extension(lease)
    }

    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        // The inner guard shares this liveness: the outer guard moves it.
        self.held.extend(lease).await
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::OnceLock;
    use std::time::Duration;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

    use super::*;
    use crate::{DistributedLockExt, MemoryLock};

    /// Everything recorded so far, per (metric, labels as `k=v` pairs). The debugging
    /// recorder's snapshots drain it, so they are added up here; tests use distinct lock
    /// names and may run in parallel.
    #[derive(Default)]
    struct Totals {
        values: HashMap<(String, Vec<String>), (f64, Vec<f64>)>,
    }

    fn snapshotter() -> &'static (Snapshotter, Mutex<Totals>) {
        static RECORDER: OnceLock<(Snapshotter, Mutex<Totals>)> = OnceLock::new();
        RECORDER.get_or_init(|| {
            let recorder = DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            recorder
                .install()
                .expect("no other recorder in this test binary");
            (snapshotter, Mutex::new(Totals::default()))
        })
    }

    /// The counter / gauge value (or histogram sample count) of `metric` with `labels`,
    /// and the histogram samples.
    fn read(metric: &str, labels: &[&str]) -> (f64, Vec<f64>) {
        let (snapshotter, totals) = snapshotter();
        let mut totals = totals.lock().unwrap();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let mut key_labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            key_labels.sort();
            let entry = totals
                .values
                .entry((key.key().name().to_owned(), key_labels))
                .or_default();
            match value {
                DebugValue::Counter(n) => entry.0 += n as f64,
                DebugValue::Gauge(g) => entry.0 += g.into_inner(),
                DebugValue::Histogram(samples) => {
                    entry.0 += samples.len() as f64;
                    entry.1.extend(samples.into_iter().map(|s| s.into_inner()));
                }
            }
        }
        let mut labels: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
        labels.sort();
        totals
            .values
            .get(&(metric.to_owned(), labels))
            .cloned()
            .unwrap_or_default()
    }

    fn count(metric: &str, labels: &[&str]) -> f64 {
        read(metric, labels).0
    }

    fn metered(options: MetricsOptions) -> (Arc<MemoryLock>, Metrics) {
        let _ = snapshotter();
        let memory = Arc::new(MemoryLock::new());
        (memory.clone(), Metrics::new(memory, options))
    }

    #[tokio::test(start_paused = true)]
    async fn acquisitions_wait_hold_and_the_held_gauge_move() {
        let (memory, locks) = metered(MetricsOptions::new().with_name_label());
        let labels = ["backend=mem", "name=m-basic"];
        let acquired = ["backend=mem", "name=m-basic", "result=acquired"];
        let first = locks.lock("m-basic").await.unwrap();
        assert_eq!(count(LOCKS_HELD, &labels), 1.0);
        let second = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.lock("m-basic").await.unwrap() })
        };
        tokio::time::sleep(Duration::from_millis(250)).await;
        first.release().await.unwrap();
        let second = second.await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(second);
        assert_eq!(count(LOCK_ACQUIRES_TOTAL, &acquired), 2.0);
        assert_eq!(count(LOCKS_HELD, &labels), 0.0);
        let (waits, wait_samples) = read(LOCK_WAIT_SECONDS, &acquired);
        assert_eq!(waits, 2.0);
        assert!(
            wait_samples.iter().any(|w| (*w - 0.25).abs() < 0.01),
            "{wait_samples:?}"
        );
        let (holds, hold_samples) = read(LOCK_HOLD_SECONDS, &labels);
        assert_eq!(holds, 2.0);
        assert!(
            hold_samples.iter().any(|h| (*h - 0.1).abs() < 0.01),
            "{hold_samples:?}"
        );
        assert!(!memory.inspect("m-basic").await.unwrap().is_held());
    }

    #[tokio::test(start_paused = true)]
    async fn timeouts_contention_and_errors_are_counted() {
        let (_memory, locks) = metered(MetricsOptions::new().with_name_label());
        let with = |result: &'static str| ["backend=mem", "name=m-fail", result];
        let held = locks.lock("m-fail").await.unwrap();
        let wait = AcquireOptions::new().wait_timeout(Duration::from_millis(50));
        assert!(locks.acquire("m-fail", wait).await.is_err());
        assert!(locks.try_lock("m-fail").await.unwrap().is_none());
        let zero = AcquireOptions::new().lease(Duration::ZERO);
        assert!(locks.acquire("m-fail", zero).await.is_err());
        assert_eq!(count(LOCK_ACQUIRES_TOTAL, &with("result=timeout")), 1.0);
        assert_eq!(count(LOCK_ACQUIRES_TOTAL, &with("result=contended")), 1.0);
        assert_eq!(count(LOCK_ACQUIRES_TOTAL, &with("result=error")), 1.0);
        assert_eq!(count(LOCK_ACQUIRES_TOTAL, &with("result=acquired")), 1.0);
        // The wait histogram has the timeout too, with its 50 ms.
        let (_, timeouts) = read(LOCK_WAIT_SECONDS, &with("result=timeout"));
        assert!(
            timeouts.iter().any(|w| (*w - 0.05).abs() < 0.01),
            "{timeouts:?}"
        );
        held.release().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_loss_is_counted_once_when_it_happens() {
        let (_memory, locks) = metered(MetricsOptions::new().with_name_label());
        let labels = ["backend=mem", "name=m-lost"];
        let opts = AcquireOptions::new().fixed_lease(Duration::from_secs(1));
        let guard = locks.acquire("m-lost", opts).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        tokio::task::yield_now().await;
        let lost = [labels[0], labels[1], "cause=lease_expired"];
        assert_eq!(count(LOCK_LOST_TOTAL, &lost), 1.0, "counted before release");
        assert_eq!(count(LOCKS_HELD, &labels), 0.0);
        assert!(matches!(guard.release().await, Err(Error::Lost { .. })));
        assert_eq!(count(LOCK_LOST_TOTAL, &lost), 1.0);
        assert_eq!(count(LOCKS_HELD, &labels), 0.0);
        assert_eq!(count(LOCK_HOLD_SECONDS, &labels), 1.0);
    }

    /// A loss is counted when it happens also for a guard acquired on a runtime that
    /// has ended since (a `block_on` on a helper thread), while the guard lives on.
    #[test]
    fn a_loss_is_counted_for_a_guard_acquired_on_a_runtime_that_ended() {
        let main = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (_memory, locks) =
            main.block_on(async { metered(MetricsOptions::new().with_name_label()) });
        let labels = ["backend=mem", "name=m-short-runtime"];
        let guard = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let short = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    let opts = AcquireOptions::new().fixed_lease(Duration::from_millis(200));
                    short.block_on(locks.acquire("m-short-runtime", opts))
                })
                .join()
                .unwrap()
        })
        .unwrap();
        main.block_on(async {
            tokio::time::sleep(Duration::from_millis(600)).await;
            let lost = [labels[0], labels[1], "cause=lease_expired"];
            assert_eq!(
                count(LOCK_LOST_TOTAL, &lost),
                1.0,
                "not counted while the guard lives"
            );
            drop(guard);
        });
    }

    /// A metrics layer made on a runtime that has ended since still counts a loss when
    /// it happens: the watch falls back to the acquire's runtime.
    #[test]
    fn a_loss_is_counted_by_a_layer_made_on_a_runtime_that_ended() {
        let (_memory, locks) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async { metered(MetricsOptions::new().with_name_label()) });
        let main = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        main.block_on(async {
            let opts = AcquireOptions::new().fixed_lease(Duration::from_millis(200));
            let guard = locks.acquire("m-made-elsewhere", opts).await.unwrap();
            tokio::time::sleep(Duration::from_millis(600)).await;
            let lost = [
                "backend=mem",
                "name=m-made-elsewhere",
                "cause=lease_expired",
            ];
            assert_eq!(
                count(LOCK_LOST_TOTAL, &lost),
                1.0,
                "not counted while the guard lives"
            );
            drop(guard);
        });
    }

    /// A loss is counted when it happens also when the runtime the layer was made on
    /// ends while the guard is held: the watch, dropped with that runtime, must go on
    /// on another (the acquire's), or the loss is not counted and the gauge not moved.
    #[test]
    fn a_loss_is_counted_after_the_layers_runtime_ended_while_the_guard_was_held() {
        let made_on = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (_memory, locks) =
            made_on.block_on(async { metered(MetricsOptions::new().with_name_label()) });
        let main = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let labels = ["backend=mem", "name=m-layer-runtime-ended"];
        let opts = AcquireOptions::new().fixed_lease(Duration::from_millis(200));
        let guard = main
            .block_on(locks.acquire("m-layer-runtime-ended", opts))
            .unwrap();
        drop(made_on);
        main.block_on(async {
            tokio::time::sleep(Duration::from_millis(600)).await;
            let lost = [labels[0], labels[1], "cause=lease_expired"];
            assert_eq!(
                count(LOCK_LOST_TOTAL, &lost),
                1.0,
                "not counted while the guard lives"
            );
            assert_eq!(count(LOCKS_HELD, &labels), 0.0);
            drop(guard);
        });
    }

    /// A loss is counted when the guard is dropped as soon as it learns of it (what
    /// `with_lock` does), before the layer's own watch ran: a revoked lock here.
    #[tokio::test(start_paused = true)]
    async fn a_loss_is_counted_when_the_guard_is_dropped_at_once() {
        let (memory, locks) = metered(MetricsOptions::new().with_name_label());
        let labels = ["backend=mem", "name=m-dropped"];
        let guard = locks
            .acquire("m-dropped", AcquireOptions::new())
            .await
            .unwrap();
        memory.revoke("m-dropped").await.unwrap();
        assert!(guard.is_lost());
        drop(guard);
        tokio::task::yield_now().await;
        let lost = [labels[0], labels[1], "cause=key_gone"];
        assert_eq!(count(LOCK_LOST_TOTAL, &lost), 1.0, "not counted");
        assert_eq!(count(LOCKS_HELD, &labels), 0.0);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(count(LOCK_LOST_TOTAL, &lost), 1.0, "counted twice");
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_are_counted_by_the_backend_with_or_without_the_layer() {
        let _ = snapshotter();
        let renewed = ["backend=mem", "result=renewed"];
        let gone = ["backend=mem", "result=gone"];
        let (renewed_before, gone_before) = (
            count(crate::RENEWALS_TOTAL, &renewed),
            count(crate::RENEWALS_TOTAL, &gone),
        );
        // No Metrics layer: the backend counts its renewals itself.
        let memory = MemoryLock::new();
        let opts = AcquireOptions::new().lease(Duration::from_secs(3));
        let guard = memory.acquire("m-renewals", opts).await.unwrap();
        tokio::time::sleep(Duration::from_millis(3500)).await;
        assert!(count(crate::RENEWALS_TOTAL, &renewed) - renewed_before >= 3.0);
        assert!(read(crate::RENEWAL_SECONDS, &["backend=mem"]).0 >= 3.0);
        memory.revoke("m-renewals").await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(count(crate::RENEWALS_TOTAL, &gone) - gone_before >= 1.0);
        assert!(guard.is_lost());
    }

    #[tokio::test(start_paused = true)]
    async fn the_name_label_is_off_by_default() {
        let memory: Arc<dyn DistributedLock> = Arc::new(MemoryLock::named("m-noname"));
        let _ = snapshotter();
        let locks = Metrics::new(memory, MetricsOptions::default());
        assert!(!MetricsOptions::default().has_name_label());
        assert!(MetricsOptions::new().with_name_label().has_name_label());
        let acquired = ["backend=mem", "result=acquired"];
        let before = count(LOCK_ACQUIRES_TOTAL, &acquired);
        let guard = locks.lock("m-noname-a").await.unwrap();
        assert_eq!(guard.backend(), "mem");
        assert!(guard.backend_key().is_none());
        guard.release().await.unwrap();
        assert!(count(LOCK_ACQUIRES_TOTAL, &acquired) > before);
        assert_eq!(
            count(
                LOCK_ACQUIRES_TOTAL,
                &["backend=mem", "name=m-noname-a", "result=acquired"]
            ),
            0.0
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn passes_the_conformance_release_case() {
        let (_memory, locks) = metered(MetricsOptions::new().without_name_label());
        let guard = locks.lock("m-idem").await.unwrap();
        let handle = guard.held().clone();
        handle.release().await.unwrap();
        handle.release().await.unwrap();
        let again = locks.try_lock("m-idem").await.unwrap().expect("free");
        assert!(matches!(
            guard.release().await,
            Ok(()) | Err(Error::Lost { .. })
        ));
        handle.release().await.unwrap();
        assert!(locks.try_lock("m-idem").await.unwrap().is_none());
        again.release().await.unwrap();
    }
}
