//! A held migration lock: its legs' guards, released in reverse order, and one liveness
//! for both.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;

use crate::{Error, HeldLock, Liveness, LockGuard};

/// The guards of the legs a migration guard stands for, in acquisition order.
///
/// [`release`](HeldLock::release) releases them in reverse order (the leg taken last is
/// freed first, so a waiter queued on the first leg finds the second one free). The
/// first call consumes the guards; later calls repeat the legs' own idempotent release.
pub(super) struct MigrationHeld {
    name: String,
    guards: Mutex<Option<Vec<(&'static str, LockGuard)>>>,
    helds: Vec<(&'static str, Arc<dyn HeldLock>)>,
    key: Option<String>,
}

impl MigrationHeld {
    /// Wraps the legs' guards (`(role, guard)`, in acquisition order). The backend key
    /// reported is the first leg's, the leg the token comes from.
    pub(super) fn new(name: &str, guards: Vec<(&'static str, LockGuard)>) -> Self {
        let helds = guards
            .iter()
            .map(|(role, guard)| (*role, guard.held().clone()))
            .collect();
        let key = guards
            .first()
            .and_then(|(_, guard)| guard.backend_key())
            .map(str::to_owned);
        MigrationHeld {
            name: name.to_owned(),
            guards: Mutex::new(Some(guards)),
            helds,
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

/// Keeps `outer` in step with two legs until the guard ends: its deadline is the earlier
/// of theirs (moved forward as they renew), it is at risk when either is, and it is lost
/// as soon as either is lost. Checks every `interval`, which must be well below the
/// renewal period of the legs (a sixth of the lease: they renew every third of it).
///
/// The outer deadline is never later than either leg's, so between two checks it can
/// only be too early, never too late.
pub(super) async fn follow_legs(
    outer: Liveness,
    legs: [(&'static str, Liveness); 2],
    interval: Duration,
) {
    let [(first_role, first), (second_role, second)] = legs;
    let lost = |role: &str, leg: &Liveness| {
        let reason = leg.lost_reason().unwrap_or("lost");
        format!("the {role} leg was lost: {reason}")
    };
    loop {
        outer.extend(first.valid_until().min(second.valid_until()));
        outer.set_at_risk(first.is_at_risk() || second.is_at_risk());
        tokio::select! {
            () = outer.ended() => return,
            () = first.lost() => {
                outer.mark_lost(lost(first_role, &first));
                return;
            }
            () = second.lost() => {
                outer.mark_lost(lost(second_role, &second));
                return;
            }
            () = outer.lost() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

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
            Duration::from_secs(1),
        ));
        tokio::time::sleep(Duration::from_secs(5)).await;
        a.extend(Instant::now() + Duration::from_secs(30));
        tokio::time::sleep(Duration::from_secs(2)).await;
        // Now the target leg (deadline at 20 s) is the earlier one.
        assert_eq!(outer.valid_until(), b.valid_until());
        b.set_at_risk(true);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(outer.is_at_risk());
        b.mark_lost("session expired");
        task.await.unwrap();
        assert!(outer.is_lost());
        assert_eq!(
            outer.lost_reason(),
            Some("the target leg was lost: session expired")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_follower_stops_when_the_guard_ends() {
        let outer = live(10);
        let task = tokio::spawn(follow_legs(
            outer.clone(),
            [("legacy", live(10)), ("target", live(10))],
            Duration::from_secs(1),
        ));
        outer.end();
        task.await.unwrap();
        assert!(!outer.is_lost());
    }
}
