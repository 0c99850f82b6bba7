//! What backends report of each lease renewal: a `tracing` event always, and with the
//! `metrics` feature a counter and a latency histogram (see
//! [`layer::metrics`](crate::layer::metrics)).

use std::time::Duration;

/// How one renewal request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RenewalOutcome {
    /// The server confirmed it: the leases it covers were extended.
    Renewed,
    /// No confirmation (timeout, connection error, no quorum): it is tried again before
    /// the deadline; past the deadline the lock is lost.
    Failed,
    /// The server answered that the lease or key is gone: the locks it covers are lost.
    Gone,
}

impl RenewalOutcome {
    /// A stable `snake_case` name, for metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            RenewalOutcome::Renewed => "renewed",
            RenewalOutcome::Failed => "failed",
            RenewalOutcome::Gone => "gone",
        }
    }
}

/// Counter of renewal requests, labelled `backend` and `result` (a [`RenewalOutcome`]).
pub const RENEWALS_TOTAL: &str = "fencelock_renewals_total";
/// Histogram of the time a renewal request took to be answered, in seconds, labelled
/// `backend` (answered requests only).
pub const RENEWAL_SECONDS: &str = "fencelock_renewal_seconds";

/// Reports one renewal request of `backend` covering `locks` locks (a batch on Redis,
/// a session's keepalive on etcd, a session check on ZooKeeper), answered after
/// `latency`.
///
/// For backend implementations; applications read it as metrics and `tracing` events
/// (target `fencelock::renewal`, `debug` level, `warn` for a lease the server says is
/// gone).
pub fn record_renewal(
    backend: &'static str,
    outcome: RenewalOutcome,
    latency: Duration,
    locks: usize,
) {
    let latency_ms = latency.as_secs_f64() * 1e3;
    match outcome {
        RenewalOutcome::Gone => tracing::warn!(
            target: "fencelock::renewal",
            backend,
            result = outcome.as_str(),
            latency_ms,
            locks,
            "lease renewal refused: the lease or key is gone"
        ),
        _ => tracing::debug!(
            target: "fencelock::renewal",
            backend,
            result = outcome.as_str(),
            latency_ms,
            locks,
            "lease renewal"
        ),
    }
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(RENEWALS_TOTAL, "backend" => backend, "result" => outcome.as_str())
            .increment(1);
        if outcome != RenewalOutcome::Failed {
            metrics::histogram!(RENEWAL_SECONDS, "backend" => backend)
                .record(latency.as_secs_f64());
        }
    }
}
