//! A held Redis lock: release and background release.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use fencelock_core::{Error, HeldLock};
use tokio::time::Instant;

use crate::engine::Engine;
use crate::keys::LockKeys;

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
                crate::error::BACKEND,
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
        fencelock_core::validate_lease(lease, crate::lock::MIN_LEASE)
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
