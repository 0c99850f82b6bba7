//! The master of a Sentinel-managed deployment: one connection to it, dropped as soon as
//! the Sentinels name another master.
//!
//! A master that stalls past the Sentinels' `down-after` and comes back after they
//! promoted its replica goes on acting as a master until they demote it (about 10 s with
//! their default periods). A client that reconnects only after a failed command would
//! keep using it, and be granted locks there while clients that connected after the
//! failover are granted the same locks on the new master. So a watcher task listens to
//! a Sentinel's `+switch-master` events, and each time it (re)subscribes, and every
//! [`RECHECK`] after, it also asks which server is master now (events may have been
//! missed while it was not subscribed; a Sentinel that went silent is left for the
//! next). The watcher remembers the master it last learned of. Whenever that differs
//! from the server the cached connection leads to, the connection is dropped; and a
//! master resolved through a Sentinel that has not caught up (it still names the old
//! one) is not used while the watcher knows another. A request already sent on the
//! dropped connection may still be answered (the old master stalled with it and ran it
//! on its return): every reply is checked against the connection's epoch, and one that
//! comes after the connection was dropped or replaced is not trusted (see
//! [`SentinelNode::unchanged`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use fencelock_core::Error;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Client, ConnectionAddr, RedisError};

use crate::error::{BACKEND, map_err, needs_reconnect};

/// The event channel Sentinels publish a completed failover on: `NAME OLD_IP OLD_PORT
/// NEW_IP NEW_PORT`.
const SWITCH_MASTER: &str = "+switch-master";

/// The delay between two rounds over all Sentinels when none could be subscribed to.
const RETRY: Duration = Duration::from_millis(500);

/// How often the watcher asks its Sentinel for the master while subscribed, to notice a
/// missed event or a Sentinel that went silent.
const RECHECK: Duration = Duration::from_secs(2);

/// How many times [`SentinelNode::connection`] resolves the master before giving up
/// while the Sentinels disagree with what the watcher learned.
const RESOLVE_TRIES: usize = 3;

/// Commands to the master the Sentinels name.
pub(crate) struct SentinelNode {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    current: Arc<Current>,
    connect_timeout: Duration,
    timeout: Duration,
    watcher: tokio::task::JoinHandle<()>,
}

/// The cached connection to the master, the master the watcher last learned of, and a
/// count of the changes of each.
#[derive(Default)]
struct Current {
    master: Mutex<Option<Master>>,
    known: Mutex<Option<(String, u16)>>,
    switches: AtomicU64,
    /// Bumped, under the lock of `master`, whenever the cached connection is dropped or
    /// replaced (see [`SentinelNode::unchanged`]).
    epoch: AtomicU64,
}

#[derive(Clone)]
struct Master {
    conn: MultiplexedConnection,
    host: String,
    port: u16,
}

impl Current {
    fn lock(&self) -> MutexGuard<'_, Option<Master>> {
        self.master.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn known(&self) -> MutexGuard<'_, Option<(String, u16)>> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the master a Sentinel names now (`None`: none), and drops the cached
    /// connection unless it leads there.
    fn learned(&self, now: Option<(&str, u16)>) {
        let now = now.map(|(host, port)| (host.to_owned(), port));
        {
            let mut known = self.known();
            if *known != now {
                *known = now.clone();
                self.switches.fetch_add(1, Ordering::SeqCst);
            }
        }
        let mut master = self.lock();
        let stale = master.as_ref().is_some_and(|m| {
            now.as_ref()
                .is_none_or(|(host, port)| (&m.host, m.port) != (host, *port))
        });
        if stale {
            *master = None;
            self.epoch.fetch_add(1, Ordering::SeqCst);
            tracing::debug!(?now, "the Sentinels named another master; reconnecting");
        }
    }

    /// Whether `host:port` may be used: the watcher knows no master, or this one.
    fn agrees(&self, host: &str, port: u16) -> bool {
        self.known()
            .as_ref()
            .is_none_or(|(h, p)| (h.as_str(), *p) == (host, port))
    }
}

impl SentinelNode {
    /// A node for `sentinel`'s service, watched through `sentinels` (one client per
    /// Sentinel). Starts the watcher task on the current runtime.
    pub(crate) fn new(
        sentinel: SentinelClient,
        sentinels: Vec<Client>,
        service: String,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Self {
        let current = Arc::new(Current::default());
        let watcher = tokio::spawn(watch(
            sentinels,
            service,
            current.clone(),
            connect_timeout,
            timeout,
        ));
        SentinelNode {
            sentinel: tokio::sync::Mutex::new(sentinel),
            current,
            connect_timeout,
            timeout,
            watcher,
        }
    }

    /// The connection to the master, opened (after asking the Sentinels) if there is
    /// none, and its epoch: a request sent on it whose reply comes after the epoch moved
    /// on (see [`unchanged`](Self::unchanged)) may have been applied by a server that is
    /// master no more.
    pub(crate) async fn connection(&self) -> Result<(MultiplexedConnection, u64), Error> {
        {
            let master = self.current.lock();
            if let Some(master) = master.as_ref() {
                return Ok((
                    master.conn.clone(),
                    self.current.epoch.load(Ordering::SeqCst),
                ));
            }
        }
        // Boxed: asking the Sentinels and connecting is a future of several KiB, which
        // every command's future would otherwise carry (and copy) for its fast path.
        Box::pin(self.resolve()).await
    }

    /// Whether the connection [`connection`](Self::connection) gave with `epoch` is
    /// still the one in use: not dropped since (the Sentinels named another master, or
    /// an error called for a reconnection) nor replaced.
    ///
    /// A request sent before the Sentinels switched masters may be answered by the old
    /// master after the switch (it stalled with the request in its socket, and runs it
    /// when it comes back, still believing it is master): a grant there is lost when
    /// the old master is demoted, while the new master grants the same lock to others.
    /// Such a reply is not trusted.
    pub(crate) fn unchanged(&self, epoch: u64) -> bool {
        let _master = self.current.lock();
        self.current.epoch.load(Ordering::SeqCst) == epoch
    }

    /// Asks the Sentinels for the master and connects to it (the slow path of
    /// [`connection`](Self::connection)).
    async fn resolve(&self) -> Result<(MultiplexedConnection, u64), Error> {
        let mut sentinel = self.sentinel.lock().await;
        {
            let master = self.current.lock();
            if let Some(master) = master.as_ref() {
                return Ok((
                    master.conn.clone(),
                    self.current.epoch.load(Ordering::SeqCst),
                ));
            }
        }
        for _ in 0..RESOLVE_TRIES {
            let switches = self.current.switches.load(Ordering::SeqCst);
            let client = sentinel.async_get_client().await.map_err(map_err)?;
            let (host, port) = match client.get_connection_info().addr() {
                ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
                ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
                other => (other.to_string(), 0),
            };
            // A Sentinel that has not caught up with a switch names the old master.
            if !self.current.agrees(&host, port) {
                tokio::time::sleep(RETRY / 5).await;
                continue;
            }
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(self.connect_timeout))
                .set_response_timeout(Some(self.timeout));
            let conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map_err(map_err)?;
            let mut current = self.current.lock();
            // A switch while this master was being resolved: it may be the old one.
            if self.current.switches.load(Ordering::SeqCst) != switches
                || !self.current.agrees(&host, port)
            {
                continue;
            }
            *current = Some(Master {
                conn: conn.clone(),
                host,
                port,
            });
            let epoch = self.current.epoch.fetch_add(1, Ordering::SeqCst) + 1;
            return Ok((conn, epoch));
        }
        Err(Error::unavailable(
            BACKEND,
            "the Sentinels do not agree on the master yet (a failover is under way)",
        ))
    }

    /// A client for the master the Sentinels name now (for pub/sub).
    pub(crate) async fn client(&self) -> Result<Client, Error> {
        self.sentinel
            .lock()
            .await
            .async_get_client()
            .await
            .map_err(map_err)
    }

    /// Drops the cached connection after an error that calls for a reconnection, if it
    /// is still the one the failed request went on (`epoch`, from
    /// [`connection`](Self::connection)). A request that failed on a connection already
    /// dropped or replaced (a timeout on the old master after a switch) says nothing
    /// about the one in use now: dropping that one would throw away the healthy
    /// connection and have every reply in flight on it distrusted.
    pub(crate) fn forget(&self, epoch: u64) {
        let mut master = self.current.lock();
        if self.current.epoch.load(Ordering::SeqCst) == epoch && master.take().is_some() {
            self.current.epoch.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Drops the connection a request went on (`epoch`) after `err`, if the error
    /// calls for a reconnection and the connection is still the one in use.
    pub(crate) fn forget_on(&self, err: &RedisError, epoch: u64) {
        if needs_reconnect(err) {
            self.forget(epoch);
        }
    }
}

impl Drop for SentinelNode {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// The watcher: subscribes to [`SWITCH_MASTER`] on one Sentinel after another (the next
/// one when the connection ends, cannot be made, or the Sentinel stops answering), asks
/// for the master's address after each subscription and every [`RECHECK`], and records
/// every master it learns of (see [`Current::learned`]).
async fn watch(
    sentinels: Vec<Client>,
    service: String,
    current: Arc<Current>,
    connect_timeout: Duration,
    timeout: Duration,
) {
    loop {
        for sentinel in &sentinels {
            let Ok(Ok(mut pubsub)) =
                tokio::time::timeout(connect_timeout, sentinel.get_async_pubsub()).await
            else {
                continue;
            };
            // A second connection for the questions (a subscribed one takes no commands).
            let Ok(Ok(mut asking)) =
                tokio::time::timeout(connect_timeout, sentinel.get_multiplexed_async_connection())
                    .await
            else {
                continue;
            };
            let command = master_addr_command(&service);
            // The master this Sentinel names now; `Err` when it does not answer in time.
            let mut ask = async || -> Result<Option<(String, u16)>, ()> {
                match tokio::time::timeout(timeout, command.query_async(&mut asking)).await {
                    Ok(Ok(answer)) => Ok(answer),
                    _ => Err(()),
                }
            };
            if !matches!(
                tokio::time::timeout(timeout, pubsub.subscribe(SWITCH_MASTER)).await,
                Ok(Ok(()))
            ) {
                continue;
            }
            // Events may have been missed while no Sentinel was subscribed to.
            let Ok(now) = ask().await else {
                continue;
            };
            current.learned(now.as_ref().map(|(h, p)| (h.as_str(), *p)));
            let mut messages = pubsub.into_on_message();
            let mut recheck = tokio::time::interval(RECHECK);
            recheck.reset();
            loop {
                tokio::select! {
                    message = messages.next() => {
                        let Some(message) = message else { break };
                        let Ok(payload) = message.get_payload::<String>() else {
                            continue;
                        };
                        let mut fields = payload.split_whitespace();
                        if fields.next() != Some(service.as_str()) {
                            continue;
                        }
                        let new = fields.nth(2).zip(fields.next().and_then(|p| p.parse().ok()));
                        current.learned(new);
                    }
                    _ = recheck.tick() => match ask().await {
                        Ok(now) => current.learned(now.as_ref().map(|(h, p)| (h.as_str(), *p))),
                        // Silent: try the next Sentinel.
                        Err(()) => break,
                    },
                }
            }
            tracing::debug!("the Sentinel event connection ended; subscribing again");
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// `SENTINEL get-master-addr-by-name service`: `nil` (no master) or `[host, port]`.
fn master_addr_command(service: &str) -> redis::Cmd {
    let mut command = redis::cmd("SENTINEL");
    command.arg("get-master-addr-by-name").arg(service);
    command
}
