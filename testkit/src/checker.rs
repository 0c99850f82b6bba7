//! The fault-test checkers: a fenced register that records every write, and the checks
//! run over its history afterwards.
//!
//! Every fault scenario writes through one [`Checker`] per lock name: a holder calls
//! [`enter`](Checker::enter) when its guard is granted, [`write`](Checker::write) for
//! each write to the protected resource (which the register accepts only with a token
//! at least as large as every token it accepted before), and [`exit`](Checker::exit)
//! when it leaves the critical section; a loss report is recorded with
//! [`lost`](Checker::lost). The checks are the ones of the fault-test plan:
//!
//! - C1 [`assert_no_overlap`](Checker::assert_no_overlap): no two holders inside at
//!   once (for runs without timing faults, where leases do not run out under a holder);
//! - C2 [`assert_no_stale_write_accepted`](Checker::assert_no_stale_write_accepted):
//!   every write with a token smaller than one already accepted was rejected;
//! - C3 [`assert_no_lost_update`](Checker::assert_no_lost_update): the register's value
//!   is the number of accepted increments;
//! - C4 [`assert_tokens_increase`](Checker::assert_tokens_increase): tokens strictly
//!   increase in grant order;
//! - C6 [`assert_loss_reported_in_time`](Checker::assert_loss_reported_in_time): a lost
//!   guard reported its loss no later than its `valid_until` + 250 ms.
//!
//! Tokens are plain `u64` (`FencingToken::get()`), so the module needs nothing but std.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

/// How late a loss report may come after the guard's own deadline (C6).
pub const LOSS_BOUND: Duration = Duration::from_millis(250);

/// One event of a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A holder was granted the lock with this token.
    Enter {
        /// Who (any label the scenario chooses).
        holder: String,
        /// The guard's token.
        token: u64,
    },
    /// A holder left its critical section.
    Exit {
        /// Who.
        holder: String,
        /// The guard's token.
        token: u64,
    },
    /// A write to the fenced register: an increment of its value.
    Write {
        /// Who.
        holder: String,
        /// The token it wrote with.
        token: u64,
        /// Whether the register accepted it.
        accepted: bool,
    },
    /// A guard reported loss.
    Lost {
        /// Who.
        holder: String,
        /// The guard's token.
        token: u64,
        /// How long after the guard's `valid_until` the report came (zero if before).
        late_by: Duration,
    },
}

/// An event with the monotonic and wall-clock times it was recorded at.
#[derive(Debug, Clone)]
pub struct Record {
    /// What happened.
    pub event: Event,
    /// When, on the monotonic clock.
    pub at: Instant,
    /// When, on the wall clock (for reading logs side by side).
    pub wall: SystemTime,
}

#[derive(Debug, Default)]
struct State {
    history: Vec<Record>,
    /// The largest token the register accepted.
    fence: u64,
    /// The register's value: accepted increments.
    value: u64,
}

/// A fenced register and the history of one lock name under a fault scenario.
#[derive(Debug, Default)]
pub struct Checker {
    state: Mutex<State>,
}

impl Checker {
    /// An empty history and a register at 0 accepting any token.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn record(state: &mut State, event: Event) {
        state.history.push(Record {
            event,
            at: Instant::now(),
            wall: SystemTime::now(),
        });
    }

    /// Records a grant.
    pub fn enter(&self, holder: &str, token: u64) {
        Self::record(
            &mut self.state(),
            Event::Enter {
                holder: holder.to_owned(),
                token,
            },
        );
    }

    /// Records the end of a critical section.
    pub fn exit(&self, holder: &str, token: u64) {
        Self::record(
            &mut self.state(),
            Event::Exit {
                holder: holder.to_owned(),
                token,
            },
        );
    }

    /// Writes an increment under `token`: accepted (and `true`) only if `token` is at
    /// least the largest token accepted so far, as a resource checking fencing tokens
    /// does (`UPDATE ... WHERE fence <= :token`).
    pub fn write(&self, holder: &str, token: u64) -> bool {
        let mut state = self.state();
        let accepted = token >= state.fence;
        if accepted {
            state.fence = token;
            state.value += 1;
        }
        Self::record(
            &mut state,
            Event::Write {
                holder: holder.to_owned(),
                token,
                accepted,
            },
        );
        accepted
    }

    /// Records a loss report of a guard whose `valid_until` was `valid_until`, now.
    pub fn lost(&self, holder: &str, token: u64, valid_until: Instant) {
        let late_by = Instant::now().saturating_duration_since(valid_until);
        Self::record(
            &mut self.state(),
            Event::Lost {
                holder: holder.to_owned(),
                token,
                late_by,
            },
        );
    }

    /// The register's value: the accepted increments.
    pub fn value(&self) -> u64 {
        self.state().value
    }

    /// The history so far.
    pub fn history(&self) -> Vec<Record> {
        self.state().history.clone()
    }

    /// The writes that were rejected.
    pub fn rejected_writes(&self) -> usize {
        self.history()
            .iter()
            .filter(|r| {
                matches!(
                    r.event,
                    Event::Write {
                        accepted: false,
                        ..
                    }
                )
            })
            .count()
    }

    /// C1: at no moment were two holders between their `enter` and `exit` (a holder
    /// whose loss was recorded counts as gone from its loss on).
    pub fn assert_no_overlap(&self) {
        let mut inside: Vec<(String, u64)> = Vec::new();
        for record in self.history() {
            match record.event {
                Event::Enter { holder, token } => {
                    assert!(
                        inside.is_empty(),
                        "C1: {holder} (token {token}) entered while {inside:?} held the lock"
                    );
                    inside.push((holder, token));
                }
                Event::Exit { holder, token } | Event::Lost { holder, token, .. } => {
                    inside.retain(|h| *h != (holder.clone(), token));
                }
                Event::Write { .. } => {}
            }
        }
    }

    /// C1 for a semaphore of `limit` permits: at no moment were more than `limit`
    /// holders between their `enter` and `exit` (a holder whose loss was recorded counts
    /// as gone from its loss on). [`assert_no_overlap`](Self::assert_no_overlap) is the
    /// case `limit` = 1. Returns the most holders seen inside at once.
    pub fn assert_at_most_inside(&self, limit: usize) -> usize {
        let mut inside: Vec<(String, u64)> = Vec::new();
        let mut most = 0;
        for record in self.history() {
            match record.event {
                Event::Enter { holder, token } => {
                    inside.push((holder.clone(), token));
                    assert!(
                        inside.len() <= limit,
                        "C1: {holder} (token {token}) entered while {} held: {inside:?}",
                        inside.len() - 1
                    );
                    most = most.max(inside.len());
                }
                Event::Exit { holder, token } | Event::Lost { holder, token, .. } => {
                    inside.retain(|h| *h != (holder.clone(), token));
                }
                Event::Write { .. } => {}
            }
        }
        most
    }

    /// C2: no write with a token below an already accepted one was accepted. (The
    /// register enforces this itself; the check replays the history, so a scenario that
    /// fenced its writes elsewhere can record them here and be checked the same way.)
    pub fn assert_no_stale_write_accepted(&self) {
        let mut fence = 0;
        for record in self.history() {
            if let Event::Write {
                holder,
                token,
                accepted,
            } = record.event
            {
                if accepted {
                    assert!(
                        token >= fence,
                        "C2: {holder}'s write with token {token} was accepted after token {fence}"
                    );
                    fence = token;
                }
            }
        }
    }

    /// C3: the register's value is `expected` (every acknowledged increment landed once).
    pub fn assert_no_lost_update(&self, expected: u64) {
        let value = self.value();
        assert_eq!(
            value, expected,
            "C3: {value} increments landed, {expected} expected"
        );
    }

    /// C4: tokens strictly increase in grant order.
    pub fn assert_tokens_increase(&self) {
        let tokens: Vec<u64> = self
            .history()
            .into_iter()
            .filter_map(|r| match r.event {
                Event::Enter { token, .. } => Some(token),
                _ => None,
            })
            .collect();
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "C4: tokens in grant order do not strictly increase: {tokens:?}"
        );
    }

    /// C6: every recorded loss came no later than [`LOSS_BOUND`] after the guard's
    /// `valid_until`.
    pub fn assert_loss_reported_in_time(&self) {
        for record in self.history() {
            if let Event::Lost {
                holder,
                token,
                late_by,
            } = record.event
            {
                assert!(
                    late_by <= LOSS_BOUND,
                    "C6: {holder} (token {token}) reported loss {late_by:?} after its valid_until"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clean_history_passes_every_check() {
        let c = Checker::new();
        c.enter("a", 1);
        assert!(c.write("a", 1));
        c.exit("a", 1);
        c.enter("b", 5);
        assert!(c.write("b", 5));
        c.exit("b", 5);
        c.assert_no_overlap();
        c.assert_no_stale_write_accepted();
        c.assert_no_lost_update(2);
        c.assert_tokens_increase();
        c.assert_loss_reported_in_time();
    }

    #[test]
    fn a_zombie_write_is_rejected_and_counted() {
        let c = Checker::new();
        c.enter("a", 1);
        c.lost("a", 1, Instant::now());
        c.enter("b", 2);
        assert!(c.write("b", 2));
        assert!(!c.write("a", 1));
        assert_eq!(c.rejected_writes(), 1);
        c.assert_no_overlap();
        c.assert_no_lost_update(1);
    }

    #[test]
    #[should_panic(expected = "C1")]
    fn overlap_is_caught() {
        let c = Checker::new();
        c.enter("a", 1);
        c.enter("b", 2);
        c.assert_no_overlap();
    }

    #[test]
    fn a_semaphore_history_counts_holders() {
        let c = Checker::new();
        c.enter("a", 1);
        c.enter("b", 2);
        c.lost("a", 1, Instant::now());
        c.enter("c", 3);
        assert_eq!(c.assert_at_most_inside(2), 2);
    }

    #[test]
    #[should_panic(expected = "C1")]
    fn a_permit_too_many_is_caught() {
        let c = Checker::new();
        c.enter("a", 1);
        c.enter("b", 2);
        c.enter("c", 3);
        c.assert_at_most_inside(2);
    }

    #[test]
    #[should_panic(expected = "C4")]
    fn a_repeated_token_is_caught() {
        let c = Checker::new();
        c.enter("a", 3);
        c.exit("a", 3);
        c.enter("b", 3);
        c.assert_tokens_increase();
    }

    #[test]
    #[should_panic(expected = "C6")]
    fn a_late_loss_report_is_caught() {
        let c = Checker::new();
        c.enter("a", 1);
        c.lost("a", 1, Instant::now() - Duration::from_secs(1));
        c.assert_loss_reported_in_time();
    }
}
