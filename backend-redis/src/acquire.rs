//! Acquiring a lock or campaigning for an election: the kit's claim/wait loop
//! ([`until_turn`]) around one try ([`attempt::try_once`]) and the waits between tries
//! ([`Trying`]: the local waiting line's front, then the unlock channel,
//! [`crate::waiting`]), and the bound of the whole wait; a grant becomes a guard in
//! [`held::guard`].

use std::sync::Arc;

use fencelock_core::kit::{Claim, GiveUp, Turn, until_turn};
use fencelock_core::line::Front;
use fencelock_core::{
    AcquireOptions, Error, FencingToken, LockGuard, Wait, WaitDeadline, validate_name,
};
use tokio::time::Instant;
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
/// is over: the kit's loop ([`until_turn`]) around [`Trying`]. The wait is looked at
/// where this waits (a free lock is granted with a zero wait); the caller bounds the
/// whole of it by [`WaitDeadline::bound`].
async fn wait_for_grant(
    engine: &Arc<Engine>,
    name: &str,
    keys: &LockKeys,
    options: AcquireOptions,
    value: Option<&str>,
    wait: WaitDeadline,
) -> Result<LockGuard, Error> {
    let lease = options.lease_kind();
    let no_wait = options.wait_kind() == Wait::NoWait;
    // A hand-written locker (raw layout) publishes nothing on release: look again
    // after a growing interval, as well as on a message or at the key's expiry.
    let config = &engine.config;
    let trying = Trying {
        engine,
        keys,
        lease: lease.duration(),
        will_wait: !no_wait,
        value,
        waiting: Waiting::new(),
        poll: config.layout.is_raw().then_some(config.poll_min),
        front: None,
        wait: &wait,
        name,
    };
    // The claim, holding this client's line for the key, lives until the guard is made.
    let (_trying, granted) = until_turn(trying, name, &wait, no_wait).await?;
    let Granted {
        token,
        owner,
        id,
        sent,
    } = granted;
    held::guard(
        engine,
        name,
        keys,
        lease,
        token,
        owner,
        id,
        sent,
        value.is_some(),
    )
}

/// A lock's tries ([`Claim::turn`]: one [`attempt::try_once`]) and the waits between
/// them ([`Claim::wait`]): behind this client's other waiters, then on the unlock
/// channel or for the holder's remaining lease.
struct Trying<'a> {
    engine: &'a Arc<Engine>,
    keys: &'a LockKeys,
    lease: std::time::Duration,
    will_wait: bool,
    value: Option<&'a str>,
    waiting: Waiting,
    /// The raw layout's polling interval, growing while nothing is heard.
    poll: Option<std::time::Duration>,
    /// Once refused, this client's line for the key (see `fencelock_core::line`): only
    /// the front subscribes and tries again.
    front: Option<Front>,
    wait: &'a WaitDeadline,
    name: &'a str,
}

/// A granted try (a lock's or a primitive's): its token, owner value, id, and when it
/// was sent.
pub(crate) struct Granted {
    pub(crate) token: FencingToken,
    pub(crate) owner: String,
    pub(crate) id: u64,
    pub(crate) sent: Instant,
}

impl Claim for Trying<'_> {
    type Grant = Granted;
    /// How long until the holder's lease ends, at most.
    type Blocker = std::time::Duration;

    async fn turn(&mut self) -> Result<Turn<Granted, std::time::Duration>, Error> {
        let tried = attempt::try_once(
            self.engine,
            self.keys,
            self.lease,
            self.will_wait,
            self.value,
        )
        .await?;
        Ok(match tried {
            Attempt::Granted {
                token,
                owner,
                id,
                sent,
            } => Turn::Granted(Granted {
                token,
                owner,
                id,
                sent,
            }),
            Attempt::Held(after) => Turn::Behind(after),
        })
    }

    async fn wait(&mut self, after: std::time::Duration) -> Result<(), Error> {
        if self.front.is_none() {
            // At the front, try again at once: the task before may have just been
            // granted the lock, or have given up.
            self.front = Some(self.engine.lines.front(&self.keys.lock).await);
            return Ok(());
        }
        let pause = self.poll.map_or(after, |poll| poll.min(after));
        let channel = (self.keys.slot, self.keys.channel.as_str());
        let waited = self
            .waiting
            .before_next_try(self.engine, channel, pause, self.wait, self.name)
            .await?;
        if waited == Waited::Slept {
            let max = self.engine.config.poll_max;
            self.poll = self.poll.map(|poll| (poll * 2).min(max));
        }
        Ok(())
    }

    /// A refused try left nothing behind (its undo ran with the try).
    async fn give_up(self, _why: GiveUp, error: Error) -> Error {
        error
    }
}
