//! [`RedisLock`]: the [`DistributedLock`] over Redis.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use async_trait::async_trait;
use fencelock_core::{
    AcquireOptions, Capabilities, DistributedLock, Error, FencingStrength, FencingToken,
    HolderInfo, Lease, ListedLock, LockGuard, LockInfo, LossDetection, Wait, validate_name,
    validate_prefix,
};
use futures_util::future::join_all;
use redis::Value;
use tokio::sync::Notify;
use tracing::Instrument;

use crate::config::{RedisConfig, Topology};
use crate::engine::{Attempt, Engine, Granted, drift};
use crate::held::RedisHeld;
use crate::keys::LockKeys;
use crate::node::{self, BACKEND};
use crate::scripts;

/// The shortest lease accepted.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

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
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped connect leaves nothing behind.
    ///
    /// # Errors
    ///
    /// - [`Error::InvalidConfig`] for a replica check on Cluster or Redlock (not
    ///   supported), or TLS without the `tls` feature;
    /// - [`Error::Unavailable`] when a server cannot be reached;
    /// - [`Error::Backend`] (not retryable) when authentication fails.
    pub async fn connect(config: RedisConfig) -> Result<Self, Error> {
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
        let nodes = node::open(&config).await?;
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

    async fn wait_for_grant(
        &self,
        name: &str,
        keys: &LockKeys,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let lease = options.lease_kind();
        let wake = Arc::new(Notify::new());
        let mut subscriptions = Vec::new();
        let will_wait = options.wait_kind() != Wait::NoWait;
        loop {
            match self
                .engine
                .try_once(keys, lease.duration(), will_wait)
                .await?
            {
                Attempt::Granted {
                    token,
                    owner,
                    id,
                    sent,
                } => return self.guard(name, keys, lease, token, owner, id, sent),
                Attempt::Held(_) if options.wait_kind() == Wait::NoWait => {
                    return Err(Error::Contended {
                        name: name.to_owned(),
                    });
                }
                Attempt::Held(_) if subscriptions.is_empty() => {
                    // Subscribe, then try again at once: an unlock between the failed
                    // try and the subscription is caught by that second try.
                    subscriptions = join_all(
                        self.engine
                            .subscribers
                            .iter()
                            .map(|s| s.subscribe(&keys.channel, wake.clone())),
                    )
                    .await;
                }
                Attempt::Held(after) => {
                    tokio::select! {
                        () = wake.notified() => {}
                        () = tokio::time::sleep(after) => {}
                    }
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn guard(
        &self,
        name: &str,
        keys: &LockKeys,
        lease: Lease,
        token: FencingToken,
        owner: String,
        id: u64,
        sent: tokio::time::Instant,
    ) -> Result<LockGuard, Error> {
        let duration = lease.duration();
        let liveness = fencelock_core::Liveness::new(sent + duration - drift(duration));
        {
            let mut held = self.engine.held();
            if self.engine.closed.is_cancelled() {
                // Closed while granting: not handed out.
                drop(held);
                self.engine
                    .release_in_background(keys.clone(), owner, Some(token.get()));
                return Err(Error::Closed { backend: BACKEND });
            }
            held.insert(
                id,
                Granted {
                    keys: keys.clone(),
                    owner: owner.clone(),
                    token: token.get(),
                    liveness: liveness.clone(),
                },
            );
        }
        if lease.is_renewing() {
            self.engine.renewals.insert(
                &self.engine,
                id,
                keys.lock.clone(),
                keys.slot,
                owner.clone(),
                duration,
                liveness.clone(),
            );
        }
        let held = RedisHeld {
            engine: self.engine.clone(),
            id,
            name: name.to_owned(),
            keys: keys.clone(),
            owner,
            token: token.get(),
            released: AtomicBool::new(false),
        };
        Ok(LockGuard::new(
            name,
            token,
            BACKEND,
            liveness,
            Arc::new(held),
        ))
    }

    /// Fails with [`Error::Closed`] once the client is closed.
    fn check_open(&self) -> Result<(), Error> {
        if self.engine.closed.is_cancelled() {
            Err(Error::Closed { backend: BACKEND })
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl DistributedLock for RedisLock {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        options.validate(MIN_LEASE)?;
        self.check_open()?;
        let keys = self.engine.config.layout.keys(name);
        let waiting = async {
            match options.wait_kind() {
                Wait::Timeout(limit) => {
                    tokio::time::timeout(limit, self.wait_for_grant(name, &keys, options))
                        .await
                        .unwrap_or_else(|_| {
                            Err(Error::Timeout {
                                name: name.to_owned(),
                                waited: limit,
                            })
                        })
                }
                Wait::NoWait | Wait::Forever => self.wait_for_grant(name, &keys, options).await,
            }
        };
        let span = tracing::debug_span!("fencelock.redis.acquire", lock = name);
        tokio::select! {
            biased;
            // Dropping the attempt releases what it may have taken, as for any cancellation.
            () = self.engine.closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
            taken = waiting.instrument(span) => taken,
        }
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        validate_name(name)?;
        self.check_open()?;
        let keys = self.engine.config.layout.keys(name);
        Ok(match self.holder_of(&keys).await? {
            Some(h) => LockInfo::held(h, None),
            None => LockInfo::free(None),
        })
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        validate_prefix(prefix)?;
        self.check_open()?;
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
            // A key seen by the scan may have gone since; a name a Redlock minority
            // holds has no holder: neither is listed.
            match self.holder_of(&layout.keys(&name)).await {
                Ok(Some(holder)) => found.push(ListedLock::new(name, LockInfo::held(holder, None))),
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
        self.check_open()?;
        let keys = self.engine.config.layout.keys(name);
        let Some(holder) = self.holder_of(&keys).await? else {
            return Ok(None);
        };
        // Compare-and-delete of the owner value seen: a holder that took the name since
        // keeps it. Waiters are told, as by a release.
        let deleted = self.engine.release(&keys, &holder.owner, None).await?;
        if deleted {
            tracing::warn!(lock = name, key = %keys.lock, "redis: lock revoked");
        }
        Ok(deleted.then_some(holder))
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
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl RedisLock {
    /// The holder a quorum of nodes agrees on, if any.
    async fn holder_of(&self, keys: &LockKeys) -> Result<Option<HolderInfo>, Error> {
        let mut invocation = scripts::INSPECT.prepare_invoke();
        invocation.key(&keys.lock).key(&keys.token);
        let replies = join_all(
            self.engine
                .nodes
                .iter()
                .map(|n| n.invoke::<Value>(&invocation)),
        )
        .await;
        let mut seen: Vec<(String, i64, u64)> = Vec::new();
        let mut answered = 0;
        let mut first_error = None;
        for reply in replies {
            match reply {
                Ok(Value::Array(items)) => {
                    answered += 1;
                    if let [owner, Value::Int(pttl), counter] = items.as_slice() {
                        if let Some(owner) = text(owner) {
                            let counter = text(counter).and_then(|c| c.parse().ok()).unwrap_or(0);
                            seen.push((owner, *pttl, counter));
                        }
                    }
                }
                Ok(_) => answered += 1,
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        if answered < self.engine.quorum {
            return Err(
                first_error.unwrap_or_else(|| Error::unavailable(BACKEND, "no quorum answered"))
            );
        }
        let holder = seen.iter().find_map(|(owner, _, _)| {
            let same: Vec<_> = seen.iter().filter(|(o, _, _)| o == owner).collect();
            (same.len() >= self.engine.quorum).then(|| {
                let token = same.iter().map(|s| s.2).max().unwrap_or(0);
                let remaining = same
                    .iter()
                    .map(|s| s.1)
                    .min()
                    .and_then(|p| u64::try_from(p).ok())
                    .map(Duration::from_millis);
                HolderInfo::new(owner.clone(), FencingToken::new(token), remaining)
            })
        });
        Ok(holder)
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

impl fmt::Debug for RedisLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLock")
            .field("config", &self.engine.config)
            .finish_non_exhaustive()
    }
}
