//! A held Redis lock: the guard handed out for a grant, its release, background release
//! and extension.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fencelock_core::kit::{self, CLOCK_DRIFT, Deleted, Extension, Grant};
use fencelock_core::{Error, FencingToken, Lease, LockGuard};
use tokio::time::Instant;

use crate::config::MIN_LEASE;
use crate::engine::{Engine, Granted};
use crate::error::BACKEND;
use crate::keys::LockKeys;
use crate::renewal;

/// Hands out the guard of a grant (of `name`, for `keys`, made by attempt `id` whose
/// request was sent at `sent`): registers it with the client for `close` (refused, and
/// released in the background, once the client is closed), starts renewing a renewing
/// lease, and wraps a [`RedisGrant`] in the guard, whose deadline counts from `sent`.
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
    let liveness = fencelock_core::Liveness::new(sent + duration - CLOCK_DRIFT.of(duration));
    // Started under the registry's lock: `close` drains the grant with its renewal.
    let mut renewal = None;
    let registered = engine.held.insert_with(id, || {
        renewal = lease.is_renewing().then(|| {
            renewal::start(
                engine,
                id,
                keys.clone(),
                owner.clone(),
                duration,
                liveness.clone(),
                sent,
            )
        });
        Granted {
            keys: keys.clone(),
            owner: owner.clone(),
            token: token.get(),
            liveness: liveness.clone(),
            election,
            renewal,
        }
    });
    if registered.is_err() {
        // Closed while granting: not handed out.
        engine.release_in_background(keys.clone(), owner, Some(token.get()), election);
        return Err(Error::Closed { backend: BACKEND });
    }
    let name: Arc<str> = name.into();
    let grant = RedisGrant {
        engine: engine.clone(),
        id,
        name: name.clone(),
        keys: keys.clone(),
        owner,
        token: token.get(),
        election,
        renewal,
    };
    Ok(LockGuard::with_name(
        name,
        token,
        BACKEND,
        liveness.clone(),
        Arc::new(kit::Held::new(grant, liveness)),
    ))
}

/// The backend side of a Redis guard, in the kit's [`Held`](kit::Held), which keeps the
/// release state. Its owner value identifies this grant alone, so a late or repeated
/// release can never delete a newer holder's key.
pub(crate) struct RedisGrant {
    pub(crate) engine: Arc<Engine>,
    pub(crate) id: u64,
    /// Shared with the guard.
    pub(crate) name: Arc<str>,
    pub(crate) keys: LockKeys,
    pub(crate) owner: String,
    /// The guard's token: a release that finds the key gone and the counter still at it
    /// knows nobody was granted since (see [`RELEASE`](crate::scripts::RELEASE)).
    pub(crate) token: u64,
    /// Whether this is a campaign's term (see [`Engine::release`]).
    pub(crate) election: bool,
    /// A renewing lease's key in the client's renewals.
    pub(crate) renewal: Option<u64>,
}

impl Grant for RedisGrant {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn name(&self) -> &str {
        &self.name
    }

    /// The lock key (on every instance, for Redlock).
    fn key(&self) -> Option<&str> {
        Some(&self.keys.lock)
    }

    fn extension(&self) -> Extension {
        // Renewing while renewed (as before: a renewing lease released or found gone
        // answers as a fixed one would).
        if self
            .renewal
            .is_some_and(|key| self.engine.renewals.contains(key))
        {
            Extension::Renewing
        } else {
            Extension::Fixed {
                min_lease: MIN_LEASE,
            }
        }
    }

    fn stop(&self) {
        if let Some(key) = self.renewal {
            self.engine.renewals.remove(key);
        }
        self.engine.held.remove(self.id);
    }

    /// Compare-and-delete on every node (a quorum for Redlock). In the raw layout the
    /// counter does not see hand-written lockers, so a gone key is always "already gone"
    /// there, never "deleted before" (see [`Engine::release`]).
    async fn delete(&self) -> Result<Deleted, Error> {
        match self
            .engine
            .release(&self.keys, &self.owner, Some(self.token), self.election)
            .await?
        {
            true => Ok(Deleted::Now),
            false => Ok(Deleted::AlreadyGone),
        }
    }

    fn delete_in_background(&self) {
        self.engine.release_in_background(
            self.keys.clone(),
            self.owner.clone(),
            Some(self.token),
            self.election,
        );
    }

    /// Moves the key's expiry on every node (a quorum for Redlock) with the renewal
    /// script: one script per node, so a dropped call extended on some nodes or none.
    #[tracing::instrument(name = "fencelock.redis.extend", level = "debug", skip_all, fields(lock = %self.name))]
    async fn extend(&self, lease: Duration) -> Result<Instant, Error> {
        self.engine
            .extend(&self.name, &self.keys, &self.owner, lease)
            .await
    }
}

impl fmt::Debug for RedisGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisGrant")
            .field("key", &self.keys.lock)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}
