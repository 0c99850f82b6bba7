//! A session: one granted lease and the guards whose keys are on it, kept alive by
//! keepalive rounds on one stream, each round begun by the client's renewal scheduler
//! ([`Keepalives`], the kit's [`Renewals`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use etcd_client::{Client, LeaseGrantOptions, LeaseKeepAliveStream, LeaseKeeper};
use fencelock_core::kit::{CLOCK_DRIFT, DriftMargin, Due, Renew, Renewals};
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
    /// Its keepalive, when it is kept alive.
    keeping: Mutex<Keeping>,
}

/// What keeps a session's lease alive.
#[derive(Default)]
struct Keeping {
    /// The client's keepalives, and the lease's key in their scheduler. Held strongly:
    /// a guard keeps its session, and so its keepalive, when the client that granted it
    /// was dropped without `close`.
    renewal: Option<(Arc<Keepalives>, u64)>,
    /// The stream the last round was answered on, kept for the next round.
    channel: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    /// The round in flight, stopped when the session ends.
    round: Option<AbortHandle>,
}

impl std::fmt::Debug for Keeping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeping")
            .field("key", &self.renewal.as_ref().map(|(_, key)| key))
            .field("stream", &self.channel.is_some())
            .field("in_flight", &self.round.is_some())
            .finish()
    }
}

impl Keeping {
    /// Stops keeping the lease alive: the round in flight ends, the scheduler forgets it.
    fn stop(self) {
        if let Some(round) = self.round {
            round.abort();
        }
        if let Some((keepalives, key)) = self.renewal {
            keepalives.renewals.remove(key);
        }
    }
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
    /// Grants a lease of `ttl` and, given the client's `keepalives`, opens its keepalive
    /// stream and hands it to them; a grant that is dropped or fails is revoked on
    /// `runtime` (the client's).
    ///
    /// # Errors
    ///
    /// Backend errors; [`Error::InvalidConfig`] if etcd granted another TTL than asked
    /// (it raises TTLs below its minimum by itself).
    pub(crate) async fn grant(
        client: &Client,
        ttl: Duration,
        runtime: &Handle,
        keepalives: Option<&Arc<Keepalives>>,
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
        if let Some(keepalives) = keepalives {
            // Opening the stream sends a keepalive and waits for its answer: etcd renewed
            // the lease on a request sent no earlier than `opening`, so that renewal is
            // credited (as `open` does for a reopened stream) and the first round is a
            // third of the lease after it. Over a slow link the grant and the opening
            // take most of a short lease; a first round a third of the lease after the
            // opening, against the grant's deadline, came too late and lost the session.
            let opening = Instant::now();
            let channel = lease.keep_alive(granted.id()).await.map_err(map)?;
            session.renewed(DRIFT_MARGIN.conservative_end(opening, ttl));
            keepalives.keep(&session, channel, opening);
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
            keeping: Mutex::default(),
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

    /// Whether the session ended because its client was closed.
    pub(crate) fn closed(&self) -> bool {
        matches!(self.state().ended, Some((LossCause::ClientClosed, _)))
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
        std::mem::take(&mut *self.keeping()).stop();
    }

    fn renewed(&self, valid_until: Instant) {
        self.state().valid_until.extend(valid_until);
    }

    fn state(&self) -> MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn keeping(&self) -> MutexGuard<'_, Keeping> {
        self.keeping.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        std::mem::take(
            self.keeping
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        )
        .stop();
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

/// The keepalives of one client's sessions, on the kit's renewal scheduler: one task
/// for the client begins each session's keepalive round when it is due (a third of the
/// TTL after the request last credited), and each round says when the next is due.
pub(crate) struct Keepalives {
    client: Client,
    renewals: Renewals<Keepalives>,
    closed: AtomicBool,
}

impl std::fmt::Debug for Keepalives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keepalives")
            .field("renewals", &self.renewals)
            .finish_non_exhaustive()
    }
}

impl Keepalives {
    /// The keepalives of `client`'s sessions, run on `runtime` (the client's).
    pub(crate) fn new(client: Client, runtime: Handle) -> Arc<Self> {
        Arc::new(Keepalives {
            client,
            renewals: Renewals::new(runtime),
            closed: AtomicBool::new(false),
        })
    }

    /// Begins keeping `session` alive on `channel`, a stream whose opening (begun at
    /// `opening`) renewed the lease: its first round is a third of the TTL after.
    fn keep(
        self: &Arc<Self>,
        session: &Arc<Session>,
        channel: (LeaseKeeper, LeaseKeepAliveStream),
        opening: Instant,
    ) {
        // The scheduler's record of the session's deadline, never a guard's: ended, so
        // that its passing the deadline warns of no lock lost.
        let deadline = session.liveness();
        deadline.end();
        let mut keeping = session.keeping();
        keeping.channel = Some(channel);
        let key = Renewals::insert(
            self,
            Arc::downgrade(session),
            session.ttl,
            deadline,
            opening,
        );
        keeping.renewal = Some((self.clone(), key));
    }

    /// The client is closed (its sessions were ended): the task ends.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.renewals.wake();
    }
}

impl Renew for Keepalives {
    type Lease = Weak<Session>;
    type Due = Weak<Session>;
    const ENDS_WHEN_IDLE: bool = true;
    const TIMES_ITSELF: bool = true;

    fn renewals(&self) -> &Renewals<Self> {
        &self.renewals
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    fn due(&self, session: &mut Weak<Session>, _now: Instant) -> Weak<Session> {
        session.clone()
    }

    /// Begins each due session's round on its own: a round may last until the lease's
    /// deadline, and must not hold up another session's.
    fn renew(self: &Arc<Self>, due: Vec<Due<Weak<Session>>>) -> impl Future<Output = ()> + Send {
        for due in due {
            let Some(session) = due.data.upgrade() else {
                self.renewals.remove(due.key);
                continue;
            };
            // Begun under the session's lock, so that a session ended meanwhile begins
            // no round, and one ended after aborts it.
            let mut keeping = session.keeping();
            if keeping.renewal.is_none() {
                drop(keeping);
                self.renewals.remove(due.key);
                continue;
            }
            let task = tokio::spawn(round(self.clone(), due.key, due.data));
            keeping.round = Some(task.abort_handle());
        }
        std::future::ready(())
    }

    /// The lease's deadline passed before its next round was begun (the last one broke
    /// and the reopening came too late).
    fn abandon(self: &Arc<Self>, _key: u64, session: Weak<Session>) {
        if let Some(session) = session.upgrade() {
            session.mark_lost(LossCause::LeaseExpired, UNANSWERED);
        }
    }
}

/// Why a session whose keepalives went unanswered until its deadline was lost.
const UNANSWERED: &str = "no keepalive answer from etcd before the lease deadline";

/// One keepalive round of the session under `key`: sends a keepalive and moves the
/// deadline to `sent + TTL − margin` on its answer, then schedules the next round a
/// third of the TTL after `sent`. A broken stream is reopened at the next round (soon),
/// until the deadline; past the deadline, or when etcd says the lease is gone, the
/// session is lost.
///
/// An answer is awaited until the deadline (a slow network still renews: etcd renews
/// as each request arrives). If none came within a third of the TTL, a new stream is
/// opened beside the old one, and whichever answers first counts, from the instant its
/// own request was sent: a keepalive forwarded to a leader that was cut off hangs there
/// until etcd's request timeout, and one on a new stream can reach a new leader. A
/// stream is never used again after a request on it went unanswered, so an answer is
/// only ever credited to the request it answers.
async fn round(keepalives: Arc<Keepalives>, key: u64, session: Weak<Session>) {
    let Some(live) = session.upgrade() else {
        keepalives.renewals.remove(key);
        return;
    };
    if live.is_lost() {
        // Past its deadline before this round began (the last stream broke and the
        // pause ran past it), or ended: the first cause given stands.
        live.mark_lost(LossCause::LeaseExpired, UNANSWERED);
        return;
    }
    let (id, ttl, deadline) = (live.lease_id, live.ttl, live.valid_until());
    let mut channel = live.keeping().channel.take();
    drop(live);
    let interval = ttl / 3;
    let client = &keepalives.client;
    let sent = Instant::now();
    let round = async {
        let Some((keeper, stream)) = channel.as_mut() else {
            return tokio::select! {
                round = open(client, id, sent, ttl) => round,
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
        let new = open(client, id, resent, ttl);
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
        keepalives.renewals.remove(key);
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
            // On a new stream, the old one, with any answer still on its way, is dropped.
            let mut keeping = session.keeping();
            if keeping.renewal.is_some() {
                keeping.channel = opened.map(|opened| *opened).or(channel);
            }
            drop(keeping);
            session.renewed(sent + granted.min(ttl) - DRIFT_MARGIN.of(ttl));
            keepalives.renewals.renew_at(key, sent + interval);
        }
        Round::Gone => {
            session.mark_lost(LossCause::SessionEnded, "the etcd session lease expired");
        }
        Round::Broken if Instant::now() < deadline => {
            // Reopened on the next round, until the deadline decides.
            tracing::debug!(lease = id, "etcd keepalive stream broke; reopening");
            let soon = Instant::now() + Duration::from_millis(100).min(interval);
            keepalives.renewals.renew_at(key, soon);
        }
        Round::Broken | Round::Unanswered => {
            session.mark_lost(LossCause::LeaseExpired, UNANSWERED);
        }
    }
}

#[cfg(test)]
mod tests;
