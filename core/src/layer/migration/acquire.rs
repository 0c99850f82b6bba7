//! Taking the legs of a migration lock: one leg, or two in a fixed order where a second
//! leg that cannot be had gives the first one back.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use super::BACKEND;
use super::held::{MigrationHeld, follow_legs};
use super::token::era_token;
use crate::{AcquireOptions, DistributedLock, Error, Lease, Liveness, LockGuard, Wait};

/// One leg of a migration: a lock service, its role, and the epoch of its tokens.
#[derive(Clone, Debug)]
pub(super) struct Leg {
    pub(super) role: &'static str,
    pub(super) lock: Arc<dyn DistributedLock>,
    pub(super) epoch: u8,
}

/// Takes the lock on one leg; the guard shares the leg's liveness.
pub(super) async fn single(
    name: &str,
    leg: &Leg,
    options: AcquireOptions,
) -> Result<LockGuard, Error> {
    let guard = leg.lock.acquire(name, options).await?;
    wrap_single(name, leg, guard).await
}

/// A guard of `leg` as the migration layer's, with the leg's era token.
pub(super) async fn wrap_single(
    name: &str,
    leg: &Leg,
    guard: LockGuard,
) -> Result<LockGuard, Error> {
    let token = match era_token(leg.epoch, guard.token()) {
        Ok(token) => token,
        Err(error) => {
            release_quietly(guard).await;
            return Err(error);
        }
    };
    let liveness = guard.liveness().clone();
    let held = MigrationHeld::new(name, vec![(leg.role, guard)], None);
    Ok(LockGuard::new(
        name,
        token,
        BACKEND,
        liveness,
        Arc::new(held),
    ))
}

/// Takes `first`, then `second`, as one lock, within the caller's wait.
///
/// The second leg is waited for at most `second_wait` (not at all with
/// [`Wait::NoWait`]); if it cannot be had, the first is released, and the whole attempt
/// is repeated after a short random pause while the caller's wait allows. That also
/// breaks the wait cycle of two clients on different phases taking the legs in opposite
/// orders during a rolling change.
pub(super) async fn both(
    name: &str,
    legs: (&Leg, &Leg),
    options: AcquireOptions,
    second_wait: Duration,
    runtime: Option<&tokio::runtime::Handle>,
) -> Result<LockGuard, Error> {
    let wait = crate::WaitDeadline::new(options.wait_kind());
    tokio::select! {
        taken = attempts(name, legs, options, (second_wait, wait), runtime) => taken,
        // A leg that stopped answering (or a release that hangs between attempts): the
        // whole acquire still ends with the wait, or the round-trip grace. What the
        // dropped attempt held is released in the background, as for any cancellation.
        () = wait.bound_passed() => Err(wait.timed_out(name)),
    }
}

/// The attempts of [`both`]. The caller's wait bounds the time the legs spend behind
/// holders: each leg is asked with what is left of it (a free leg is granted with a zero
/// wait), and the pause between attempts ends with it.
async fn attempts(
    name: &str,
    (first, second): (&Leg, &Leg),
    options: AcquireOptions,
    (second_wait, wait): (Duration, crate::WaitDeadline),
    runtime: Option<&tokio::runtime::Handle>,
) -> Result<LockGuard, Error> {
    let no_wait = options.wait_kind() == Wait::NoWait;
    let mut attempt: u32 = 0;
    loop {
        let first_options = match (no_wait, wait.left()) {
            (true, _) => options,
            (false, Some(left)) => options.wait_timeout(left),
            (false, None) => options.wait_forever(),
        };
        let first_guard = match first.lock.acquire(name, first_options).await {
            Ok(guard) => guard,
            Err(Error::Timeout { .. }) => return Err(wait.timed_out(name)),
            Err(error) => return Err(error),
        };
        let second_options = match (no_wait, wait.left()) {
            (true, _) => options,
            (false, Some(left)) => options.wait_timeout(left.min(second_wait)),
            (false, None) => options.wait_timeout(second_wait),
        };
        let why = match second.lock.acquire(name, second_options).await {
            Ok(second_guard) => {
                if let Some(first_guard) = restarted(first_guard, &second_guard, options).await {
                    if !second_guard.is_lost() {
                        let legs = ((first, first_guard), (second, second_guard));
                        return combine(name, legs, runtime).await;
                    }
                    release_quietly(first_guard).await;
                }
                // A leg was lost while the other was taken (revoked, its session ended,
                // its lease ran out): not a grant, though the other leg looks fine. Both
                // go, and the attempt starts again.
                release_quietly(second_guard).await;
                "a leg was lost while the other was taken"
            }
            Err(Error::Contended { .. } | Error::Timeout { .. }) => {
                release_quietly(first_guard).await;
                "the second leg is held"
            }
            Err(error) => {
                release_quietly(first_guard).await;
                return Err(error);
            }
        };
        if no_wait {
            return Err(Error::Contended {
                name: name.to_owned(),
            });
        }
        if wait.left().is_some_and(|left| left.is_zero()) {
            return Err(wait.timed_out(name));
        }
        attempt = attempt.saturating_add(1);
        tracing::debug!(
            lock = name,
            attempt,
            first = first.role,
            second = second.role,
            "migration: {why}; released the legs taken and trying again"
        );
        let pause = backoff(attempt);
        tokio::time::sleep(wait.left().map_or(pause, |left| pause.min(left))).await;
        if wait.left().is_some_and(|left| left.is_zero()) {
            return Err(wait.timed_out(name));
        }
    }
}

/// The first leg's guard, still held, once the second is granted: `None` (released) if
/// it was lost meanwhile. A fixed lease starts at the grant, and the first leg's ran
/// while the second was waited for; when that wait used more than a twentieth of it, the
/// first leg is extended to a whole lease again (one round trip). A leg that cannot
/// extend ([`Error::Unsupported`]) keeps the deadline it has, which the guard reports.
async fn restarted(
    first_guard: LockGuard,
    second_guard: &LockGuard,
    options: AcquireOptions,
) -> Option<LockGuard> {
    if let Lease::Fixed(lease) = options.lease_kind() {
        let behind = second_guard
            .valid_until()
            .saturating_duration_since(first_guard.valid_until());
        if behind > lease / 20 && !first_guard.is_lost() {
            match first_guard.extend(lease).await {
                Ok(()) | Err(Error::Unsupported { .. }) => {}
                Err(error) => {
                    tracing::debug!(%error, "migration: the first leg could not be extended");
                    release_quietly(first_guard).await;
                    return None;
                }
            }
        }
    }
    if first_guard.is_lost() {
        release_quietly(first_guard).await;
        return None;
    }
    Some(first_guard)
}

/// Makes one guard of two leg guards: the token of the first leg in its epoch, a
/// liveness that follows both legs' own guards (see [`follow_legs`]), and a handle that
/// releases both. The caller's options play no part in it: the legs may have run leases
/// of their own configuration.
async fn combine(
    name: &str,
    ((first, first_guard), (second, second_guard)): ((&Leg, LockGuard), (&Leg, LockGuard)),
    runtime: Option<&tokio::runtime::Handle>,
) -> Result<LockGuard, Error> {
    let token = match era_token(first.epoch, first_guard.token()) {
        Ok(token) => token,
        Err(error) => {
            release_quietly(second_guard).await;
            release_quietly(first_guard).await;
            return Err(error);
        }
    };
    let legs = [
        (first.role, first_guard.liveness().clone()),
        (second.role, second_guard.liveness().clone()),
    ];
    let outer = Liveness::new(legs[0].1.valid_until().min(legs[1].1.valid_until()));
    // On the lock's own runtime (see `MigrationLock::runtime`), else on the runtimes
    // the legs' records were made on (their clients', whose own tasks must run for the
    // legs to work), else this call's (which may be one the caller enters only now and
    // then); when the one it runs on ends while the guard is held, on the next of these.
    let runtimes = runtime
        .cloned()
        .into_iter()
        .chain(legs.iter().filter_map(|(_, leg)| leg.runtime().cloned()))
        .chain(tokio::runtime::Handle::try_current().ok())
        .collect::<Vec<_>>();
    let (following, follower) = (outer.clone(), legs.clone());
    let started = crate::kept::spawn_kept(
        runtimes,
        move || follow_legs(following.clone(), follower.clone()),
        || {},
    );
    if !started {
        release_quietly(second_guard).await;
        release_quietly(first_guard).await;
        return Err(Error::InvalidConfig(
            "the migration layer needs a Tokio runtime".into(),
        ));
    }
    let held = MigrationHeld::new(
        name,
        vec![(first.role, first_guard), (second.role, second_guard)],
        Some(outer.clone()),
    );
    Ok(LockGuard::new(name, token, BACKEND, outer, Arc::new(held)))
}

/// Releases a leg that is not needed after all. Errors only mean the leg expires with its
/// lease; if this future is dropped, the guard is dropped and releases in the background.
async fn release_quietly(guard: LockGuard) {
    let backend = guard.backend();
    if let Err(error) = guard.release().await {
        tracing::debug!(backend, %error, "migration: releasing an unused leg failed");
    }
}

/// A random pause before attempt `attempt + 1`: up to 20 ms × 2^attempt, at most 320 ms.
fn backoff(attempt: u32) -> Duration {
    let ceiling_ms = 20u64 << attempt.min(4);
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    Duration::from_millis(5 + random % ceiling_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_bounded() {
        for attempt in 0..20 {
            let pause = backoff(attempt);
            assert!(pause >= Duration::from_millis(5));
            assert!(pause < Duration::from_millis(5 + 320));
        }
    }
}
