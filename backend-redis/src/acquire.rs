//! Acquiring a lock or campaigning for an election: the waiting loop around one try
//! ([`attempt::try_once`]), the local waiting line's front, the wait on the unlock
//! channel ([`crate::waiting`]), and the bound of the whole wait; a grant becomes a guard in
//! [`held::guard`].

use std::sync::Arc;

use fencelock_core::{AcquireOptions, Error, LockGuard, Wait, WaitDeadline, validate_name};
use tracing::Instrument;

use crate::attempt::{self, Attempt};
use crate::config::MIN_LEASE;
use crate::engine::Engine;
use crate::error::BACKEND;
use crate::held;
use crate::keys::LockKeys;
use crate::waiting::{Waited, Waiting};

/// Takes `name` (with a `value`: campaigns for it), waiting as `options` allow.
pub(crate) async fn take(
    engine: &Arc<Engine>,
    name: &str,
    options: AcquireOptions,
    value: Option<&str>,
) -> Result<LockGuard, Error> {
    validate_name(name)?;
    options.validate(MIN_LEASE)?;
    engine.check_open()?;
    let keys = engine.lock_keys(name)?;
    let wait = WaitDeadline::new(options.wait_kind());
    let waiting = wait_for_grant(engine, name, &keys, options, value, wait);
    let span = if value.is_some() {
        tracing::debug_span!("fencelock.redis.campaign", election = name)
    } else {
        tracing::debug_span!("fencelock.redis.acquire", lock = name)
    };
    tokio::select! {
        biased;
        // Dropping the attempt releases what it may have taken, as for any cancellation.
        () = engine.closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
        taken = waiting.instrument(span) => taken,
        // A server that stopped answering: the whole acquire ends with the wait.
        () = wait.bound_passed() => Err(wait.timed_out(name)),
    }
}

/// Tries, and while the lock is held waits and tries again, until granted or `wait`
/// is over. The wait is looked at where this waits (a free lock is granted with a
/// zero wait); the caller bounds the whole of it by [`WaitDeadline::bound`].
async fn wait_for_grant(
    engine: &Arc<Engine>,
    name: &str,
    keys: &LockKeys,
    options: AcquireOptions,
    value: Option<&str>,
    wait: WaitDeadline,
) -> Result<LockGuard, Error> {
    let lease = options.lease_kind();
    let mut waiting = Waiting::new();
    let will_wait = options.wait_kind() != Wait::NoWait;
    // A hand-written locker (raw layout) publishes nothing on release: look again
    // after a growing interval, as well as on a message or at the key's expiry.
    let config = &engine.config;
    let mut poll = config.layout.is_raw().then_some(config.poll_min);
    // Once refused, wait behind this client's other waiters for the key (see
    // `fencelock_core::line`): only the front of the line subscribes and tries again.
    let mut front = None;
    loop {
        match attempt::try_once(engine, keys, lease.duration(), will_wait, value).await? {
            Attempt::Granted {
                token,
                owner,
                id,
                sent,
            } => {
                return held::guard(
                    engine,
                    name,
                    keys,
                    lease,
                    token,
                    owner,
                    id,
                    sent,
                    value.is_some(),
                );
            }
            Attempt::Held(_) if options.wait_kind() == Wait::NoWait => {
                return Err(Error::Contended {
                    name: name.to_owned(),
                });
            }
            Attempt::Held(_) if wait.is_over() => return Err(wait.timed_out(name)),
            Attempt::Held(_) if front.is_none() => {
                // At the front, try again at once: the task before may have just
                // been granted the lock, or have given up.
                tokio::select! {
                    at_front = engine.lines.front(&keys.lock) => front = Some(at_front),
                    () = wait.over() => return Err(wait.timed_out(name)),
                }
            }
            Attempt::Held(after) => {
                let pause = poll.map_or(after, |poll| poll.min(after));
                let channel = (keys.slot, keys.channel.as_str());
                let waited = waiting
                    .before_next_try(engine, channel, pause, &wait, name)
                    .await?;
                if waited == Waited::Slept {
                    poll = poll.map(|poll| (poll * 2).min(config.poll_max));
                }
            }
        }
    }
}
