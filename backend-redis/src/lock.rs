//! [`RedisLock`]: the [`DistributedLock`] over Redis.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use fencelock_core::{
    AcquireOptions, Capabilities, DistributedLock, Error, FencingStrength, FencingToken,
    HolderInfo, Leader, LeaderChanges, ListedLock, LockGuard, LockInfo, LossDetection, Permits,
    validate_name, validate_prefix,
};
use futures_util::future::join_all;

use crate::config::{MIN_LEASE, RedisConfig};
use crate::election::{self, Holder};
use crate::engine::Engine;
use crate::error::BACKEND;
use crate::primitives::{self, Ask};
use crate::topology::Topology;
use crate::{acquire, connect, observe};

/// Locks in Redis: a single server, a Sentinel-managed master, a Cluster, or Redlock over
/// independent masters.
///
/// See the crate documentation for what it guarantees: exclusion as long as the Redis
/// master keeps its data and clocks behave; fencing tokens that never go backwards under
/// the documented assumption; no FIFO.
#[derive(Clone)]
pub struct RedisLock {
    engine: Arc<Engine>,
}

impl RedisLock {
    /// Connects as `config` says. The first connection (with AUTH) is made here, so
    /// wrong credentials fail now.
    ///
    /// Redlock: every instance that answers is asked for its server's `run_id`
    /// (`INFO server`), and two instances that are one server (two names or addresses
    /// of it, such as `localhost:6379` and `127.0.0.1:6379`) are refused: that server
    /// would count twice toward the majority. An instance down now is checked at its
    /// first answer, and every instance again whenever its connection is re-made after
    /// an error (perhaps to another server): until then its replies do not count. The user needs `+info` on every instance (see the README's "Redlock
    /// instances").
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped connect leaves nothing behind.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidConfig`] for a replica check on Cluster or Redlock (not
    ///   supported), TLS without the `tls` feature, durations out of range (see
    ///   [`RedisConfig::check_durations`]), a Redlock instance given twice (see
    ///   [`RedisConfig::check_instances`]), or two Redlock instances that answer with
    ///   one server's `run_id` (the message names both endpoints);
    /// - [`Error::Unavailable`] when a server cannot be reached;
    /// - [`Error::Backend`] (not retryable) when authentication fails, or when a Redlock
    ///   instance refuses `INFO` (allow the user `+info`) or names no `run_id`.
    pub async fn connect(config: RedisConfig) -> Result<Self, Error> {
        config.check_durations()?;
        config.check_instances()?;
        if config.wait_replicas > 0
            && matches!(
                config.topology,
                Topology::Cluster { .. } | Topology::Redlock { .. }
            )
        {
            return Err(Error::InvalidConfig(
                "wait_replicas is supported on a single server and Sentinel only".into(),
            ));
        }
        if matches!(config.topology, Topology::Single { tls: true, .. }) && !cfg!(feature = "tls") {
            return Err(Error::InvalidConfig(
                "rediss:// needs TLS support: cargo feature `redis-tls` of fencelock (`tls` of fencelock-redis)".into(),
            ));
        }
        let nodes = connect::open(&config).await?;
        Ok(RedisLock {
            engine: Arc::new(Engine::new(config, nodes)),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &RedisConfig {
        &self.engine.config
    }

    /// How many held locks this client is renewing right now.
    pub fn renewing(&self) -> usize {
        self.engine.renewals.len()
    }
}

#[async_trait]
impl DistributedLock for RedisLock {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        acquire::take(&self.engine, name, options, None).await
    }

    /// Holders have keys of their own, renewed and released like lock keys, listed in
    /// an index hash with the semaphore's limit (see the README's key layout). Not FIFO:
    /// waiters wake on a release and race, but the first refused waiting request
    /// records an intent that keeps its permits from smaller requests, so it is not
    /// starved by barging. Not on Redlock (see
    /// the capabilities): a majority of independent instances cannot bound the holders.
    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        primitives::take_member(
            &self.engine,
            name,
            primitives::ask_permits(permits),
            options,
        )
        .await
    }

    /// Writer-preferring: a waiting writer's intent (refreshed while it waits, deleted
    /// at its grant or cancellation) keeps new readers out. Not on Redlock.
    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        primitives::take_member(&self.engine, name, Ask::Read, options).await
    }

    /// See [`acquire_read`](Self::acquire_read).
    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        primitives::take_member(&self.engine, name, Ask::Write, options).await
    }

    /// Takes the lock `election` with `value` stored in its key (see the crate's
    /// Elections documentation): everything of [`acquire`](Self::acquire) holds.
    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        fencelock_core::validate_leader_value(value)?;
        acquire::take(&self.engine, election, options, Some(value)).await
    }

    /// One read of the lock key (owner line, token, value and `PTTL` together), on a
    /// quorum for Redlock. On Redlock a term is a leader once confirmed: while its grant
    /// is being made (a quorum holds only its provisional lines) this is `None`.
    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        validate_name(election)?;
        self.engine.check_open()?;
        let keys = self.engine.lock_keys(election)?;
        Ok(election::reading(&self.engine, &keys).await?.leader())
    }

    /// Subscribes to the election channel on every node, then reads the leader once and
    /// follows the channel (see the crate's Elections documentation).
    ///
    /// Only campaigns publish on the election channel: a plain lock on the name is seen
    /// only when the observer reads for another reason (its first read, a campaign's
    /// message, the `PTTL` deadline of its last read, a pub/sub reconnection). An
    /// observer of a free name is not told when a plain lock takes it, and a plain
    /// lock's release is reported at the `PTTL` deadline of the observer's last read
    /// (within one lease), not when it happens.
    ///
    /// Only confirmed terms are reported, each once, with the leader's own token, in
    /// the order of the terms (see the crate's `election` module): on Redlock, a term is
    /// reported once a majority holds its confirmed line.
    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        validate_name(election)?;
        self.engine.check_open()?;
        let keys = self.engine.lock_keys(election)?;
        observe::start(&self.engine, keys).await
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        validate_name(name)?;
        self.engine.check_open()?;
        let keys = self.engine.lock_keys(name)?;
        Ok(match election::holder_of(&self.engine, &keys).await? {
            Some(h) => LockInfo::held(holder_info(&h), None),
            None => LockInfo::free(None),
        })
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        validate_prefix(prefix)?;
        self.engine.check_open()?;
        let layout = &self.engine.config.layout;
        let pattern = layout.match_pattern(prefix);
        let scans = join_all(self.engine.nodes.iter().map(|n| n.scan(&pattern))).await;
        let mut names = std::collections::BTreeSet::new();
        let mut answered = 0;
        let mut first_error = None;
        for scan in scans {
            match scan {
                Ok(keys) => {
                    answered += 1;
                    names.extend(
                        keys.iter()
                            .filter_map(|k| layout.name_of(k))
                            .filter(|n| n.starts_with(prefix)),
                    );
                }
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        if answered < self.engine.quorum {
            return Err(
                first_error.unwrap_or_else(|| Error::unavailable(BACKEND, "no quorum answered"))
            );
        }
        let mut found = Vec::with_capacity(names.len());
        for name in names {
            // A raw key a Cluster cannot serve as a lock (see `lock_keys`) is not read.
            let Ok(keys) = self.engine.lock_keys(&name) else {
                continue;
            };
            // A key seen by the scan may have gone since; a name a Redlock minority
            // holds has no holder: neither is listed.
            match election::holder_of(&self.engine, &keys).await {
                Ok(Some(holder)) => found.push(ListedLock::new(
                    name,
                    LockInfo::held(holder_info(&holder), None),
                )),
                Ok(None) => {}
                // The raw layout's prefix may hold the application's own keys (a hash
                // answers WRONGTYPE): they are not locks.
                Err(error) if layout.is_raw() && !error.is_retryable() => {}
                Err(error) => return Err(error),
            }
        }
        Ok(found)
    }

    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        validate_name(name)?;
        self.engine.check_open()?;
        let keys = self.engine.lock_keys(name)?;
        let Some(holder) = election::holder_of(&self.engine, &keys).await? else {
            return Ok(None);
        };
        // Compare-and-delete of the owner value seen: a holder that took the name since
        // keeps it. Waiters (and a term's observers) are told, as by a release.
        let deleted = self
            .engine
            .revoke(&keys, &holder.owner, holder.value.is_some())
            .await?;
        if deleted {
            tracing::warn!(lock = name, key = %keys.lock, "redis: lock revoked");
        }
        Ok(deleted.then(|| holder_info(&holder)))
    }

    async fn close(&self) -> Result<(), Error> {
        self.engine.close().await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(
            false,
            FencingStrength::BestEffort,
            false,
            LossDetection::Notified,
        )
        .with_min_lease(MIN_LEASE)
        .with_election(true)
        // A majority of independent instances can neither bound a semaphore's holders
        // nor (as implemented) run the read-write lock: single, Sentinel and Cluster only.
        .with_semaphore(!self.engine.is_redlock())
        .with_rw_lock(!self.engine.is_redlock())
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

/// What `inspect`, `list` and `revoke` report of a holder.
fn holder_info(holder: &Holder) -> HolderInfo {
    HolderInfo::new(
        holder.owner.clone(),
        FencingToken::new(holder.token),
        holder.remaining,
    )
}

impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("config", &self.engine.config)
            .finish_non_exhaustive()
    }
}
