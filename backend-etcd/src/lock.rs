//! `EtcdLock`: the client, its shared state and how it connects.
//!
//! The rest of the client lives by concept: [`crate::client`] (the `DistributedLock`
//! methods), [`crate::acquire`] (a lock's acquire path, read top to bottom:
//! `acquire` → [`crate::create`] → [`crate::wait`] → [`crate::grant`] → [`crate::held`]),
//! [`crate::queue`] (read-write locks and semaphores).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use fencelock_core::Error;
use fencelock_core::kit::Delayed;
use fencelock_core::line::Lines;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use crate::batch::Batcher;
use crate::config::EtcdConfig;
use crate::error::{BACKEND, map, timed_out};
use crate::leases::FixedLeases;
use crate::sessions::Sessions;
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
    /// One contender per (session, name) inside the client: the client's key for a name
    /// is `{name prefix}{lease id}`, so its tasks contending for one name queue here, by
    /// key, in FIFO order, and only the front puts a key in etcd (see
    /// [`Cleanup::permit`](crate::cleanup::Cleanup::permit)).
    pub(crate) lines: Arc<Lines>,
    pub(crate) runtime: Handle,
}

/// How long a guard goes without its own key watch (see [`Delayed`]): most critical
/// sections end before, and then cost no watch at all. A deletion of the key in the
/// meantime is not missed: the watch replays history from the grant's revision.
const WATCH_DELAY: Duration = Duration::from_millis(50);

/// How often the queue of guards waiting for their watch is looked at while it is not
/// empty.
const WATCH_TICK: Duration = Duration::from_millis(25);

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
            let sessions = Sessions::new(&client, Handle::current());
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
                    delayed: Arc::new(Delayed::new(Handle::current(), WATCH_DELAY, WATCH_TICK)),
                    watches: Arc::new(KeyWatches::new(client.clone(), Handle::current())),
                    client,
                    config,
                    sessions,
                    fixed: Arc::default(),
                    closed: CancellationToken::new(),
                    lines: Arc::default(),
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
    pub(crate) fn check_open(&self) -> Result<(), Error> {
        if self.inner.closed.is_cancelled() {
            Err(Error::Closed { backend: BACKEND })
        } else {
            Ok(())
        }
    }
}
