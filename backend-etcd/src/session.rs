//! One lease per client (per lease duration), kept alive by one keepalive stream.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{Client, LeaseGrantOptions, LeaseKeepAliveStream, LeaseKeeper};
use fencelock_core::kit::{CLOCK_DRIFT, DriftMargin};
use fencelock_core::{Error, Liveness, LossCause, RenewalOutcome, SharedDeadline, record_renewal};
use tokio::runtime::Handle;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::error::map;
use crate::leases::Unkept;

/// A granted lease and the guards whose keys are attached to it.
#[derive(Debug)]
pub(crate) struct Session {
    lease_id: i64,
    ttl: Duration,
    /// Fires when the lease is gone or can no longer be confirmed.
    lost: CancellationToken,
    state: Mutex<SessionState>,
    next_guard: AtomicU64,
    keepalive: Mutex<Option<AbortHandle>>,
}

#[derive(Debug)]
struct SessionState {
    /// Conservative local deadline: last keepalive sent + TTL − margin. Shared by the
    /// guards on this lease, so a renewal moves one value however many are held.
    valid_until: SharedDeadline,
    guards: HashMap<u64, Liveness>,
    /// Why the session ended, once it has: told to a guard registered after the end.
    ended: Option<(LossCause, String)>,
}

/// The margin subtracted from every deadline for clock-rate drift between this client and
/// the etcd leader: core's rule ([`CLOCK_DRIFT`], 1 % of the lease plus 2 ms) plus 48 ms,
/// so 1 % of the lease plus 50 ms, the value etcd's deadlines have had since the backend
/// was written (and that its README and fault tests state).
///
/// Why etcd keeps 48 ms more than the rule was never written down (not in the commit
/// that introduced it, the design, the docs or the issues), and no need for it is known:
/// etcd starts a lease's TTL when its leader handles the grant or keepalive, after our
/// send, and expires leases late rather than early (its expiry check runs every 500 ms, a
/// new leader extends every lease). It is kept rather than narrowed without evidence that
/// nothing relies on it; narrowing it is a separate, deliberate change.
pub(crate) const DRIFT_MARGIN: DriftMargin = CLOCK_DRIFT.plus(0, Duration::from_millis(48));

impl Session {
    /// Grants a lease of `ttl` and, when `keep_alive`, starts its keepalive stream on
    /// `runtime` (the client's), where a grant that is dropped or fails is also revoked.
    ///
    /// # Errors
    ///
    /// Backend errors; [`Error::InvalidConfig`] if etcd granted another TTL than asked
    /// (it raises TTLs below its minimum by itself).
    pub(crate) async fn grant(
        client: &Client,
        ttl: Duration,
        runtime: &Handle,
        keep_alive: bool,
    ) -> Result<Arc<Self>, Error> {
        let mut lease = client.lease_client();
        let sent = Instant::now();
        let seconds = crate::config::lease_seconds(ttl)?;
        // The lease's ID is chosen here, before the request: a grant dropped in flight
        // (the acquire cancelled), or failing after etcd applied it, is then revoked in
        // the background instead of living out its TTL unseen.
        let mut unkept = Unkept::new(client, runtime);
        let granted = match lease
            .grant(seconds, Some(LeaseGrantOptions::new().with_id(unkept.id())))
            .await
        {
            Ok(granted) => granted,
            Err(error) => {
                if crate::error::is_lease_exists(&error) {
                    // Someone else's lease has this ID: never revoke it.
                    unkept.keep();
                }
                return Err(map(error));
            }
        };
        if granted.ttl() != seconds {
            return Err(Error::InvalidConfig(format!(
                "etcd granted a {} s lease when {seconds} s was asked; the server's minimum TTL is higher",
                granted.ttl()
            )));
        }
        let session = Arc::new(Session::new(
            granted.id(),
            ttl,
            DRIFT_MARGIN.conservative_end(sent, ttl),
        ));
        if keep_alive {
            // Opening the stream sends a keepalive and waits for its answer: etcd renewed
            // the lease on a request sent no earlier than `opening`, so that renewal is
            // credited (as `open` does for a reopened stream) and the first round is a
            // third of the lease after it. Over a slow link the grant and the opening
            // take most of a short lease; a first round a third of the lease after the
            // opening, against the grant's deadline, came too late and lost the session.
            let opening = Instant::now();
            let (keeper, stream) = lease.keep_alive(granted.id()).await.map_err(map)?;
            session.renewed(DRIFT_MARGIN.conservative_end(opening, ttl));
            let task = runtime.spawn(keep_alive_loop(
                client.clone(),
                Arc::downgrade(&session),
                keeper,
                stream,
                opening + ttl / 3,
            ));
            *session
                .keepalive
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(task.abort_handle());
        }
        unkept.keep();
        Ok(session)
    }

    /// A session of the granted lease `lease_id`, valid until `valid_until`, with no
    /// guard and no keepalive yet.
    fn new(lease_id: i64, ttl: Duration, valid_until: Instant) -> Self {
        Session {
            lease_id,
            ttl,
            lost: CancellationToken::new(),
            state: Mutex::new(SessionState {
                valid_until: SharedDeadline::new(valid_until),
                guards: HashMap::new(),
                ended: None,
            }),
            next_guard: AtomicU64::new(0),
            keepalive: Mutex::new(None),
        }
    }

    pub(crate) fn lease_id(&self) -> i64 {
        self.lease_id
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    pub(crate) fn valid_until(&self) -> Instant {
        self.state().valid_until.get()
    }

    /// A fresh guard's liveness, whose deadline is the session's.
    pub(crate) fn liveness(&self) -> Liveness {
        Liveness::with_shared_deadline(self.state().valid_until.clone())
    }

    /// Whether the session can no longer be used.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled() || Instant::now() >= self.valid_until()
    }

    /// Completes when the session is lost.
    pub(crate) async fn lost(&self) {
        loop {
            if self.is_lost() {
                return;
            }
            let deadline = self.valid_until();
            tokio::select! {
                _ = self.lost.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// Starts reporting loss to `liveness`, made by [`liveness`](Self::liveness).
    /// Returns the registration id.
    pub(crate) fn register(&self, liveness: Liveness) -> u64 {
        let id = self.next_guard.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state();
        // `mark_lost` records why under this lock as it drains the guards: a guard
        // registered after is told the same (a lock granted while `close` ran is lost
        // because the client closed, not to some session failure).
        if let Some((cause, reason)) = &state.ended {
            liveness.mark_lost(*cause, reason.as_str());
        } else {
            state.guards.insert(id, liveness);
        }
        id
    }

    pub(crate) fn unregister(&self, id: u64) {
        self.state().guards.remove(&id);
    }

    /// How many guards hold locks on this session now.
    pub(crate) fn registered(&self) -> usize {
        self.state().guards.len()
    }

    /// Declares the session lost and tells every guard on it, and every guard
    /// registered later, why: the first cause given.
    pub(crate) fn mark_lost(&self, cause: LossCause, reason: &str) {
        let (guards, (cause, reason)) = {
            let mut state = self.state();
            let ended = state
                .ended
                .get_or_insert_with(|| (cause, reason.to_owned()))
                .clone();
            self.lost.cancel();
            let guards: Vec<Liveness> = state.guards.drain().map(|(_, l)| l).collect();
            (guards, ended)
        };
        for liveness in guards {
            liveness.mark_lost(cause, reason.as_str());
        }
        if let Some(task) = self
            .keepalive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }

    fn renewed(&self, valid_until: Instant) {
        self.state().valid_until.extend(valid_until);
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(task) = self
            .keepalive
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

/// What one keepalive round came to.
enum Round {
    /// etcd renewed the lease for `ttl` on a request sent at `sent`; `opened` is the new
    /// stream that carried it, if it was not the old one.
    Renewed {
        sent: Instant,
        ttl: Duration,
        opened: Option<Box<(LeaseKeeper, LeaseKeepAliveStream)>>,
    },
    /// etcd answered that the lease is gone.
    Gone,
    /// The stream broke (leader change, connection reset) before an answer.
    Broken,
    /// No answer before the deadline.
    Unanswered,
}

/// Opens a new keepalive stream for lease `id`. Opening sends a keepalive and waits for
/// its answer, so a stream that opens is a renewal confirmed for `ttl` from the instant
/// it was begun. etcd-client reports a lease etcd no longer has only as an error named
/// `lease not found`: that is [`Round::Gone`].
async fn open(client: &Client, id: i64, sent: Instant, ttl: Duration) -> Round {
    match client.lease_client().keep_alive(id).await {
        Ok(opened) => Round::Renewed {
            sent,
            ttl,
            opened: Some(Box::new(opened)),
        },
        Err(etcd_client::Error::LeaseKeepAliveError(message)) if message == "lease not found" => {
            Round::Gone
        }
        Err(_) => Round::Broken,
    }
}

/// The answer on a stream whose request was sent at `sent`.
fn answered(
    sent: Instant,
    answer: Result<Option<etcd_client::LeaseKeepAliveResponse>, etcd_client::Error>,
) -> Round {
    match answer {
        Ok(Some(response)) if response.ttl() > 0 => Round::Renewed {
            sent,
            ttl: Duration::from_secs(u64::try_from(response.ttl()).unwrap_or(0)),
            opened: None,
        },
        Ok(Some(_)) => Round::Gone,
        Ok(None) | Err(_) => Round::Broken,
    }
}

/// Sends a keepalive every third of the TTL, the first at `first` (a third of the TTL
/// after the stream's opening, the last renewal credited), and moves the deadline to
/// `sent + TTL − margin` on each answer. A broken stream is reopened until the deadline;
/// past the deadline, or when etcd says the lease is gone, the session is lost.
///
/// An answer is awaited until the deadline (a slow network still renews: etcd renews
/// as each request arrives). If none came within a third of the TTL, a new stream is
/// opened beside the old one, and whichever answers first counts, from the instant its
/// own request was sent: a keepalive forwarded to a leader that was cut off hangs there
/// until etcd's request timeout, and one on a new stream can reach a new leader. A
/// stream is never used again after a request on it went unanswered, so an answer is
/// only ever credited to the request it answers.
async fn keep_alive_loop(
    client: Client,
    session: std::sync::Weak<Session>,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
    first: Instant,
) {
    let Some((id, ttl)) = session.upgrade().map(|s| (s.lease_id, s.ttl)) else {
        return;
    };
    let interval = ttl / 3;
    let mut channel = Some((keeper, stream));
    let mut next = first;
    loop {
        tokio::time::sleep_until(next).await;
        let Some(deadline) = session.upgrade().map(|s| s.valid_until()) else {
            return;
        };
        let sent = Instant::now();
        let round = async {
            let Some((keeper, stream)) = channel.as_mut() else {
                return tokio::select! {
                    round = open(&client, id, sent, ttl) => round,
                    () = tokio::time::sleep_until(deadline) => Round::Unanswered,
                };
            };
            let old = async {
                keeper.keep_alive().await?;
                stream.message().await
            };
            tokio::pin!(old);
            tokio::select! {
                answer = &mut old => return answered(sent, answer),
                () = tokio::time::sleep_until(deadline.min(sent + interval)) => {}
            }
            let resent = Instant::now();
            let new = open(&client, id, resent, ttl);
            tokio::pin!(new);
            // Either may break while the other can still answer before the deadline.
            let (mut waiting_old, mut opening) = (true, true);
            loop {
                tokio::select! {
                    answer = &mut old, if waiting_old => match answered(sent, answer) {
                        Round::Broken if opening => waiting_old = false,
                        round => return round,
                    },
                    round = &mut new, if opening => match round {
                        Round::Broken if waiting_old => opening = false,
                        round => return round,
                    },
                    () = tokio::time::sleep_until(deadline) => return Round::Unanswered,
                }
            }
        }
        .instrument(tracing::debug_span!("fencelock.etcd.renew", lease = id))
        .await;
        let Some(session) = session.upgrade() else {
            return;
        };
        let outcome = match &round {
            Round::Renewed { .. } => RenewalOutcome::Renewed,
            Round::Gone => RenewalOutcome::Gone,
            Round::Broken | Round::Unanswered => RenewalOutcome::Failed,
        };
        let locks = session.registered();
        record_renewal(crate::error::BACKEND, outcome, sent.elapsed(), locks);
        match round {
            Round::Renewed {
                sent,
                ttl: granted,
                opened,
            } => {
                if let Some(opened) = opened {
                    // The old stream, with any answer still on its way, is dropped.
                    channel = Some(*opened);
                }
                session.renewed(sent + granted.min(ttl) - DRIFT_MARGIN.of(ttl));
                next = sent + interval;
            }
            Round::Gone => {
                session.mark_lost(LossCause::SessionEnded, "the etcd session lease expired");
                return;
            }
            Round::Broken if Instant::now() < deadline => {
                // Reopened on the next round, until the deadline decides.
                tracing::debug!(lease = id, "etcd keepalive stream broke; reopening");
                channel = None;
                next = Instant::now() + Duration::from_millis(100).min(interval);
            }
            Round::Broken | Round::Unanswered => {
                session.mark_lost(
                    LossCause::LeaseExpired,
                    "no keepalive answer from etcd before the lease deadline",
                );
                return;
            }
        }
        drop(session);
    }
}

/// The most session leases (distinct lease durations) one client keeps at once, each
/// with its own keepalive; leases nobody uses are revoked to make room.
pub(crate) const MAX_SESSIONS: usize = 8;

/// The client's sessions, one per lease duration, created on first use, at most
/// [`MAX_SESSIONS`] at once.
#[derive(Debug)]
pub(crate) struct Sessions {
    /// The client's runtime, where the sessions' keepalive tasks run (not the runtime of
    /// whichever acquire granted a session: when that one ended, so would the keepalive,
    /// and every lock on the session would be lost at its TTL).
    runtime: Handle,
    /// The live sessions, read without waiting on every acquire.
    live: std::sync::RwLock<HashMap<Duration, Arc<Session>>>,
    /// Serializes granting, so concurrent first acquisitions share one new session.
    granting: tokio::sync::Mutex<()>,
    /// Set once the client is closed (under `live`'s write lock): nothing is granted or
    /// handed out any more.
    closed: AtomicBool,
}

impl Sessions {
    /// No sessions yet; their keepalive tasks will run on `runtime`.
    pub(crate) fn new(runtime: Handle) -> Self {
        Sessions {
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
        let session = Box::pin(Session::grant(client, ttl, &self.runtime, true)).await?;
        let mut live = self.live.write().unwrap_or_else(PoisonError::into_inner);
        if self.closed.load(Ordering::SeqCst) {
            // Closed while granting: `close` did not see this session, so it is ended
            // here.
            drop(live);
            session.mark_lost(LossCause::ClientClosed, "the client was closed");
            let mut leases = client.lease_client();
            let id = session.lease_id;
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
                let id = session.lease_id;
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
        sessions
            .iter()
            .map(|session| {
                session.mark_lost(LossCause::ClientClosed, "the client was closed");
                session.lease_id
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guard registered after its session was ended reports the cause the session
    /// ended with: a lock granted while `close` ran is lost because the client was
    /// closed, not because of some session failure (the conformance case
    /// `acquires_racing_close_are_given_up` met this race on a loaded machine).
    #[test]
    fn a_guard_registered_after_the_end_reports_the_cause_it_ended_with() {
        let session = Session::new(7, Duration::from_secs(10), Instant::now());
        let before = session.liveness();
        session.register(before.clone());
        session.mark_lost(LossCause::ClientClosed, "the client was closed");
        let after = session.liveness();
        session.register(after.clone());
        for liveness in [before, after] {
            assert_eq!(liveness.lost_cause(), Some(LossCause::ClientClosed));
            assert_eq!(liveness.lost_reason(), Some("the client was closed"));
        }
        assert_eq!(session.registered(), 0);
    }
}
