//! ZooKeeper sessions: the lease behind every lock.
//!
//! A session's heartbeats are the renewal of every lock created in it. Each session has
//! one monitor task that
//!
//! - sends a `sync` and a tiny read (`exists /`) every quarter of the session timeout
//!   and, when both are answered, moves the deadline of every lock of the session to
//!   *send time of the previous answered probe + session timeout − margin* (2 % of the
//!   timeout plus 50 ms, core's drift rule with ZooKeeper's extra for late leader
//!   pings: [`DEADLINE_MARGIN`]): the leader
//!   has surely heard from the session by then (a follower reports touches to the leader
//!   only at the leader's next ping, so the latest probe may not have reached it when a
//!   partition starts), so it cannot expire the session (and delete the nodes) before
//!   that deadline; a plain read alone could be answered by a follower cut off from the
//!   leader, hence the `sync`;
//! - marks every lock *at risk* while the client is disconnected, and clears the mark on
//!   reconnection;
//! - marks every lock *lost* when the session expires, is closed or fails to
//!   authenticate.
//!
//! The monitor holds the session weakly: dropping the last user closes the session.
//!
//! Sessions are opened on the client's runtime (see [`crate::pool`]), so their tasks
//! (the client's connection, the monitor, the watcher, background clean-up) live as long
//! as the client, whichever call opened them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use fencelock_core::kit::{CLOCK_DRIFT, Delayed, DriftMargin, Grants};
use fencelock_core::{Error, Lease, Liveness, LossCause, RenewalOutcome, record_renewal};
use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::config::{AclPolicy, AuthMethod, ZkConfig};
use crate::error::{BACKEND, map, session_ended};
use crate::transport::Transport;
use crate::watcher::{self, Deadlines, TICK, WATCH_DELAY, Watched};

/// How much earlier than `anchor + timeout` a session's deadline is: core's drift rule
/// ([`CLOCK_DRIFT`], 1 % of the timeout + 2 ms) plus ZooKeeper's own 1 % + 48 ms, in all
/// 2 % of the timeout for clock-rate differences between client and server and 50 ms for
/// the leader's pings coming later than every half tick. The further 1 % keeps the 2 %
/// for clock rates this backend has always kept; the 48 ms, with the rule's 2 ms, are
/// the slack for late pings:
///
/// The anchor is the older of the last two answered probes, sent at least a quarter of
/// the timeout before the later one (see [`ZkSession::anchor`]). The leader hears of a
/// probe at the first ping after it reached the follower; the later probe's `sync` went
/// through the leader after the last ping the follower handled before it, so the leader
/// has heard of the older probe, or else of the one before it no earlier than
/// (later probe − ping interval). With pings every half tick, at most a quarter of the
/// timeout (the timeout is at least two ticks), that is no earlier than the older
/// probe; pings that come late by the leader loop's own time, a pause or scheduling
/// delays move it earlier by that much, which the slack covers. At the minimum session
/// timeout (two ticks: 1 s with a `tickTime` of 500 ms) the probes are exactly one ping
/// period (250 ms) apart: the margin is 20 + 50 = 70 ms (it was the 20 ms drift margin
/// alone); at 2 s, 40 + 50 = 90 ms.
pub(crate) const DEADLINE_MARGIN: DriftMargin = CLOCK_DRIFT.plus(1, Duration::from_millis(48));

/// The end of a fixed lease confirmed by a request sent at `sent`.
pub(crate) fn fixed_cap(lease: Lease, sent: Instant) -> Option<Instant> {
    match lease {
        Lease::Fixed(duration) => Some(sent + duration),
        Lease::Renewing(_) => None,
    }
}

/// One ZooKeeper session and the locks held in it.
pub(crate) struct ZkSession {
    pub(crate) client: zk::Client,
    timeout: Duration,
    /// The client's `min_lease`: the shortest lease an extension may ask for.
    min_lease: Duration,
    acl: AclPolicy,
    root: String,
    runtime: Handle,
    ended: CancellationToken,
    /// The locks held on this session, by id. Closed by [`give_up`](Self::give_up) (the
    /// client was closed): a grant is either drained there or refused at
    /// [`register`](Self::register).
    held: Grants<Registered>,
    next_id: AtomicU64,
    /// Send times of the last two answered probes (older, latest): see
    /// [`anchor`](Self::anchor).
    confirmed: Mutex<(Instant, Instant)>,
    /// Woken at every answered probe (see [`confirmed_deadline`](Self::confirmed_deadline)).
    probed: tokio::sync::Notify,
    /// The waiting lines of this session's tasks, by directory: one node per waiting
    /// (session, name), the other tasks wait locally (see [`fencelock_core::line`]).
    pub(crate) lines: Arc<fencelock_core::line::Lines>,
    /// Starts the watches on the nodes of the locks held on this session (see
    /// [`crate::watcher`]).
    watches: Arc<Delayed>,
    /// The deadlines of the watched locks, to give up their nodes once lost.
    deadlines: Arc<Deadlines>,
}

/// A held lock as the monitor sees it.
struct Registered {
    liveness: Liveness,
    cap: Option<Instant>,
    /// The grant's nodes, deleted at close ([`ZkSession::give_up`]). Weak: the guard owns
    /// them, and they hold the session.
    tracked: Weak<dyn Watched>,
}

impl ZkSession {
    /// Opens a session with exactly `timeout`, or fails.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when no server answers; [`Error::InvalidConfig`] when the
    /// server negotiated a different timeout (it is outside the server's
    /// `minSessionTimeout`..`maxSessionTimeout`): the lease is never silently changed.
    /// A failed TLS handshake (untrusted server, client certificate required, not a TLS
    /// port) and failed authentication are non-retryable [`Error::Backend`]s.
    pub(crate) async fn connect(
        config: &ZkConfig,
        transport: &Transport,
        timeout: Duration,
    ) -> Result<Arc<Self>, Error> {
        let connector = || {
            let mut connector = zk::Client::connector()
                .with_session_timeout(timeout)
                .with_fail_eagerly();
            if let (Some(auth), AuthMethod::Digest) = (config.auth(), config.auth_method()) {
                let credentials = format!("{}:{}", auth.user, auth.password);
                connector = connector.with_auth("digest", credentials.as_bytes());
            }
            connector
        };
        let connecting = Instant::now();
        let sasl = config.auth().is_some() && config.auth_method() == AuthMethod::SaslDigestMd5;
        let attempts = async {
            let mut outcome = transport.connect(connector(), config.hosts()).await;
            // A server refusing SASL credentials answers and closes the connection; the
            // client sometimes sees the close first and reports that no server took the
            // session. Asked again, it learns the refusal (at most twice more).
            for _ in 0..2 {
                match &outcome {
                    Err(zk::Error::NoHosts | zk::Error::ConnectionLoss) if sasl => {
                        outcome = transport.connect(connector(), config.hosts()).await;
                    }
                    _ => break,
                }
            }
            outcome
        };
        // A server that accepts the connection but never answers would hold the connect
        // for 2/5 of the session timeout per host.
        let client = match tokio::time::timeout(config.connect_timeout(), attempts).await {
            Ok(Ok(client)) => client,
            Ok(Err(err)) => {
                return Err(transport.connect_failed(config, connecting, err).await);
            }
            Err(_) => {
                return Err(Error::unavailable(
                    BACKEND,
                    format!(
                        "no ZooKeeper server answered within connect_timeout ({:?})",
                        config.connect_timeout()
                    ),
                ));
            }
        };
        let negotiated = client.session_timeout();
        if negotiated != timeout {
            return Err(Error::InvalidConfig(format!(
                "ZooKeeper granted a session timeout of {negotiated:?} instead of the requested \
                 {timeout:?}: the lease is outside the server's minSessionTimeout..maxSessionTimeout"
            )));
        }
        let watches = Arc::new(Delayed::new(Handle::current(), WATCH_DELAY, TICK));
        let session = Arc::new(ZkSession {
            client,
            timeout,
            min_lease: config.min_lease(),
            acl: config.acl(),
            root: config.chroot().to_owned(),
            runtime: Handle::current(),
            ended: CancellationToken::new(),
            held: Grants::new(),
            next_id: AtomicU64::new(0),
            lines: Arc::default(),
            watches: watches.clone(),
            deadlines: Arc::new(Deadlines::new(watches)),
            // Creating a session is a write the leader commits: it heard from us then.
            confirmed: Mutex::new((connecting, connecting)),
            probed: tokio::sync::Notify::new(),
        });
        spawn_monitor(&session);
        Ok(session)
    }

    /// The negotiated session timeout.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The shortest lease accepted (the configured `min_lease`).
    pub(crate) fn min_lease(&self) -> Duration {
        self.min_lease
    }

    /// The lock root (`""` for `/`).
    pub(crate) fn root(&self) -> &str {
        &self.root
    }

    /// The ACLs for the nodes this session creates.
    pub(crate) fn acls(&self) -> zk::Acls<'static> {
        match self.acl {
            AclPolicy::Open => zk::Acls::anyone_all(),
            AclPolicy::CreatorOnly => zk::Acls::creator_all(),
        }
    }

    /// The runtime the session lives on (the client's), for background clean-up from
    /// `Drop`.
    pub(crate) fn runtime(&self) -> &Handle {
        &self.runtime
    }

    /// The latest instant this session can be assumed alive by the server if the leader
    /// last heard from it at `anchor`: `anchor + timeout − margin`, with the margin of
    /// [`DEADLINE_MARGIN`].
    pub(crate) fn deadline(&self, anchor: Instant) -> Instant {
        DEADLINE_MARGIN.conservative_end(anchor, self.timeout)
    }

    /// The instant the leader has surely heard from this session since: the send time of
    /// the *older* of the last two answered probes (or the session's creation).
    ///
    /// Not the latest request: a follower touches our session when a request arrives but
    /// reports touches to the leader only at the leader's next ping (every half tick), so
    /// a follower cut off right after answering may leave the leader's expiry clock at
    /// our previous request. Probes are a quarter of the timeout apart, at least half a
    /// tick (the timeout is at least two ticks), and the later probe's `sync` went
    /// through the leader after the earlier touch was reported, so the older probe's
    /// touch has reached the leader, within the ping loop's delays that
    /// [`DEADLINE_MARGIN`] covers.
    pub(crate) fn anchor(&self) -> Instant {
        self.confirmed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    /// The first deadline of a guard confirmed by a request sent at `sent`: the session's
    /// (from the probe the leader has surely heard, not the grant's requests: see
    /// [`anchor`](Self::anchor)), or the fixed lease's end if earlier.
    pub(crate) fn grant_deadline(&self, lease: Lease, sent: Instant) -> Instant {
        let deadline = self.deadline(self.anchor());
        fixed_cap(lease, sent).map_or(deadline, |cap| cap.min(deadline))
    }

    /// [`grant_deadline`](Self::grant_deadline), once it is later than now: waits for
    /// the next answered probes while it is not, until `until` (an acquire's give-up
    /// instant, `None` for never). `None` when `until` or the fixed lease's end comes
    /// first or the session ends.
    ///
    /// After a cut that outlived the deadline while the session lived on, the anchor is
    /// the older of the last two answered probes (see [`anchor`](Self::anchor)), from
    /// before the cut, until the second probe after it is answered, a quarter of the
    /// timeout later: an acquire with time left to wait is granted then, not failed.
    pub(crate) async fn confirmed_deadline(
        &self,
        lease: Lease,
        sent: Instant,
        until: Option<Instant>,
    ) -> Option<Instant> {
        let cap = fixed_cap(lease, sent);
        let limit = match (cap, until) {
            (Some(cap), Some(until)) => Some(cap.min(until)),
            (cap, until) => cap.or(until),
        };
        // Usually confirmed already: no need to listen for probes then.
        let deadline = self.grant_deadline(lease, sent);
        if deadline > Instant::now() {
            return Some(deadline);
        }
        loop {
            let probed = self.probed.notified();
            tokio::pin!(probed);
            // Registered before the deadline is read, so no probe is missed in between.
            probed.as_mut().enable();
            let deadline = self.grant_deadline(lease, sent);
            let now = Instant::now();
            if deadline > now {
                return Some(deadline);
            }
            if limit.is_some_and(|limit| limit <= now) || !self.is_usable() {
                return None;
            }
            let give_up = async {
                match limit {
                    Some(limit) => tokio::time::sleep_until(limit).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut probed => {}
                () = self.ended() => return None,
                () = give_up => return None,
            }
        }
    }

    /// Completes when the session has expired or was closed.
    pub(crate) async fn ended(&self) {
        self.ended.cancelled().await
    }

    /// Whether new requests can still succeed on this session.
    pub(crate) fn is_usable(&self) -> bool {
        !self.ended.is_cancelled() && !self.client.state().is_terminated()
    }

    /// Watches the nodes of a fresh grant, from [`WATCH_DELAY`] on (see
    /// [`crate::watcher`]).
    pub(crate) fn watch<W: Watched + 'static>(&self, tracked: &Arc<W>) {
        watcher::watch(&self.watches, &self.deadlines, tracked);
    }

    /// Lets the monitor renew and report on `tracked` (capped at `cap` for a fixed
    /// lease). Returns the id for [`unregister`](Self::unregister).
    ///
    /// After [`give_up`](Self::give_up) (a grant that passed the acquire's check of the
    /// client's close just before it), the lock is given up here as it would have been
    /// there: it is lost ([`LossCause::ClientClosed`]), not kept, and its nodes are
    /// deleted in the background.
    pub(crate) fn register<W: Watched + 'static>(
        &self,
        tracked: &Arc<W>,
        cap: Option<Instant>,
    ) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let liveness = tracked.liveness().clone();
        let registered = self.held.insert_with(id, || {
            // Under the registry's lock, which `end` takes after cancelling `ended`: a
            // lock registered after `end` went through the held ones sees it ended.
            if self.ended.is_cancelled() {
                liveness.mark_lost(LossCause::SessionEnded, "the ZooKeeper session ended");
            }
            Registered {
                liveness,
                cap,
                tracked: Arc::downgrade(tracked) as Weak<dyn Watched>,
            }
        });
        if registered.is_err() {
            // Closed: given up here as `give_up` would have.
            tracked
                .liveness()
                .mark_lost(LossCause::ClientClosed, "the client was closed");
            tracked.give_up();
        }
        id
    }

    /// Moves the end of registered lock `id`'s fixed lease to `cap` (an extension).
    /// Returns `false` when it is no longer registered (released, or the client closed).
    pub(crate) fn set_cap(&self, id: u64, cap: Instant) -> bool {
        self.held.with(id, |entry| entry.cap = Some(cap)).is_some()
    }

    /// Stops tracking a released lock.
    pub(crate) fn unregister(&self, id: u64) {
        self.held.remove(id);
    }

    /// Gives up every lock held on this session (on close), at once: each guard reports
    /// [`LossCause::ClientClosed`], and the monitor forgets it. Returns the paths of their
    /// nodes, for [`delete_given_up`](Self::delete_given_up).
    ///
    /// Locks registered later are given up at [`register`](Self::register).
    pub(crate) fn give_up(&self) -> Vec<String> {
        self.held
            .close(())
            .into_iter()
            .flat_map(|entry| {
                entry
                    .liveness
                    .mark_lost(LossCause::ClientClosed, "the client was closed");
                entry
                    .tracked
                    .upgrade()
                    .map(|tracked| tracked.paths())
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Deletes the `nodes` of the locks [`give_up`](Self::give_up) gave up, each delete
    /// bounded by `limit`. Returns the first delete that failed (that node goes with the
    /// session).
    pub(crate) async fn delete_given_up(
        &self,
        nodes: Vec<String>,
        limit: Duration,
    ) -> Result<(), Error> {
        let mut outcome = Ok(());
        for node in nodes {
            let deleted = tokio::time::timeout(limit, self.client.delete(&node, None)).await;
            match deleted {
                Ok(Ok(()) | Err(zk::Error::NoNode)) => {}
                Ok(Err(err)) if session_ended(&err) => {}
                Ok(Err(err)) => outcome = outcome.and(Err(map(err))),
                Err(_) => {
                    outcome = outcome.and(Err(Error::unavailable(
                        BACKEND,
                        "a lock node could not be deleted at close in time; it goes with the session",
                    )));
                }
            }
        }
        outcome
    }

    fn set_at_risk(&self, at_risk: bool) {
        self.held
            .for_each(|entry| entry.liveness.set_at_risk(at_risk));
    }

    fn end(&self, reason: &str) {
        self.ended.cancel();
        self.held
            .for_each(|entry| entry.liveness.mark_lost(LossCause::SessionEnded, reason));
    }

    /// One renewal: a `sync` and an `exists /`, whose answers prove the leader heard
    /// from our server after `sent`. A plain read alone would not: a follower cut off
    /// from the leader answers reads for up to syncLimit × tickTime, which may be after
    /// the leader expired the session; its `sync` fails instead.
    #[tracing::instrument(name = "fencelock.zookeeper.renew", level = "debug", skip_all)]
    async fn probe(&self) {
        let sent = Instant::now();
        let answer = tokio::time::timeout(self.timeout / 3, async {
            self.client.sync("/").await?;
            self.client.check_stat("/").await
        })
        .await;
        let outcome = match &answer {
            Ok(Ok(_)) => RenewalOutcome::Renewed,
            Ok(Err(err)) if session_ended(err) => RenewalOutcome::Gone,
            _ => RenewalOutcome::Failed,
        };
        record_renewal(BACKEND, outcome, sent.elapsed(), self.held.len());
        match answer {
            Ok(Ok(_)) => {
                let anchor = {
                    let mut confirmed = self
                        .confirmed
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    *confirmed = (confirmed.1, sent);
                    confirmed.0
                };
                self.probed.notify_waiters();
                let deadline = self.deadline(anchor);
                self.held.for_each(|entry| {
                    entry
                        .liveness
                        .extend(entry.cap.map_or(deadline, |cap| cap.min(deadline)));
                    entry.liveness.set_at_risk(false);
                });
            }
            Ok(Err(err)) if session_ended(&err) => self.end(&format!("ZooKeeper session: {err}")),
            Ok(Err(_)) | Err(_) => {}
        }
    }
}

impl std::fmt::Debug for ZkSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkSession")
            .field("id", &self.client.session_id())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn spawn_monitor(session: &Arc<ZkSession>) {
    let weak: Weak<ZkSession> = Arc::downgrade(session);
    let mut states = session.client.state_watcher();
    // A quarter of the timeout: at least half a tick (the timeout is at least two ticks),
    // so the older of two probes has reached the leader (see `ZkSession::anchor`), and a
    // server stall of up to 0.4 × the timeout just before a probe costs no loss.
    let interval = session.timeout / 4;
    session.runtime.spawn(async move {
        let mut next_probe = Instant::now() + interval;
        loop {
            tokio::select! {
                state = states.changed() => {
                    let Some(session) = weak.upgrade() else { return };
                    match state {
                        zk::SessionState::Disconnected => session.set_at_risk(true),
                        zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                            next_probe = Instant::now();
                        }
                        terminal => {
                            session.end(&format!("the ZooKeeper session ended: {terminal}"));
                            return;
                        }
                    }
                }
                _ = tokio::time::sleep_until(next_probe) => {
                    let Some(session) = weak.upgrade() else { return };
                    next_probe = Instant::now() + interval;
                    session.probe().await;
                    if !session.is_usable() {
                        session.end("the ZooKeeper session ended");
                        return;
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests;
