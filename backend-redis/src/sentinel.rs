//! The master of a Sentinel-managed deployment: one connection to it, dropped as soon as
//! the Sentinels name another master.
//!
//! A master that stalls past the Sentinels' `down-after` and comes back after they
//! promoted its replica goes on acting as a master until they demote it (about 10 s with
//! their default periods). A client that reconnects only after a failed command would
//! keep using it, and be granted locks there while clients that connected after the
//! failover are granted the same locks on the new master. So a watcher task listens to
//! a Sentinel's `+switch-master` events, and each time it (re)subscribes it also asks
//! which server is master now (it may have missed events while it was not subscribed).
//! Whenever the answer differs from the server the cached connection leads to, the
//! connection is dropped, and the next command asks the Sentinels again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use fencelock_core::Error;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Client, ConnectionAddr};

use crate::node::map_err;

/// The event channel Sentinels publish a completed failover on: `NAME OLD_IP OLD_PORT
/// NEW_IP NEW_PORT`.
const SWITCH_MASTER: &str = "+switch-master";

/// The delay between two rounds over all Sentinels when none could be subscribed to.
const RETRY: Duration = Duration::from_millis(500);

/// Commands to the master the Sentinels name.
pub(crate) struct SentinelNode {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    current: Arc<Current>,
    connect_timeout: Duration,
    timeout: Duration,
    watcher: tokio::task::JoinHandle<()>,
}

/// The cached connection to the master, and a count of the times it was dropped because
/// the Sentinels named another master.
#[derive(Default)]
struct Current {
    master: Mutex<Option<Master>>,
    switches: AtomicU64,
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

    /// Drops the connection unless it leads to `host:port` (`None`: whatever it leads
    /// to).
    fn switch_unless(&self, now: Option<(&str, u16)>) {
        let mut master = self.lock();
        let stale = master.as_ref().is_some_and(|m| {
            now.is_none_or(|(host, port)| (m.host.as_str(), m.port) != (host, port))
        });
        if stale {
            *master = None;
            self.switches.fetch_add(1, Ordering::SeqCst);
            tracing::debug!(?now, "the Sentinels named another master; reconnecting");
        }
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
        let watcher = tokio::spawn(watch(sentinels, service, current.clone(), timeout));
        SentinelNode {
            sentinel: tokio::sync::Mutex::new(sentinel),
            current,
            connect_timeout,
            timeout,
            watcher,
        }
    }

    /// The connection to the master, opened (after asking the Sentinels) if there is
    /// none.
    pub(crate) async fn connection(&self) -> Result<MultiplexedConnection, Error> {
        if let Some(master) = self.current.lock().clone() {
            return Ok(master.conn);
        }
        let mut sentinel = self.sentinel.lock().await;
        if let Some(master) = self.current.lock().clone() {
            return Ok(master.conn);
        }
        loop {
            let switches = self.current.switches.load(Ordering::SeqCst);
            let client = sentinel.async_get_client().await.map_err(map_err)?;
            let (host, port) = match client.get_connection_info().addr() {
                ConnectionAddr::Tcp(host, port) => (host.clone(), *port),
                ConnectionAddr::TcpTls { host, port, .. } => (host.clone(), *port),
                other => (other.to_string(), 0),
            };
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(self.connect_timeout))
                .set_response_timeout(Some(self.timeout));
            let conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map_err(map_err)?;
            let mut current = self.current.lock();
            // A switch while this master was being resolved: it may be the old one.
            if self.current.switches.load(Ordering::SeqCst) != switches {
                continue;
            }
            *current = Some(Master {
                conn: conn.clone(),
                host,
                port,
            });
            return Ok(conn);
        }
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

    /// Drops the cached connection (after an error that calls for a reconnection).
    pub(crate) fn forget(&self) {
        *self.current.lock() = None;
    }
}

impl Drop for SentinelNode {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// The watcher: subscribes to [`SWITCH_MASTER`] on one Sentinel after another (the next
/// one when the connection ends or cannot be made), checks the master's address after
/// each subscription, and drops the cached connection on every switch of `service`.
async fn watch(sentinels: Vec<Client>, service: String, current: Arc<Current>, timeout: Duration) {
    loop {
        for sentinel in &sentinels {
            let Ok(Ok(mut pubsub)) =
                tokio::time::timeout(timeout, sentinel.get_async_pubsub()).await
            else {
                continue;
            };
            if !matches!(
                tokio::time::timeout(timeout, pubsub.subscribe(SWITCH_MASTER)).await,
                Ok(Ok(()))
            ) {
                continue;
            }
            // Events may have been missed while no Sentinel was subscribed to.
            match tokio::time::timeout(timeout, master_addr(sentinel, &service)).await {
                Ok(Ok(Some((host, port)))) => current.switch_unless(Some((&host, port))),
                Ok(Ok(None)) => current.switch_unless(None),
                // This Sentinel does not answer: try the next one.
                _ => continue,
            }
            let mut messages = pubsub.into_on_message();
            while let Some(message) = messages.next().await {
                let Ok(payload) = message.get_payload::<String>() else {
                    continue;
                };
                let mut fields = payload.split_whitespace();
                if fields.next() != Some(service.as_str()) {
                    continue;
                }
                let new = fields
                    .nth(2)
                    .zip(fields.next().and_then(|p| p.parse().ok()));
                current.switch_unless(new);
            }
            tracing::debug!("the Sentinel event connection ended; subscribing again");
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// `SENTINEL get-master-addr-by-name service` on `sentinel`: `None` when it names no
/// master.
async fn master_addr(
    sentinel: &Client,
    service: &str,
) -> redis::RedisResult<Option<(String, u16)>> {
    let mut conn = sentinel.get_multiplexed_async_connection().await?;
    redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(service)
        .query_async(&mut conn)
        .await
}
