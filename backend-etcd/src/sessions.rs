//! The client's sessions: one per lease duration, granted on first use and kept alive
//! by the client's [`Keepalives`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use etcd_client::Client;
use fencelock_core::{Error, LossCause};
use tokio::runtime::Handle;

use crate::session::{Keepalives, Session};

/// The most session leases (distinct lease durations) one client keeps at once, each
/// with its own keepalive; leases nobody uses are revoked to make room.
pub(crate) const MAX_SESSIONS: usize = 8;

/// The client's sessions, one per lease duration, created on first use, at most
/// [`MAX_SESSIONS`] at once.
#[derive(Debug)]
pub(crate) struct Sessions {
    /// The client's runtime, where the sessions' keepalives run and a session granted
    /// after `close` is revoked (not the runtime of whichever acquire granted a
    /// session: when that one ended, so would the keepalive, and every lock on the
    /// session would be lost at its TTL).
    runtime: Handle,
    /// What keeps the sessions alive.
    keepalives: Arc<Keepalives>,
    /// The live sessions, read without waiting on every acquire.
    live: std::sync::RwLock<HashMap<Duration, Arc<Session>>>,
    /// Serializes granting, so concurrent first acquisitions share one new session.
    granting: tokio::sync::Mutex<()>,
    /// Set once the client is closed (under `live`'s write lock): nothing is granted or
    /// handed out any more.
    closed: AtomicBool,
}

impl Sessions {
    /// No sessions of `client` yet; their keepalives will run on `runtime`.
    pub(crate) fn new(client: &Client, runtime: Handle) -> Self {
        Sessions {
            keepalives: Keepalives::new(client.clone(), runtime.clone()),
            runtime,
            live: std::sync::RwLock::default(),
            granting: tokio::sync::Mutex::default(),
            closed: AtomicBool::new(false),
        }
    }

    /// The live session for `ttl`, granting a new one if there is none or the last one was
    /// lost.
    pub(crate) async fn get(&self, client: &Client, ttl: Duration) -> Result<Arc<Session>, Error> {
        if let Some(session) = self.live(ttl) {
            return Ok(session);
        }
        let _granting = self.granting.lock().await;
        let closed = || Error::Closed {
            backend: crate::error::BACKEND,
        };
        if self.closed.load(Ordering::SeqCst) {
            return Err(closed());
        }
        if let Some(session) = self.live(ttl) {
            return Ok(session);
        }
        self.make_room(client, ttl)?;
        // Boxed: granting (a lease grant and a keepalive stream) is a future of several
        // KiB that every acquire's future would otherwise carry for the cached path.
        let session = Box::pin(Session::grant(
            client,
            ttl,
            &self.runtime,
            Some(&self.keepalives),
        ))
        .await?;
        let mut live = self.live.write().unwrap_or_else(PoisonError::into_inner);
        if self.closed.load(Ordering::SeqCst) {
            // Closed while granting: `close` did not see this session, so it is ended
            // here.
            drop(live);
            session.mark_lost(LossCause::ClientClosed, "the client was closed");
            let mut leases = client.lease_client();
            let id = session.lease_id();
            self.runtime.spawn(async move { leases.revoke(id).await });
            return Err(closed());
        }
        live.insert(ttl, session.clone());
        Ok(session)
    }

    /// Before a session of a new duration is added: drops lost sessions, and when
    /// [`MAX_SESSIONS`] are live, revokes those nobody uses (no guard, queued key or
    /// acquire holds them). Fails when all are in use.
    fn make_room(&self, client: &Client, ttl: Duration) -> Result<(), Error> {
        let mut live = self.live.write().unwrap_or_else(PoisonError::into_inner);
        live.retain(|_, s| !s.is_lost());
        if live.contains_key(&ttl) || live.len() < MAX_SESSIONS {
            return Ok(());
        }
        let idle: Vec<Duration> = live
            .iter()
            .filter(|(_, s)| Arc::strong_count(s) == 1)
            .map(|(d, _)| *d)
            .collect();
        for duration in idle {
            if let Some(session) = live.remove(&duration) {
                session.mark_lost(
                    LossCause::ClientClosed,
                    "an idle session was closed to make room",
                );
                let mut leases = client.lease_client();
                let id = session.lease_id();
                // On the client's runtime: the acquire's may end before the revoke.
                self.runtime.spawn(async move { leases.revoke(id).await });
            }
        }
        if live.len() >= MAX_SESSIONS {
            return Err(Error::InvalidConfig(format!(
                "etcd: locks of more than {MAX_SESSIONS} distinct lease durations are held at \
                 once on one client, and each duration is a lease with its own keepalive; use \
                 fewer distinct leases"
            )));
        }
        Ok(())
    }

    fn live(&self, ttl: Duration) -> Option<Arc<Session>> {
        let sessions = self.live.read().unwrap_or_else(PoisonError::into_inner);
        sessions.get(&ttl).filter(|s| !s.is_lost()).cloned()
    }

    /// Marks every session lost, so its guards are told and its keepalive stops, and
    /// grants none any more (on close). Returns their leases, to revoke. Nothing is
    /// awaited: a `close` dropped right after leaves no session renewed.
    pub(crate) fn close(&self) -> Vec<i64> {
        let sessions: Vec<Arc<Session>> = {
            let mut live = self.live.write().unwrap_or_else(PoisonError::into_inner);
            self.closed.store(true, Ordering::SeqCst);
            live.drain().map(|(_, s)| s).collect()
        };
        let leases = sessions
            .iter()
            .map(|session| {
                session.mark_lost(LossCause::ClientClosed, "the client was closed");
                session.lease_id()
            })
            .collect();
        self.keepalives.close();
        leases
    }
}
