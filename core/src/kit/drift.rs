//! The one rule for the margin a local deadline keeps from the server's: every backend
//! subtracts [`CLOCK_DRIFT`] (plus what it documents it needs beyond that) from the
//! lease it computes a deadline from.

use std::time::Duration;

use tokio::time::Instant;

/// A margin for the difference between the rate of this client's clock and the
/// server's: a share of the lease plus a fixed part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriftMargin {
    /// Hundredths of the lease.
    percent: u32,
    fixed: Duration,
}

/// The margin every backend keeps: 1 % of the lease plus 2 ms, as in the Redlock
/// description (clocks that run at rates up to 1 % apart, and the timer's granularity).
pub const CLOCK_DRIFT: DriftMargin = DriftMargin {
    percent: 1,
    fixed: Duration::from_millis(2),
};

impl DriftMargin {
    /// This margin plus a backend's own: `percent` more of the lease and `fixed` more.
    /// A backend that needs more than [`CLOCK_DRIFT`] documents why where it calls this.
    pub const fn plus(self, percent: u32, fixed: Duration) -> Self {
        DriftMargin {
            percent: self.percent + percent,
            fixed: self.fixed.saturating_add(fixed),
        }
    }

    /// The margin for a lease of `lease`.
    pub fn of(self, lease: Duration) -> Duration {
        (lease / 100).saturating_mul(self.percent) + self.fixed
    }

    /// The conservative end of a lease of `lease` whose request was sent at `sent`: `sent
    /// + lease − margin` (never before `sent`).
    pub fn conservative_end(self, sent: Instant, lease: Duration) -> Instant {
        sent + lease.saturating_sub(self.of(lease))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_a_share_of_the_lease_plus_a_fixed_part() {
        let lease = Duration::from_secs(10);
        assert_eq!(CLOCK_DRIFT.of(lease), Duration::from_millis(102));
        let more = CLOCK_DRIFT.plus(1, Duration::from_millis(48));
        assert_eq!(more.of(lease), Duration::from_millis(250));
        let sent = Instant::now();
        assert_eq!(
            CLOCK_DRIFT.conservative_end(sent, lease),
            sent + Duration::from_millis(9_898)
        );
        // A lease shorter than its margin ends at the send.
        assert_eq!(more.conservative_end(sent, Duration::from_millis(10)), sent);
    }
}
