//! [`ZkLock`]: the ZooKeeper implementation of [`DistributedLock`].

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fencelock_core::{
    AcquireOptions, Capabilities, DistributedLock, Error, FencingStrength, HolderInfo, Leader,
    LeaderChanges, Lease, ListedLock, LockGuard, LockInfo, LossDetection, Permits, Wait,
    WaitDeadline, validate_name, validate_prefix,
};
use tracing::Instrument;
use zookeeper_client as zk;

use crate::acquire::{self, Ask};
use crate::config::ZkConfig;
use crate::election;
use crate::error::{BACKEND, map, retry};
use crate::fence::ZkFence;
use crate::inspect::{self, synced};
use crate::names::{self, Recipe};
use crate::pool::{SessionPool, closed};
use crate::semaphore;
use crate::session::ZkSession;
use crate::transport::Transport;

/// Locks in a ZooKeeper ensemble, compatible with Apache Curator's `InterProcessMutex`.
///
/// - **Lease** = the ZooKeeper session. One session per distinct renewing lease
///   duration, created on first use and shared by every lock with that duration. Options
///   without a lease (`AcquireOptions::new()`) use the configured `session_timeout` (30 s
///   unless configured otherwise). A
///   [`Lease::Fixed`] lock lives in the default session and its node is deleted by this
///   client when the fixed lease ends (if this process is stopped, the session timeout
///   frees it instead).
/// - **Token** = the czxid of the holder's node: 64-bit, ensemble-wide, strictly
///   increasing.
/// - **Waiting** watches only the immediate predecessor: FIFO, no herd.
/// - **Loss**: the guard is at risk while disconnected, lost when the session expires,
///   when the session could not be confirmed for `session_timeout` (local monotonic
///   deadline), or when its node is deleted by someone else.
/// - **Release** deletes the node: `Ok` when our delete removed it, [`Error::Lost`] when
///   it was gone already. The directory goes in the same multi-op when the node was its
///   last child (under the root `/`, only a directory the acquire made itself), so many
///   distinct names do not pile up empty containers on the server. A delete whose connection broke before its answer came is sent
///   again on the next connection; if that one finds the node gone, our first delete may
///   have removed it or someone else may have (ZooKeeper does not say who), and the
///   release answers [`Error::Unavailable`]: the lock is free, but whether it was held
///   until the release cannot be told.
///
/// # Leader election
///
/// Elections follow Curator's `LeaderLatch`, so a Java service with a `LeaderLatch` on
/// `{root}/{encoded name}` and fencelock candidates of election `name` elect one leader
/// among them:
///
/// - [`campaign`](DistributedLock::campaign) creates
///   `{root}/{encoded name}/_c_<uuid>-latch-<seq>` (EPHEMERAL_SEQUENTIAL, Curator's
///   protected mode) with the value as data (Curator's participant id); it is the lock's
///   acquire with another node name, so the term has the same lease, loss reporting,
///   release (resignation) and cancellation safety as a lock, and waiting watches only
///   the predecessor.
/// - The lowest sequence leads; the **token** is its node's czxid.
/// - [`leader`](DistributedLock::leader) reads the first node's data and czxid;
///   [`observe`](DistributedLock::observe) holds one persistent recursive watch on the
///   directory (ZooKeeper 3.6 or later) and reports each change of leader in order. The
///   watch is removed when the [`LeaderChanges`] is dropped or the client closed, and
///   set again on a new session if the old one expires. A term shorter than one round
///   trip, or changes while the observer's connection was lost, can be missed: after a
///   reconnection the observer reports the leader it then reads.
/// - **A lock and an election never share a name.** Curator's `InterProcessMutex` sorts
///   by what follows `lock-` and its `LeaderLatch` by what follows `latch-`, each putting
///   the other's nodes last, so Curator processes would not see a lock and a latch in
///   one directory exclude each other. fencelock refuses the mix instead of queueing
///   both: of two live nodes of different kinds, the later one gives up with a
///   non-retryable [`Error::Backend`] (its node deleted first), so the lock and the
///   election of one name still exclude each other, and [`leader`](DistributedLock::leader)
///   reports nobody while a lock holds the name. Give elections names of their own.
///
/// # Semaphores
///
/// [`acquire_permits`](DistributedLock::acquire_permits) uses Curator's
/// `InterProcessSemaphoreV2` layout on `{root}/%sem/{encoded name}` (a namespace of its
/// own: `%sem` is no encoded lock name): the request takes the internal mutex
/// `…/locks/`, waits until its permits fit, and creates one `_c_<uuid>-lease-<seq>`
/// node per permit in `…/leases/` in one multi-op (all or nothing), then releases the
/// mutex. The limit is the data of `…/leases/` (`limit=<N>`, which Curator ignores): a
/// request with another limit while leases are held is [`Error::InvalidConfig`]. The
/// token is the czxid of the lease nodes. Details in the crate's README.
///
/// # Read-write locks
///
/// [`acquire_read`](DistributedLock::acquire_read) and
/// [`acquire_write`](DistributedLock::acquire_write) use Curator's
/// `InterProcessReadWriteLock` layout on `{root}/%rw/{encoded name}`:
/// `_c_<uuid>-__READ__<seq>` and `_c_<uuid>-__WRIT__<seq>` nodes sorted by sequence. A
/// writer holds when first and watches its predecessor; a reader holds when no writer
/// comes before it and watches the nearest writer before it (FIFO, no writer
/// starvation). The token is the grant's node's czxid.
///
/// # Inspect, list and revoke
///
/// A lock's directory may hold nodes that are no lock's: under the root `/`, the
/// directory of lock `admin` is Kafka's `/admin`. [`inspect`](DistributedLock::inspect),
/// [`list`](DistributedLock::list) and [`revoke`](DistributedLock::revoke) see only the
/// nodes of the recipes above, named as Curator and fencelock name them
/// (`[_c_<uuid>-]lock-<seq>`, `latch-<seq>`, `__READ__<seq>`, `__WRIT__<seq>`): the first
/// of them holds, the others wait. A directory without one is free and is not listed,
/// and no other node is ever deleted. Acquiring, campaigning,
/// [`leader`](DistributedLock::leader) and [`observe`](DistributedLock::observe) read a
/// directory the same way: another node is never a holder, a leader or a predecessor.
/// `list` reports the children of the root whose names
/// are encoded lock names and which hold such a node (so neither semaphores nor
/// read-write locks, which live under `%sem` and `%rw`).
///
/// Clones share the sessions.
///
/// # Examples
///
/// ```no_run
/// use fencelock_core::DistributedLockExt;
/// use fencelock_zk::{ZkConfig, ZkLock};
///
/// # #[tokio::main] async fn main() -> Result<(), fencelock_core::Error> {
/// let locks = ZkLock::connect(ZkConfig::from_url("zk://zk1:2181,zk2:2181/locks")?).await?;
/// let guard = locks.lock("orders/SKU-8842").await?;
/// println!("token {}", guard.token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ZkLock {
    pool: Arc<SessionPool>,
}

impl ZkLock {
    /// Validates `config` and opens the default session.
    ///
    /// The client's sessions (their connections, renewals and clean-up) run on the Tokio
    /// runtime this is called on, whichever runtime later calls run on: it must outlive
    /// the client. Once it has shut down, a call that needs a new session fails with a
    /// non-retryable [`Error::Backend`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped connect leaves no session behind.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for inconsistent settings, a missing or unusable TLS file
    /// (checked before connecting), TLS or SASL without its cargo feature, or a session
    /// timeout the server does not grant; [`Error::Unavailable`] when no server answers;
    /// a non-retryable [`Error::Backend`] when the TLS handshake or the authentication
    /// fails.
    pub async fn connect(config: ZkConfig) -> Result<Self, Error> {
        config.validate()?;
        let transport = Transport::prepare(&config)?;
        // The client's runtime: every session is opened and served there.
        let pool = Arc::new(SessionPool::new(
            config,
            transport,
            tokio::runtime::Handle::current(),
        ));
        pool.get(pool.config().session_timeout()).await?;
        Ok(ZkLock { pool })
    }

    /// The configuration.
    pub fn config(&self) -> &ZkConfig {
        self.pool.config()
    }

    /// Takes the lock `name` (or campaigns for it) with nodes of `recipe` carrying
    /// `data`, waiting as `options` allow; `name` was validated.
    async fn take(
        &self,
        name: &str,
        options: AcquireOptions,
        recipe: Recipe,
        data: &[u8],
    ) -> Result<LockGuard, Error> {
        self.take_what(name, options, What::Node(recipe, data))
            .await
    }

    /// [`ZkLock::take`] for any kind of grant.
    async fn take_what(
        &self,
        name: &str,
        options: AcquireOptions,
        what: What<'_>,
    ) -> Result<LockGuard, Error> {
        let (recipe, data) = match what {
            What::Node(recipe, data) => (recipe, data),
            What::Permits(_) => (Recipe::Lock, &b""[..]),
        };
        // No lease on the options means "this client's session": the configured
        // `session_timeout` (see the type's documentation). That is the lease checked
        // against `min_lease`, not the 30 s default of other backends.
        let lease = options.lease_or(self.config().session_timeout());
        fencelock_core::validate_lease(lease.duration(), self.config().min_lease())?;
        let session_timeout = match lease {
            Lease::Renewing(duration) => {
                check_session_lease(duration)?;
                duration
            }
            Lease::Fixed(_) => self.config().session_timeout(),
        };
        let wait = options.wait_kind();
        let ask = Ask {
            recipe,
            data,
            lease,
            no_wait: wait == Wait::NoWait,
            wait: WaitDeadline::new(wait),
        };
        let attempt = async {
            let session = self.pool.get(session_timeout).await?;
            tokio::select! {
                biased;
                // Dropping the acquire deletes its node, as for any cancellation.
                () = self.pool.closed().cancelled() => Err(closed()),
                taken = async {
                    match what {
                        What::Node(Recipe::Read | Recipe::Write, _) => {
                            let dir = names::rw_dir(session.root(), name);
                            acquire::acquire_in(session, name, dir, ask).await
                        }
                        What::Node(..) => acquire::acquire(session, name, ask).await,
                        What::Permits(permits) => {
                            semaphore::acquire(session, name, permits.count(), permits.limit(), ask)
                                .await
                        }
                    }
                }
                .instrument(tracing::debug_span!("fencelock.zookeeper.acquire", lock = name, ?recipe)) => taken,
            }
        };
        let timed_out = |limit| Error::Timeout {
            name: name.to_owned(),
            waited: limit,
        };
        match wait {
            // The waiter gives up by itself at the deadline (deleting its node first); this
            // outer bound only covers a connect or create that hangs. It is never shorter
            // than `ROUND_TRIP_GRACE`, so the round trips of a free lock or semaphore
            // (about ten for permits) fit in a zero or tiny wait, as on every backend.
            Wait::Timeout(limit) => {
                let bound = limit.max(fencelock_core::ROUND_TRIP_GRACE) + acquire::GIVE_UP_DELETE;
                match tokio::time::timeout(bound, attempt).await {
                    Ok(Err(Error::Timeout { .. })) | Err(_) => Err(timed_out(limit)),
                    Ok(result) => result,
                }
            }
            Wait::NoWait | Wait::Forever => attempt.await,
        }
    }

    async fn default_session(&self) -> Result<Arc<ZkSession>, Error> {
        self.pool.get(self.config().session_timeout()).await
    }

    /// A ZooKeeper client on this lock's default session, for the application's own
    /// data (for example the fenced writes of [`ZkFence`]).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    ///
    /// # Errors
    ///
    /// As [`ZkLock::connect`] if the session had expired and cannot be reopened.
    pub async fn client(&self) -> Result<zk::Client, Error> {
        Ok(self.default_session().await?.client.clone())
    }

    /// A fence for writes to ZooKeeper data that succeed only while `guard` holds its
    /// lock: every write is a multi-op whose first op checks the holder's node version.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`] if `guard`'s node is no longer the holder;
    /// [`Error::InvalidConfig`] if `guard` was not granted by this client (another
    /// backend, another `ZkLock`, a layer such as `migrate://`); backend errors as for
    /// `acquire`.
    ///
    /// Any grant of this client has a fence: a lock, a write or read lock, an election's
    /// term, a semaphore's permits (fenced on its first permit's node). A granted node is
    /// held for as long as it exists, so the fence checks the guard's own node. The read
    /// follows a `sync`, so a server behind the leader cannot report a held node gone.
    pub async fn fence(&self, guard: &LockGuard) -> Result<ZkFence, Error> {
        let foreign = || {
            Error::InvalidConfig(format!(
                "a ZooKeeper fence needs a guard granted by this client; {:?} was granted by \
                 another client or backend ({})",
                guard.name(),
                guard.backend()
            ))
        };
        let (BACKEND, Some(path)) = (guard.backend(), guard.backend_key()) else {
            return Err(foreign());
        };
        let session = self.default_session().await?;
        let lost = || Error::lost(guard.name(), "the guard's node is not the holder any more");
        // The node may live on another session of this client, connected to another
        // server: without a sync this session's server may not have seen it yet.
        synced(&session).await?;
        let found = match retry(|| session.client.check_stat(path)).await {
            Ok(found) => found,
            Err(err) => return Err(map(err)),
        };
        match found {
            Some(stat) if stat.czxid as u64 == guard.token().get() => {
                // Write through the session that owns the node: if that session
                // expires, the node is gone and so is the right to write.
                // A live node on a session this client does not have: another
                // client's grant (ours are deleted with their sessions).
                let owner = self
                    .pool
                    .find(stat.ephemeral_owner)
                    .await
                    .ok_or_else(foreign)?;
                Ok(ZkFence::new(
                    owner.client.clone(),
                    owner.acls(),
                    guard.name(),
                    guard.token(),
                    path.to_owned(),
                    stat.version,
                ))
            }
            _ => Err(lost()),
        }
    }
}

impl std::fmt::Debug for ZkLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkLock")
            .field("config", self.config())
            .finish_non_exhaustive()
    }
}

/// What [`ZkLock::take_what`] takes.
#[derive(Debug, Clone, Copy)]
enum What<'a> {
    /// A node of a lock, an election or a read-write lock, with its data.
    Node(Recipe, &'a [u8]),
    /// Permits of a semaphore.
    Permits(Permits),
}

/// Session timeouts are negotiated in whole milliseconds that fit an `i32`.
fn check_session_lease(lease: Duration) -> Result<(), Error> {
    if lease.subsec_nanos() % 1_000_000 != 0 || lease.as_millis() > i32::MAX as u128 {
        return Err(Error::InvalidConfig(format!(
            "a renewing ZooKeeper lease is a session timeout: whole milliseconds up to i32::MAX, not {lease:?}"
        )));
    }
    Ok(())
}

#[async_trait]
impl DistributedLock for ZkLock {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        self.take(name, options, Recipe::Lock, b"").await
    }

    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(name)?;
        self.take_what(name, options, What::Permits(permits)).await
    }

    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        self.take(name, options, Recipe::Read, b"").await
    }

    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        self.take(name, options, Recipe::Write, b"").await
    }

    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(election)?;
        fencelock_core::validate_leader_value(value)?;
        self.take(election, options, Recipe::Latch, value.as_bytes())
            .await
    }

    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        validate_name(election)?;
        let session = self.default_session().await?;
        let dir = names::lock_dir(session.root(), election);
        synced(&session).await?;
        election::leader(&session, &dir).await
    }

    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        validate_name(election)?;
        let session = self.default_session().await?;
        let dir = names::lock_dir(session.root(), election);
        let stop = self.pool.closed().child_token();
        // The first item is "the leader now": as fresh as `leader()`.
        synced(&session).await?;
        // Dropped (and the watch removed) if this call is cancelled before it returns.
        let (watcher, candidates) = tokio::select! {
            () = stop.cancelled() => return Err(closed()),
            started = election::start(&session, &dir) => started.map_err(map)?,
        };
        let (changes, receiver) = tokio::sync::mpsc::unbounded_channel();
        // The first item: the state the watch starts from.
        let _ = changes.send(Ok(candidates.leader()));
        session.runtime().spawn(
            election::follow(
                self.pool.clone(),
                session.clone(),
                dir,
                watcher,
                candidates,
                changes,
                stop.clone(),
            )
            .instrument(tracing::debug_span!(
                "fencelock.zookeeper.observe",
                election
            )),
        );
        Ok(LeaderChanges::new(receiver, stop))
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        validate_name(name)?;
        let session = self.default_session().await?;
        inspect::inspect(&session, name).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        validate_prefix(prefix)?;
        let session = self.default_session().await?;
        inspect::list(&session, prefix).await
    }

    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        validate_name(name)?;
        let session = self.default_session().await?;
        inspect::revoke(&session, name).await
    }

    /// Closes the client, as [`DistributedLock::close`] describes: every lock held
    /// through it is given up and its node deleted, waiting acquires and observations
    /// end, and every later call fails with [`Error::Closed`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: from its first poll the client takes no new request and every lock
    /// it holds is reported lost ([`LossCause::ClientClosed`](fencelock_core::LossCause));
    /// the nodes are deleted by a task on the client's runtime, which a dropped `close`
    /// does not stop. Calling `close` again waits for those deletes, then returns `Ok`.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] or [`Error::Backend`] when a node could not be deleted in
    /// `connect_timeout` (it goes with its session), or the client's runtime has shut
    /// down; the client is closed regardless.
    async fn close(&self) -> Result<(), Error> {
        self.pool.close().await
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(true, FencingStrength::Strong, true, LossDetection::Notified)
            .with_min_lease(self.config().min_lease())
            .with_counts_waiters(true)
            .with_election(true)
            .with_semaphore(true)
            .with_rw_lock(true)
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}
