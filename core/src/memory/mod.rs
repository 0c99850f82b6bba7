//! The in-memory backend (`mem://`): the embedded default and a test double for
//! applications' own tests.

mod held;
mod kind;
mod permits;
mod renewal;
mod semaphore;
mod table;
mod waiting;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use self::held::MemoryGrant;
use self::kind::Kind;
use self::semaphore::Semaphores;
use self::table::Table;
use self::waiting::Ticket;
use crate::kit::until_turn;
use crate::{
    AcquireOptions, Capabilities, DistributedLock, Error, FencingStrength, HolderInfo, Leader,
    LeaderChange, LeaderChanges, ListedLock, LockGuard, LockInfo, LossDetection, Permits, Wait,
    WaitDeadline, validate_name, validate_prefix,
};

const BACKEND: &str = "mem";

/// Locks held in this process's memory, with the full semantics of the remote backends.
///
/// Leases expire when not renewed, renewing leases are renewed every third of their
/// duration while the guard lives, loss is reported at the deadline, waiters are served in
/// FIFO order without polling, tokens strictly increase, and a dropped `acquire` leaves
/// nothing behind. All timing uses `tokio::time`, so tests can run it on a paused clock.
///
/// Renewals and observations run on the Tokio runtime of the call that started them
/// (`acquire`, `observe`). When that runtime shuts down, a renewing lease is no longer
/// renewed (the guard reports the loss at its deadline) and an observation's stream ends
/// with [`Error::Unavailable`].
///
/// It excludes tasks of one process only. Clones share the same locks; so do instances
/// obtained with [`MemoryLock::named`] (what `mem://NAME` connects to), while
/// [`MemoryLock::new`] creates an independent set.
///
/// # Examples
///
/// ```
/// use fencelock_core::{DistributedLockExt, MemoryLock};
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), fencelock_core::Error> {
/// let locks = MemoryLock::new();
/// let a = locks.lock("job").await?;
/// assert!(locks.try_lock("job").await?.is_none());
/// a.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MemoryLock {
    shared: Arc<Shared>,
    client: Arc<Client>,
}

/// The locks of one set: what a server is to the remote backends.
#[derive(Debug)]
struct Shared {
    instance: u64,
    table: Mutex<Table>,
    semaphores: Mutex<Semaphores>,
    /// Read-write locks: semaphores of [`semaphore::RW_PERMITS`] permits.
    rwlocks: Mutex<Semaphores>,
}

impl Shared {
    fn new() -> Arc<Self> {
        static INSTANCES: AtomicU64 = AtomicU64::new(0);
        Arc::new(Shared {
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed) + 1,
            table: Mutex::new(Table::default()),
            semaphores: Mutex::new(Semaphores::default()),
            rwlocks: Mutex::new(Semaphores::default()),
        })
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn semaphores(&self) -> MutexGuard<'_, Semaphores> {
        self.semaphores
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn rwlocks(&self) -> MutexGuard<'_, Semaphores> {
        self.rwlocks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The semaphore table of `kind`.
    fn permits_of(&self, kind: Kind) -> MutexGuard<'_, Semaphores> {
        match kind {
            Kind::ReadWrite => self.rwlocks(),
            Kind::Lock | Kind::Permits => self.semaphores(),
        }
    }
}

/// One client of a set: a [`MemoryLock`] and its clones. Closing it releases what was
/// taken through it, as closing a remote client ends its session.
#[derive(Debug)]
struct Client {
    id: u64,
    /// Cancelled by `close`, under the table's lock: stops renewals and refuses acquires.
    closed: CancellationToken,
    /// The renewing leases of the locks held through this client.
    renewals: renewal::ClientRenewals,
}

impl Client {
    fn new() -> Arc<Self> {
        static CLIENTS: AtomicU64 = AtomicU64::new(0);
        Arc::new(Client {
            id: CLIENTS.fetch_add(1, Ordering::Relaxed) + 1,
            closed: CancellationToken::new(),
            renewals: renewal::ClientRenewals::default(),
        })
    }
}

impl MemoryLock {
    /// A new, independent set of locks, and a client of it.
    pub fn new() -> Self {
        MemoryLock {
            shared: Shared::new(),
            client: Client::new(),
        }
    }

    /// A new client of the process-wide set of locks called `namespace` (`""` for
    /// `mem://`), created on first use. Every caller naming the same namespace shares its
    /// locks; each call is a client of its own, which [`close`](DistributedLock::close)
    /// closes without touching the others.
    pub fn named(namespace: &str) -> Self {
        static NAMED: OnceLock<Mutex<HashMap<String, Arc<Shared>>>> = OnceLock::new();
        let shared = NAMED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(namespace.to_owned())
            .or_insert_with(Shared::new)
            .clone();
        MemoryLock {
            shared,
            client: Client::new(),
        }
    }

    /// How many names currently have a holder or a waiter. Zero when nothing is held
    /// and nobody waits: no state is kept for idle names. A holder whose lease ran out
    /// (say, a leaked fixed-lease guard) no longer counts.
    pub fn active_names(&self) -> usize {
        self.shared.table().active_names()
            + self.shared.semaphores().active()
            + self.shared.rwlocks().active()
    }

    /// The guard of grant `id` of `name` in the table of `kind`: renewed while it lives
    /// (for a renewing lease), released through that table.
    fn guard(
        &self,
        kind: Kind,
        name: &Arc<str>,
        id: u64,
        lease: crate::Lease,
        (token, liveness): (crate::FencingToken, crate::Liveness),
    ) -> LockGuard {
        let grant = MemoryGrant::start(
            self.shared.clone(),
            kind,
            self.client.clone(),
            (name.clone(), id),
            lease,
            liveness.clone(),
        );
        let held = crate::kit::Held::new(grant, liveness.clone());
        LockGuard::with_name(name.clone(), token, BACKEND, liveness, Arc::new(held))
    }

    /// Fails with [`Error::Closed`] once this client is closed.
    fn check_open(&self) -> Result<(), Error> {
        if self.client.closed.is_cancelled() {
            Err(Error::Closed { backend: BACKEND })
        } else {
            Ok(())
        }
    }
}

impl Default for MemoryLock {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryLock")
            .field("instance", &self.shared.instance)
            .field("client", &self.client.id)
            .finish_non_exhaustive()
    }
}

/// The shortest renewing lease: renewed every third of it on timers that tick in whole
/// milliseconds, a shorter one would be renewed only after it ran out.
const SHORTEST_RENEWING_LEASE: Duration = Duration::from_millis(10);

/// The options' checks: the lease's range, and a renewing lease long enough to renew.
fn check_options(options: AcquireOptions) -> Result<(), Error> {
    options.validate(Duration::ZERO)?;
    match options.lease_kind() {
        crate::Lease::Renewing(lease) if lease < SHORTEST_RENEWING_LEASE => {
            Err(Error::InvalidConfig(format!(
                "a renewing lease of {lease:?} is shorter than {SHORTEST_RENEWING_LEASE:?}: it \
                 would run out before its renewal (timers tick in milliseconds); use a \
                 longer one or a fixed lease"
            )))
        }
        // Renewal runs on a Tokio runtime: refused here, before anything is granted,
        // rather than granted and then failing with the name held until the lease ends.
        crate::Lease::Renewing(_) if tokio::runtime::Handle::try_current().is_err() => {
            Err(needs_a_runtime("a renewing lease"))
        }
        _ => Ok(()),
    }
}

/// The two ends of an observation's relay: the table's channel to it (`kept`) and the
/// caller's stream (`changes`).
struct Relay {
    kept: Option<tokio::sync::mpsc::UnboundedReceiver<LeaderChange>>,
    changes: Option<tokio::sync::mpsc::UnboundedSender<LeaderChange>>,
    shared: std::sync::Weak<Shared>,
    key: Arc<str>,
}

impl Relay {
    /// The relay ended: the name's entry goes if nothing else keeps it.
    fn finish(&mut self) {
        self.changes = None;
        // Dropped first, so the table sees the observer gone.
        self.kept = None;
        if let Some(shared) = self.shared.upgrade() {
            shared.table().unobserve(&self.key);
        }
    }
}

impl Drop for Relay {
    /// Dropped unfinished: the runtime the relay ran on shut down. The caller's stream
    /// gets what the table had told it, then an error, instead of just ending (which
    /// would read as an observation nobody ends).
    fn drop(&mut self) {
        let Some(changes) = self.changes.take() else {
            return;
        };
        if let Some(kept) = self.kept.as_mut() {
            while let Ok(change) = kept.try_recv() {
                let _ = changes.send(change);
            }
        }
        let _ = changes.send(Err(Error::unavailable(
            BACKEND,
            "the Tokio runtime this election was observed on shut down; observe it again on a running one",
        )));
        self.finish();
    }
}

/// What needs a Tokio runtime and was asked for outside one.
fn needs_a_runtime(what: &str) -> Error {
    Error::InvalidConfig(format!(
        "{what} needs a Tokio runtime (the mem:// backend renews and observes on one); call it from within one, or use a fixed lease"
    ))
}

impl MemoryLock {
    /// `acquire`, or with a `value` a campaign.
    async fn take(
        &self,
        name: &str,
        options: AcquireOptions,
        value: Option<Arc<str>>,
    ) -> Result<LockGuard, Error> {
        validate_name(name)?;
        check_options(options)?;
        let key: Arc<str> = Arc::from(name);
        let lease = options.lease_kind();
        let wait = WaitDeadline::new(options.wait_kind());
        let no_wait = options.wait_kind() == Wait::NoWait;
        let ticket = Ticket {
            lock: self,
            name: &key,
            id: self.shared.table().next_id(),
            value: value.as_ref(),
            lease: lease.duration(),
            queue: !no_wait,
            wake: Arc::new(Notify::new()),
            queued: false,
        };
        let (ticket, granted) = until_turn(ticket, name, &wait, no_wait).await?;
        Ok(self.guard(Kind::Lock, &key, ticket.id, lease, granted))
    }
}

#[async_trait]
impl DistributedLock for MemoryLock {
    #[tracing::instrument(name = "fencelock.mem.acquire", level = "debug", skip_all, fields(lock = name))]
    async fn acquire(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        self.take(name, options, None).await
    }

    #[tracing::instrument(
        name = "fencelock.mem.campaign",
        level = "debug",
        skip_all,
        fields(election)
    )]
    async fn campaign(
        &self,
        election: &str,
        value: &str,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        crate::validate_leader_value(value)?;
        self.take(election, options, Some(Arc::from(value))).await
    }

    #[tracing::instrument(name = "fencelock.mem.acquire_permits", level = "debug", skip_all, fields(semaphore = name))]
    async fn acquire_permits(
        &self,
        name: &str,
        permits: Permits,
        options: AcquireOptions,
    ) -> Result<LockGuard, Error> {
        validate_name(name)?;
        check_options(options)?;
        self.check_open()?;
        self.permits(
            Kind::Permits,
            name,
            (permits.count(), permits.limit()),
            options,
        )
        .await
    }

    #[tracing::instrument(name = "fencelock.mem.acquire_read", level = "debug", skip_all, fields(lock = name))]
    async fn acquire_read(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        check_options(options)?;
        self.check_open()?;
        self.permits(Kind::ReadWrite, name, (1, semaphore::RW_PERMITS), options)
            .await
    }

    #[tracing::instrument(name = "fencelock.mem.acquire_write", level = "debug", skip_all, fields(lock = name))]
    async fn acquire_write(&self, name: &str, options: AcquireOptions) -> Result<LockGuard, Error> {
        validate_name(name)?;
        check_options(options)?;
        self.check_open()?;
        let all = semaphore::RW_PERMITS;
        self.permits(Kind::ReadWrite, name, (all, all), options)
            .await
    }

    async fn leader(&self, election: &str) -> Result<Option<Leader>, Error> {
        validate_name(election)?;
        self.check_open()?;
        Ok(self.shared.table().leader(election))
    }

    async fn observe(&self, election: &str) -> Result<LeaderChanges, Error> {
        validate_name(election)?;
        self.check_open()?;
        let key: Arc<str> = Arc::from(election);
        let (changes, receiver) = tokio::sync::mpsc::unbounded_channel();
        // The table tells a keeper task, which forwards to the caller's stream. The
        // keeper also wakes at the end of the leader's lease, when nobody else may touch
        // the name (nobody campaigns), and looks, so the end of the term is pushed as
        // etcd's deletion would be; and it ends the stream with `Closed` when this client
        // closes. It ends with the observation.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(needs_a_runtime("observing"));
        };
        let (keeper, kept) = tokio::sync::mpsc::unbounded_channel();
        self.shared.table().observe(&key, keeper);
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let closed = self.client.closed.clone();
        let shared = Arc::downgrade(&self.shared);
        // Owns both ends while the relay runs; if the runtime drops the relay unfinished
        // (it shut down), it ends the caller's stream with an error and lets go of the
        // name (see `Relay`'s `Drop`).
        let mut relay = Relay {
            kept: Some(kept),
            changes: Some(changes),
            shared: shared.clone(),
            key: key.clone(),
        };
        runtime.spawn(async move {
            let (Some(kept), Some(changes)) = (relay.kept.as_mut(), relay.changes.as_ref()) else {
                return;
            };
            // Forwards until the observation ends: `true` when it ends with `Closed`
            // (this client closed, or every handle of it is gone without a close).
            let closing = async {
                loop {
                    let Some(at) = shared.upgrade().map(|s| s.table().expiry_of(&key)) else {
                        return true;
                    };
                    tokio::select! {
                        biased;
                        () = stopped.cancelled() => return false,
                        () = closed.cancelled() => return true,
                        change = kept.recv() => {
                            // The table let go of our sender: it is gone with the client.
                            let Some(change) = change else { return true };
                            if changes.send(change).is_err() {
                                return false;
                            }
                        }
                        () = async {
                            match at {
                                Some(at) => tokio::time::sleep_until(at).await,
                                None => std::future::pending().await,
                            }
                        } => {
                            if let Some(shared) = shared.upgrade() {
                                shared.table().leader(&key);
                            }
                        }
                    }
                }
            }
            .await;
            if closing {
                // The changes told before the end (its own releases among them) come
                // first, in order.
                while let Ok(change) = kept.try_recv() {
                    let _ = changes.send(change);
                }
                let _ = changes.send(Err(Error::Closed { backend: BACKEND }));
            }
            relay.finish();
        });
        Ok(LeaderChanges::new(receiver, stop))
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo, Error> {
        validate_name(name)?;
        self.check_open()?;
        let mut table = self.shared.table();
        Ok(table.inspect(name, self.shared.instance))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ListedLock>, Error> {
        validate_prefix(prefix)?;
        self.check_open()?;
        let mut table = self.shared.table();
        Ok(table.list(prefix, self.shared.instance))
    }

    async fn revoke(&self, name: &str) -> Result<Option<HolderInfo>, Error> {
        validate_name(name)?;
        self.check_open()?;
        let mut table = self.shared.table();
        Ok(table.revoke(name, self.shared.instance))
    }

    async fn close(&self) -> Result<(), Error> {
        self.shared.table().close_client(&self.client);
        self.shared.semaphores().close_client(&self.client);
        self.shared.rwlocks().close_client(&self.client);
        // Closing marked every lock lost: the renewal tasks end now, not at their next
        // renewal.
        self.client.renewals.wake_all();
        Ok(())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new(true, FencingStrength::Strong, true, LossDetection::Notified)
            .with_min_lease(crate::SHORTEST_LEASE)
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

#[cfg(test)]
mod tests;
