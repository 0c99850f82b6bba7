//! Migration: a legacy lock and a target lock held as one, so a fleet moves from one lock
//! service to another (Redis → etcd, typically) by configuration alone, with old and new
//! versions of a service running side by side and never two holders.
//!
//! # Phases
//!
//! | phase | legs, in order | tokens from |
//! |---|---|---|
//! | [`Legacy`](MigrationPhase::Legacy) | legacy | legacy leg, legacy epoch |
//! | [`LegacyFirst`](MigrationPhase::LegacyFirst) | legacy, then target | legacy leg, legacy epoch |
//! | [`TargetFirst`](MigrationPhase::TargetFirst) | target, then legacy | target leg, target epoch |
//! | [`Target`](MigrationPhase::Target) | target | target leg, target epoch |
//!
//! In the two-leg phases both legs are taken in the phase's fixed order. The second leg is
//! waited for a bounded time ([`MigrationLock::second_leg_wait`]); if it cannot be had,
//! or fails, the first leg is released before `acquire` returns or tries again, so no
//! half-held lock outlives the call. Dropping the `acquire` future at any point drops
//! whatever leg guard it holds, which releases in the background. The guard is valid
//! only while both legs hold: its deadline is the earlier of the legs' deadlines, and the
//! loss of either leg is the loss of the guard. Both follow the legs' own guards, never
//! the caller's options: a leg may run a lease of its own configuration
//! (`etcd://...?lease=2s`, `zk://...?session_timeout=4s`) when the options set none.
//! Release frees the legs in reverse order.
//!
//! # Fencing tokens across the switch
//!
//! A token is the token of the first leg with an epoch in its high bits:
//! `epoch << 56 | leg token` ([`era_token`]). The legacy epoch is 0 by default, so in the
//! legacy phases tokens are *exactly* the legacy backend's own, comparable with those of
//! services that still use the legacy backend directly. The target epoch (default 1)
//! makes every target-era token larger than every legacy-era one, whatever the two
//! backends' numbers (Redis: microseconds, about 1.7 × 10^15; etcd: revisions, small;
//! ZooKeeper: zxids). So a resource that has seen legacy tokens accepts the first holder
//! of the target era and keeps rejecting legacy-era zombies.
//!
//! The guarantee: tokens handed out by this layer and by legacy-only services grow
//! with the order of grants across every phase change, given that
//!
//! 1. each backend keeps its own token promise (see its
//!    [`FencingStrength`](crate::FencingStrength));
//! 2. backend tokens fit in 56 bits (checked on every grant: a grant whose token does
//!    not fit is refused, never wrapped);
//! 3. once any instance runs a target-token phase (`target-first`, `target`), no
//!    service writes with legacy-era tokens any more: instances still on a legacy phase
//!    (during a rolling change, or after a rollback) get their writes *refused* by
//!    resources that have seen a target-era token. That is safe (a refusal, never a
//!    stale write accepted) but it is an outage for them, so roll that step quickly;
//! 4. epochs only grow: a later migration (etcd → ZooKeeper) uses the previous target
//!    epoch as its legacy epoch and a larger target epoch.
//!
//! Tokens stay below 2^63 ([`MAX_EPOCH`] is 127), so they fit a signed SQL `BIGINT`.
//!
//! # Who holds it
//!
//! `inspect`, `list` and `revoke` report the first leg's holder when it has one, else the
//! second's, with a token in this lock's order: never above the token of the next grant.
//! A holder seen on the first leg is reported with that leg's token in the lock's era. A
//! lock held on its second leg only (an acquire between its legs, the second leg of a
//! cancelled acquire whose reply was lost, a leg whose partner expired, an instance of
//! the other two-leg phase during a rolling change) is held, but no guard of this phase
//! has a token from that leg. In `target-first`, a holder of the legacy leg only is
//! reported with its legacy-era token (below every token of this phase). In
//! `legacy-first`, a holder of the target leg only is reported with the lowest token of
//! the legacy era, `era_token(legacy epoch, 0)` (0 by default): its target-era token
//! would be above every later grant of the phase, so a resource fenced with it would
//! refuse every later holder, and `revoke` promises the next holder a larger token. (A
//! `target-first` instance seen this way, while that phase rolls out, will hold a
//! target-era token above the reported one, like every target-era token: rule 3.)
//!
//! # Composition
//!
//! Outermost first: metrics → retry → migration → backends. A retry therefore repeats a
//! whole two-leg acquisition, never half of one.

mod acquire;
mod held;
mod holders;
mod observe;
mod token;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use self::acquire::Leg;
pub use self::token::{ERA_SHIFT, MAX_EPOCH, era_token};
use crate::{
    AcquireOptions, Capabilities, DistributedLock, Error, HolderInfo, Leader, LeaderChanges,
    ListedLock, LockGuard, LockInfo, Permits, validate_name, validate_prefix,
};

/// The short backend name of a [`MigrationLock`] and its guards.
const BACKEND: &str = "migration";

/// Where a migration stands. Teams move forward one phase at a time by changing
/// configuration; see the [module documentation](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MigrationPhase {
    /// Only the legacy lock: behaves exactly like the legacy backend (`legacy`).
    Legacy,
    /// The legacy lock, then the target lock; legacy tokens (`legacy-first`).
    LegacyFirst,
    /// The target lock, then the legacy lock; target tokens (`target-first`).
    TargetFirst,
    /// Only the target lock; target tokens (`target`).
    Target,
}

impl MigrationPhase {
    /// Every phase, in the order a migration goes through them.
    pub const ALL: [MigrationPhase; 4] = [
        MigrationPhase::Legacy,
        MigrationPhase::LegacyFirst,
        MigrationPhase::TargetFirst,
        MigrationPhase::Target,
    ];

    /// The phase's name in configuration: `legacy`, `legacy-first`, `target-first`,
    /// `target`.
    pub const fn as_str(self) -> &'static str {
        match self {
            MigrationPhase::Legacy => "legacy",
            MigrationPhase::LegacyFirst => "legacy-first",
            MigrationPhase::TargetFirst => "target-first",
            MigrationPhase::Target => "target",
        }
    }

    /// Whether the phase takes the legacy lock.
    pub const fn uses_legacy(self) -> bool {
        !matches!(self, MigrationPhase::Target)
    }

    /// Whether the phase takes the target lock.
    pub const fn uses_target(self) -> bool {
        !matches!(self, MigrationPhase::Legacy)
    }

    /// Whether guards carry target-era tokens (the target epoch) rather than legacy-era
    /// ones.
    pub const fn target_tokens(self) -> bool {
        matches!(self, MigrationPhase::TargetFirst | MigrationPhase::Target)
    }
}

impl fmt::Display for MigrationPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MigrationPhase {
    type Err = Error;

    /// Parses a phase name; `_` may stand for `-`.
    fn from_str(text: &str) -> Result<Self, Error> {
        let wanted = text.trim().to_ascii_lowercase().replace('_', "-");
        Self::ALL
            .into_iter()
            .find(|phase| phase.as_str() == wanted)
            .ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "migration: unknown phase {text:?}; expected legacy, legacy-first, \
                     target-first or target"
                ))
            })
    }
}

/// A [`DistributedLock`] that holds a legacy lock and a target lock as one, by
/// [`MigrationPhase`]. See the [module documentation](self) for the rules and the token
/// guarantee.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use fencelock_core::layer::migration::{MigrationLock, MigrationPhase};
/// use fencelock_core::{DistributedLock, DistributedLockExt, MemoryLock};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
/// let legacy: Arc<dyn DistributedLock> = Arc::new(MemoryLock::new());
/// let target: Arc<dyn DistributedLock> = Arc::new(MemoryLock::new());
/// let locks = MigrationLock::new(MigrationPhase::LegacyFirst, Some(legacy.clone()), Some(target))?;
/// let guard = locks.lock("orders/SKU-8842").await?;
/// // Services that only know the legacy lock are excluded.
/// assert!(legacy.try_lock("orders/SKU-8842").await?.is_none());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MigrationLock {
    phase: MigrationPhase,
    /// The leg taken first; its tokens are the guard's.
    first: Leg,
    /// The leg taken second, in the two-leg phases.
    second: Option<Leg>,
    second_leg_wait: Duration,
    /// Where a two-leg guard's follower and an observer's mapping run first: the
    /// runtime this was made on (the legs' clients renew on theirs), so that a guard
    /// taken on a runtime that then ends (a `block_on` on a helper thread) is not
    /// reported lost while its legs hold. `None` when made outside a runtime: then the
    /// runtime of each call. A follower or mapping whose runtime ends goes on on the
    /// call's runtime, and a follower then on the runtimes the legs' records were made
    /// on (see [`spawn_kept`](crate::kept::spawn_kept)).
    runtime: Option<tokio::runtime::Handle>,
}

impl MigrationLock {
    /// The default bound on waiting for the second leg: 2 s.
    pub const DEFAULT_SECOND_LEG_WAIT: Duration = Duration::from_secs(2);

    /// A migration lock in `phase`, with legacy epoch 0 and target epoch 1. A leg the
    /// phase does not take may be `None`.
    ///
    /// Made inside a Tokio runtime, a two-leg guard follows its legs on that runtime,
    /// whichever runtime acquired it (as the legs' own clients renew on theirs); made
    /// outside one, or once that runtime has ended, on a runtime the legs' guards were
    /// made on, else on the acquire's. When the runtime a guard's follower runs on ends
    /// while the guard is held, the follower goes on on the next of these, so the loss
    /// of a leg is still reported; an observation's mapping goes on on the runtime
    /// `observe` was called on.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if a leg the phase takes is missing.
    pub fn new(
        phase: MigrationPhase,
        legacy: Option<Arc<dyn DistributedLock>>,
        target: Option<Arc<dyn DistributedLock>>,
    ) -> Result<Self, Error> {
        let leg = |role, lock: Option<Arc<dyn DistributedLock>>, epoch| {
            lock.map(|lock| Leg { role, lock, epoch })
        };
        let legacy = leg("legacy", legacy, 0);
        let target = leg("target", target, 1);
        let missing = |which: &str| {
            Error::InvalidConfig(format!("migration: phase {phase} needs the {which} lock"))
        };
        let (first, second) = match phase {
            MigrationPhase::Legacy => (legacy.ok_or_else(|| missing("legacy"))?, None),
            MigrationPhase::LegacyFirst => (
                legacy.ok_or_else(|| missing("legacy"))?,
                Some(target.ok_or_else(|| missing("target"))?),
            ),
            MigrationPhase::TargetFirst => (
                target.ok_or_else(|| missing("target"))?,
                Some(legacy.ok_or_else(|| missing("legacy"))?),
            ),
            MigrationPhase::Target => (target.ok_or_else(|| missing("target"))?, None),
        };
        Ok(MigrationLock {
            phase,
            first,
            second,
            second_leg_wait: Self::DEFAULT_SECOND_LEG_WAIT,
            runtime: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// Sets the epochs of legacy-era and target-era tokens.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] if `target` is not larger than `legacy`, or either is
    /// larger than [`MAX_EPOCH`].
    pub fn with_epochs(mut self, legacy: u8, target: u8) -> Result<Self, Error> {
        if target > MAX_EPOCH {
            return Err(Error::InvalidConfig(format!(
                "migration: epoch {target} is larger than the maximum {MAX_EPOCH}"
            )));
        }
        if target <= legacy {
            return Err(Error::InvalidConfig(format!(
                "migration: the target epoch ({target}) must be larger than the legacy \
                 epoch ({legacy}), or target-era tokens could be lower than legacy-era ones"
            )));
        }
        for leg in std::iter::once(&mut self.first).chain(self.second.as_mut()) {
            leg.epoch = if leg.role == "legacy" { legacy } else { target };
        }
        Ok(self)
    }

    /// Sets how long `acquire` waits for the second leg before it gives the first back
    /// and tries again (default [`DEFAULT_SECOND_LEG_WAIT`](Self::DEFAULT_SECOND_LEG_WAIT)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a zero duration, or one of [`FOREVER`](crate::FOREVER)
    /// or longer: a second leg waited for without end would let two clients in opposite
    /// phases wait on each other for ever, the cycle this wait is there to break.
    pub fn with_second_leg_wait(mut self, wait: Duration) -> Result<Self, Error> {
        if wait.is_zero() {
            return Err(Error::InvalidConfig(
                "migration: the second-leg wait must be longer than zero".into(),
            ));
        }
        if wait >= crate::FOREVER {
            return Err(Error::InvalidConfig(format!(
                "migration: a second-leg wait of {wait:?} would never end; it must be \
                 shorter than {:?}",
                crate::FOREVER
            )));
        }
        self.second_leg_wait = wait;
        Ok(self)
    }

    /// The phase.
    pub fn phase(&self) -> MigrationPhase {
        self.phase
    }

    /// The leg elections run on: the only one of a single-leg phase.
    fn election_leg(&self) -> Result<&Leg, Error> {
        self.single_leg("leader election while both legs are locked (a two-leg phase)")
    }

    /// The only leg of a single-leg phase; `operation` is refused in a two-leg phase.
    fn single_leg(&self, operation: &'static str) -> Result<&Leg, Error> {
        match &self.second {
            None => Ok(&self.first),
            Some(_) => Err(Error::Unsupported {
                backend: BACKEND,
                operation,
            }),
        }
    }

    /// The epoch of the tokens this lock hands out in its phase.
    pub fn token_epoch(&self) -> u8 {
        self.first.epoch
    }

    /// How long the second leg is waited for.
    pub fn second_leg_wait(&self) -> Duration {
        self.second_leg_wait
    }
}

#[async_trait]
impl DistributedLock for MigrationLock {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        // Without a lease each leg applies (and checks) its own default, which may be
        // longer than the 30 s `lease_kind` would check here.
        if options.has_lease() {
            options.validate(self.capabilities().min_lease)?;
        }
        match &self.second {
            None => acquire::single(name, &self.first, options).await,
            Some(second) => {
                let legs = (&self.first, second);
                let runtime = self.runtime.as_ref();
                acquire::both(name, legs, options, self.second_leg_wait, runtime).await
            }
        }
    }

    /// The holder of the first leg when it has one, else the second's; the waiters of
    /// the first leg. The holder's token is never above the next grant's: see the
    /// [module documentation](self#who-holds-it).
    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        validate_name(name)?;
        holders::inspect(self, name).await
    }

    /// The locks of both legs, each reported as [`inspect`](Self::inspect) would.
    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        validate_prefix(prefix)?;
        holders::list(self, prefix).await
    }

    /// Revokes the lock on both legs; returns the holder of the first leg when it had
    /// one, otherwise the second's, as [`inspect`](Self::inspect) reports it (so the next
    /// holder's token is larger).
    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        validate_name(name)?;
        holders::revoke(self, name).await
    }

    /// Takes a read lock on the one leg of a single-leg phase (refused in two-leg phases,
    /// as permits are).
    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        let leg =
            self.single_leg("read-write locks while both legs are locked (a two-leg phase)")?;
        let grant = leg.lock.acquire_read(name, options).await?;
        acquire::wrap_single(name, leg, grant).await
    }

    /// Takes a write lock on the one leg of a single-leg phase (refused in two-leg
    /// phases, as permits are).
    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        let leg =
            self.single_leg("read-write locks while both legs are locked (a two-leg phase)")?;
        let grant = leg.lock.acquire_write(name, options).await?;
        acquire::wrap_single(name, leg, grant).await
    }

    /// Takes permits on the one leg of a single-leg phase, with the leg's era tokens.
    /// The two-leg phases have no semaphores ([`Error::Unsupported`]): permits counted
    /// by two backends at once would need both to agree on who holds which.
    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(name)?;
        let leg = self.single_leg("semaphores while both legs are locked (a two-leg phase)")?;
        let grant = leg.lock.acquire_permits(name, permits, options).await?;
        acquire::wrap_single(name, leg, grant).await
    }

    /// Campaigns on the one leg of a single-leg phase (`legacy`, `target`), with the
    /// leg's era tokens. The two-leg phases have no election: a leader elected on both
    /// legs at once would need both backends' elections to agree, which nothing
    /// guarantees ([`Error::Unsupported`]; their capabilities say so).
    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(election)?;
        let leg = self.election_leg()?;
        let term = leg.lock.campaign(election, value, options).await?;
        acquire::wrap_single(election, leg, term).await
    }

    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        validate_name(election)?;
        let leg = self.election_leg()?;
        match leg.lock.leader(election).await? {
            Some(leader) => Ok(Some(Leader::new(
                leader.value,
                era_token(leg.epoch, leader.token)?,
            ))),
            None => Ok(None),
        }
    }

    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        validate_name(election)?;
        let leg = self.election_leg()?;
        let inner = leg.lock.observe(election).await?;
        observe::mapped(inner, leg.epoch, self.runtime.clone())
    }

    /// Closes both legs (both even when the first fails; the first error is returned).
    async fn close(&self) -> Result<(), Error> {
        let first = self.first.lock.close().await;
        let second = match &self.second {
            Some(second) => second.lock.close().await,
            None => Ok(()),
        };
        first.and(second)
    }

    fn capabilities(&self) -> Capabilities {
        let first = self.first.lock.capabilities();
        let Some(second) = &self.second else {
            return first;
        };
        let second = second.lock.capabilities();
        // Services that take only the legacy lock are excluded by it alone, so the pair is
        // only as strong as its weaker leg; waiting can restart, so no FIFO.
        Capabilities::new(
            first.linearizable && second.linearizable,
            first.fencing,
            false,
            first.loss_detection.min(second.loss_detection),
        )
        .with_min_lease(first.min_lease.max(second.min_lease))
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }
}

impl fmt::Debug for MigrationLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MigrationLock")
            .field("phase", &self.phase)
            .field("first", &self.first)
            .field("second", &self.second)
            .field("second_leg_wait", &self.second_leg_wait)
            .finish()
    }
}

#[cfg(test)]
mod tests;
