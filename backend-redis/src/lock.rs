//! [`RedisLock`]: the [`DistributedLock`] over Redis.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use async_trait::async_trait;
use fencelock_core::{
    AcquireOptions, Capabilities, DistributedLock, Error, FencingStrength, FencingToken,
    HolderInfo, Leader, LeaderChanges, Lease, ListedLock, LockGuard, LockInfo, LossDetection,
    Permits, Wait, WaitDeadline, validate_name, validate_prefix,
};
use futures_util::future::join_all;
use redis::Value;
use tokio::sync::Notify;
use tracing::Instrument;

use crate::config::{RedisConfig, Topology};
use crate::election::{self, Holder, Reading, Seen};
use crate::engine::{Attempt, Engine, Granted};
use crate::error::BACKEND;
use crate::held::RedisHeld;
use crate::keys::LockKeys;
use crate::node;
use crate::quorum::drift;
use crate::renewal;
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

    /// Takes `name` (with a `value`: campaigns for it), waiting as `options` allow.
    async fn take(
        &self,
        name: &str,
        options: AcquireOptions,
        value: Option<&str>,
    ) -> Result<LockGuard, Error> {
        validate_name(name)?;
        options.validate(MIN_LEASE)?;
        self.check_open()?;
        let keys = self.lock_keys(name)?;
        let wait = WaitDeadline::new(options.wait_kind());
        let waiting = self.wait_for_grant(name, &keys, options, value, wait);
        let span = if value.is_some() {
            tracing::debug_span!("fencelock.redis.campaign", election = name)
        } else {
            tracing::debug_span!("fencelock.redis.acquire", lock = name)
        };
        tokio::select! {
            biased;
            // Dropping the attempt releases what it may have taken, as for any cancellation.
            () = self.engine.closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
            taken = waiting.instrument(span) => taken,
            // A server that stopped answering: the whole acquire ends with the wait.
            () = wait.bound_passed() => Err(wait.timed_out(name)),
        }
    }

    /// Tries, and while the lock is held waits and tries again, until granted or `wait`
    /// is over. The wait is looked at where this waits (a free lock is granted with a
    /// zero wait); the caller bounds the whole of it by [`WaitDeadline::bound`].
    async fn wait_for_grant(
        &self,
        name: &str,
        keys: &LockKeys,
        options: AcquireOptions,
        value: Option<&str>,
        wait: WaitDeadline,
    ) -> Result<LockGuard, Error> {
        let lease = options.lease_kind();
        let wake = Arc::new(Notify::new());
        let mut subscriptions = Vec::new();
        let will_wait = options.wait_kind() != Wait::NoWait;
        // A hand-written locker (raw layout) publishes nothing on release: look again
        // after a growing interval, as well as on a message or at the key's expiry.
        let config = &self.engine.config;
        let mut poll = config.layout.is_raw().then_some(config.poll_min);
        // Once refused, wait behind this client's other waiters for the key (see
        // `fencelock_core::line`): only the front of the line subscribes and tries again.
        let mut front = None;
        loop {
            match self
                .engine
                .try_once(keys, lease.duration(), will_wait, value)
                .await?
            {
                Attempt::Granted {
                    token,
                    owner,
                    id,
                    sent,
                } => {
                    return self.guard(name, keys, lease, token, owner, id, sent, value.is_some());
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
                        at_front = self.engine.lines.front(&keys.lock) => front = Some(at_front),
                        () = wait.over() => return Err(wait.timed_out(name)),
                    }
                }
                Attempt::Held(_) if subscriptions.is_empty() => {
                    // Subscribe, then try again at once: an unlock between the failed
                    // try and the subscription is caught by that second try.
                    let subscribing = join_all(
                        self.engine
                            .subscribers_for(keys.slot)
                            .iter()
                            .map(|s| s.subscribe(&keys.channel, wake.clone())),
                    );
                    tokio::select! {
                        subscribed = subscribing => subscriptions = subscribed,
                        () = wait.over() => return Err(wait.timed_out(name)),
                    }
                }
                Attempt::Held(after) => {
                    let pause = poll.map_or(after, |poll| poll.min(after));
                    tokio::select! {
                        () = wake.notified() => {}
                        () = tokio::time::sleep(pause) => {}
                        () = wait.over() => return Err(wait.timed_out(name)),
                    }
                    poll = poll.map(|poll| (poll * 2).min(config.poll_max));
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn guard(
        &self,
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
            let mut held = self.engine.held();
            if self.engine.closed.is_cancelled() {
                // Closed while granting: not handed out.
                drop(held);
                self.engine
                    .release_in_background(keys.clone(), owner, Some(token.get()), election);
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
                &self.engine,
                id,
                keys.clone(),
                owner.clone(),
                duration,
                liveness.clone(),
                sent,
            );
        }
        let held = RedisHeld {
            engine: self.engine.clone(),
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

    /// The keys of lock (or election) `name`. In the raw layout, a name whose key would
    /// be another name's auxiliary key is [`Error::InvalidName`] (see
    /// `KeyLayout::refusal`). On a Redis Cluster, a name whose
    /// keys cannot share one slot (the raw layout's `}` without a tag: see
    /// [`KeyLayout::raw`](crate::KeyLayout::raw)) is [`Error::InvalidName`], before any
    /// I/O: its scripts would fail with `CROSSSLOT`.
    pub(crate) fn lock_keys(&self, name: &str) -> Result<LockKeys, Error> {
        let layout = &self.engine.config.layout;
        if let Some(reason) = layout.refusal(name, false) {
            return Err(invalid_name(name, reason));
        }
        let keys = layout.keys(name);
        if self.engine.is_cluster() && !keys.share_a_slot() {
            return Err(invalid_name(
                name,
                "in the raw layout on a Redis Cluster, a lock key with `}` and no \
                 non-empty {tag} cannot keep its token key in its slot: put a {tag} \
                 in the name",
            ));
        }
        Ok(keys)
    }

    /// The client's shared state.
    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Fails with [`Error::Closed`] once the client is closed.
    pub(crate) fn check_open(&self) -> Result<(), Error> {
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
        self.take(name, options, None).await
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
        self.take_member(name, crate::primitives::ask_permits(permits), options)
            .await
    }

    /// Writer-preferring: a waiting writer's intent (refreshed while it waits, deleted
    /// at its grant or cancellation) keeps new readers out. Not on Redlock.
    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.take_member(name, crate::primitives::Ask::Read, options)
            .await
    }

    /// See [`acquire_read`](Self::acquire_read).
    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.take_member(name, crate::primitives::Ask::Write, options)
            .await
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
        self.take(election, options, Some(value)).await
    }

    /// One read of the lock key (owner line, token, value and `PTTL` together), on a
    /// quorum for Redlock. On Redlock a term is a leader once confirmed: while its grant
    /// is being made (a quorum holds only its provisional lines) this is `None`.
    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        validate_name(election)?;
        self.check_open()?;
        let keys = self.lock_keys(election)?;
        Ok(self.reading(&keys).await?.leader())
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
        self.check_open()?;
        let keys = self.lock_keys(election)?;
        let wake = Arc::new(Notify::new());
        // Subscribed before the first read: a change after the read is a message.
        let subscriptions = join_all(
            self.engine
                .subscribers_for(keys.slot)
                .iter()
                .map(|s| s.subscribe(&keys.election, wake.clone())),
        )
        .await;
        let first = self.reading(&keys).await?;
        let (changes, receiver) = tokio::sync::mpsc::unbounded_channel();
        let _ = changes.send(Ok(first.leader()));
        let stop = self.engine.closed.child_token();
        self.engine.runtime.spawn(election::follow(
            self.clone(),
            keys,
            subscriptions,
            wake,
            first,
            changes,
            stop.clone(),
            self.engine.closed.clone(),
        ));
        Ok(LeaderChanges::new(receiver, stop))
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        validate_name(name)?;
        self.check_open()?;
        let keys = self.lock_keys(name)?;
        Ok(match self.holder_of(&keys).await? {
            Some(h) => LockInfo::held(holder_info(&h), None),
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
            // A raw key a Cluster cannot serve as a lock (see `lock_keys`) is not read.
            let Ok(keys) = self.lock_keys(&name) else {
                continue;
            };
            // A key seen by the scan may have gone since; a name a Redlock minority
            // holds has no holder: neither is listed.
            match self.holder_of(&keys).await {
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
        self.check_open()?;
        let keys = self.lock_keys(name)?;
        let Some(holder) = self.holder_of(&keys).await? else {
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
        .with_semaphore(!self.is_redlock())
        .with_rw_lock(!self.is_redlock())
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl RedisLock {
    /// The holder a quorum of nodes agrees on, if any (see [`Self::reading`]); a term
    /// being granted (not yet confirmed) is a holder here, as it holds the name.
    pub(crate) async fn holder_of(&self, keys: &LockKeys) -> Result<Option<Holder>, Error> {
        Ok(self.reading(keys).await?.holder())
    }

    /// One read of the lock key and its `PTTL` (and the counter, a plain lock's token) per
    /// node, decided by [`election::decide`]: a holder is an owner a quorum agrees on,
    /// and a campaign's term (read from the lock key itself, value and token with the
    /// owner) is confirmed only when a quorum holds its confirmed line.
    pub(crate) async fn reading(&self, keys: &LockKeys) -> Result<Reading, Error> {
        let mut invocation = scripts::INSPECT.prepare_invoke();
        invocation.key(&keys.lock).key(&keys.token);
        let replies = join_all(
            self.engine
                .nodes
                .iter()
                .map(|n| n.invoke::<Value>(&invocation)),
        )
        .await;
        let mut seen: Vec<Seen> = Vec::new();
        let mut answered = 0;
        let mut first_error = None;
        for reply in replies {
            match reply {
                Ok(Value::Array(items)) => {
                    answered += 1;
                    if let [stored, Value::Int(pttl), counter] = items.as_slice() {
                        if let Some(stored) = text(stored) {
                            let (owner, term) = election::parse(&stored);
                            seen.push(Seen {
                                owner: owner.to_owned(),
                                term: term.map(|t| (t.token, t.value.to_owned(), t.confirmed)),
                                counter: text(counter).and_then(|c| c.parse().ok()).unwrap_or(0),
                                remaining: u64::try_from(*pttl).ok().map(Duration::from_millis),
                            });
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
        Ok(election::decide(
            &seen,
            answered,
            self.engine.nodes.len(),
            self.engine.quorum,
        ))
    }
}

/// What `inspect`, `list` and `revoke` report of a holder.
/// [`Error::InvalidName`] for `name` (shortened, as `validate_name` does) and `reason`.
pub(crate) fn invalid_name(name: &str, reason: &'static str) -> Error {
    Error::InvalidName {
        name: name.chars().take(64).collect(),
        reason,
    }
}

fn holder_info(holder: &Holder) -> HolderInfo {
    HolderInfo::new(
        holder.owner.clone(),
        FencingToken::new(holder.token),
        holder.remaining,
    )
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
