//! The retry schedule: how many attempts, and the backoff with jitter between them.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

use crate::Error;

/// When and how often [`Retry`](super::Retry) tries again.
///
/// The default is the seeds' schedule: up to **3 retries** after the first attempt,
/// waiting **200 ms, 500 ms and 1 s** before them (an exponential backoff from 200 ms
/// with factor 2.5, capped at 1 s, computed by the `backon` crate). Each delay is then
/// shortened by a random fraction of up to 20 % (jitter), so clients that failed together
/// do not retry in lockstep; the nominal delays are upper bounds.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use fencelock_core::layer::retry::RetryPolicy;
///
/// let policy = RetryPolicy::default();
/// let delays: Vec<_> = policy.nominal_delays().collect();
/// assert_eq!(delays, [200, 500, 1000].map(Duration::from_millis));
///
/// let patient = RetryPolicy::default()
///     .max_retries(6)
///     .max_delay(Duration::from_secs(5))
///     .jitter(0.5);
/// assert_eq!(patient.nominal_delays().count(), 6);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    max_retries: usize,
    min_delay: Duration,
    max_delay: Duration,
    factor: f32,
    jitter: f32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_retries: 3,
            min_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(1),
            factor: 2.5,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// The default policy (3 retries: 200 ms, 500 ms, 1 s, 20 % jitter).
    pub fn new() -> Self {
        Self::default()
    }

    /// A policy that never retries: [`Retry`](super::Retry) then only forwards.
    pub fn never() -> Self {
        Self::default().max_retries(0)
    }

    /// How many times to retry after the first attempt (0 = never).
    pub fn max_retries(mut self, retries: usize) -> Self {
        self.max_retries = retries;
        self
    }

    /// The delay before the first retry. Default 200 ms. Each later delay grows from
    /// it, so it must be longer than zero.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a zero delay: every delay would then be zero, and a
    /// backend that fails fast would be retried in a busy loop.
    pub fn min_delay(mut self, delay: Duration) -> Result<Self, Error> {
        if delay.is_zero() {
            return Err(Error::InvalidConfig(
                "retry: the minimum delay must be longer than zero, or every retry would \
                 follow its failure at once"
                    .into(),
            ));
        }
        self.min_delay = delay;
        Ok(self)
    }

    /// The longest delay between two attempts. Default 1 s.
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// How much each delay grows over the previous one. Default 2.5. Values below 1 (and
    /// NaN) are taken as 1: a constant delay.
    pub fn factor(mut self, factor: f32) -> Self {
        self.factor = if factor >= 1.0 { factor } else { 1.0 };
        self
    }

    /// The largest random fraction by which a delay is shortened, from 0 (no jitter) to 1
    /// (anywhere between zero and the nominal delay). Default 0.2. Out-of-range values
    /// (and NaN) are clamped into `0..=1`.
    pub fn jitter(mut self, ratio: f32) -> Self {
        self.jitter = if ratio.is_nan() {
            0.0
        } else {
            ratio.clamp(0.0, 1.0)
        };
        self
    }

    /// The configured number of retries.
    pub fn retries(&self) -> usize {
        self.max_retries
    }

    /// The configured jitter ratio.
    pub fn jitter_ratio(&self) -> f32 {
        self.jitter
    }

    /// The configured delay before the first retry and the longest delay.
    pub fn delay_bounds(&self) -> (Duration, Duration) {
        (self.min_delay, self.max_delay)
    }

    /// The delays before each retry, before jitter.
    pub fn nominal_delays(&self) -> impl Iterator<Item = Duration> + use<> {
        ExponentialBuilder::new()
            .with_min_delay(self.min_delay)
            .with_max_delay(self.max_delay.max(self.min_delay))
            .with_factor(self.factor)
            .with_max_times(self.max_retries)
            .build()
    }

    /// The delays before each retry, with jitter applied.
    pub(super) fn delays(&self) -> impl Iterator<Item = Duration> + use<> {
        let jitter = self.jitter;
        self.nominal_delays().map(move |delay| {
            // In f64 and checked: `mul_f32` rounds a delay near `Duration::MAX` up past
            // it and panics.
            let factor = f64::from(1.0 - jitter * random_fraction()).clamp(0.0, 1.0);
            Duration::try_from_secs_f64(delay.as_secs_f64() * factor).unwrap_or(delay)
        })
    }
}

/// A uniformly distributed number in `0..1`, from the standard library's per-instance
/// random hasher keys (no extra dependency; not for cryptography).
fn random_fraction() -> f32 {
    let bits = RandomState::new().build_hasher().finish() >> 40;
    bits as f32 / (1u64 << 24) as f32
}
