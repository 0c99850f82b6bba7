//! `EtcdLock`: the etcd implementation of `DistributedLock`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, TxnResponse,
};
use fencelock_core::{
    AcquireOptions, Capabilities, DistributedLock, Error, FencingStrength, FencingToken,
    HolderInfo, Leader, LeaderChanges, Lease, ListedLock, Liveness, LockGuard, LockInfo, LossCause,
    LossDetection, Permits, Wait, validate_name, validate_prefix,
};
use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::batch::{Batcher, Created};
use crate::config::{EtcdConfig, MIN_LEASE, lease_seconds};
use crate::delayed::Delayed;
use crate::error::{BACKEND, map, timed_out};
use crate::gate::Gates;
use crate::held::{Armed, Cleanup, EtcdHeld, KeyState};
use crate::keys::{decode, encode, name_prefix, own_key};
use crate::queue::Ask;
use crate::session::{FixedLeases, Session, Sessions, revoke};
use crate::wait;
use crate::watches::KeyWatches;

/// Locks in etcd, with the algorithm of etcd's Go `concurrency.Mutex`, done right.
///
/// - One session lease per client (per lease duration), kept alive by one keepalive stream
///   every third of the lease; all locks of the client share it. If it is lost, every guard
///   on it reports loss and the next acquisition grants a new session.
/// - Key `{prefix}/{encoded name}/{lease id in hex}`, so Go services using
///   `concurrency.Mutex` and `etcdctl lock` on `{prefix}/{name}` exclude fencelock and
///   each other.
/// - Uncontended acquire is one transaction; waiters watch only their immediate predecessor
///   (FIFO, no herd) and check their key still exists before taking the lock.
/// - Token = the create revision of the holder's key; release deletes only that
///   incarnation, in one transaction.
/// - Tasks of one client contending for one name queue inside the client (FIFO) and only
///   the first puts a key in etcd.
/// - Uncontended acquires and releases that tasks of one client issue at the same time, on
///   distinct names, share transactions (group commit), each still answered exactly.
///
/// # Examples
///
/// ```no_run
/// use fencelock_core::DistributedLockExt;
/// use fencelock_etcd::{EtcdConfig, EtcdLock};
///
/// # async fn demo() -> Result<(), fencelock_core::Error> {
/// let locks = EtcdLock::connect(EtcdConfig::from_url("etcd://127.0.0.1:2379/locks")?).await?;
/// let guard = locks.lock("orders/SKU-8842").await?;
/// println!("token {}", guard.token());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct EtcdLock {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// Shared by reference count: a `Client` clone copies a dozen gRPC handles, too much
    /// for every acquire.
    pub(crate) client: Arc<Client>,
    /// Group commit of concurrent creates and releases.
    pub(crate) batcher: Arc<Batcher>,
    /// Per-guard watches, started only for guards that live a while.
    pub(crate) delayed: Arc<Delayed>,
    /// The key watches of held locks, on one shared stream.
    pub(crate) watches: Arc<KeyWatches>,
    pub(crate) config: EtcdConfig,
    pub(crate) sessions: Sessions,
    /// The dedicated leases of fixed-lease grants, revoked by `close`.
    pub(crate) fixed: Arc<FixedLeases>,
    /// Cancelled by `close`: waiting acquires end with `Error::Closed`.
    pub(crate) closed: CancellationToken,
    pub(crate) gates: Arc<Gates>,
    pub(crate) runtime: Handle,
}

impl std::fmt::Debug for EtcdLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLock")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl EtcdLock {
    /// Connects, authenticates and grants the client's session lease, so a wrong address,
    /// password or lease fails here rather than at the first lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe; a lease granted before the future was dropped expires on its own.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for bad settings (including a lease etcd would change),
    /// [`Error::Unavailable`] when etcd cannot be reached within the connect timeout,
    /// [`Error::Backend`] for authentication failures.
    pub async fn connect(config: EtcdConfig) -> Result<Self, Error> {
        config.validate()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let (Some(user), Some(password)) = (&config.user, &config.password) {
            options = options.with_user(user.clone(), password.clone());
        } else if let Some(user) = &config.user {
            options = options.with_user(user.clone(), "");
        }
        options = crate::tls::apply(options, config.tls.as_ref())?;
        let scheme = if config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let endpoints: Vec<String> = config
            .endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect();
        let connecting = async {
            let client = Client::connect(endpoints, Some(options))
                .await
                .map_err(map)?;
            let sessions = Sessions::new(Handle::current());
            sessions.get(&client, config.lease).await?;
            Ok::<_, Error>((client, sessions))
        };
        let (client, sessions) = tokio::time::timeout(config.connect_timeout, connecting)
            .await
            .map_err(|_| timed_out("the connection"))??;
        Ok(EtcdLock {
            inner: Arc::new({
                let client = Arc::new(client);
                Inner {
                    batcher: Arc::new(Batcher::new(client.clone(), Handle::current())),
                    delayed: Arc::new(Delayed::new(Handle::current())),
                    watches: Arc::new(KeyWatches::new(client.clone(), Handle::current())),
                    client,
                    config,
                    sessions,
                    fixed: Arc::default(),
                    closed: CancellationToken::new(),
                    gates: Arc::default(),
                    runtime: Handle::current(),
                }
            }),
        })
    }

    /// The underlying `etcd-client` client, for fenced transactions of your own.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The configuration in use.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// The shared state, for the other modules of this crate.
    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Fails with [`Error::Closed`] once the client is closed.
    fn check_open(&self) -> Result<(), Error> {
        if self.inner.closed.is_cancelled() {
            Err(Error::Closed { backend: BACKEND })
        } else {
            Ok(())
        }
    }

    /// [`take`](Self::take), once more on a new session if the session turned out to be
    /// gone (revoked or expired before its keepalive noticed).
    async fn take_fresh(
        &self,
        name: &str,
        options: AcquireOptions,
        value: &str,
    ) -> Result<LockGuard, Error> {
        let deadline = match options.wait_kind() {
            // A wait too long to represent is a wait forever.
            Wait::Timeout(limit) => Instant::now().checked_add(limit),
            Wait::NoWait | Wait::Forever => None,
        };
        match self.take(name, options, deadline, value).await {
            Err(error) if crate::error::is_stale_session(&error) => {
                self.take(name, options, deadline, value).await
            }
            other => other,
        }
    }

    /// Takes the lock, giving up at `deadline` (if any) with [`Error::Timeout`].
    ///
    /// A waiter that gives up (a timeout, or an error while waiting) deletes its key
    /// before returning (bounded by the clean-up timeout), so a process that exits right
    /// after leaves nothing that would block the name until its lease expires. Only a
    /// dropped future leaves the clean-up to the background.
    async fn take(
        &self,
        name: &str,
        options: AcquireOptions,
        deadline: Option<Instant>,
        value: &str,
    ) -> Result<LockGuard, Error> {
        let timed_out = || Error::Timeout {
            name: name.to_owned(),
            waited: match options.wait_kind() {
                Wait::Timeout(limit) => limit,
                _ => Duration::ZERO,
            },
        };
        // The steps before any waiting (the session, the create) get at least
        // `ROUND_TRIP_GRACE`: a free lock is granted with a zero wait.
        let steps = step_deadline(deadline);
        let inner = &self.inner;
        let names = name_prefix(&inner.config.prefix, name);
        let lease = options.lease_or(inner.config.lease);
        let no_wait = options.wait_kind() == Wait::NoWait;
        // A fixed lease starts when the lock is granted, never while waiting. A try that
        // does not wait is granted or refused by its create, so its key goes straight onto
        // a lease granted just before. One that may wait queues on the client's renewing
        // session and moves its key onto a fresh fixed lease when its turn comes.
        // Every step is bounded by the caller's wait (the steps before any waiting by
        // at least `ROUND_TRIP_GRACE`), also when etcd hangs (a request caught in an election
        // waits for etcd's own request timeout).
        let (session, fixed_now) = match lease {
            Lease::Fixed(ttl) if no_wait => (
                Box::pin(Session::grant(&inner.client, ttl, &inner.runtime, false)).await?,
                true,
            ),
            Lease::Fixed(_) => (
                within(
                    steps,
                    inner.sessions.get(&inner.client, inner.config.lease),
                    timed_out,
                )
                .await??,
                false,
            ),
            Lease::Renewing(ttl) => (
                within(steps, inner.sessions.get(&inner.client, ttl), timed_out).await??,
                false,
            ),
        };
        let key: Arc<str> = own_key(&names, session.lease_id()).into();
        let cleanup = Cleanup {
            client: inner.client.clone(),
            batcher: inner.batcher.clone(),
            runtime: inner.runtime.clone(),
            timeout: inner.config.cleanup_timeout,
            key: key.clone(),
            state: KeyState::Absent,
            session: (!fixed_now).then(|| session.clone()),
            fixed_lease: fixed_now.then(|| session.lease_id()),
            moved_maybe: Vec::new(),
            permit: None,
            create: None,
        };
        // Until the guard exists, dropping this (error, timeout, cancellation) undoes it all.
        let mut pending = Armed::new(cleanup);
        let permit = if no_wait {
            inner
                .gates
                .try_enter(&key, &names)
                .ok_or_else(|| Error::Contended {
                    name: name.to_owned(),
                })?
        } else {
            // Waiting behind this client's other waiters: the caller's deadline (a free
            // gate is entered at its first poll).
            within(deadline, inner.gates.enter(&key, &names), timed_out).await?
        };
        pending.get().permit = Some(permit);

        let revision = if no_wait {
            self.create_if_free(&key, &names, session.lease_id(), value, &mut pending)
                .await?
                .ok_or_else(|| Error::Contended {
                    name: name.to_owned(),
                })?
        } else {
            // The create's own bound starts now, after the wait at this client's gate: a
            // waiter let through the gate at its deadline would otherwise have its
            // create cut in flight and return while the key is still being made (the
            // background clean-up deletes it a moment later). Created, it is granted if
            // the lock is free (the wait bounds only time behind holders), and otherwise
            // finds its deadline passed below and deletes its key before returning.
            let (mine, first) = within(
                step_deadline(deadline),
                self.create_and_read_first(&key, &names, session.lease_id(), value, &mut pending),
                timed_out,
            )
            .await??;
            if first != mine {
                // Boxed, as are the other steps off the uncontended path below: their
                // futures (watch streams, lease grants) are several KiB each, which
                // every acquire's future would otherwise carry and copy.
                let waiting = Box::pin(
                    wait::for_turn(&inner.client, (&names, &key), mine, &session, name)
                        .instrument(tracing::debug_span!("fencelock.etcd.wait", lock = name)),
                );
                match within(deadline, waiting, timed_out).await {
                    Ok(Ok(())) => {}
                    // Lost or failed while waiting: the key goes now too, as in the
                    // read-write and semaphore queues.
                    Ok(Err(error)) | Err(error) => {
                        Box::pin(pending.finish_now()).await;
                        return Err(error);
                    }
                }
            }
            mine
        };

        // The holder's session: the renewing one, or the fixed lease the key is on.
        let (session, fixed) = match lease {
            Lease::Fixed(ttl) if !fixed_now => (
                Box::pin(self.move_to_fixed_lease(&key, revision, ttl, name, value, &mut pending))
                    .await?,
                true,
            ),
            _ => (session, fixed_now),
        };
        self.grant(name, session, fixed, revision, pending)
    }

    /// Turns our key, created at `revision` on `session`'s lease (a dedicated fixed
    /// lease when `fixed`), into a guard, once it is our turn.
    pub(crate) fn grant(
        &self,
        name: &str,
        session: Arc<Session>,
        fixed: bool,
        revision: i64,
        pending: Armed,
    ) -> Result<LockGuard, Error> {
        let inner = &self.inner;
        // Anchored at the moment the request that started the lease was sent: the grant
        // of a fixed lease, the last keepalive of a renewing session.
        let valid_until = session.valid_until();
        if valid_until <= Instant::now() {
            // The lease ran out before the grant was confirmed (slow replies): the lock
            // may already be someone else's. Not a grant; the clean-up deletes our key.
            return Err(Error::unavailable(
                BACKEND,
                "the lease ran out before the grant was confirmed (etcd answered too slowly)",
            ));
        }
        let liveness = if fixed {
            Liveness::new(valid_until)
        } else {
            session.liveness()
        };
        if fixed && !inner.fixed.register(session.lease_id(), &liveness) {
            // Closed while granting: the clean-up revokes the lease.
            return Err(Error::Closed { backend: BACKEND });
        }
        let registration = (!fixed).then(|| session.register(liveness.clone()));
        let cleanup = pending.disarm();
        let held = EtcdHeld::start(
            name,
            session,
            registration,
            fixed,
            liveness.clone(),
            cleanup,
            inner,
        );
        let token = FencingToken::new(u64::try_from(revision).unwrap_or_default());
        Ok(LockGuard::new(
            name,
            token,
            BACKEND,
            liveness,
            Arc::new(held),
        ))
    }

    /// Our turn came for a fixed-lease lock queued on the renewing session: grants the
    /// fixed lease now (its TTL starts with this request) and moves our key onto it, if
    /// the key is still the incarnation we queued with (a put keeps the create revision,
    /// so the token is unchanged). Returns the fixed lease.
    pub(crate) async fn move_to_fixed_lease(
        &self,
        key: &str,
        revision: i64,
        ttl: Duration,
        name: &str,
        value: &str,
        pending: &mut Armed,
    ) -> Result<Arc<Session>, Error> {
        let fixed = Session::grant(&self.inner.client, ttl, &self.inner.runtime, false).await?;
        // From here the clean-up revokes the fixed lease as well as deleting our key.
        pending.get().fixed_lease = Some(fixed.lease_id());
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, revision)])
            .and_then([TxnOp::put(
                key,
                value,
                Some(PutOptions::new().with_lease(fixed.lease_id())),
            )]);
        let moved = self
            .inner
            .client
            .kv_client()
            .txn(txn)
            .await
            .map_err(map)?
            .succeeded();
        if !moved {
            return Err(Error::lost(
                name,
                "our key disappeared before its fixed lease started (session expired or key deleted)",
            ));
        }
        // The key now lives and dies with the fixed lease alone.
        pending.get().session = None;
        Ok(fixed)
    }

    /// Creates our key and learns the first key under the name. Returns (our create
    /// revision, the holder's create revision).
    ///
    /// Uncontended (the name has no key at all) this is one round trip whose transaction
    /// is just that compare and the put: the same work, and the same bytes in etcd's log,
    /// as the raw floor, and we are the holder. Otherwise the same transaction queues us:
    /// it puts our key, if it does not exist, and reads the first-created key under the
    /// name. A key of ours that exists already can only be left from an earlier grant
    /// whose deletion never got through: it is never reused (its token would not be new)
    /// nor given our value (an observer would pair that value with its old token), but
    /// deleted, and we queue again with a put under the same condition.
    async fn create_and_read_first(
        &self,
        key: &str,
        names: &str,
        lease_id: i64,
        value: &str,
        pending: &mut Armed,
    ) -> Result<(i64, i64), Error> {
        // One transaction creates our key if the name is free and queues it otherwise:
        // a queued acquire costs one proposal, not a failed create and then a put.
        match self
            .create_or_queue(key, names, lease_id, value, true, pending)
            .await?
        {
            Created::Granted(revision) => return Ok((revision, revision)),
            Created::Queued {
                revision,
                stale: false,
                first: Some(first),
            } => return Ok((revision, first)),
            // A stale key of ours (never a grant: its token may not be new): delete it
            // and queue afresh below.
            Created::Queued {
                revision,
                stale: true,
                ..
            } => {
                // Boxed, off the usual path (see `take`).
                Box::pin(crate::held::delete_incarnation(
                    &self.inner.client,
                    key,
                    revision,
                ))
                .await?;
                pending.get().state = KeyState::Absent;
            }
            // Cannot happen (our own key is under the name); queue again below.
            Created::Queued { .. } | Created::Taken { .. } => {}
        }
        let put = TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease_id)));
        loop {
            // Never a put over a stale key of ours: it would keep the stale incarnation's
            // create revision, and an observer would see our value with its token.
            let txn = Txn::new()
                .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                .and_then([put.clone(), TxnOp::get(names, Some(first_created()))])
                .or_else([TxnOp::get(key, None)]);
            let response = self.send_create(txn, pending).await?;
            let ops = response.op_responses();
            if !response.succeeded() {
                if let Some(stale) = stale_of(&response) {
                    pending.get().state = KeyState::Created(stale);
                    Box::pin(crate::held::delete_incarnation(
                        &self.inner.client,
                        key,
                        stale,
                    ))
                    .await?;
                }
                pending.get().state = KeyState::Absent;
                continue;
            }
            let revision = response.header().map_or(0, |h| h.revision());
            pending.get().state = KeyState::Created(revision);
            let first = get_first(&ops, 1)
                .ok_or_else(|| internal("no key under the name after creating one"))?;
            return Ok((revision, first));
        }
    }

    /// Sends a transaction that may create our key: until its answer arrives, whether the
    /// key exists is unknown (and a clean-up must delete by key).
    ///
    /// The transaction must put our key only when its compares succeed, and read our
    /// key in its `or_else` if it reads anything there. It runs in its own task,
    /// recorded in the clean-up: if this future is dropped before the answer, the
    /// clean-up waits for it and deletes exactly the incarnation it made (created at the
    /// transaction's revision) or found (a stale key of ours the failed compare read).
    pub(crate) async fn send_create(
        &self,
        txn: Txn,
        pending: &mut Armed,
    ) -> Result<TxnResponse, Error> {
        let client = self.inner.client.clone();
        self.create_in_task(
            pending,
            move || async move { client.kv_client().txn(txn).await },
            // Our put creates the key now; a compare that failed on a key of ours read it
            // (to be deleted all the same).
            |response| {
                if response.succeeded() {
                    response.header().map(|h| h.revision())
                } else {
                    stale_of(response)
                }
            },
        )
        .await
    }

    /// Sends `request`, which may create our key, in a task of its own recorded in the
    /// clean-up, and returns its answer. Until the answer arrives our key's state is
    /// unknown; if this future is dropped first, the clean-up waits for the task and
    /// deletes exactly the incarnation `ours` reads from the answer (`None`: none).
    ///
    /// `request` makes the request's future inside the task, so the caller's future
    /// never holds it (a gRPC call's future is several KiB, which every acquire would
    /// otherwise carry and copy).
    async fn create_in_task<T: Send + 'static, F>(
        &self,
        pending: &mut Armed,
        request: impl FnOnce() -> F + Send + 'static,
        ours: fn(&T) -> Option<i64>,
    ) -> Result<T, Error>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    {
        pending.get().state = KeyState::Unknown;
        let (answer, answered) = tokio::sync::oneshot::channel();
        let create = self.inner.runtime.spawn(async move {
            let response = request().await;
            let made = match &response {
                Ok(value) => Ok(ours(value)),
                // Refused before anything was applied (RBAC, a lease etcd no longer
                // knows, ...): nothing was created.
                Err(e) if !crate::error::outcome_unknown(e) => Ok(None),
                // etcd may still apply it.
                Err(_) => Err(()),
            };
            let _ = answer.send(response);
            made
        });
        pending.get().create = Some(create);
        let response = answered.await.unwrap_or_else(|_| {
            Err(etcd_client::Error::InvalidArgs(
                "the create task ended without an answer".into(),
            ))
        });
        pending.get().create = None;
        response.map_err(|e| stale(e, pending))
    }

    /// One round trip: create our key only if no key exists under the name (through the
    /// client's group commit), so a try on a taken name leaves nothing behind. Returns our
    /// create revision, or `None` if the name is taken. A key of ours found on a taken
    /// name (an earlier send of this create whose answer was lost) is recorded in the
    /// clean-up, which deletes it.
    async fn create_if_free(
        &self,
        key: &str,
        names: &str,
        lease_id: i64,
        value: &str,
        pending: &mut Armed,
    ) -> Result<Option<i64>, Error> {
        match self
            .create_or_queue(key, names, lease_id, value, false, pending)
            .await?
        {
            Created::Granted(revision) => Ok(Some(revision)),
            _ => Ok(None),
        }
    }

    /// The create of [`create_if_free`](Self::create_if_free); with `queue`, a taken name
    /// gets our key in the same transaction ([`Created::Queued`]). The clean-up records
    /// exactly which incarnation of our key exists afterwards.
    async fn create_or_queue(
        &self,
        key: &str,
        names: &str,
        lease_id: i64,
        value: &str,
        queue: bool,
        pending: &mut Armed,
    ) -> Result<Created, Error> {
        let (batcher, names, key) = (self.inner.batcher.clone(), names.to_owned(), key.to_owned());
        let value = value.to_owned();
        let created = self
            .create_in_task(
                pending,
                move || async move {
                    batcher
                        .create_if_free(&names, &key, lease_id, &value, queue)
                        .await
                },
                |created| match created {
                    Created::Granted(revision) | Created::Queued { revision, .. } => {
                        Some(*revision)
                    }
                    Created::Taken { ours } => *ours,
                },
            )
            .await?;
        pending.get().state = match created {
            Created::Granted(revision) | Created::Queued { revision, .. } => {
                KeyState::Created(revision)
            }
            Created::Taken { ours: Some(stale) } => KeyState::Created(stale),
            Created::Taken { ours: None } => KeyState::Absent,
        };
        Ok(created)
    }

    /// After waiting: our key must still be the one we queued with. If the session expired
    /// while we waited, the key is gone and the lock must not be taken (etcd #11456).
    pub(crate) async fn check_still_queued(
        &self,
        key: &str,
        mine: i64,
        name: &str,
    ) -> Result<(), Error> {
        let response = self
            .inner
            .client
            .kv_client()
            .get(key, None)
            .await
            .map_err(map)?;
        match response.kvs().first() {
            Some(kv) if kv.create_revision() == mine => Ok(()),
            _ => Err(Error::lost(
                name,
                "our key disappeared while waiting (session expired or key deleted)",
            )),
        }
    }
}

/// Maps a create's error; a lease etcd no longer knows means the session is gone. A
/// refusal leaves nothing to clean up; any other error leaves the key's state unknown
/// (etcd may still apply the create), for the clean-up to deal with.
fn stale(error: etcd_client::Error, pending: &mut Armed) -> Error {
    if !crate::error::outcome_unknown(&error) {
        // Refused before anything was applied (RBAC, a lease etcd no longer knows, ...):
        // there is nothing to clean up (a delete RBAC refused would be refused the same
        // way).
        pending.get().state = KeyState::Absent;
    }
    if crate::error::is_lease_not_found(&error) {
        if let Some(session) = &pending.get().session {
            session.mark_lost(
                LossCause::SessionEnded,
                "etcd no longer knows the session lease",
            );
        }
    }
    map(error)
}

/// Runs `step`, giving up at `deadline` with the error `timed_out` makes.
/// The deadline of the steps before any waiting (connecting a session, creating the key,
/// the first read of the queue): the caller's, or [`ROUND_TRIP_GRACE`] from now if that
/// is later, so that a free lock is granted with a zero wait and a hung etcd still ends
/// the acquire (as [`fencelock_core::WaitDeadline::bound`]).
///
/// [`ROUND_TRIP_GRACE`]: fencelock_core::ROUND_TRIP_GRACE
pub(crate) fn step_deadline(deadline: Option<Instant>) -> Option<Instant> {
    deadline.map(|d| d.max(Instant::now() + fencelock_core::ROUND_TRIP_GRACE))
}

pub(crate) async fn within<T>(
    deadline: Option<Instant>,
    step: impl std::future::Future<Output = T>,
    timed_out: impl FnOnce() -> Error,
) -> Result<T, Error> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, step)
            .await
            .map_err(|_| timed_out()),
        None => Ok(step.await),
    }
}

impl EtcdLock {
    /// A read lock, write lock or permits (see [`crate::queue`]), after the checks every
    /// acquire makes, ended by `close`.
    async fn queued(
        &self,
        name: &str,
        ask: Ask,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(name)?;
        options.validate(MIN_LEASE)?;
        lease_seconds(options.lease_or(self.inner.config.lease).duration())?;
        self.check_open()?;
        let span = tracing::debug_span!("fencelock.etcd.queue", lock = name, ask = ?ask);
        // Once more on a new session if the session turned out to be gone (revoked or
        // expired before its keepalive noticed), as for a lock (`take_fresh`).
        // One deadline for both tries: the retry does not restart the caller's wait.
        let deadline = match options.wait_kind() {
            Wait::Timeout(limit) => Instant::now().checked_add(limit),
            Wait::NoWait | Wait::Forever => None,
        };
        let taken = async {
            match self.queue(name, ask, options, deadline).await {
                Err(error) if crate::error::is_stale_session(&error) => {
                    self.queue(name, ask, options, deadline).await
                }
                other => other,
            }
        };
        tokio::select! {
            biased;
            () = self.inner.closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
            taken = taken.instrument(span) => taken,
        }
    }

    /// Every key under `range` (keys only), in create order.
    async fn keys_in_create_order(&self, range: &str) -> Result<etcd_client::GetResponse, Error> {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_keys_only();
        self.inner
            .client
            .kv_client()
            .get(range, Some(options))
            .await
            .map_err(map)
    }

    /// What [`DistributedLock::inspect`] reports of the name whose key range is `names`,
    /// given its keys (key, create revision, lease) in create order.
    async fn describe(&self, names: &str, keys: &[(&[u8], i64, i64)]) -> LockInfo {
        let local = self.inner.gates.queued(names);
        let Some(&(key, revision, lease)) = keys.first() else {
            return LockInfo::free(Some(local));
        };
        let remaining = match self
            .inner
            .client
            .lease_client()
            .time_to_live(lease, None)
            .await
        {
            Ok(ttl) if ttl.ttl() >= 0 => Some(Duration::from_secs(ttl.ttl().unsigned_abs())),
            _ => None,
        };
        let owner = String::from_utf8_lossy(key)
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let token = FencingToken::new(u64::try_from(revision).unwrap_or_default());
        let waiters = keys.len() - 1 + local;
        LockInfo::held(HolderInfo::new(owner, token, remaining), Some(waiters))
    }
}

/// Sort options selecting the first-created key under a name.
pub(crate) fn first_created() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
        .with_keys_only()
}

pub(crate) fn get_first(ops: &[TxnOpResponse], index: usize) -> Option<i64> {
    match ops.get(index) {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.create_revision()),
        _ => None,
    }
}

/// A nested transaction that runs `put` (of `key`) only if `key` does not exist, and
/// otherwise reads it: a put over a stale key of ours would keep that incarnation's
/// create revision (its token) and give it our value. [`stale_of`] reads the answer.
pub(crate) fn put_if_absent(key: &str, put: TxnOp) -> TxnOp {
    TxnOp::txn(
        Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([put])
            .or_else([TxnOp::get(key, None)]),
    )
}

/// The create revision of the stale key of ours that kept a transaction made like
/// [`put_if_absent`] from putting (`None`: the put happened).
pub(crate) fn stale_of(response: &TxnResponse) -> Option<i64> {
    if response.succeeded() {
        return None;
    }
    match response.op_responses().first() {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.create_revision()),
        _ => None,
    }
}

fn internal(what: &str) -> Error {
    Error::backend(BACKEND, false, format!("unexpected etcd answer: {what}"))
}

#[async_trait]
impl DistributedLock for EtcdLock {
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        options.validate(MIN_LEASE)?;
        lease_seconds(options.lease_or(self.inner.config.lease).duration())?;
        self.check_open()?;
        let span = tracing::debug_span!("fencelock.etcd.acquire", lock = name);
        tokio::select! {
            biased;
            // Dropping the acquire undoes whatever it did, as for any cancellation.
            () = self.inner.closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
            taken = self.take_fresh(name, options, "").instrument(span) => taken,
        }
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        validate_name(name)?;
        self.check_open()?;
        let names = name_prefix(&self.inner.config.prefix, name);
        let response = self.keys_in_create_order(&names).await?;
        let keys: Vec<(&[u8], i64, i64)> = response
            .kvs()
            .iter()
            .map(|kv| (kv.key(), kv.create_revision(), kv.lease()))
            .collect();
        Ok(self.describe(&names, &keys).await)
    }

    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.queued(name, Ask::Read, options).await
    }

    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.queued(name, Ask::Write, options).await
    }

    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        let ask = Ask::Permits {
            count: permits.count(),
            limit: permits.limit(),
        };
        self.queued(name, ask, options).await
    }

    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(election)?;
        fencelock_core::validate_leader_value(value)?;
        options.validate(MIN_LEASE)?;
        lease_seconds(options.lease_or(self.inner.config.lease).duration())?;
        self.check_open()?;
        let span = tracing::debug_span!("fencelock.etcd.campaign", election);
        tokio::select! {
            biased;
            () = self.inner.closed.cancelled() => Err(Error::Closed { backend: BACKEND }),
            taken = self.take_fresh(election, options, value).instrument(span) => taken,
        }
    }

    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        validate_name(election)?;
        self.check_open()?;
        let names = name_prefix(&self.inner.config.prefix, election);
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let response = self
            .inner
            .client
            .kv_client()
            .get(names.as_str(), Some(options))
            .await
            .map_err(map)?;
        Ok(crate::election::Candidates::from_kvs(response.kvs()).leader())
    }

    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        validate_name(election)?;
        self.check_open()?;
        let names = name_prefix(&self.inner.config.prefix, election);
        let (candidates, revision) = crate::election::read(&self.inner.client, &names).await?;
        let (changes, receiver) = tokio::sync::mpsc::unbounded_channel();
        // The first item: the state the watch starts from.
        let _ = changes.send(Ok(candidates.leader()));
        let stop = self.inner.closed.child_token();
        self.inner.runtime.spawn(crate::election::follow(
            self.inner.client.clone(),
            names,
            candidates,
            revision,
            changes,
            stop.clone(),
        ));
        Ok(LeaderChanges::new(receiver, stop))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        validate_prefix(prefix)?;
        self.check_open()?;
        let root = format!("{}/", self.inner.config.prefix);
        let range = format!("{root}{}", encode(prefix));
        let response = self.keys_in_create_order(&range).await?;
        // Every key is `{root}{encoded name}/{lease}`; group them by name, keeping the
        // create order within each.
        let mut by_name: BTreeMap<String, Vec<(&[u8], i64, i64)>> = BTreeMap::new();
        for kv in response.kvs() {
            let Some(rest) = kv.key().strip_prefix(root.as_bytes()) else {
                continue;
            };
            let Some(slash) = rest.iter().position(|&b| b == b'/') else {
                continue;
            };
            let Some(name) = std::str::from_utf8(&rest[..slash]).ok().and_then(decode) else {
                continue;
            };
            by_name
                .entry(name)
                .or_default()
                .push((kv.key(), kv.create_revision(), kv.lease()));
        }
        let mut found = Vec::with_capacity(by_name.len());
        for (name, keys) in by_name {
            let info = self
                .describe(&name_prefix(&self.inner.config.prefix, &name), &keys)
                .await;
            found.push(ListedLock::new(name, info));
        }
        Ok(found)
    }

    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        validate_name(name)?;
        self.check_open()?;
        let names = name_prefix(&self.inner.config.prefix, name);
        let response = self
            .inner
            .client
            .kv_client()
            .get(names.as_str(), Some(first_created()))
            .await
            .map_err(map)?;
        let Some(first) = response.kvs().first() else {
            return Ok(None);
        };
        let key = first.key_str().map_err(map)?.to_owned();
        let info = self
            .describe(
                &names,
                &[(first.key(), first.create_revision(), first.lease())],
            )
            .await;
        // Only the incarnation seen: a holder that took the name since keeps it.
        let deleted =
            crate::held::delete_incarnation(&self.inner.client, &key, first.create_revision())
                .await?;
        if deleted {
            tracing::warn!(lock = name, key, "etcd: lock revoked");
        }
        Ok(info.holder.filter(|_| deleted))
    }

    async fn close(&self) -> Result<(), Error> {
        self.inner.closed.cancel();
        // Every guard is told before anything is awaited, and the revokes run in a task
        // of their own: a dropped `close` leaves no session renewed, no guard valid, and
        // no lease unrevoked.
        let sessions = self.inner.sessions.close();
        let fixed = self.inner.fixed.close();
        let client = self.inner.client.clone();
        let revoking = self.inner.runtime.spawn(async move {
            let mut outcome = Ok(());
            for lease in sessions {
                if let Err(error) = revoke(&client, lease).await {
                    tracing::warn!(lease, %error, "etcd: a session lease could not be revoked at close; it expires on its own");
                    outcome = outcome.and(Err(error));
                }
            }
            for lease in fixed {
                if let Err(error) = revoke(&client, lease).await {
                    tracing::warn!(lease, %error, "etcd: a fixed lease could not be revoked at close; it expires on its own");
                    outcome = outcome.and(Err(error));
                }
            }
            outcome
        });
        revoking
            .await
            .unwrap_or_else(|_| Err(Error::unavailable(BACKEND, "the close task failed")))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(true, FencingStrength::Strong, true, LossDetection::Notified)
            .with_min_lease(MIN_LEASE)
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
