//! A held migration lock: its legs' guards, released in reverse order, and one liveness
//! for both.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::{Error, HeldLock, Liveness, LockGuard, LossCause};

/// The guards of the legs a migration guard stands for, in acquisition order.
///
/// [`release`](HeldLock::release) releases them in reverse order (the leg taken last is
/// freed first, so a waiter queued on the first leg finds the second one free). The
/// first call consumes the guards; later calls repeat the legs' own idempotent release.
pub(super) struct MigrationHeld {
    name: String,
    guards: Mutex<Option<Vec<(&'static str, LockGuard)>>>,
    helds: Vec<(&'static str, Arc<dyn HeldLock>)>,
    /// The legs' own liveness records, in acquisition order, moved by `extend`.
    legs: Vec<Liveness>,
    /// The migration guard's own record, when it is not a leg's (two legs): brought
    /// down to the earlier leg's deadline after every extension, which may have moved a
    /// leg's back (see [`follow_legs`]).
    outer: Option<Liveness>,
    key: Option<String>,
}

impl MigrationHeld {
    /// Wraps the legs' guards (`(role, guard)`, in acquisition order). The backend key
    /// reported is the first leg's, the leg the token comes from. `outer` is the
    /// migration guard's own liveness when it is not the (single) leg's.
    pub(super) fn new(
        name: &str,
        guards: Vec<(&'static str, LockGuard)>,
        outer: Option<Liveness>,
    ) -> Self {
        let helds = guards
            .iter()
            .map(|(role, guard)| (*role, guard.held().clone()))
            .collect();
        let legs = guards
            .iter()
            .map(|(_, guard)| guard.liveness().clone())
            .collect();
        let key = guards
            .first()
            .and_then(|(_, guard)| guard.backend_key())
            .map(str::to_owned);
        MigrationHeld {
            name: name.to_owned(),
            guards: Mutex::new(Some(guards)),
            helds,
            legs,
            outer,
            key,
        }
    }

    fn take_guards(&self) -> Option<Vec<(&'static str, LockGuard)>> {
        self.guards
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Keeps the most telling error of the legs: a loss beats any other failure, since
    /// it means work under the lock may have overlapped with another holder.
    fn merge(&self, outcome: &mut Result<(), Error>, role: &str, result: Result<(), Error>) {
        let error = match result {
            Ok(()) => return,
            Err(Error::Lost { reason, .. }) => {
                Error::lost(&self.name, format!("the {role} leg was lost: {reason}"))
            }
            Err(other) => other,
        };
        let replace = match outcome {
            Ok(()) => true,
            Err(Error::Lost { .. }) => false,
            Err(_) => matches!(error, Error::Lost { .. }),
        };
        if replace {
            *outcome = Err(error);
        }
    }
}

#[async_trait]
impl HeldLock for MigrationHeld {
    async fn release(&self) -> Result<(), Error> {
        let mut outcome = Ok(());
        match self.take_guards() {
            // If this future is dropped midway, the guards not yet released are dropped
            // with it and release in the background.
            Some(guards) => {
                for (role, guard) in guards.into_iter().rev() {
                    let result = guard.release().await;
                    self.merge(&mut outcome, role, result);
                }
            }
            None => {
                for (role, held) in self.helds.iter().rev() {
                    let result = held.release().await;
                    self.merge(&mut outcome, role, result);
                }
            }
        }
        outcome
    }

    fn release_in_background(&self) {
        if let Some(guards) = self.take_guards() {
            // Each leg guard's drop stops its renewal and releases in the background.
            for guard in guards.into_iter().rev() {
                drop(guard);
            }
        }
    }

    fn backend_key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    fn can_extend(&self) -> Result<(), Error> {
        self.helds
            .iter()
            .try_for_each(|(_, held)| held.can_extend())
    }

    fn check_extension(&self, lease: Duration) -> Result<(), Error> {
        self.helds
            .iter()
            .try_for_each(|(_, held)| held.check_extension(lease))
    }

    /// Extends every leg, in acquisition order, each under the rule
    /// [`LockGuard::extend`] applies: a leg whose deadline already covers `lease` from
    /// now is not extended (its server's lease may be longer than `lease`, after an
    /// earlier extension that failed on a later leg, and must not be shortened under the
    /// deadline it keeps), and a leg that is extended takes its backend's answer as its
    /// deadline. The migration guard is valid until the earlier of the legs' deadlines.
    /// A leg that cannot be extended fails the whole call (the legs extended before it
    /// just hold longer), and the guard's deadline still comes down to the earlier
    /// leg's, which an extension may have moved back.
    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        let extended = self.extend_legs(lease).await;
        // Also after a failure: a leg extended before it may have moved back.
        let legs_until = self.legs.iter().map(Liveness::valid_until).min();
        if let (Some(outer), Some(legs_until)) = (&self.outer, legs_until) {
            outer.lower_to(legs_until);
        }
        // The legs as they are now, not as each was right after its own extension: a
        // leg its backend moved back meanwhile (an earlier, dropped call's etcd task)
        // must not be raised over by this answer. The follower, woken by the guard's
        // deadline moving, checks again after the caller sets it.
        extended.map(|until| legs_until.map_or(until, |legs| until.min(legs)))
    }
}

impl MigrationHeld {
    /// The legs' part of [`extend`](HeldLock::extend).
    async fn extend_legs(&self, lease: Duration) -> Result<Instant, Error> {
        let mut valid_until: Option<Instant> = None;
        for ((role, held), leg) in self.helds.iter().zip(&self.legs) {
            match crate::guard::extend_held(&**held, leg, lease).await {
                Ok(_) => {}
                Err(Error::Lost { reason, .. }) => {
                    return Err(Error::lost(
                        &self.name,
                        format!("the {role} leg was lost: {reason}"),
                    ));
                }
                Err(error) => return Err(error),
            }
            let leg_until = leg.valid_until();
            valid_until = Some(valid_until.map_or(leg_until, |v| v.min(leg_until)));
        }
        valid_until.ok_or_else(|| Error::lost(&self.name, "the migration guard has no legs"))
    }
}

impl fmt::Debug for MigrationHeld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let legs: Vec<&str> = self.helds.iter().map(|(role, _)| *role).collect();
        f.debug_struct("MigrationHeld")
            .field("name", &self.name)
            .field("legs", &legs)
            .finish_non_exhaustive()
    }
}

/// The shortest pause between two looks at the legs, so a leg about to expire is not
/// polled in a busy loop (its own loss signal ends the follower at its deadline anyway).
const MIN_CHECK: Duration = Duration::from_millis(5);

/// Keeps `outer` in step with two legs until the guard ends: its deadline is the earlier
/// of theirs (moved forward as they renew), it is at risk when either is, and it is lost
/// as soon as either leg reports loss (marked lost, or its own deadline passed).
///
/// Everything here comes from the legs' own guards, never from the options of the
/// caller: the legs may run leases of their own configuration (`etcd://...?lease=2s`,
/// `zk://...?session_timeout=4s`), far shorter than the caller's default. The legs are
/// looked at again after a sixth of the time the earlier one is still valid for (see
/// [`next_check`]), so the outer deadline is refreshed long before it could pass while
/// the legs renew, and more and more often as a leg that stopped renewing nears its end.
///
/// The outer deadline is never later than either leg's, so between two checks it can
/// only be too early, never too late: a leg moved back (not only forward, by renewals)
/// wakes the follower at once.
pub(super) async fn follow_legs(outer: Liveness, legs: [(&'static str, Liveness); 2]) {
    let [(first_role, first), (second_role, second)] = legs;
    let lost = |role: &str, leg: &Liveness| {
        let reason = leg.lost_reason().unwrap_or("lost");
        format!("the {role} leg was lost: {reason}")
    };
    loop {
        // Registered before the legs are read: a leg moved back after the read (an
        // extension's task confirming a shorter lease) wakes this loop at once.
        // So does the guard's own deadline being set (an extension's answer may lie past
        // a leg moved back since it was read).
        let (first_moved, second_moved, outer_moved) =
            (first.changes(), second.changes(), outer.changes());
        tokio::pin!(first_moved, second_moved, outer_moved);
        first_moved.as_mut().enable();
        second_moved.as_mut().enable();
        outer_moved.as_mut().enable();
        let legs_until = first.valid_until().min(second.valid_until());
        outer.extend(legs_until);
        // Read again: an extension may have moved a leg back (and the guard with it)
        // since the first read, which the line above must not have undone.
        outer.lower_to(first.valid_until().min(second.valid_until()));
        outer.set_at_risk(first.is_at_risk() || second.is_at_risk());
        let next = next_check(Instant::now(), legs_until);
        tokio::select! {
            () = outer.ended() => return,
            () = first.lost() => {
                outer.mark_lost(LossCause::MigrationLeg, lost(first_role, &first));
                return;
            }
            () = second.lost() => {
                outer.mark_lost(LossCause::MigrationLeg, lost(second_role, &second));
                return;
            }
            () = outer.lost() => return,
            () = &mut first_moved => {}
            () = &mut second_moved => {}
            () = &mut outer_moved => {}
            () = tokio::time::sleep_until(next) => {}
        }
    }
}

/// When to look at the legs again, `now`, with the earlier leg valid until
/// `legs_until`: after a sixth of the time left (the legs renew every third of their
/// lease, so while they do, a check comes well before the outer deadline), and no
/// sooner than [`MIN_CHECK`].
fn next_check(now: Instant, legs_until: Instant) -> Instant {
    let pause = (legs_until.saturating_duration_since(now) / 6).max(MIN_CHECK);
    now.checked_add(pause).unwrap_or(legs_until)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(secs: u64) -> Liveness {
        Liveness::new(Instant::now() + Duration::from_secs(secs))
    }

    #[tokio::test(start_paused = true)]
    async fn outer_follows_the_earlier_leg_and_dies_with_either() {
        let (a, b) = (live(10), live(20));
        let outer = live(10);
        let task = tokio::spawn(follow_legs(
            outer.clone(),
            [("legacy", a.clone()), ("target", b.clone())],
        ));
        tokio::time::sleep(Duration::from_secs(5)).await;
        a.extend(Instant::now() + Duration::from_secs(30));
        tokio::time::sleep(Duration::from_secs(2)).await;
        // Now the target leg (deadline at 20 s) is the earlier one.
        assert_eq!(outer.valid_until(), b.valid_until());
        b.set_at_risk(true);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(outer.is_at_risk());
        b.mark_lost(LossCause::SessionEnded, "session expired");
        task.await.unwrap();
        assert!(outer.is_lost());
        assert_eq!(
            outer.lost_reason(),
            Some("the target leg was lost: session expired")
        );
    }

    #[test]
    fn checks_come_after_a_sixth_of_the_time_left() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        assert_eq!(next_check(now, at(1_800)), at(300));
        assert_eq!(next_check(now, at(30_000)), at(5_000));
        // Near or past the legs' deadline: no busy loop.
        assert_eq!(next_check(now, at(12)), at(5));
        assert_eq!(next_check(at(100), now), at(105));
    }

    /// Legs that renew a 2 s lease every third of it keep the outer guard alive for many
    /// leases; when one stops renewing, the guard is lost at that leg's deadline.
    #[tokio::test(start_paused = true)]
    async fn short_renewing_legs_keep_the_outer_guard_alive() {
        let lease = Duration::from_secs(2);
        let (a, b) = (live(2), live(2));
        let outer = live(2);
        tokio::spawn(follow_legs(
            outer.clone(),
            [("legacy", a.clone()), ("target", b.clone())],
        ));
        for _ in 0..30 {
            tokio::time::sleep(lease / 3).await;
            a.extend(Instant::now() + lease);
            b.extend(Instant::now() + lease);
            assert!(!outer.is_lost(), "{:?}", outer.lost_reason());
        }
        let deadline = b.valid_until();
        a.extend(Instant::now() + lease * 10);
        outer.lost().await;
        assert_eq!(Instant::now(), deadline);
    }

    /// A leg whose deadline its backend moves back between two checks (an extension's
    /// task confirming a shorter lease after the caller went away) takes the outer
    /// deadline back at once, not at the next check: the outer guard never claims more
    /// time than a leg has.
    #[tokio::test(start_paused = true)]
    async fn a_leg_moved_back_between_checks_moves_the_guard_back_at_once() {
        let (a, b) = (live(60), live(60));
        let outer = live(60);
        tokio::spawn(follow_legs(
            outer.clone(),
            [("legacy", a.clone()), ("target", b.clone())],
        ));
        // Let the follower read the legs and go to sleep until its next check (10 s).
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(a.confirm_extension(Instant::now() + Duration::from_secs(30)));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(
            outer.valid_until() <= a.valid_until(),
            "the guard claims {:?}, its legacy leg only {:?}",
            outer.valid_until() - Instant::now(),
            a.valid_until() - Instant::now()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_follower_stops_when_the_guard_ends() {
        let outer = live(10);
        let task = tokio::spawn(follow_legs(
            outer.clone(),
            [("legacy", live(10)), ("target", live(10))],
        ));
        outer.end();
        task.await.unwrap();
        assert!(!outer.is_lost());
    }
}
