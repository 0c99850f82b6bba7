//! The sessions of one client: one per distinct lease duration, opened on the client's
//! runtime on first use, replaced after expiry, and given up together at close.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fencelock_core::Error;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use crate::config::ZkConfig;
use crate::error::BACKEND;
use crate::session::ZkSession;
use crate::transport::Transport;

/// The most sessions (distinct lease durations) one client keeps open at once. Each is a
/// connection, and ZooKeeper limits connections per client address (`maxClientCnxns`,
/// 60 by default): leases of many durations must not exhaust it. Sessions nobody uses are
/// closed to make room; a client that holds locks of more durations at once gets
/// [`Error::InvalidConfig`].
pub(crate) const MAX_SESSIONS: usize = 8;

fn too_many_sessions(max: usize) -> Error {
    Error::InvalidConfig(format!(
        "zookeeper: locks of more than {max} distinct lease durations are held at once on one \
         client, and each duration is a session (a connection); use fewer distinct leases"
    ))
}

/// The session of one lease duration; the async mutex serializes (re)connecting.
type Slot = Arc<tokio::sync::Mutex<Option<Arc<ZkSession>>>>;

/// The sessions of one client: one per distinct lease duration, created on first use and
/// replaced after expiry.
#[derive(Debug)]
pub(crate) struct SessionPool {
    config: ZkConfig,
    /// The TLS and SASL material, read once.
    transport: Transport,
    /// The client's runtime (where [`ZkLock::connect`](crate::ZkLock::connect) ran). Every
    /// session is opened on it, whichever call needs the session, so that its connection
    /// task, monitor and watcher live as long as the client: opened on the runtime of the
    /// acquire that needed it, a session died with that runtime (a `block_on`, another
    /// test's), for every lock of its lease duration.
    runtime: Handle,
    slots: Mutex<HashMap<Duration, Slot>>,
    /// Cancelled by [`SessionPool::close`]: no session is opened any more, and waiting
    /// acquires end.
    closed: CancellationToken,
    /// Cancelled when the deletes of the first [`SessionPool::close`] are over.
    close_done: CancellationToken,
}

impl SessionPool {
    /// A pool opening its sessions on `runtime`, the client's.
    pub(crate) fn new(config: ZkConfig, transport: Transport, runtime: Handle) -> Self {
        SessionPool {
            config,
            transport,
            runtime,
            slots: Mutex::new(HashMap::new()),
            closed: CancellationToken::new(),
            close_done: CancellationToken::new(),
        }
    }

    pub(crate) fn config(&self) -> &ZkConfig {
        &self.config
    }

    /// The open session with ZooKeeper session id `id`, if it is one of ours. Waits for a
    /// slot that is connecting (a `try_lock` would miss a live session while another
    /// request holds its slot).
    pub(crate) async fn find(&self, id: i64) -> Option<Arc<ZkSession>> {
        let slots: Vec<Slot> = self
            .slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        for slot in slots {
            let current = slot.lock().await;
            if let Some(session) = current.as_ref().filter(|s| s.client.session_id().0 == id) {
                return Some(session.clone());
            }
        }
        None
    }

    /// The live session with `timeout`, connecting one if there is none or it ended.
    ///
    /// # Errors
    ///
    /// As [`ZkSession::connect`].
    pub(crate) async fn get(&self, timeout: Duration) -> Result<Arc<ZkSession>, Error> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            if !slots.contains_key(&timeout) && slots.len() >= MAX_SESSIONS {
                // Close the sessions nobody uses (no guard, no acquire holds them): the
                // pool's reference is the last, and dropping it closes the session.
                let default = self.config.session_timeout();
                slots.retain(|duration, slot| {
                    *duration == default
                        || slot.try_lock().map_or(true, |current| {
                            current.as_ref().is_some_and(|s| Arc::strong_count(s) > 1)
                        })
                });
                if slots.len() >= MAX_SESSIONS {
                    return Err(too_many_sessions(MAX_SESSIONS));
                }
            }
            slots.entry(timeout).or_default().clone()
        };
        let mut current = slot.lock().await;
        // Checked under the slot's lock, which `close` takes too: no session is opened
        // after `close` went through the slots.
        if self.closed.is_cancelled() {
            return Err(closed());
        }
        if let Some(session) = current.as_ref().filter(|s| s.is_usable()) {
            return Ok(session.clone());
        }
        let session = self.connect(timeout).await?;
        *current = Some(session.clone());
        Ok(session)
    }

    /// [`ZkSession::connect`] on the client's runtime (see [`SessionPool::runtime`]).
    /// Dropping the future stops the connect.
    async fn connect(&self, timeout: Duration) -> Result<Arc<ZkSession>, Error> {
        let (config, transport) = (self.config.clone(), self.transport.clone());
        let task = self
            .runtime
            .spawn(async move { ZkSession::connect(&config, &transport, timeout).await });
        let _stop = AbortOnDrop(task.abort_handle());
        match task.await {
            Ok(connected) => connected,
            Err(error) => Err(Error::backend(
                BACKEND,
                false,
                format!(
                    "the ZooKeeper session could not be opened on the client's runtime (the \
                     one ZkLock::connect ran on; it must outlive the client): {error}"
                ),
            )),
        }
    }

    /// Whether [`SessionPool::close`] was called, as a future to select on.
    pub(crate) fn closed(&self) -> &CancellationToken {
        &self.closed
    }

    /// Closes the client: every lock held is given up and its node deleted, and the
    /// sessions are dropped (each ends on the server when the last guard using it is
    /// gone). Returns the first delete that failed.
    ///
    /// Before its first await, the client is closed to new requests and the locks of
    /// every session are marked lost (those of a session being opened right now, which
    /// holds none yet, once it is open). The deletes run as a task on the client's
    /// runtime, so a dropped `close` does not stop them, and a later `close` waits for
    /// them. A close that stopped half-way left the locks of the sessions it had not
    /// reached held, and the next `close` found nothing to do.
    pub(crate) async fn close(&self) -> Result<(), Error> {
        let slots: Option<Vec<Slot>> = {
            let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
            if self.closed.is_cancelled() {
                None
            } else {
                self.closed.cancel();
                Some(slots.drain().map(|(_, slot)| slot).collect())
            }
        };
        let Some(slots) = slots else {
            // Closed already: the first close's deletes go on without it, if it was
            // dropped.
            self.close_done.cancelled().await;
            return Ok(());
        };
        // Cancelled when the deletes are over, or dropped with the runtime.
        let done = self.close_done.clone().drop_guard();
        let mut given_up = Vec::new();
        // Held by a request opening (or looking up) a session: done in the task.
        let mut busy = Vec::new();
        for slot in slots {
            let taken = slot.try_lock().map(|mut current| current.take());
            match taken {
                Ok(Some(session)) => {
                    let nodes = session.give_up();
                    given_up.push((session, nodes));
                }
                Ok(None) => {}
                Err(_) => busy.push(slot),
            }
        }
        let limit = self.config.connect_timeout();
        let deletes = async move {
            let _done = done;
            let mut outcome = Ok(());
            for (session, nodes) in given_up {
                outcome = outcome.and(session.delete_given_up(nodes, limit).await);
            }
            for slot in busy {
                let session = slot.lock().await.take();
                if let Some(session) = session {
                    let nodes = session.give_up();
                    outcome = outcome.and(session.delete_given_up(nodes, limit).await);
                }
            }
            outcome
        };
        match self.runtime.spawn(deletes).await {
            Ok(outcome) => outcome,
            Err(_) => Err(Error::unavailable(
                BACKEND,
                "the lock nodes could not be deleted at close: the client's runtime has shut \
                 down; they go with their sessions",
            )),
        }
    }
}

/// Aborts a task when dropped (a finished one is left as it is).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The error of every call on a closed client.
pub(crate) fn closed() -> Error {
    Error::Closed { backend: BACKEND }
}
