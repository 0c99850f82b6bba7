//! A held Redis lock: the guard handed out for a grant, its release, background release
//! and extension.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use fencelock_core::{Error, FencingToken, HeldLock, Lease, LockGuard};
use tokio::time::Instant;

use crate::config::MIN_LEASE;
use crate::engine::{Engine, Granted};
use crate::error::BACKEND;
use crate::keys::LockKeys;
use crate::quorum::drift;
use crate::renewal;

/// Hands out the guard of a grant (of `name`, for `keys`, made by attempt `id` whose
/// request was sent at `sent`): registers it with the client for `close` (refused, and
/// released in the background, once the client is closed), starts renewing a renewing
/// lease, and wraps a [`RedisHeld`] in the guard, whose deadline counts from `sent`.
///
/// # Errors
///
/// [`Error::Closed`] when the client was closed while granting.
#[allow(clippy::too_many_arguments)]
pub(crate) fn guard(
    engine: &Arc<Engine>,
    name: &str,
    keys: &LockKeys,
    lease: Lease,
    token: FencingToken,
    owner: String,
    id: u64,
    sent: tokio::time::Instant,
    election: bool,
) -> Result<LockGuard, Error> {
    let duration = lease.duration();
    let liveness = fencelock_core::Liveness::new(sent + duration - drift(duration));
    {
        let mut held = engine.held();
        if engine.closed.is_cancelled() {
            // Closed while granting: not handed out.
            drop(held);
            engine.release_in_background(keys.clone(), owner, Some(token.get()), election);
            return Err(Error::Closed { backend: BACKEND });
        }
        held.insert(
            id,
            Granted {
                keys: keys.clone(),
                owner: owner.clone(),
                token: token.get(),
                liveness: liveness.clone(),
                election,
            },
        );
    }
    if lease.is_renewing() {
        renewal::start(
            engine,
            id,
            keys.clone(),
            owner.clone(),
            duration,
            liveness.clone(),
            sent,
        );
    }
    let held = RedisHeld {
        engine: engine.clone(),
        id,
        name: name.to_owned(),
        keys: keys.clone(),
        owner,
        token: token.get(),
        election,
        released: AtomicBool::new(false),
        release_sent: AtomicBool::new(false),
    };
    Ok(LockGuard::new(
        name,
        token,
        BACKEND,
        liveness,
        Arc::new(held),
    ))
}

/// The backend side of a Redis guard. Its owner value identifies this grant alone, so a
/// late or repeated release can never delete a newer holder's key.
pub(crate) struct RedisHeld {
    pub(crate) engine: Arc<Engine>,
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) keys: LockKeys,
    pub(crate) owner: String,
    /// The guard's token: a release that finds the key gone and the counter still at it
    /// knows nobody was granted since (see [`RELEASE`](crate::scripts::RELEASE)).
    pub(crate) token: u64,
    /// Whether this is a campaign's term (see [`Engine::release`]).
    pub(crate) election: bool,
    pub(crate) released: AtomicBool,
    /// A release was sent (its future may have been dropped before the answer came): a
    /// key a repeated release finds gone may be one that release deleted, after which
    /// another client may even have been granted the name.
    pub(crate) release_sent: AtomicBool,
}

#[async_trait]
impl HeldLock for RedisHeld {
    #[tracing::instrument(name = "fencelock.redis.release", level = "debug", skip_all, fields(lock = %self.name))]
    async fn release(&self) -> Result<(), Error> {
        self.engine.renewals.remove(self.id);
        self.engine.held().remove(&self.id);
        let repeated = self.release_sent.swap(true, Ordering::AcqRel);
        match self
            .engine
            .release(&self.keys, &self.owner, Some(self.token), self.election)
            .await?
        {
            true => {
                self.released.store(true, Ordering::Release);
                Ok(())
            }
            false if self.released.load(Ordering::Acquire) => Ok(()),
            // The key is gone, maybe by our own earlier release (the raw layout keeps no
            // counter to tell, and a later grant moves the counter): not a known loss.
            false if repeated => Err(Error::unavailable(
                BACKEND,
                "the release could not be confirmed: an earlier release of this grant was                  sent but not answered, and the key is gone now (deleted by that release,                  or expired before it); the lock is free of this grant",
            )),
            false => Err(Error::lost(
                &self.name,
                "the lock key was gone or held by another owner at release",
            )),
        }
    }

    fn release_in_background(&self) {
        self.engine.renewals.remove(self.id);
        self.engine.held().remove(&self.id);
        // A release called after this one may find the key deleted by it.
        self.release_sent.store(true, Ordering::Release);
        if !self.released.load(Ordering::Acquire) {
            self.engine.release_in_background(
                self.keys.clone(),
                self.owner.clone(),
                Some(self.token),
                self.election,
            );
        }
    }

    fn can_extend(&self) -> Result<(), Error> {
        // Only renewing leases are in the renewal registry.
        if self.engine.renewals.contains(self.id) {
            Err(Error::not_a_fixed_lease())
        } else {
            Ok(())
        }
    }

    fn check_extension(&self, lease: Duration) -> Result<(), Error> {
        self.can_extend()?;
        fencelock_core::validate_lease(lease, MIN_LEASE)
    }

    /// Moves the key's expiry on every node (a quorum for Redlock) with the renewal
    /// script: one script per node, so a dropped call extended on some nodes or none.
    #[tracing::instrument(name = "fencelock.redis.extend", level = "debug", skip_all, fields(lock = %self.name))]
    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        self.check_extension(lease)?;
        if self.released.load(Ordering::Acquire) {
            return Err(Error::lost(&self.name, "the lock was released"));
        }
        self.engine
            .extend(&self.name, &self.keys, &self.owner, lease)
            .await
    }

    /// The lock key (on every instance, for Redlock).
    fn backend_key(&self) -> Option<&str> {
        Some(&self.keys.lock)
    }
}

impl Drop for RedisHeld {
    fn drop(&mut self) {
        self.engine.renewals.remove(self.id);
        self.engine.held().remove(&self.id);
    }
}

impl fmt::Debug for RedisHeld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisHeld")
            .field("key", &self.keys.lock)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}
