//! How long to wait for a lock and how long to hold it.

use std::time::Duration;

use crate::Error;

/// The lease of a renewing lock when none is given: 30 seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The shortest lease any backend accepts: 1 ms. Backends have higher minimums of their
/// own ([`Capabilities::min_lease`](crate::Capabilities::min_lease)); `mem://` takes a
/// fixed lease of 1 ms but a renewing one of 10 ms at least (it is renewed every third
/// of it, and timers tick in milliseconds).
pub const SHORTEST_LEASE: Duration = Duration::from_millis(1);

/// The longest lease any backend accepts: 365 days. A longer one is an
/// [`Error::InvalidConfig`], not a lease that overflows a deadline.
pub const MAX_LEASE: Duration = Duration::from_secs(365 * 24 * 3600);

/// A wait timeout at or above this (100 years) waits forever, as [`Wait::Forever`]: no
/// deadline that far away can be represented on every platform, and none is meant.
pub const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How a held lock stays held.
///
/// A lease is the time after which the backend frees a lock whose holder went silent
/// (crashed, partitioned, paused). It bounds how long others wait for a dead holder; it
/// does **not** guarantee exclusion on its own (a paused holder can outlive its lease),
/// which is what [fencing tokens](crate::FencingToken) are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// The lease is renewed every third of its duration for as long as the guard lives,
    /// so the lock is held until released, dropped or lost. The default, with
    /// [`DEFAULT_LEASE`].
    Renewing(Duration),
    /// The lease is never renewed: the lock expires at the latest after this duration
    /// even if the guard is still alive, and the guard then reports loss. Chosen
    /// explicitly, never as a side effect of passing a duration.
    Fixed(Duration),
}

impl Lease {
    /// The lease duration.
    pub fn duration(self) -> Duration {
        match self {
            Lease::Renewing(d) | Lease::Fixed(d) => d,
        }
    }

    /// Whether the lease is renewed while the guard lives.
    pub fn is_renewing(self) -> bool {
        matches!(self, Lease::Renewing(_))
    }

    /// How often a renewing lease is renewed: a third of its duration.
    pub fn renew_interval(self) -> Duration {
        self.duration() / 3
    }
}

impl Default for Lease {
    fn default() -> Self {
        Lease::Renewing(DEFAULT_LEASE)
    }
}

/// How long `acquire` waits while someone else holds the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wait {
    /// Do not wait: fail with [`Error::Contended`] if the lock is held.
    NoWait,
    /// Wait at most this long while the lock is held, then fail with
    /// [`Error::Timeout`]. A free lock is granted even with a zero timeout if the backend
    /// answers within [`ROUND_TRIP_GRACE`]; against a backend that stopped answering the
    /// acquire ends after the timeout or that grace, the later. A timeout of [`FOREVER`]
    /// or more is taken as [`Wait::Forever`] by [`AcquireOptions::wait`].
    Timeout(Duration),
    /// Wait until the lock is granted (or an error occurs). The default.
    #[default]
    Forever,
}

/// The end of an acquire's wait, for backends and layers: [`Wait::Timeout`] bounds the
/// time spent behind holders, so a backend looks at it where it waits (and a free lock is
/// granted with a zero wait); the whole acquire, round trips included, is bounded by
/// [`bound`](Self::bound).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{Wait, WaitDeadline};
///
/// # let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
/// # runtime.block_on(async {
/// let wait = WaitDeadline::new(Wait::Timeout(Duration::from_millis(5)));
/// wait.over().await;
/// assert!(wait.is_over());
/// assert!(matches!(wait.timed_out("n"), fencelock_core::Error::Timeout { .. }));
/// # });
/// ```
#[derive(Debug, Clone, Copy)]
pub struct WaitDeadline {
    at: Option<tokio::time::Instant>,
    waited: Duration,
    started: tokio::time::Instant,
}

/// How long an acquire's round trips may take when the caller's wait is shorter: with
/// a zero wait a free lock is still granted if the backend answers within this, and an
/// acquire against a server that stopped answering ends after the wait or this, the
/// later (see [`WaitDeadline::bound`]).
pub const ROUND_TRIP_GRACE: Duration = Duration::from_millis(500);

impl WaitDeadline {
    /// The deadline of `wait` from now: none for [`Wait::NoWait`], [`Wait::Forever`] and a
    /// timeout too long to represent (a wait forever).
    pub fn new(wait: Wait) -> Self {
        let started = tokio::time::Instant::now();
        match wait {
            Wait::Timeout(limit) => WaitDeadline {
                at: started.checked_add(limit),
                waited: limit,
                started,
            },
            Wait::NoWait | Wait::Forever => WaitDeadline {
                at: None,
                waited: Duration::ZERO,
                started,
            },
        }
    }

    /// When the whole acquire gives up, round trips included (a server that stopped
    /// answering): the end of the wait, or [`ROUND_TRIP_GRACE`] after the start if that
    /// is later. `None` without an end.
    pub fn bound(&self) -> Option<tokio::time::Instant> {
        self.at.map(|at| at.max(self.started + ROUND_TRIP_GRACE))
    }

    /// [`bound`](Self::bound) for round trips that start now rather than at the start of
    /// the acquire: the end of the wait, or [`ROUND_TRIP_GRACE`] from now if that is
    /// later; `None` without an end. For a step sent after a local wait (behind this
    /// client's other tasks), which is still granted a free lock at a zero wait.
    pub fn bound_from_now(&self) -> Option<tokio::time::Instant> {
        self.at
            .map(|at| at.max(tokio::time::Instant::now() + ROUND_TRIP_GRACE))
    }

    /// Runs `step` until `until` (this wait's [`at`](Self::at), [`bound`](Self::bound) or
    /// [`bound_from_now`](Self::bound_from_now); `None`: no end), and otherwise fails with
    /// [`timed_out`](Self::timed_out) for lock `name`.
    ///
    /// # Cancel safety
    ///
    /// As cancel safe as `step`, which is dropped at `until`.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when `until` comes first.
    pub async fn run_until<F: std::future::Future>(
        &self,
        until: Option<tokio::time::Instant>,
        name: &str,
        step: F,
    ) -> Result<F::Output, Error> {
        match until {
            Some(until) => tokio::time::timeout_at(until, step)
                .await
                .map_err(|_| self.timed_out(name)),
            None => Ok(step.await),
        }
    }

    /// The instant the wait ends, if it does.
    pub fn at(&self) -> Option<tokio::time::Instant> {
        self.at
    }

    /// Whether the wait has ended.
    pub fn is_over(&self) -> bool {
        self.at.is_some_and(|at| tokio::time::Instant::now() >= at)
    }

    /// What is left of the wait (zero once over); `None` without an end.
    pub fn left(&self) -> Option<Duration> {
        self.at
            .map(|at| at.saturating_duration_since(tokio::time::Instant::now()))
    }

    /// Completes at [`bound`](Self::bound), when the whole acquire gives up; never
    /// without an end.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only sleeps.
    ///
    /// # Errors
    ///
    /// None.
    pub async fn bound_passed(&self) {
        match self.bound() {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }

    /// Completes when the wait ends; never without an end.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only sleeps.
    ///
    /// # Errors
    ///
    /// None.
    pub async fn over(&self) {
        match self.at {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }

    /// The [`Error::Timeout`] for lock `name`, naming the wait that was asked for.
    pub fn timed_out(&self, name: &str) -> Error {
        Error::Timeout {
            name: name.to_owned(),
            waited: self.waited,
        }
    }
}

/// Options for one [`acquire`](crate::DistributedLock::acquire).
///
/// The default is a renewing 30 s lease and waiting forever.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::{AcquireOptions, Lease, Wait};
///
/// let opts = AcquireOptions::new()
///     .lease(Duration::from_secs(10))          // renewed every 3.3 s
///     .wait_timeout(Duration::from_secs(2));
/// assert_eq!(opts.lease_kind(), Lease::Renewing(Duration::from_secs(10)));
/// assert_eq!(opts.wait_kind(), Wait::Timeout(Duration::from_secs(2)));
///
/// // A lease that is never renewed must be asked for by name.
/// let fixed = AcquireOptions::new().fixed_lease(Duration::from_secs(5)).no_wait();
/// assert_eq!(fixed.lease_kind(), Lease::Fixed(Duration::from_secs(5)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AcquireOptions {
    /// `None`: the backend's configured default lease (a renewing [`DEFAULT_LEASE`] unless
    /// the backend's configuration says otherwise, e.g. `etcd://...?lease=10s`).
    lease: Option<Lease>,
    wait: Wait,
}

impl AcquireOptions {
    /// Renewing 30 s lease, wait forever.
    pub fn new() -> Self {
        Self::default()
    }

    /// A renewing lease of this duration (renewed every third of it).
    pub fn lease(mut self, duration: Duration) -> Self {
        self.lease = Some(Lease::Renewing(duration));
        self
    }

    /// A fixed lease of this duration that is never renewed.
    pub fn fixed_lease(mut self, duration: Duration) -> Self {
        self.lease = Some(Lease::Fixed(duration));
        self
    }

    /// Sets the lease directly.
    pub fn with_lease(mut self, lease: Lease) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Sets the wait directly. A timeout of [`FOREVER`] or more (such as
    /// `Duration::MAX`) waits forever.
    pub fn wait(mut self, wait: Wait) -> Self {
        self.wait = match wait {
            Wait::Timeout(limit) if limit >= FOREVER => Wait::Forever,
            other => other,
        };
        self
    }

    /// Do not wait if the lock is held.
    pub fn no_wait(self) -> Self {
        self.wait(Wait::NoWait)
    }

    /// Wait at most this long; [`FOREVER`] or more (such as `Duration::MAX`) waits
    /// forever.
    pub fn wait_timeout(self, timeout: Duration) -> Self {
        self.wait(Wait::Timeout(timeout))
    }

    /// Wait until the lock is granted.
    pub fn wait_forever(self) -> Self {
        self.wait(Wait::Forever)
    }

    /// The lease: the one set on these options, or a renewing [`DEFAULT_LEASE`].
    ///
    /// Backends whose configuration sets a default lease use
    /// [`lease_or`](Self::lease_or) instead.
    pub fn lease_kind(&self) -> Lease {
        self.lease.unwrap_or_default()
    }

    /// The lease set on these options, or a renewing lease of `configured` when none was
    /// set: how a backend applies its configured default lease.
    pub fn lease_or(&self, configured: Duration) -> Lease {
        self.lease.unwrap_or(Lease::Renewing(configured))
    }

    /// Whether a lease was set on these options (rather than left to the backend's
    /// default).
    pub fn has_lease(&self) -> bool {
        self.lease.is_some()
    }

    /// The wait.
    pub fn wait_kind(&self) -> Wait {
        self.wait
    }

    /// Checks the options against a backend's minimum lease.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if the lease is zero, shorter than `min_lease` or than
    /// [`SHORTEST_LEASE`], or longer than [`MAX_LEASE`]. The lease is never silently adjusted.
    pub fn validate(&self, min_lease: Duration) -> Result<(), Error> {
        validate_lease(self.lease_kind().duration(), min_lease)
    }
}

/// Checks a lease duration against the range every backend accepts and the backend's
/// own minimum: longer than zero, at most 365 days, at least `min_lease` (and the
/// shortest lease any backend takes). For backends, when a lease arrives without
/// [`AcquireOptions`] (as in [`LockGuard::extend`](crate::LockGuard::extend)).
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the bound that was crossed.
pub fn validate_lease(lease: Duration, min_lease: Duration) -> Result<(), Error> {
    if lease.is_zero() {
        return Err(Error::InvalidConfig(
            "the lease must be longer than zero".into(),
        ));
    }
    if lease > MAX_LEASE {
        return Err(Error::InvalidConfig(format!(
            "a lease of {lease:?} is longer than the maximum of {MAX_LEASE:?} (365 days)"
        )));
    }
    let min_lease = min_lease.max(SHORTEST_LEASE);
    if lease < min_lease {
        return Err(Error::InvalidConfig(format!(
            "a lease of {lease:?} is shorter than this backend's minimum of {min_lease:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_a_renewing_30s_lease_and_waiting_forever() {
        let o = AcquireOptions::new();
        assert_eq!(o.lease_kind(), Lease::Renewing(Duration::from_secs(30)));
        assert_eq!(o.lease_kind().renew_interval(), Duration::from_secs(10));
        assert_eq!(o.wait_kind(), Wait::Forever);
        assert!(!o.has_lease());
        assert_eq!(
            o.lease_or(Duration::from_secs(5)),
            Lease::Renewing(Duration::from_secs(5))
        );
        let explicit = o.lease(Duration::from_secs(30));
        assert_eq!(
            explicit.lease_or(Duration::from_secs(5)),
            Lease::Renewing(Duration::from_secs(30))
        );
    }

    /// A step sent after a local wait gets the grace from when it is sent, not from the
    /// start of the acquire; a step cut at its bound fails with the wait's timeout.
    #[tokio::test(start_paused = true)]
    async fn steps_are_bounded_from_when_they_start() {
        let wait = WaitDeadline::new(Wait::Timeout(Duration::from_millis(100)));
        assert_eq!(WaitDeadline::new(Wait::Forever).bound_from_now(), None);
        let start = tokio::time::Instant::now();
        assert_eq!(wait.bound_from_now(), Some(start + ROUND_TRIP_GRACE));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = tokio::time::Instant::now();
        assert_eq!(wait.bound_from_now(), Some(now + ROUND_TRIP_GRACE));
        assert_eq!(wait.bound(), Some(start + ROUND_TRIP_GRACE));
        // A long wait is its own bound.
        let long = WaitDeadline::new(Wait::Timeout(Duration::from_secs(10)));
        assert_eq!(long.bound_from_now(), long.at());

        let step = wait.run_until(wait.bound_from_now(), "n", std::future::pending::<()>());
        match step.await {
            Err(Error::Timeout { name, waited }) => {
                assert_eq!((name.as_str(), waited), ("n", Duration::from_millis(100)));
            }
            other => panic!("not a timeout: {other:?}"),
        }
        assert_eq!(tokio::time::Instant::now(), now + ROUND_TRIP_GRACE);
        assert_eq!(wait.run_until(None, "n", async { 7 }).await.ok(), Some(7));
        assert_eq!(
            wait.run_until(wait.at(), "n", async { 7 }).await.ok(),
            Some(7)
        );
    }

    #[test]
    fn validation_never_adjusts_the_lease() {
        let min = Duration::from_secs(2);
        assert!(
            AcquireOptions::new()
                .lease(Duration::ZERO)
                .validate(min)
                .is_err()
        );
        assert!(
            AcquireOptions::new()
                .fixed_lease(Duration::from_secs(1))
                .validate(min)
                .is_err()
        );
        assert!(AcquireOptions::new().fixed_lease(min).validate(min).is_ok());
    }
}
