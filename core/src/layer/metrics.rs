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

use std::sync::Arc;

use async_trait::async_trait;
use metrics::{
    Label, Unit, counter, describe_counter, describe_gauge, describe_histogram, histogram,
};
use tokio::time::Instant;
use tracing::Instrument;

use crate::{
    AcquireOptions, Capabilities, DistributedLock, Error, HolderInfo, Leader, LeaderChanges,
    ListedLock, LockGuard, LockInfo, Permits,
};

mod held;

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
        held::metered(name, guard, backend, labels, self.runtime.as_ref())
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

#[cfg(test)]
mod tests;
